#!/bin/bash
# The GPU check, one prepared script for a device lease: its steps stop by 330 s (a step that
# would start with less than 20 s left is skipped and says so), so that with the machine's start
# it fits in 6 minutes of device time.
#
# Here, once:   bash scripts/pack_device.sh          (flwr, slim Ray, 12k-image Fashion-MNIST)
# On the GPU:   run(command="bash benchmarks/gpu.sh", carry=[".device"], timeout_s=360)
#
# It runs, each step under its own time limit so that one slow step cannot eat the lease:
#   1. Ray's start (the slimmed Ray has to work before anything else is tried);
#   2. the default config (fedavg and pflalign, 3 rounds) on the Flower/Ray engine with
#      fractional GPUs (client-resources-num-gpus = 0.25), then on the batched engine: s/round
#      of both, side by side;
#   3. the batched engine at 1,000 clients (benchmarks/scale.py --gpu) in one process, then on
#      2 Ray workers sharing the GPU (batched:2, client-resources-num-gpus = 0.5 each): clients/s,
#      s/round, the evaluation of all clients and the GPU memory peak, 2 workers against 1;
#   4. the batched engine at 1,000 clients with cohort-size 16, 64 and 256 (fedavg, 2 rounds):
#      s/round against GPU memory, the measurements behind the README's sizing guidance.
# Everything lands in $OUT (results.json of each run, logs, summary.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
source .device/setup.sh || { echo "no .device/: run bash scripts/pack_device.sh first"; exit 3; }
DATA="--set data-root=$PFLALIGN_DEVICE_DATA"
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
BUDGET=${GPU_CHECK_BUDGET_S:-330}
limit() {  # limit WANTED: WANTED seconds, or what is left of the budget if that is less
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then echo 0; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

say "== 1. Ray start"
timeout 60 python3 -c "import ray; ray.init(num_cpus=2); print('ray ok', ray.__version__)" \
  > "$OUT/ray.log" 2>&1 && ray_ok=1 || ray_ok=0
tail -2 "$OUT/ray.log" | tee -a "$OUT/summary.txt"

run() {  # run NAME LIMIT_S ARGS...: one simulate.py run, its s/round into the summary
  local name=$1 limit; limit=$(limit "$2"); shift 2
  [ "$limit" = 0 ] && { say "$name: skipped (the ${BUDGET} s budget is spent)"; return; }
  local t0=$SECONDS
  timeout "$limit" python3 simulate.py --overwrite --quiet $DATA --set out-dir="$OUT/$name" "$@" \
    > "$OUT/$name.log" 2>&1
  local code=$?
  python3 - "$OUT/$name" "$name" "$code" "$((SECONDS - t0))" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
folder, name, code, wall = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
try:
    results = json.loads((folder / "results.json").read_text())
except (OSError, ValueError):
    print(f"{name}: no results (exit {code}, {wall} s); see {name}.log")
    raise SystemExit
for label, entry in results["methods"].items():
    rows = entry["rounds"]
    train = [r["train-seconds"] for r in rows]
    ev = sum(r.get("eval-seconds", 0.0) for r in rows)
    print(f"{name}: {label}: s/round {sum(train) / len(train):.3f} (rounds 2+: "
          f"{sum(train[1:]) / max(len(train) - 1, 1):.3f}), eval {ev:.2f} s, "
          f"personal {100 * entry['final'].get('personal-acc', float('nan')):.2f}% "
          f"(exit {code}, {wall} s)")
PY
}

COMMON="--set methods=fedavg,pflalign --set rounds=3 --set eval-every=3"
say "== 2. default config, Flower/Ray engine with fractional GPUs, then the batched engine"
if [ "$ray_ok" = 1 ]; then
  run flower-gpu 150 $COMMON --set engine=flower --set client-resources-num-gpus=0.25 \
    --set client-resources-num-cpus=2
else
  say "flower-gpu: skipped (Ray did not start)"
fi
run batched-gpu 90 $COMMON --set engine=batched --set client-resources-num-gpus=1 \
  --set client-resources-num-cpus=4

say "== 3. batched engine at 1,000 clients (5% per round): one process, then 2 Ray workers"
step=$(limit 150)
if [ "$step" = 0 ] || [ "$ray_ok" != 1 ]; then
  say "scale: skipped (budget spent or Ray did not start)"
else
  timeout "$step" python3 benchmarks/scale.py --engines batched,batched:2 --clients 1000 \
    --methods pflalign --gpu $DATA --out "$OUT/scale" > "$OUT/scale.log" 2>&1
  grep -A12 "^engine" "$OUT/scale.log" | tee -a "$OUT/summary.txt"
fi

say "== 4. cohort size against memory (1,000 clients, fedavg, 2 rounds)"
for size in 16 64 256; do
  step=$(limit 40)
  [ "$step" = 0 ] && { say "cohort-size $size: skipped (the ${BUDGET} s budget is spent)"; continue; }
  timeout "$step" python3 benchmarks/scale.py --engines batched --clients 1000 --methods fedavg \
    --rounds 2 --gpu $DATA --set cohort-size=$size --set fraction-train=0.25 \
    --out "$OUT/cohort-$size" > "$OUT/cohort-$size.log" 2>&1
  say "cohort-size $size: $(grep '^batched' "$OUT/cohort-$size.log" | head -1)"
done
say "done in $SECONDS s"
