#!/bin/bash
# The privacy experiment (benchmarks/privacy_experiment.py) on a lent GPU machine, as one prepared
# script for one device lease: the 12 runs (epsilon 1, 3, 8, infinity x seeds 0, 1, 2) at once,
# sharing the GPU, each run's results.json under $OUT/privacy; the report is written here after.
#
# Here, once:   bash benchmarks/privacy_gpu.sh pack
#   (into the git-excluded .device/: Opacus and what it imports that the device image lacks --
#   scipy, without its tests, as tar.xz; opt-einsum, tqdm, dill -- and the whole Fashion-MNIST,
#   the training images as xz; under the 64 MiB a device run carries)
# On the GPU:   run(command="bash benchmarks/privacy_gpu.sh", carry=[".device"], timeout_s=600)
# Here, after:  bash benchmarks/privacy_gpu.sh restore <files_at> results/privacy
#               python benchmarks/privacy_experiment.py --out results/privacy
#   (the device returns files at most three folders deep: each finished run's results.json comes
#   back as runs/eps-<e>-seed-<s>.json, and restore puts it where the experiment reads it)
#
# Tried on 2026-12-04 (an H200, 16 cores): the vmap smoke run passed in 53 s, then the 12 runs
# at once kept the GPU 98-99% busy (25-29 GB) and none had finished its 30 rounds of five
# methods after 492 s, so nothing came back; the experiment was run on the CPU instead
# (docs/experiments/privacy.md). A next lease should time one run alone before sharing the GPU.
#
# On the device it checks torch, CUDA and the accountant, runs a 40-client smoke run of the five
# methods (vmap backend; on failure the loop backend), then the experiment within the lease's
# budget (PRIVACY_GPU_BUDGET_S, default 540 s). A run that does not finish leaves nothing (no
# checkpoints: a later lease would be a fresh machine); the summary says which finished.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = restore ]; then  # restore FILES_AT OUT: runs/eps-E-seed-S.json -> OUT/eps-E/seed-S/
  for f in "$2"/runs/eps-*-seed-*.json; do
    name=$(basename "$f" .json); mkdir -p "$3/${name%-seed-*}/seed-${name##*-seed-}"
    cp "$f" "$3/${name%-seed-*}/seed-${name##*-seed-}/results.json"
  done
  exit 0
fi
if [ "${1:-}" = pack ]; then
  set -e
  D=.device; W=$(mktemp -d /tmp/privpack.XXXXXX); trap 'rm -rf "$W"' EXIT
  rm -rf "$D"; mkdir -p "$D/whl" "$D/fmnist" "$(git rev-parse --git-dir)/info"
  grep -qx "/$D/" "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null \
    || echo "/$D/" >> "$(git rev-parse --git-dir)/info/exclude"
  P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --quiet
     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
  python3 -m pip download $P -d "$D/whl" opacus==1.6.0 opt_einsum==3.4.0 tqdm dill
  python3 -m pip download $P -d "$W" scipy==1.18.1
  mkdir "$W/x" && (cd "$W/x" && unzip -q "$W"/scipy-*.whl && find . -type d -name tests \
    -prune -exec rm -rf {} + && tar -cJf "$OLDPWD/$D/scipy-slim.tar.xz" .)
  zcat /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz | xz -9 -T2 \
    > "$D/fmnist/train-images-idx3-ubyte.xz"
  cp /usr/share/datasets/fashion-mnist/{train-labels,t10k-images,t10k-labels}* "$D/fmnist/"
  tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  dev=$(du -sb "$D" | cut -f1)
  echo "packed $D: $((dev / 1048576)) MiB; with tracked files $(((dev + tracked) / 1048576)) MiB" \
       "(limit 64 MiB)"
  exit 0
fi

OUT=${OUT:-/tmp/privacy-gpu}
mkdir -p "$OUT"
BUDGET=${PRIVACY_GPU_BUDGET_S:-540}
say() { echo "[$SECONDS s] $*" | tee -a "$OUT/summary.txt"; }
[ -d .device/whl ] || { echo "no .device/: run bash benchmarks/privacy_gpu.sh pack first"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .device/whl/*.whl || exit 4
tar -xJf .device/scipy-slim.tar.xz -C /tmp/site || exit 5
DATA=/tmp/fmnist; mkdir -p $DATA
cp .device/fmnist/*.gz $DATA/
xz -dc .device/fmnist/train-images-idx3-ubyte.xz | gzip -1 > $DATA/train-images-idx3-ubyte.gz
# 12 processes on 16 cores: one thread each (torch's is client-resources-num-cpus = 1)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0 RAY_USAGE_STATS_ENABLED=0
say "set up"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 -c "
import torch, opacus, scipy
from pflalign.server.privacy import calibrate
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'opacus', opacus.__version__,
      'scipy', scipy.__version__, 'cores', __import__('os').cpu_count())
" 2>&1 | tail -3 | tee -a "$OUT/summary.txt"

COMMON=(--set data-root=$DATA --set client-resources-num-gpus=0.05 --set memory-budget-gb=0
        --set checkpoint-every=0 --set report=false)
smoke() {  # smoke BACKEND: the five methods on 40 clients, 2 rounds, epsilon 3
  timeout 120 python3 simulate.py --config configs/privacy.toml --seeds 0 "${COMMON[@]}" \
    --set batched-backend="$1" --set num-clients=40 --set rounds=2 --set dp-epsilon=3 --quiet \
    --out "$OUT/smoke-$1" > "$OUT/smoke-$1.log" 2>&1
}
BACKEND=vmap
if smoke vmap; then say "smoke run (vmap) passed"
else
  say "smoke run (vmap) failed:"; grep -v WARNING "$OUT/smoke-vmap.log" | tail -15 | tee -a "$OUT/summary.txt"
  BACKEND=loop
  if smoke loop; then say "smoke run (loop) passed"
  else say "smoke run (loop) failed:"; grep -v WARNING "$OUT/smoke-loop.log" | tail -15 | tee -a "$OUT/summary.txt"; exit 6
  fi
fi
grep -A7 "^method" "$OUT/smoke-$BACKEND.log" >> "$OUT/summary.txt"

LEFT=$((BUDGET - SECONDS))
[ "$LEFT" -ge 60 ] || { say "$LEFT s left: the experiment is not started"; exit 7; }
say "the experiment: 12 runs at once, backend $BACKEND, $LEFT s left"
( while sleep 30; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader \
    | sed "s/^/[gpu] /" >> "$OUT/gpu.log"; done ) & MONITOR=$!
timeout "$LEFT" python3 benchmarks/privacy_experiment.py --out "$OUT/privacy" --jobs 12 --runs-only \
  "${COMMON[@]}" --set batched-backend=$BACKEND > "$OUT/experiment.log" 2>&1
rc=$?
kill $MONITOR 2>/dev/null
say "experiment exit $rc"
grep -E "^\[eps" "$OUT/experiment.log" | grep " s$" | tee -a "$OUT/summary.txt"
mkdir -p "$OUT/runs"
for f in "$OUT"/privacy/eps-*/seed-*/results.json; do
  [ -f "$f" ] || continue
  seed=$(basename "$(dirname "$f")"); eps=$(basename "$(dirname "$(dirname "$f")")")
  cp "$f" "$OUT/runs/$eps-$seed.json"
done
say "finished runs: $(ls "$OUT/runs" | wc -l) of 12"
rm -rf "$OUT/privacy"
du -sh "$OUT" | tee -a "$OUT/summary.txt"
