# `make run`: set everything up and run the default simulation; `make test`: set up and test.
PY := .venv/bin/python

.PHONY: setup run test test-slow lint bench clean

setup:
	bash scripts/setup.sh

run: setup
	$(PY) simulate.py --overwrite

# the default suite (about 14 minutes on 2 cores: its files spread over TEST_WORKERS pytest-xdist
# processes, a file's tests in one, the longest files first:
# tests/conftest.py's HEAVY_FILES); `make test-slow`: the extended integration cases (pytest -m
# slow: deployments and a two-node Ray cluster across network namespaces, the manual steps, bad
# nodes), one at a time
TEST_WORKERS ?= 2

test: setup lint
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile

test-slow: setup
	$(PY) -m pytest -q -m slow

lint: setup
	$(PY) -m ruff check .

bench: setup
	$(PY) benchmarks/overhead.py

clean:
	rm -rf .venv results .pytest_cache .ruff_cache
