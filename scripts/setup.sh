#!/usr/bin/env bash
# Set up everything pflalign needs on a Debian machine: the Fashion-MNIST package, a virtual
# environment in .venv, and the project with its dependencies (pip install -e ".[test]").
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
echo "==> set up: .venv/bin/python $(.venv/bin/python -c 'import torch, flwr; print(f"(torch {torch.__version__}, flwr {flwr.__version__})")')"
