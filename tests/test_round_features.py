"""Round features (pflalign.round.feature): a config turns on exactly the features it names, a
new feature is one class and one registration, and its state goes into checkpoints under its
name and comes back on resume."""

from __future__ import annotations

import pytest
from conftest import needs_fashion_mnist
from test_checkpoint import _StopAt

from pflalign.engines.sequential import SequentialEngine
from pflalign.methods.registry import METHODS
from pflalign.outputs.results import Reporter
from pflalign.process import interrupt
from pflalign.process.interrupt import Interrupted
from pflalign.round import feature as features_module
from pflalign.round.checkpoint import Checkpoint
from pflalign.round.feature import FEATURES, RoundFeature, compose, register
from pflalign.round.loop import RoundLoop
from pflalign.run.config import build_settings
from pflalign.run.driver import initial_model, run_methods, template_model
from pflalign.server.runtime import ServerRuntime
from pflalign.wire.protocol import CLIENT_SECONDS

TINY = {"engine": "sequential", "num-clients": 4, "max-samples": 800, "rounds": 3,
        "eval-every": 3, "fraction-train": 0.5, "local-steps": 2, "save-models": "none"}


def _features(method: str = "fedavg", **values) -> list[str]:
    settings = build_settings({**TINY, "methods": method, **values})
    model, trainable = initial_model(settings)
    server = ServerRuntime(settings, method, model, trainable, template_model(settings))
    loop = RoundLoop(server, METHODS[method].build(settings), None, Reporter(quiet=True))
    assert [f.name for f in loop.features] == [f.name for f in compose(loop)]
    return [f.name for f in loop.features]


@needs_fashion_mnist
def test_the_config_turns_on_exactly_its_features_in_registry_order():
    assert list(FEATURES) == ["gga", "record-uploads", "clock", "telemetry", "audit",
                              "update-bounds", "robust-aggregation", "secure-aggregation",
                              "central-dp", "distributed-dp", "local-dp", "saved-models"]
    # save-models (on by default) asks for the models last, after every check of the replies
    assert _features(**{"save-models": "final"})[-1] == "saved-models"
    # every run reports its processes and its audits (zero audited at fraction 0)
    assert _features(**{"update-norm-bound": 0}) == ["telemetry", "audit"]
    assert _features() == ["telemetry", "audit", "update-bounds"]
    assert _features(**{"device-profiles": "lognormal", "round-deadline": 60,
                        "record-uploads": True, "gga": True}) == [
        "gga", "record-uploads", "clock", "telemetry", "audit", "update-bounds"]
    # central DP's clip replaces the norm bound; a method that uploads nothing only reports
    # its epsilon (0)
    assert _features(dp="central") == ["telemetry", "audit", "central-dp"]
    assert _features("local", dp="central") == ["telemetry", "audit", "update-bounds",
                                                "local-dp"]
    # distributed DP: the noised sum secure aggregation unmasks, divided and accounted after it
    assert _features(dp="distributed", **{"secure-aggregation": "secagg+",
                                          "eval-audit-fraction": 0}) == [
        "telemetry", "audit", "secure-aggregation", "distributed-dp"]
    assert _features(dp="local", **{"eval-audit-fraction": 0}) == [
        "telemetry", "audit", "update-bounds", "local-dp"]
    assert _features(**{"update-clip": 2.0}) == ["telemetry", "audit", "update-bounds"]
    # a robust rule: its references before aggregation, and its row entries
    assert _features(aggregation="krum") == ["telemetry", "audit", "update-bounds",
                                             "robust-aggregation"]
    assert _features("local", aggregation="median") == ["telemetry", "audit", "update-bounds"]
    # secure aggregation: the sum alone; the quantization's clip replaces the norm bound
    assert _features(**{"secure-aggregation": "secagg+"}) == ["telemetry", "audit",
                                                               "secure-aggregation"]


class SlowestClient(RoundFeature):
    """The worked example of docs/design.md: each round's slowest training reply, and how many
    rounds it has seen (its state)."""

    name = "slowest-client"

    @classmethod
    def wanted(cls, settings, method) -> bool:
        return True

    def __init__(self, loop):
        self.rounds = 0

    def checked(self, loop, training, collected):
        seconds = [m[CLIENT_SECONDS] for m, _ in collected.good if CLIENT_SECONDS in m]
        if seconds:
            training.row["slowest-client-seconds"] = max(seconds)
        self.rounds += 1
        training.row["slowest-client-rounds"] = self.rounds
        return collected

    def state_dict(self) -> dict:
        return {"rounds": self.rounds}

    def load_state_dict(self, state) -> None:
        self.rounds = int(state["rounds"])


@pytest.fixture
def planted():
    """SlowestClient registered for one test (one call: the class and its registration)."""
    register(SlowestClient)
    yield SlowestClient
    del features_module.FEATURES[SlowestClient.name]


@needs_fashion_mnist
def test_a_new_feature_is_one_class_and_one_registration_and_resumes_from_checkpoints(
        tmp_path, planted):
    settings = build_settings({**TINY, "methods": "fedavg", "checkpoint-every": 1,
                               "out-dir": str(tmp_path / "run")})
    with pytest.raises(Interrupted):  # stopped in round 2, after round 1's checkpoint
        run_methods(settings, SequentialEngine, _StopAt("[fedavg] round   2/3"))
    interrupt.reset()
    snapshot = Checkpoint.for_entry(settings.run.out_dir, "fedavg", settings).read()
    assert snapshot.round in (1, 2) and snapshot.features["slowest-client"] == {
        "rounds": snapshot.round}
    resumed = run_methods(settings, SequentialEngine, Reporter(quiet=True), resume=True)
    rows = resumed["methods"]["fedavg"]["rounds"]
    assert [r["slowest-client-rounds"] for r in rows] == [1, 2, 3]  # counted on from the file
    assert all(r["slowest-client-seconds"] > 0 for r in rows)
    # without the registration, the same run has none of it
    del features_module.FEATURES[SlowestClient.name]
    plain = run_methods(settings.replace({"out-dir": str(tmp_path / "plain")}), SequentialEngine,
                        Reporter(quiet=True))
    register(SlowestClient)
    assert not any("slowest-client-rounds" in r for r in plain["methods"]["fedavg"]["rounds"])


def test_a_feature_needs_a_name_of_its_own():
    class Nameless(RoundFeature):
        pass

    with pytest.raises(ValueError, match="name of its own"):
        register(Nameless)
    with pytest.raises(ValueError, match="name of its own"):
        register(type("Clock", (RoundFeature,), {"name": "clock"}))
