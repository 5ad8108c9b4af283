"""SecAgg+ (pflalign/wire/secagg.py): the server's unmasked sum is exactly the sum of the survivors'
quantized vectors, with and without a client dropping after sharing its keys, and dequantizes to
within the stated error of the plain sum."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import needs_fashion_mnist

from pflalign.wire.secagg import (
    Params,
    dequantize_sum,
    graph,
    masked_input,
    quantize,
    setup,
    share_keys,
    unmask,
    unmasked_sum,
)


def _round(clients, vectors, params, drop_after_keys=(), drop_after_input=(), seed=0):
    """Run the four stages; returns the server's sum mod M and what each survivor sent."""
    rng = np.random.default_rng(seed)
    neighbours = graph(clients, params.neighbours, rng)
    secrets, public = {}, {}
    for c in clients:
        secrets[c], public[c] = setup(c)
    views = {c: {v: public[v] for v in (*neighbours[c], c)} for c in clients}
    sent = {c: share_keys(secrets[c], views[c], params.threshold) for c in clients}
    inbox = {c: {s: out[c] for s, out in sent.items() if c in out} for c in clients}
    masked = {c: masked_input(secrets[c], inbox[c], vectors[c], params.modulus)
              for c in clients if c not in drop_after_keys}
    survivors = sorted(masked)
    dropped = [c for c in clients if c not in masked]
    shares = {c: unmask(secrets[c], [v for v in survivors if v in views[c]],
                        [v for v in dropped if v in views[c]])
              for c in survivors if c not in drop_after_input}
    return unmasked_sum(masked, views, shares, params), survivors, masked


@pytest.mark.parametrize("count,neighbours,dropped", [(5, 4, ()), (5, 4, (2,)), (8, 4, (5,)),
                                                     (8, 4, (0, 6))])
def test_the_unmasked_sum_is_exactly_the_survivors_quantized_sum(count, neighbours, dropped):
    params = Params(threshold=2, neighbours=neighbours, clip=1.0)
    clients = list(range(count))
    rng = np.random.default_rng(1)
    values = {c: rng.uniform(-1.2, 1.2, size=50) for c in clients}
    quantized = {c: quantize(values[c], params, np.random.default_rng([7, c])) for c in clients}
    total, survivors, masked = _round(clients, quantized, params, drop_after_keys=dropped)
    assert survivors == [c for c in clients if c not in dropped]
    expected = sum(quantized[c] for c in survivors)
    assert np.array_equal(total.astype(np.int64), expected)
    # a masked vector tells nothing of its input: it is not the quantized vector
    assert all(not np.array_equal(masked[c].astype(np.int64), quantized[c]) for c in survivors)
    # dequantized: within n * 2 clip / T of the sum of the clipped values
    plain = sum(np.clip(values[c], -1.0, 1.0) for c in survivors)
    error = np.abs(dequantize_sum(total, len(survivors), params) - plain).max()
    assert error < params.error_bound(len(survivors))
    assert params.error_bound(len(survivors)) == len(survivors) * 2 / (1 << 22)


def test_a_survivor_silent_in_the_unmasking_is_covered_by_the_threshold():
    params = Params(threshold=2, neighbours=4, clip=1.0)
    clients = list(range(5))
    vectors = {c: np.full(3, c, dtype=np.int64) for c in clients}
    total, survivors, _ = _round(clients, vectors, params, drop_after_keys=(1,),
                                 drop_after_input=(4,))
    assert total.astype(np.int64).tolist() == [0 + 2 + 3 + 4] * 3


def test_too_few_shares_cannot_unmask():
    params = Params(threshold=4, neighbours=4, clip=1.0)
    clients = list(range(5))
    vectors = {c: np.zeros(3, dtype=np.int64) for c in clients}
    with pytest.raises(ValueError, match="fewer than the threshold 4"):
        _round(clients, vectors, params, drop_after_keys=(0, 1))


def test_the_graph_is_regular_and_symmetric():
    neighbours = graph(list(range(20)), 6, np.random.default_rng(0))
    assert all(len(v) == 6 for v in neighbours.values())
    assert all(c in neighbours[o] for c, others in neighbours.items() for o in others)
    assert graph([3, 1, 2], 6, np.random.default_rng(0)) == {1: (2, 3), 2: (1, 3), 3: (1, 2)}


def test_quantization_is_unbiased_and_within_one_step():
    params = Params(threshold=2, neighbours=2, clip=2.0, target=1 << 8)
    x = np.full(20000, 0.3)
    q = quantize(x, params, np.random.default_rng(0))
    step = 2 * params.clip / params.target
    back = q * step - params.clip
    assert np.abs(back - 0.3).max() < step
    assert abs(back.mean() - 0.3) < 0.01 * step * 10
    with pytest.raises(ValueError, match="wraps the modulus"):
        Params(threshold=2, neighbours=2, clip=1.0).check(1024)


# --- in a run ----------------------------------------------------------------------------------
SA = {"num-clients": 6, "max-samples": 2000, "fraction-train": 1.0, "rounds": 2, "eval-every": 2,
      "local-steps": 3, "seed": 4, "engine": "sequential", "update-norm-bound": 0.0,
      "save-models": "none"}


class _Models:
    """The global model after every round's aggregation."""

    name = "test-models"

    def __init__(self):
        self.models = []

    def __getattr__(self, hook):  # every other hook does nothing
        from pflalign.round.feature import RoundFeature

        return getattr(RoundFeature(), hook)

    def trained(self, loop, server_round, row):
        self.models.append({k: v.copy() for k, v in loop.state.model.items()})
        self.row = row


def _run(tmp_path, method="fedavg", **changes):
    from pflalign.engines.sequential import SequentialEngine
    from pflalign.methods.registry import METHODS
    from pflalign.outputs.results import Reporter
    from pflalign.round.loop import RoundLoop
    from pflalign.run.config import build_settings
    from pflalign.run.driver import initial_model, template_model
    from pflalign.server.runtime import ServerRuntime

    settings = build_settings({**SA, "methods": method, "out-dir": str(tmp_path), **changes})
    model, trainable = initial_model(settings)
    server = ServerRuntime(settings, method, model, trainable, template_model(settings))
    recorder = _Models()
    result = RoundLoop(server, METHODS[method].build(settings), SequentialEngine(settings),
                       Reporter(quiet=True), features=[recorder]).run(model)
    return result, recorder.models


@pytest.mark.parametrize("changes,secure", [({}, {}),
                                            ({"client-dropout-rate": 0.3},
                                             {"secagg-threshold": 2}),
                                            ({"num-clients": 8}, {"secagg-neighbours": 2}),
                                            ({"attackers": 0.34, "attack": "ipm"}, {})])
@needs_fashion_mnist
def test_the_secure_aggregate_is_fedavgs_within_the_quantization_error(tmp_path, changes,
                                                                       secure):
    """The global model after a round equals plain FedAvg's (the update-norm bound off in
    both) to within the stated error: per coordinate, n * 2 clip / 2^22 on the weighted sum,
    divided by the sum of the weights (at least 1), plus the float32 rounding of the model;
    with clients dropping out of training after sharing their keys (client-dropout-rate: the
    same clients in both runs), on a sparse graph, and with two colluding attackers, whose
    attack applies before their upload is masked. (Only the first round is compared: from
    the second on, the clients train from models that differ by that error, and training moves
    them further apart.)"""
    plain, plain_models = _run(tmp_path / "plain", **changes)
    secure, secure_models = _run(tmp_path / "secure", **{"secure-aggregation": "secagg+",
                                                         **changes, **secure})
    n = changes.get("num-clients", 6)
    bound = n * 2 * 1.0 / (1 << 22) + 1e-6
    a, b = plain_models[0], secure_models[0]
    error = max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)
    assert 0 < error < bound
    rows = secure["rounds"]
    assert all(r["secagg-bytes-up"] > 0 and r["secagg-bytes-down"] > 0 for r in rows)
    assert [r["clients-trained"] for r in rows] == [r["clients-trained"] for r in plain["rounds"]]
    if "client-dropout-rate" in changes:
        assert sum(r["secagg-dropped"] for r in rows) == sum(r["timeouts"] for r in rows) > 0
    assert all("update-cosine" not in r for r in rows)  # no single upload to compare
    # the secrets of a client that dropped never reach the audit's state request
    assert secure["final"]["eval-audit-rejected"] == 0
    # the protocol's own bytes are in the round's
    assert all(r["bytes-up"] > p["bytes-up"] for r, p in zip(rows, plain["rounds"], strict=True))


def test_what_reads_one_upload_is_refused_under_secure_aggregation():
    from pflalign.run.config import build_settings
    from pflalign.settings.options import ConfigError

    base = {"secure-aggregation": "secagg+"}
    for changes, words in [({"methods": "scaffold"}, "scaffold cannot run secure-aggregation"),
                           ({"aggregation": "median"}, "aggregation = 'median' reads each"),
                           ({"update-clip": 1.0}, "update-clip = 1 scales each upload"),
                           ({"train-audit-fraction": 0.5}, "recomputes each upload"),
                           ({"dp": "central", "dp-clipping": "adaptive"},
                            "counts the clipped uploads one by one")]:
        with pytest.raises(ConfigError, match=words):
            build_settings({**base, **changes})
    with pytest.raises(ConfigError, match="secure-aggregation = 'secagg\\+'"):
        build_settings({"secagg-clip": 2.0})


@needs_fashion_mnist
def test_central_dp_after_unmasking_is_central_dps_release(tmp_path):
    """dp = central on top: each client clips its update to dp-clip before masking it, and the
    server adds the noise to the unmasked sum, from the same stream as central DP without secure
    aggregation; round 1's global model equals that run's to within the quantization error on
    the sum (n * 2 dp-clip / 2^22) over the expected clients, and epsilon is the same."""
    dp = {"dp": "central", "dp-clip": 0.1, "dp-noise-multiplier": 0.5}
    plain, plain_models = _run(tmp_path / "plain", **dp)
    secure, secure_models = _run(tmp_path / "secure", **{"secure-aggregation": "secagg+",
                                                         **dp})
    a, b = plain_models[0], secure_models[0]
    error = max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)
    assert 0 < error < 6 * 2 * 0.1 / (1 << 22) / 6 + 1e-6
    assert [r["dp-epsilon"] for r in secure["rounds"]] == [r["dp-epsilon"]
                                                           for r in plain["rounds"]]


@needs_fashion_mnist
def test_a_malformed_masked_vector_drops_only_its_client(tmp_path):
    """A client that sends a masked vector one value short (as an outside client could) is
    rejected and unmasked as dropped; the round goes on with the other five."""
    import torch

    from pflalign.engines import sequential
    from pflalign.engines.secagg_client import MASKED

    real = sequential.SequentialEngine.__init__

    def init(self, settings):
        real(self, settings)
        honest = self.handler

        def short(action, settings_, cid, config, arrays, saved, node=None):
            metrics, reply, state = honest(action, settings_, cid, config, arrays, saved,
                                           node=node)
            if cid == 0 and MASKED in reply:
                reply = {MASKED: {"y": torch.as_tensor(reply[MASKED]["y"][:-1])}}
            return metrics, reply, state

        self.handler = short

    sequential.SequentialEngine.__init__ = init
    try:
        result, models = _run(tmp_path, **{"secure-aggregation": "secagg+", "rounds": 1,
                                           "eval-every": 1})
    finally:
        sequential.SequentialEngine.__init__ = real
    (row,) = result["rounds"]
    assert row["clients-trained"] == 5 and row["rejected"] == 1 and row["secagg-dropped"] == 1
    assert all(np.isfinite(v).all() for v in models[0].values())
