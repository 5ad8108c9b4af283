#!/usr/bin/env python
"""Run federated methods on one partition and seed, or a study over seeds, scenarios, sweeps and
tuning; print a comparison; write results.json, results.csv, report.md and plots/.

    python simulate.py                                  # configs/default.toml
    python simulate.py --config FILE --set rounds=5 --methods fedavg,local --out DIR
    python simulate.py --seeds 0,1,2 --reference pflalign     # mean, 95% CIs, paired differences
    python simulate.py --suite --seeds 0-2              # every scenario in configs/scenarios
    python simulate.py --scenario dir-0.1 --tune 6      # equal-budget tuning on validation data
    python simulate.py --sweep lr=0.01,0.05             # one row per setting, no selection
    python simulate.py --resume DIR                     # continue a stopped or killed run
    python simulate.py --print-config                   # every key with its resolved value
    python simulate.py --ray-address 127.0.0.1:6379     # clients on a running Ray cluster

Ctrl-C (or SIGTERM) stops a run: what finished is written, marked "interrupted", the exit status
is 130 (143 for SIGTERM), and `--resume DIR` continues it; a second Ctrl-C exits at once.
"""

from __future__ import annotations

import sys

from pflalign.run.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
