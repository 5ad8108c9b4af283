#!/usr/bin/env bash
# Pack, into .device/ of this checkout (git-ignored), what the GPU machine lacks for
# benchmarks/gpu.sh: flwr 1.42 and the packages its runs import, a slim Ray, and a
# Fashion-MNIST subset. The machine has Python 3.12 with CUDA torch, numpy, grpcio, rich,
# typer, pyyaml and requests, and no network; a run carries .device with the working tree:
#
#     bash scripts/pack_device.sh                 # then: run(command="bash benchmarks/gpu.sh",
#                                                 #       carry=[".device"], timeout_s=360)
#     NO_RAY=1 bash scripts/pack_device.sh        # without Ray (the in-process engines only)
#     TRAIN_SAMPLES=20000 bash scripts/pack_device.sh   (more images: check the size it prints)
#
# What travels (tracked files and .device) must stay under 64 MiB; the last line says how much.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.device
PY=${PYTHON:-$PWD/.venv/bin/python}
[ -x "$PY" ] || PY=python3
work=$(mktemp -d /tmp/pflalign-pack.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out/wheels" "$out/fashion-mnist"

# Wheels for CPython 3.12 on manylinux x86-64, without their dependencies: the list is flwr
# 1.42's runtime imports under simulate.py, beside what the machine already has.
platforms=""
for tag in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms="$platforms --platform $tag"
done
download() {
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp $platforms -d "$1" "${@:2}"
}
download "$out/wheels" \
    flwr==1.42.0 protobuf==6.33.6 grpcio-health-checking==1.81.1 typing_extensions==4.16.0 \
    cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pycryptodome==3.24.1 iterators==0.0.2 \
    typer==0.20.1 tomli==2.5.0 tomli_w==1.2.0 prompt_toolkit==3.0.53 wcwidth==0.9.4 \
    SQLAlchemy==2.1.9 greenlet==3.5.6 alembic==1.20.1 Mako==1.4.3 \
    fastapi==0.138.2 starlette==1.3.1 pydantic==2.14.4 pydantic_core==2.50.5 \
    annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1

if [ -z "${NO_RAY:-}" ]; then
    # Ray's wheel is larger than what may travel; without its Java jars, its libraries for
    # learning, serving and data (RLlib, Train, Tune, Serve, LLM, Data, Workflow) and the
    # dashboard's web page, none of which a Flower simulation imports, packed with xz, it fits
    download "$work" ray==2.55.1
    mkdir "$work/ray"
    (cd "$work/ray" && "$PY" -m zipfile -e "$work"/ray-*.whl . \
        && rm -rf ray/jars ray/rllib ray/train ray/tune ray/serve ray/llm ray/data ray/workflow \
            ray/dashboard/client \
        && tar -cJf "$OLDPWD/$out/ray.tar.xz" .)
fi

# The first TRAIN_SAMPLES training images of Fashion-MNIST, and its whole test set
TRAIN_SAMPLES=${TRAIN_SAMPLES:-12000} "$PY" - "$out/fashion-mnist" <<'PYTHON'
import gzip
import os
import shutil
import struct
import sys

source, target = "/usr/share/datasets/fashion-mnist", sys.argv[1]
keep = int(os.environ["TRAIN_SAMPLES"])
for name, header in (("train-images-idx3-ubyte.gz", 16), ("train-labels-idx1-ubyte.gz", 8)):
    data = gzip.open(os.path.join(source, name)).read()
    fields = list(struct.unpack(">" + "I" * (header // 4), data[:header]))
    per_item = (len(data) - header) // fields[1]
    fields[1] = keep
    with gzip.open(os.path.join(target, name), "wb", 9) as handle:
        handle.write(struct.pack(">" + "I" * len(fields), *fields))
        handle.write(data[header:header + keep * per_item])
for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
    shutil.copy(os.path.join(source, name), target)
PYTHON

cat > "$out/setup.sh" <<'SETUP'
# On the GPU machine, from the checkout's root: `source .device/setup.sh` installs what was
# packed into /tmp/site and sets the environment a run needs (no network: nothing is fetched).
python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .device/wheels/*.whl || return 3 2>/dev/null || exit 3
if [ -f .device/ray.tar.xz ]; then
    tar -xJf .device/ray.tar.xz -C /tmp/site || return 4 2>/dev/null || exit 4
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_USAGE_STATS_ENABLED=0
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export PFLALIGN_DEVICE_DATA=$PWD/.device/fashion-mnist   # --set data-root=$PFLALIGN_DEVICE_DATA
SETUP

packed=$(du -sb "$out" | cut -f1)
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "packed $out: $((packed / 1048576)) MiB; with the tracked files $(((packed + tracked) / 1048576)) MiB (at most 64 MiB travel)"
