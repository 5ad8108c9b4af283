"""A large population costs what its rounds cost: a training round walks no per-client
structure of the whole population, and memory grows by a stated bound per client."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

from pflalign.engines.sequential import SequentialEngine
from pflalign.outputs.results import Reporter
from pflalign.run.config import build_settings
from pflalign.run.driver import run_methods

#: Synthetic(1, 1) with the MLP, diurnal availability on lognormal profiles, 20 clients a round
SYNTHETIC = {"dataset": "synthetic", "partition": "natural", "model": "mlp", "local-steps": 2,
             "device-profiles": "lognormal", "availability": "diurnal", "save-models": "none",
             "eval-clients": 50, "report": False}


class _Walks(dict):
    """The clients' record, counting each walk over all of them (iteration, keys, values,
    items)."""

    walks = 0


def _counted(name: str):
    def walk(self):
        _Walks.walks += 1
        return getattr(dict, name)(self)
    return walk


for _name in ("__iter__", "keys", "values", "items"):
    setattr(_Walks, _name, _counted(_name))


class _Counting(SequentialEngine):
    """The sequential engine whose discovery gives a :class:`_Walks`, recording the walks so
    far at the start of each training exchange."""

    at_training: list[int] = []

    def discover(self):
        return _Walks(super().discover())

    def exchange(self, action, messages):
        if action == "train":
            _Counting.at_training.append(_Walks.walks)
        return super().exchange(action, messages)


def test_a_training_round_walks_no_record_of_the_whole_population(tmp_path):
    for method in ("fedavg", "pflalign", "scaffold"):
        _Walks.walks, _Counting.at_training = 0, []
        settings = build_settings({**SYNTHETIC, "num-clients": 3000, "fraction-train": 0.005,
                                   "rounds": 4, "eval-every": 4, "methods": method,
                                   "out-dir": str(tmp_path / method)})
        result = run_methods(settings, _Counting, Reporter(quiet=True))["methods"][method]
        assert [r["clients-trained"] for r in result["rounds"]] == [15] * 4
        # set-up walks the clients (and so does an evaluation); rounds 2 to 4 none at all
        assert _Counting.at_training[0] > 0
        assert _Counting.at_training[1:] == [_Counting.at_training[0]] * 3, method


def _peak_after_one_round(clients: int, out) -> float:
    """The server process's peak resident MiB over a run of one round (20 clients trained, 50
    evaluated), in a fresh interpreter."""
    flags = [arg for k, v in {**SYNTHETIC, "num-clients": clients, "methods": "fedavg",
                              "fraction-train": 20 / clients, "rounds": 1}.items()
             for arg in ("--set", f"{k}={json.dumps(v) if isinstance(v, str | bool) else v}")]
    run = subprocess.run([sys.executable, str(ROOT / "simulate.py"), *flags, "--quiet",
                          "--set", "engine=batched", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    entry = json.loads((out / "results.json").read_text())["methods"]["fedavg"]
    assert entry["final"]["evaluated"] == 50
    return entry["processes"][0]["peak-rss-mb"]


#: what each client beyond the first 2,000 may add to the process's memory (measured on
#: 2026-12-07: about 560 bytes, mostly the partition's record of each client, 310, and the
#: discovered record, 150)
BYTES_PER_CLIENT = 1000


def test_memory_grows_by_a_bounded_amount_per_client_from_2000_to_200000(tmp_path):
    small = _peak_after_one_round(2000, tmp_path / "small")
    large = _peak_after_one_round(200_000, tmp_path / "large")
    assert large - small <= 198_000 * BYTES_PER_CLIENT / 2**20, (small, large)
