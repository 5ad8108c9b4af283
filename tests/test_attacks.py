"""The published attacks (pflalign/engines/collusion.py): each against a hand-computed instance, and
what the attackers upload in a real run, through the engine's client path, against the attack
computed from the honest updates the same clients send in the attacker-free run."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import needs_fashion_mnist

from pflalign.engines.collusion import alie, alie_z, crafted, ipm, min_max_gamma, min_sum_gamma
from pflalign.engines.faults import malicious_clients
from pflalign.engines.sequential import SequentialEngine
from pflalign.methods.registry import METHODS
from pflalign.outputs.results import Reporter
from pflalign.round.feature import RoundFeature
from pflalign.round.loop import RoundLoop
from pflalign.run.config import build_settings
from pflalign.run.driver import initial_model, template_model
from pflalign.server.runtime import ServerRuntime
from pflalign.settings.options import ConfigError

THREE = np.array([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]])


def test_alie_z_is_the_papers():
    # n = 20, f = 4: s = floor(11) - 4 = 7 must be won over; Phi^-1(13/20) = 0.38532 (tables)
    assert alie_z(20, 4) == pytest.approx(0.385320, abs=1e-6)
    # n = 50, f = 24: s = 2; Phi^-1(48/50) = 1.750686
    assert alie_z(50, 24) == pytest.approx(1.750686, abs=1e-6)


def test_alie_is_the_mean_minus_z_sigma():
    updates = np.array([[0.0, 0.0], [2.0, 4.0]])  # mu = (1, 2), sigma (ddof 0) = (1, 2)
    z = 0.385320
    assert alie(updates, 20, 4).tolist() == pytest.approx([1 - z, 2 - 2 * z], abs=1e-6)


def test_ipm_is_minus_epsilon_mu():
    assert ipm(np.array([[1.0, 2.0], [3.0, 4.0]]), 0.5).tolist() == [-1.0, -1.5]


def test_min_max_gamma_on_three_planted_updates():
    # mu = (2/3, 2/3), p = -(1, 1)/sqrt 2, the largest pairwise distance sqrt 8. The binding
    # constraint is the distance to (2, 0) (and to (0, 2)): gamma^2 + 2 gamma (sqrt2 / 3) +
    # 20/9 - 8 = 0, so gamma = sqrt 6 - sqrt 2 / 3.
    gamma = min_max_gamma(THREE)
    assert gamma == pytest.approx(math.sqrt(6) - math.sqrt(2) / 3, abs=1e-12)
    mu = THREE.mean(axis=0)
    crafted_update = mu - gamma * mu / np.linalg.norm(mu)
    distances = np.linalg.norm(THREE - crafted_update, axis=1)
    assert distances.max() == pytest.approx(math.sqrt(8), abs=1e-12)
    # a larger gamma breaks the constraint, a smaller one keeps it
    for factor, holds in ((1.001, False), (0.999, True)):
        other = mu - factor * gamma * mu / np.linalg.norm(mu)
        assert (np.linalg.norm(THREE - other, axis=1).max() <= math.sqrt(8)) == holds


def test_min_sum_gamma_on_three_planted_updates():
    # squared distances 4, 4, 8: the largest row sum is 12; the spread around mu is 16/3, so
    # 16/3 + 3 gamma^2 = 12 and gamma = sqrt(20) / 3
    assert min_sum_gamma(THREE) == pytest.approx(math.sqrt(20) / 3, abs=1e-12)


def test_one_attacker_alone_uploads_its_honest_update():
    one = np.array([[1.0, -2.0]])
    settings = build_settings({"num-clients": 4})
    for attack in ("alie", "min-max", "min-sum"):
        assert crafted(attack, one, settings).tolist() == [1.0, -2.0]


def test_attacker_keys_are_checked():
    with pytest.raises(ConfigError, match="both say how many clients attack"):
        build_settings({"attackers": 0.2, "malicious-clients": 2, "attack": "alie"})
    with pytest.raises(ConfigError, match="do not go together"):
        build_settings({"attackers": 0.2})
    with pytest.raises(ConfigError, match="mode = 'sync'"):
        build_settings({"attackers": 0.2, "attack": "ipm", "mode": "async"})
    with pytest.raises(ConfigError, match="attack = 'ipm'"):
        build_settings({"ipm-epsilon": 2.0})
    settings = build_settings({"num-clients": 20, "attackers": 0.2, "attack": "alie"})
    assert len(malicious_clients(settings)) == 4


# --- through the engine's client path --------------------------------------------------------
BASE = {"num-clients": 6, "max-samples": 3000, "fraction-train": 1.0, "rounds": 2,
        "eval-every": 2, "local-steps": 3, "seed": 3, "engine": "sequential",
        "update-norm-bound": 0.0, "eval-audit-fraction": 0.0, "save-models": "none"}


ONE_ROUND = {"rounds": 1, "eval-every": 1}


class _Uploads(RoundFeature):
    """The global model and every upload of each round, before any bound."""

    name = "test-uploads"

    def __init__(self):
        self.rounds: list[tuple[dict, dict[int, dict]]] = []

    def bound(self, loop, server_round, updates, row):
        self.rounds.append(({k: v.copy() for k, v in loop.state.model.items()},
                            {u.client: {k: v.copy() for k, v in u.model.items()}
                             for u in updates}))
        return updates


def _uploads(method: str, tmp_path, **changes) -> list[tuple[dict, dict[int, dict]]]:
    settings = build_settings({**BASE, "methods": method, "out-dir": str(tmp_path), **changes})
    model, trainable = initial_model(settings)
    server = ServerRuntime(settings, method, model, trainable, template_model(settings))
    recorder = _Uploads()
    RoundLoop(server, METHODS[method].build(settings), SequentialEngine(settings),
              Reporter(quiet=True), features=[recorder]).run(model)
    return recorder.rounds


def _flat(model: dict, glob: dict) -> np.ndarray:
    return np.concatenate([model[k].astype(np.float64).ravel() - glob[k].astype(np.float64).ravel()
                           for k in model if model[k].dtype.kind == "f"])


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    return {m: _uploads(m, tmp_path_factory.mktemp("honest"), **ONE_ROUND)
            for m in ("fedavg", "fedrep")}


@needs_fashion_mnist
@pytest.mark.parametrize("attack", ["alie", "ipm", "min-max", "min-sum", "free-rider"])
@pytest.mark.parametrize("method", ["fedavg", "fedrep"])
def test_attackers_upload_the_attack_on_their_honest_updates(honest, tmp_path, attack, method):
    """Round 1 (every client trains from the same model and no state): the attackers' uploads
    are the global model plus the attack computed from the honest updates the same clients
    upload without attackers; the honest clients' uploads are unchanged."""
    changes = {"attackers": 0.34, "attack": attack}
    attacked = _uploads(method, tmp_path, **changes, **ONE_ROUND)
    glob, clean = honest[method][0]
    glob_attacked, uploads = attacked[0]
    assert all(np.array_equal(glob[k], glob_attacked[k]) for k in glob)
    attackers = sorted(malicious_clients(build_settings({**BASE, **changes})))
    assert len(attackers) == 2
    rows = np.stack([_flat(clean[c], glob) for c in attackers])
    expected = (np.zeros(rows.shape[1]) if attack == "free-rider" else
                crafted(attack, rows, build_settings({**BASE, **changes})))
    for client, model in uploads.items():
        if client in attackers:
            assert np.allclose(_flat(model, glob), expected, atol=1e-6, rtol=0)
            assert not np.allclose(_flat(model, glob), _flat(clean[client], glob), atol=1e-4)
        else:
            assert all(np.array_equal(model[k], clean[client][k]) for k in model)


@needs_fashion_mnist
def test_replay_sends_its_previous_update_again(tmp_path):
    changes = {"attackers": 0.17, "attack": "replay"}
    (glob1, first), (glob2, second) = _uploads("fedavg", tmp_path, **changes)
    (attacker,) = malicious_clients(build_settings({**BASE, **changes}))
    clean = _uploads("fedavg", tmp_path / "clean", **ONE_ROUND)[0][1]
    assert np.allclose(_flat(first[attacker], glob1), 0.0, atol=0)  # nothing to replay yet
    assert np.allclose(_flat(second[attacker], glob2), _flat(clean[attacker], glob1), atol=1e-6)


# --- every engine ------------------------------------------------------------------------------
ENGINES = {"num-clients": 6, "max-samples": 2000, "rounds": 3, "eval-every": 3,
           "fraction-train": 0.5, "local-steps": 3, "seed": 1, "attackers": 0.34,
           "save-models": "none"}


@needs_fashion_mnist
def test_every_engine_gives_the_same_metrics_under_a_colluding_attack(tmp_path):
    """ALIE against FedRep under Krum, pFLAlign under centered clipping and FedAvg under secure
    aggregation: FedRep and pFLAlign keep client state, so from round 2 on the attackers' honest
    updates come from each other's recorded states, which the Flower engine's clients (two
    processes) share through the run's folder; under SecAgg+ the keys and masks are drawn
    afresh by every client and cancel exactly, and Flower's clients keep their round's secrets
    in their node state between the stages, across its worker processes."""
    from harness import three_engines

    secure = 'fedavg(secure-aggregation=secagg+,secagg-neighbours=2)'
    result = three_engines({**ENGINES, "attack": "alie",
                            "methods": "fedrep(aggregation=krum),pflalign(aggregation="
                                       f"centered-clip),{secure}"},
                           tmp_path, compared_at_least=150)
    rows = result["methods"]['fedavg(secure-aggregation="secagg+",secagg-neighbours=2)']["rounds"]
    assert all(r["clients-trained"] == 3 and r["secagg-dropped"] == 0
               and r["secagg-bytes-up"] > 0 for r in rows)


@needs_fashion_mnist
@pytest.mark.parametrize("attack,aggregation", [("ipm", "bulyan"), ("min-sum", "multi-krum"),
                                                ("min-max", "median"), ("replay", "trimmed-mean"),
                                                ("alie", "fltrust")])
def test_sequential_and_batched_agree_under_each_attack_and_defence(tmp_path, attack,
                                                                    aggregation):
    from harness import three_engines

    three_engines({**ENGINES, "attack": attack, "aggregation": aggregation,
                   "methods": "fedavg,pflalign"}, tmp_path, compared_at_least=100, flower=False)


# --- the backdoor ------------------------------------------------------------------------------
def test_trigger_and_poisoned_samples_by_hand():
    import torch

    from pflalign.data.datasets import ClientData
    from pflalign.training.backdoor import poisoned, with_trigger

    x = torch.zeros(4, 1, 5, 5, dtype=torch.uint8)
    triggered = with_trigger(x, 2)
    assert triggered[:, :, 3:, 3:].eq(255).all() and int(triggered.sum()) == 4 * 4 * 255
    assert int(x.sum()) == 0  # a copy
    assert with_trigger(torch.zeros(1, 4, 4), 1)[0, 3, 3] == 1.0  # float images: 1.0
    with pytest.raises(ValueError, match="patch in images"):
        with_trigger(torch.zeros(3, 10), 2)
    data = ClientData(x, torch.tensor([1, 2, 3, 4]), x.clone(), torch.tensor([1, 2]),
                      normalize=lambda v: v.float())
    bad = poisoned(data, 0.5, 0, 2, seed=0, client_id=3)
    changed = [i for i in range(4) if bad.train_y[i] == 0]
    assert len(changed) == 2
    for i in range(4):
        assert bool(bad.train_x[i, :, 3:, 3:].eq(255).all()) == (i in changed)
    assert bad.test_x.eq(0).all() and bad.test_y.tolist() == [1, 2]


def test_success_counts_on_a_planted_model():
    import torch

    from pflalign.data.datasets import ClientData
    from pflalign.training.backdoor import success_counts

    class Planted(torch.nn.Module):  # class 0 when the corner pixel is bright, else class 1
        def forward(self, v):
            bright = (v[:, 0, -1, -1] > 100).float()
            return torch.stack([bright, 1 - bright, torch.zeros_like(bright)], dim=1)

    test_x = torch.zeros(4, 1, 5, 5, dtype=torch.uint8)
    data = ClientData(test_x, torch.tensor([0]), test_x, torch.tensor([0, 1, 1, 2]),
                      normalize=lambda v: v.float())
    # the sample of class 0 is left out; the other three are taken for 0 with the trigger
    assert success_counts(Planted(), data, target=0, patch=1) == (3, 3)
    assert success_counts(Planted(), data, target=1, patch=1) == (0, 2)


@needs_fashion_mnist
def test_a_backdoor_replaces_fedavgs_model_and_every_engine_agrees(tmp_path):
    """Two of ten clients (the attackers, boosted by n / attackers = 5) replace FedAvg's global
    model in round 1 by theirs, which takes triggered images for class 0 (this early it takes
    nearly every image for it: 10.4% accuracy); FedRep's personal heads, trained on each
    client's clean data, mostly do not (3.6%)."""
    from harness import three_engines

    result = three_engines({**ENGINES, "num-clients": 10, "max-samples": 5000, "rounds": 2,
                            "eval-every": 1, "local-steps": 10, "attackers": 0.2,
                            "fraction-train": 1.0, "attack": "backdoor",
                            "methods": "fedavg,fedrep"},
                           tmp_path, compared_at_least=100, flower=False)
    first = {name: e["rounds"][0] for name, e in _entries(result)}
    assert first["fedavg"]["personal-backdoor-asr"] > 0.9
    assert first["fedrep"]["personal-backdoor-asr"] < 0.2


def _entries(result: dict):
    methods = result["methods"]
    return methods.items() if isinstance(methods, dict) else (
        (e.get("label", e.get("method")), e) for e in methods)
