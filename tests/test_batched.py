"""The batched engine and the client-state store.

- ``engine = batched`` gives the sequential engine's results bit for bit on the CPU (backend
  ``loop``) for every method it batches, and for a method it does not (which runs one client at a
  time and says so); backend ``vmap`` agrees within float32 rounding.
- The cohort's lockstep training masks clients with fewer samples: each client takes exactly its
  own number of steps, and vmap's masked gradients equal the per-client ones.
- The state store round-trips, spills under a tiny budget, and spilling changes no metric.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pflalign import interrupt
from pflalign.cohort import Cohort, unsupported
from pflalign.config import Settings
from pflalign.engines.batched import simulate as simulate_batched
from pflalign.engines.sequential import simulate as simulate_sequential
from pflalign.interrupt import Interrupted
from pflalign.methods import METHODS
from pflalign.results import Reporter
from pflalign.store import ClientStateStore
from pflalign.train import num_local_steps
from tests.test_checkpoint import _StopAt

#: every registered method with batched rules (the variants of pFLAlign among them), fedavg with
#: each local optimizer, and fedbn, which has none and must say it runs one client at a time
UNBATCHED = {spec.name for spec in METHODS.values()
             if spec.method.missing_batched_rule() is not None}
ENTRIES = ",".join([spec.name for spec in METHODS.values() if spec.name not in UNBATCHED
                    and (spec.variant_of is None or spec.variant_of == "pflalign")]
                   + ['fedavg(local-optimizer="adam")', 'fedavg(local-optimizer="genie")',
                      'pflalign(pflalign-state="server")', "fedbn"])
ROOT = Path(__file__).resolve().parent.parent
TINY = {"num-clients": 5, "num-unseen-clients": 1, "max-samples": 1000, "rounds": 2,
        "eval-every": 1, "fraction-train": 0.6, "local-steps": 2, "cohort-size": 2}


class Lines(Reporter):
    def __init__(self):
        super().__init__(quiet=True)
        self.lines: list[str] = []

    def info(self, text: str) -> None:
        self.lines.append(text)


def comparable(value: object) -> object:
    """``value`` without timings and without the config keys that pick the engine."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()
                if "seconds" not in k and k not in ("started", "engine", "out-dir",
                                                    "batched-backend", "memory-budget-gb")}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


def _run(tmp_path, name: str, simulate, **changes) -> tuple[dict, list[str]]:
    reporter = Lines()
    settings = Settings({**TINY, "methods": ENTRIES, "out-dir": str(tmp_path / name), **changes})
    return simulate(settings, reporter), reporter.lines


@pytest.fixture(scope="module")
def sequential(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("seq"), "run", simulate_sequential,
                engine="sequential")[0]


def test_the_batched_engine_gives_the_sequential_engines_results_bit_for_bit(sequential,
                                                                            tmp_path):
    batched, lines = _run(tmp_path, "batched", simulate_batched, engine="batched",
                          **{"batched-backend": "loop"})
    assert comparable(batched["methods"]) == comparable(sequential["methods"])
    said = [line for line in lines if "one at a time" in line]
    assert len(said) == 1 and said[0].startswith("[fedbn]") and "batch norm" in said[0]


def _close(a: object, b: object, where: str = "") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{where}[{k}]")
    elif isinstance(a, float) and not math.isnan(a):
        if where.endswith("acc") or "acc" in where.rsplit(".", 1)[-1]:
            assert abs(a - b) <= 0.02, where  # a prediction may flip near a tie
        else:
            assert b == pytest.approx(a, rel=2e-3, abs=2e-4), where
    else:
        assert a == b or (isinstance(a, float) and math.isnan(b)), where


def test_the_vmap_backend_agrees_within_float32_rounding(sequential, tmp_path):
    vmapped, _ = _run(tmp_path, "vmap", simulate_batched, engine="batched",
                      **{"batched-backend": "vmap", "methods": "fedavg,pflalign"})
    for label in ("fedavg", "pflalign"):
        ours = comparable(vmapped["methods"][label])
        theirs = comparable(sequential["methods"][label])
        assert ours != theirs  # not the loop backend in disguise: rounding does differ
        _close(theirs["rounds"], ours["rounds"], label)


def test_a_spilled_run_gives_the_same_results(sequential, tmp_path):
    entries = ["pflalign", 'pflalign(pflalign-state="server")', "ditto", "scaffold"]
    spilled, lines = _run(tmp_path, "spilled", simulate_batched, engine="batched",
                          methods=",".join(entries), **{"memory-budget-gb": 1e-5})
    assert comparable(spilled["methods"]) == comparable(
        {k: sequential["methods"][k] for k in entries})
    notes = [line for line in lines if "memory-budget-gb" in line]
    assert any(line.startswith("[pflalign]") and "written to" in line for line in notes)
    assert not list((tmp_path / "spilled").glob(".client-state-*"))  # removed with the engine


# --- the cohort ----------------------------------------------------------------------------------
def _cohort(backend: str, **changes) -> tuple[Cohort, dict]:
    settings = Settings({**TINY, "partition": "quantity", "methods": "fedavg", **changes})
    from pflalign.engines import initial_model

    model, _ = initial_model(settings)
    cohort = Cohort(settings, [0, 1, 2, 3], torch.device("cpu"), backend)
    return cohort, {k: torch.from_numpy(v) for k, v in model.items()}


def test_lockstep_training_masks_clients_with_fewer_samples():
    cohort, model = _cohort("loop", **{"local-steps": 0, "batch-size": 16,
                                       "max-samples": 1000})
    sizes = [cohort.num_train(i) for i in range(len(cohort))]
    assert len(set(sizes)) > 1  # quantity skew: the clients' step counts differ
    params = cohort.stack([model] * len(cohort))
    before = {n: p.clone() for n, p in params.items()}
    stats = cohort.local_train(params, 1, cohort.optimizers(params, 1))
    for i, s in enumerate(stats):
        assert s.steps == num_local_steps(sizes[i], 16, 1) and s.samples == sizes[i]
        assert all(not torch.equal(params[n][i], before[n][i]) for n in params)


def test_vmaps_masked_gradients_equal_each_clients_own():
    loop, model = _cohort("loop")
    vmapped, _ = _cohort("vmap")
    params = loop.stack([model] * len(loop))
    batch = [torch.arange(5), torch.arange(3), None, torch.arange(7)]  # unequal, one finished
    active = [0, 1, 3]
    names = tuple(loop.names)
    g_loop, l_loop = loop._loop_grads(params, names, batch, active)
    g_vmap, l_vmap = vmapped._vmap_grads(params, names, batch, active)
    assert set(g_vmap) == set(active)
    for i in active:
        assert float(l_vmap[i]) == pytest.approx(float(l_loop[i]), rel=1e-5)
        for a, b in zip(g_loop[i], g_vmap[i], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_what_the_cohort_cannot_serve_falls_back_and_says_why():
    base = {**TINY, "methods": "fedavg"}
    assert unsupported(Settings(base)) is None
    assert "rotated" in unsupported(Settings({**base, "partition": "rotated"}))
    assert "fault" in unsupported(Settings({**base, "client-failure-rate": 0.1}))
    assert "batch norm" in unsupported(Settings({**base, "model": "cnn-bn"}))
    # a subclass that changes train must not inherit its parent's batched rule
    fedavg = METHODS["fedavg"].method

    class Changed(fedavg):
        def train(self, client, received, state):
            return super().train(client, received, state)

    assert "no batched train rule" in Changed.missing_batched_rule()
    assert fedavg.missing_batched_rule() is None
    assert METHODS["fedbn"].method.missing_batched_rule() is not None


# --- the store -----------------------------------------------------------------------------------
def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"offset/w": rng.standard_normal((100, 10)).astype(np.float32),
            "optimizer/w.step": np.array(seed, dtype=np.int64),
            "fit_count": np.array(7)}


def test_the_store_round_trips_and_spills_under_its_budget(tmp_path):
    size = sum(a.nbytes for a in _state(0).values())
    store = ClientStateStore(budget_bytes=2 * size + 1, spill_root=tmp_path)
    for c in range(5):
        store[c] = _state(c)
        assert store.resident <= store.budget
    assert len(store) == 5 and store.on_disk == 3 and store.spills == 3
    assert sorted(store) == [0, 1, 2, 3, 4]
    for c in range(5):  # memory-mapped back with every value, dtype and shape
        got = store[c]
        assert list(got) == list(_state(c))
        for k, v in _state(c).items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            np.testing.assert_array_equal(got[k], v)
    assert isinstance(store[0]["offset/w"], np.memmap)
    store[0] = _state(10)  # a new state replaces the spilled file
    np.testing.assert_array_equal(store[0]["offset/w"], _state(10)["offset/w"])
    assert store.on_disk == 3  # client 0 came back to memory; the oldest in memory went out
    del store[1]
    assert 1 not in store and len(store) == 4
    assert "written to" in store.describe()
    folder = store._dir
    store.close()
    assert not folder.exists()


def test_a_store_without_a_budget_never_spills(tmp_path):
    store = ClientStateStore(budget_bytes=0, spill_root=tmp_path)
    for c in range(20):
        store[c] = _state(c)
    assert store.on_disk == 0 and store.describe() is None and not list(tmp_path.iterdir())


def test_simulate_py_on_the_batched_engine_imports_neither_ray_nor_flwr(tmp_path):
    """The GPU machine's NO_RAY pack runs the in-process engines from simulate.py."""
    code = ("import runpy, sys\n"
            "sys.argv = ['simulate.py', '--quiet', '--overwrite', '--set', 'engine=batched',\n"
            "            '--set', 'methods=fedavg', '--set', 'num-clients=4', '--set',\n"
            "            'max-samples=400', '--set', 'rounds=1', '--set', 'local-steps=1',\n"
            f"            '--set', 'out-dir={tmp_path}']\n"
            "try:\n"
            "    runpy.run_path('simulate.py', run_name='__main__')\n"
            "except SystemExit as stop:\n"
            "    assert not stop.code, stop.code\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'flwr'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "results.json").exists()


def test_a_stopped_batched_run_resumes_to_the_uninterrupted_results(sequential, tmp_path):
    """Client-held state (pFLAlign's Delta, v, P) goes to the checkpoint through the store and
    comes back to each cohort client as its restored state."""
    settings = Settings({**TINY, "engine": "batched", "methods": "pflalign,ditto",
                         "checkpoint-every": 1, "out-dir": str(tmp_path)})
    with pytest.raises(Interrupted):
        simulate_batched(settings, _StopAt("[ditto] round   1/2"))
    interrupt.reset()
    assert (tmp_path / "checkpoints" / "ditto.npz").exists()
    reporter = _StopAt()
    resumed = simulate_batched(settings, reporter, resume=True)
    assert any(line.startswith("[ditto] resumed from round 1") for line in reporter.lines)
    assert comparable(resumed["methods"]) == comparable(
        {k: sequential["methods"][k] for k in ("pflalign", "ditto")})
