#!/usr/bin/env bash
# The runs a refactor is checked against: every method, every pFLAlign variant and the paths the
# others do not take, 3 rounds with 2 unseen clients on configs/default.toml, on each engine
# (sequential, batched, Flower on Ray, and batched on 2 Ray workers). Run it in a clean checkout
# of the commit before a change and again after it, on the same machine, then compare:
#
#     bash scripts/reference_runs.sh /tmp/before            # in a worktree of the old commit
#     bash scripts/reference_runs.sh /tmp/after             # in the new one
#     python scripts/compare_results.py /tmp/before /tmp/after
#
# ENGINES="sequential batched" limits the engines; PYTHON names the interpreter (.venv's by
# default). Each run writes OUT/<engine>/<set>/results.json.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/reference_runs.sh OUT_DIR}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
ENGINES=${ENGINES:-"sequential batched flower batched-2"}
variants=pflalign-noprecond,pflalign-gamma0,pflalign-gamma05,pflalign-gamma1,pflalign-hardgamma
variants=$variants,pflalign-nopersonal,pflalign-genie,pflalign-sgd,pflalign
extras="pflalign(pflalign-state=server),fedavg(local-optimizer=adam),fedprox(local-optimizer=genie)"
extras="$extras,ditto(local-optimizer=genie),pflalign(model=cnn-bn,pflalign-bn=local),fedavg(gga=true)"
for engine in $ENGINES; do
    case $engine in
        batched-2) settings=(--set engine=batched --set batched-workers=2
                             --set client-resources-num-cpus=1) ;;
        *) settings=(--set "engine=$engine") ;;
    esac
    for set in all variants extras; do
        case $set in
            all) methods=all ;;
            variants) methods=$variants ;;
            extras) methods=$extras ;;
        esac
        echo "==> $engine/$set"
        start=$(date +%s)
        PYTHONPATH=$PWD "$PYTHON" simulate.py --methods "$methods" --set rounds=3 \
            --set num-unseen-clients=2 "${settings[@]}" --overwrite --quiet \
            --out "$out/$engine/$set" > "$out.$engine.$set.log" 2>&1 \
            || { echo "failed: see $out.$engine.$set.log" >&2; exit 1; }
        echo "    $(( $(date +%s) - start )) s"
    done
done
