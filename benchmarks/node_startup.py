#!/usr/bin/env python
"""What a deployed SuperNode pays per message to get its client's data, before and after the
partition cache.

Under Flower's default subprocess isolation every message starts a new ``flwr-clientapp``
process, so a client's data is read afresh each time: from the pooled dataset (read, subset and
partitioned: the path a node without ``data-path`` took before), or from its own partition file
(``data-path``, or the partition cache a node now writes on its first message). Each
measurement runs in a new Python process, as a message would, and times the data step alone and
together with importing the ClientApp (torch, flwr, pflalign: the same for both); the median of
``--repeat`` runs is printed. Flower's own start-up of a ``flwr-clientapp`` comes on top.

    python benchmarks/node_startup.py                       # default config (20 clients)
    python benchmarks/node_startup.py --set num-clients=3 --set max-samples=3000
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import sys, time
began = time.perf_counter()
import clients.app  # what a flwr-clientapp process imports for this app (torch, flwr, pflalign)
from pflalign.run.config import resolve
from pflalign.data.node import node_data_from_file, pooled_node_data
settings = resolve(None, sys.argv[3:])
client = int(sys.argv[2])
started = time.perf_counter()
if sys.argv[1] == "pool":
    node = pooled_node_data(settings, client)
else:
    node = node_data_from_file(sys.argv[1], settings, client)
done = time.perf_counter()
print(done - started, done - began, node.data.num_train)
"""


def measure(source: str, client: int, overrides: list[str]) -> tuple[float, float]:
    """(the data step, imports + data step) in a new process, in seconds."""
    out = subprocess.run([sys.executable, "-c", CHILD, source, str(client), *overrides],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    data, total, _ = out.stdout.split()
    return float(data), float(total)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--client", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from pflalign.data.node import export_partitions
    from pflalign.run.config import resolve

    settings = resolve(None, args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        path = export_partitions(settings, tmp, [args.client])[0]
        pool = [measure("pool", args.client, args.overrides) for _ in range(args.repeat)]
        file = [measure(str(path), args.client, args.overrides) for _ in range(args.repeat)]
        size = path.stat().st_size
    p, f = (statistics.median(x[0] for x in pool), statistics.median(x[0] for x in file))
    pt, ft = (statistics.median(x[1] for x in pool), statistics.median(x[1] for x in file))
    print(f"config: {' '.join(args.overrides) or 'defaults'}; client {args.client}; "
          f"median of {args.repeat} fresh processes (data step / with imports)")
    print(f"  pooled dataset (read + partition): {p * 1000:8.1f} ms / {pt:.2f} s  "
          f"(data runs: {', '.join(f'{x[0] * 1000:.0f}' for x in pool)} ms)")
    print(f"  own partition file ({size / 1e6:.1f} MB):  {f * 1000:8.1f} ms / {ft:.2f} s  "
          f"(data runs: {', '.join(f'{x[0] * 1000:.0f}' for x in file)} ms)")
    print(f"  saved per message: {(p - f) * 1000:.1f} ms ({p / f:.0f}x faster data step; "
          f"start-up to data ready {pt:.2f} s -> {ft:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
