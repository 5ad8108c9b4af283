# `make run`: set everything up and run the default simulation; `make test`: set up and test.
PY := .venv/bin/python

.PHONY: setup run test lint bench clean

setup:
	bash scripts/setup.sh

run: setup
	$(PY) simulate.py --overwrite

test: setup lint
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check .

bench: setup
	$(PY) benchmarks/overhead.py

clean:
	rm -rf .venv results .pytest_cache .ruff_cache
