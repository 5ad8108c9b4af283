#!/usr/bin/env bash
# The runs a refactor is checked against: every method, every pFLAlign variant and the paths the
# others do not take, 3 rounds with 2 unseen clients on configs/default.toml, on each engine
# (sequential, batched, Flower on Ray, and batched on 2 Ray workers). Beside the methods, one set
# per round feature: central DP with adaptive clipping and Poisson sampling, local DP, deadlines
# with over-selection, device profiles and diurnal availability, FedBuff on the simulated clock,
# the audits at fraction 1 with the update clip, a robust aggregation, upload recording and an
# evaluation at round 0, and GGA. Run it in a clean checkout of the commit before a change and
# again after it, on the same machine, then compare:
#
#     bash scripts/reference_runs.sh /tmp/before            # in a worktree of the old commit
#     bash scripts/reference_runs.sh /tmp/after             # in the new one
#     python scripts/compare_results.py /tmp/before /tmp/after
#
# ENGINES="sequential batched" limits the engines, SETS="all dp-central" the sets; PYTHON names the interpreter (.venv's by
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
SETS=${SETS:-"all variants extras dp-central dp-local deadline fedbuff audit gga"}
for engine in $ENGINES; do
    case $engine in
        batched-2) settings=(--set engine=batched --set batched-workers=2
                             --set client-resources-num-cpus=1) ;;
        *) settings=(--set "engine=$engine") ;;
    esac
    for set in $SETS; do
        features=()
        case $set in
            all) methods=all ;;
            variants) methods=$variants ;;
            extras) methods=$extras ;;
            dp-central) methods=fedavg,fedrep,pflalign,local
                        features=(--set dp=central --set dp-clipping=adaptive
                                  --set dp-noise-multiplier=0.3 --set sampling=poisson) ;;
            dp-local) methods=fedavg,pflalign
                      features=(--set dp=local --set dp-noise-multiplier=0.3
                                --set eval-audit-fraction=0) ;;
            deadline) methods=fedavg,ditto,pflalign,scaffold
                      features=(--set device-profiles=lognormal --set round-deadline=30
                                --set over-selection=1.5 --set availability=diurnal) ;;
            fedbuff) methods=fedavg,fedrep,pflalign
                     features=(--set device-profiles=lognormal --set mode=async) ;;
            audit) methods="fedavg(aggregation=median),ditto,pflalign,fedrep"
                   features=(--set train-audit-fraction=1 --set eval-audit-fraction=1
                             --set update-clip=1 --set record-uploads=true
                             --set eval-at-start=true) ;;
            gga) methods="fedavg(gga=true),pflalign(gga=true)" ;;
            *) echo "unknown set '$set'" >&2; exit 2 ;;
        esac
        echo "==> $engine/$set"
        start=$(date +%s)
        PYTHONPATH=$PWD "$PYTHON" simulate.py --methods "$methods" --set rounds=3 \
            --set num-unseen-clients=2 "${settings[@]}" "${features[@]}" --overwrite --quiet \
            --out "$out/$engine/$set" > "$out.$engine.$set.log" 2>&1 \
            || { echo "failed: see $out.$engine.$set.log" >&2; exit 1; }
        echo "    $(( $(date +%s) - start )) s"
    done
done
