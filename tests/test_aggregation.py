import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, Metadata, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from harness import train_metrics

from pflalign.methods.registry import METHODS
from pflalign.outputs.results import Reporter
from pflalign.round.evaluation import evaluate_round
from pflalign.round.loop import RoundLoop
from pflalign.run.config import build_settings
from pflalign.server.aggregation import FlatSpec, fedavg, weighted_average
from pflalign.server.runtime import ServerRuntime
from pflalign.wire.messages import ClientInfo, Exchange
from strategies.flower import FlowerEngine, to_record


def test_weighted_average_matches_hand_computation():
    a, b, c = np.array([1.0, 2.0]), np.array([3.0, -2.0]), np.array([0.0, 10.0])
    # weights 1, 2, 1 -> (1*a + 2*b + 1*c) / 4
    expected = np.array([(1 + 6 + 0) / 4, (2 - 4 + 10) / 4])
    np.testing.assert_allclose(weighted_average([a, b, c], [1, 2, 1]), expected, rtol=0, atol=0)


def test_fedavg_on_states_matches_hand_computation_and_keeps_dtypes():
    s1 = {"w": np.array([[1.0, 2.0]], np.float32), "n": np.array(4, np.int64)}
    s2 = {"w": np.array([[5.0, 0.0]], np.float32), "n": np.array(8, np.int64)}
    out = fedavg([s1, s2], [30, 10])
    np.testing.assert_array_equal(out["w"], np.array([[2.0, 1.5]], np.float32))
    assert out["w"].dtype == np.float32
    assert out["n"].dtype == np.int64 and int(out["n"]) == 5  # 0.75*4 + 0.25*8 = 5


def test_weighted_average_rejects_bad_weights():
    with pytest.raises(ValueError):
        weighted_average([np.zeros(2)], [0])
    with pytest.raises(ValueError):
        weighted_average([np.zeros(2), np.ones(2)], [1, float("nan")])


def test_flat_spec_round_trip_and_problems():
    state = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([7], np.int64)}
    spec = FlatSpec.of(state)
    assert spec.size == 7
    assert spec.nbytes == 6 * 4 + 8
    back = spec.unflatten(spec.flatten(state))
    assert all(np.array_equal(back[k], state[k]) and back[k].dtype == state[k].dtype
               for k in state)
    assert spec.problem_with(state) is None
    assert "missing" in spec.problem_with({"a": state["a"]})
    assert "shape" in spec.problem_with({"a": np.zeros((3, 2), np.float32), "b": state["b"]})
    bad = {"a": state["a"].copy(), "b": state["b"]}
    bad["a"][0, 0] = np.inf
    assert "NaN or infinite" in spec.problem_with(bad)


# --- the round loop's aggregation over the Flower engine, against Flower's own FedAvg ------------
class _Replies:
    """An engine that answers every exchange with prepared Flower replies (in the given order),
    converted by the Flower engine as real replies are. A reply answers the message of the
    client whose node sent it, unless ``answers`` names another client."""

    def __init__(self, flower: FlowerEngine, replies: list[Message],
                 answers: dict[int, int] | None = None):
        self.flower, self.replies, self.answers = flower, replies, answers or {}

    def exchange(self, action, messages):
        client_of = {node: cid for cid, node in self.flower.node_of.items()}
        limits = {m.client: m.limits for m in messages}
        answers = [self.answers.get(i, client_of.get(m.metadata.src_node_id))
                   for i, m in enumerate(self.replies)]
        return Exchange([self.flower.reply(cid, m, limits.get(cid))
                         for cid, m in zip(answers, self.replies, strict=True)], 0, 0)


def _reply(node: int, content: RecordDict) -> Message:
    md = Metadata(run_id=1, message_id="", src_node_id=node, dst_node_id=0,
                  reply_to_message_id="m", group_id="", created_at=0.0, ttl=60,
                  message_type="train")
    return Message(metadata=md, content=content)


def _error_reply(node: int, reason: str) -> Message:
    md = Metadata(run_id=1, message_id="", src_node_id=node, dst_node_id=0,
                  reply_to_message_id="m", group_id="", created_at=0.0, ttl=60,
                  message_type="train")
    return Message(metadata=md, error=Error(code=1, reason=reason))


def _train_reply(node: int, cid: int, state: dict, n: int, loss: float = 0.5) -> Message:
    return _reply(node, RecordDict({
        "arrays": to_record(state),
        "metrics": MetricRecord(train_metrics(cid, n, loss))}))


def _federation(initial: dict, replies: list[Message], num_clients: int = 3,
                answers: dict[int, int] | None = None, sizes: tuple[int, ...] = (),
                test_sizes: tuple[int, ...] = (), **changes) -> RoundLoop:
    """FedAvg's round loop over the Flower engine, with clients 0..n-1 on nodes 100..100+n-1,
    discovered with ``sizes`` training and ``test_sizes`` test samples (10 and 5 by default)."""
    # prepared replies answer every exchange: no state query of the evaluation audit's
    settings = build_settings({"num-clients": num_clients, "methods": "fedavg",
                               "eval-audit-fraction": 0.0, **changes})
    server = ServerRuntime(settings, "fedavg", initial, tuple(initial), template=lambda: None)
    server.clients = {i: ClientInfo(i, sizes[i] if sizes else 10,
                                    test_sizes[i] if test_sizes else 5, False)
                      for i in range(num_clients)}
    flower = FlowerEngine(None, settings, Reporter(quiet=True))
    flower.node_of = {i: 100 + i for i in range(num_clients)}
    method = METHODS["fedavg"].build(settings)
    federation = RoundLoop(server, method, _Replies(flower, replies, answers),
                           Reporter(quiet=True))
    federation.state = method.init_server(server, initial)
    return federation


def _states(seed: int, k: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"conv.weight": rng.normal(size=(4, 1, 3, 3)).astype(np.float32),
             "fc.bias": rng.normal(size=(5,)).astype(np.float32)} for _ in range(k)]


def test_aggregation_equals_hand_computed_mean_and_flowers_fedavg():
    states = _states(0, 3)
    sizes = [10, 30, 60]
    replies = [_train_reply(100 + i, i, s, n)
               for i, (s, n) in enumerate(zip(states, sizes, strict=True))]
    federation = _federation(states[0], replies[::-1], sizes=tuple(sizes))  # in any order
    metrics, _, _ = federation.train_round(1)
    ours = federation.state.model
    for key in ours:
        expected = sum(n * s[key].astype(np.float64)
                       for s, n in zip(states, sizes, strict=True)) / 100
        np.testing.assert_allclose(ours[key], expected, rtol=1e-6, atol=1e-7)
    theirs, _ = FedAvg().aggregate_train(1, replies)
    for key in ours:
        np.testing.assert_allclose(ours[key], theirs[key].numpy(), rtol=1e-5, atol=1e-6)
    assert metrics["train-loss"] == pytest.approx(0.5)
    assert metrics["clients-trained"] == 3 and metrics["failures"] == 0


def test_malformed_and_non_finite_updates_are_rejected_and_the_rest_aggregated():
    states = _states(1, 3)
    nan_state = {k: v.copy() for k, v in states[1].items()}
    nan_state["fc.bias"][2] = np.nan
    wrong_shape = {"conv.weight": np.zeros((4, 1, 3, 3), np.float32),
                   "fc.bias": np.zeros(6, np.float32)}
    replies = [
        _train_reply(100, 0, states[0], 10),
        _train_reply(101, 1, nan_state, 10),
        _train_reply(102, 2, wrong_shape, 10),
        _error_reply(103, "out of memory"),
        _reply(104, RecordDict({"metrics": MetricRecord(
            {"partition-id": 4, "num-examples": 10, "train-loss": float("inf")}),
            "arrays": to_record(states[2])})),
        _train_reply(105, 4, states[2], 10),  # another node answering client 4's message
    ]
    federation = _federation(states[0], replies, num_clients=5, answers={5: 4})
    warnings = []
    federation.reporter.warn = warnings.append
    metrics, _, _ = federation.train_round(1)
    assert metrics["failures"] == 2 and metrics["rejected"] == 3
    assert metrics["clients-trained"] == 1
    np.testing.assert_array_equal(federation.state.model["fc.bias"], states[0]["fc.bias"])
    text = "\n".join(warnings)
    assert "client 1's update was rejected: array 'fc.bias' contains NaN" in text
    assert "client 2's update was rejected: array 'fc.bias' has shape (6,)" in text
    assert "client 3 failed: out of memory" in text
    assert "client 4 reported a non-finite" in text
    assert "client 4 was answered by node 105, not by its own node 104" in text


def test_when_every_update_fails_the_global_model_is_kept():
    states = _states(2, 1)
    federation = _federation(states[0], [_error_reply(100, "boom")])
    metrics, _, _ = federation.train_round(1)
    assert metrics["clients-trained"] == 0 and metrics["failures"] == 1
    np.testing.assert_array_equal(federation.state.model["conv.weight"], states[0]["conv.weight"])


def test_client_sampling_is_reproducible_and_method_independent():
    def samples(seed: int) -> list[list[int]]:
        server = _federation(_states(0, 1)[0], [], num_clients=10, seed=seed,
                             **{"fraction-train": 0.3}).server
        return [server.sample(r) for r in range(1, 6)]

    first = samples(5)
    assert first == samples(5)
    assert all(len(s) == 3 for s in first) and len({tuple(s) for s in first}) > 1
    assert samples(6) != first


def test_arrayrecord_round_trip_is_exact():
    state = _states(3, 1)[0]
    back = {k: v.numpy() for k, v in to_record(state).items()}
    assert all(np.array_equal(back[k], state[k]) for k in state)
    assert isinstance(to_record(state), ArrayRecord)


def _eval_reply(node: int, cid: int, correct: int, count: int, global_correct: int) -> Message:
    return _reply(node, RecordDict({"metrics": MetricRecord({
        "partition-id": cid, "num-test": count, "personal-correct": correct,
        "personal-loss": 0.3, "global-correct": global_correct, "global-loss": 0.4})}))


def test_evaluation_metrics_from_client_replies():
    federation = _federation(_states(0, 1)[0], [
        _eval_reply(100, 0, 8, 10, 5), _eval_reply(101, 1, 10, 30, 20),
        _eval_reply(102, 2, 12, 10, 3),  # more correct than samples: rejected
        _eval_reply(103, 3, 3, 4, 3)], num_clients=4, test_sizes=(10, 30, 10, 4))
    federation.server.clients[3] = ClientInfo(3, 10, 4, True)  # an unseen client
    warnings = []
    federation.reporter.warn = warnings.append
    metrics, _, _ = evaluate_round(federation, 1)
    assert metrics["personal-acc"] == pytest.approx(18 / 40)
    assert metrics["personal-acc-unweighted"] == pytest.approx((0.8 + 1 / 3) / 2)
    assert metrics["global-acc"] == pytest.approx(25 / 40)
    assert metrics["unseen-acc"] == pytest.approx(3 / 4)
    assert metrics["eval-failures"] == 1
    assert "client 2 reported personal-correct = 12" in warnings[0]
    assert [c["id"] for c in federation.client_results] == [0, 1, 3]


def test_personal_offset_and_personalized_init_by_hand():
    from pflalign.methods.pflalign import personal_offset, personalized_init
    from pflalign.server.aggregation import l2_norm

    theta_g = {"w": np.array([1.0, 2.0], np.float32), "bn": np.array([5.0], np.float32)}
    end = {"w": np.array([4.0, -2.0], np.float32), "bn": np.array([7.0], np.float32)}
    delta = personal_offset(end, theta_g, ["w"])
    assert set(delta) == {"w"}
    np.testing.assert_array_equal(delta["w"], [3.0, -4.0])
    assert l2_norm(delta) == 5.0
    init = personalized_init({"w": np.array([0.5, 0.5], np.float32), "bn": theta_g["bn"]}, delta)
    np.testing.assert_array_equal(init["w"], [3.5, -3.5])
    np.testing.assert_array_equal(init["bn"], [5.0])  # buffers come from the global model


def test_mean_cosine_by_hand():
    from pflalign.server.aggregation import mean_cosine

    ref = np.array([1.0, 0.0])
    assert mean_cosine([np.array([2.0, 0.0]), np.array([0.0, 3.0]), np.array([-1.0, 0.0])],
                       ref) == pytest.approx((1 + 0 - 1) / 3)
    assert mean_cosine([np.zeros(2)], ref) == 0.0


def test_the_round_row_has_medians_that_one_client_cannot_drag():
    states = _states(3, 3)
    replies = [_train_reply(100 + i, i, s, 10, loss)
               for i, (s, loss) in enumerate(zip(states, [0.5, 0.6, 200.0], strict=True))]
    metrics, _, _ = _federation(states[0], replies).train_round(1)
    assert metrics["train-loss"] == pytest.approx((0.5 + 0.6 + 200.0) / 3)
    assert metrics["train-loss-median"] == 0.6
    federation = _federation(_states(0, 1)[0], [
        _eval_reply(100, 0, 8, 10, 5), _eval_reply(101, 1, 10, 30, 20),
        _reply(102, RecordDict({"metrics": MetricRecord({
            "partition-id": 2, "num-test": 10, "personal-correct": 1, "personal-loss": 150.0,
            "global-correct": 1, "global-loss": 150.0})}))],
        test_sizes=(10, 30, 10))
    metrics, _, _ = evaluate_round(federation, 1)
    assert metrics["personal-loss-median"] == 0.3
    assert metrics["personal-loss"] == pytest.approx((0.3 * 10 + 0.3 * 30 + 150.0 * 10) / 50)


@pytest.mark.parametrize("rule,expected", [
    ("trimmed-mean", "round 1: aggregation = 'trimmed-mean' trims nothing at 3 uploads "
                     "(trim-fraction = 0.2 needs at least 5); such rounds are a plain unweighted "
                     "mean."),
    ("median", None),
])
def test_a_robust_rule_that_cannot_act_at_a_rounds_size_says_so_once(rule, expected):
    states = _states(4, 3)
    warnings: list[str] = []
    replies = [_train_reply(100 + i, i, s, 10) for i, s in enumerate(states)]
    federation = _federation(states[0], replies, aggregation=rule)
    federation.reporter.warn = warnings.append
    federation.train_round(1)
    federation.train_round(2)  # a second round of the same size: nothing more is said
    assert [w for w in warnings if "uploads" in w] == ([f"[fedavg] {expected}"] if expected
                                                       else [])
    two = [_train_reply(100 + i, i, s, 10) for i, s in enumerate(states[:2])]
    federation = _federation(states[0], two, aggregation="median")
    federation.reporter.warn = warnings.append
    federation.train_round(1)
    assert warnings[-1] == ("[fedavg] round 1: aggregation = 'median' at 2 uploads is their "
                            "mean: one client moves it freely.")


def test_a_reply_larger_than_any_honest_one_is_refused_unread():
    """Each record of a reply is held to what its action's replies carry (the method's declared
    arrays, by their bytes), before any array is converted; without such limits, the whole reply
    to 8 x the largest message sent + 1 MiB."""
    states = _states(5, 3)
    blob = to_record({"x": np.zeros(1 << 20, np.float32)})  # 4 MiB
    padded = to_record({**states[2], "pad": np.zeros(1 << 18, np.float32)})
    cases = {
        "blob": RecordDict({"arrays": to_record(states[2]), "blob": blob,
                            "metrics": MetricRecord(train_metrics(2, 10))}),
        "padded": RecordDict({"arrays": padded, "metrics": MetricRecord(train_metrics(2, 10))}),
        "config": RecordDict({"arrays": to_record(states[2]), "note": ConfigRecord({"s": "x"}),
                              "metrics": MetricRecord(train_metrics(2, 10))}),
    }
    model_bytes = sum(v.nbytes for v in states[0].values())
    declared = model_bytes + 512 * len(states[0])
    padded_bytes = sum(len(a.data) for a in padded.values())
    expected = {
        "blob": "client 2 sent the array record 'blob', which this action's replies do not have",
        "padded": f"client 2 sent {padded_bytes:,} bytes in its 'arrays' record, more than the "
                  f"{declared:,} its declared arrays take",
        "config": "client 2 sent 1 record no reply has ('note')"}
    for case, content in cases.items():
        replies = [_train_reply(100, 0, states[0], 10), _train_reply(101, 1, states[1], 10),
                   _reply(102, content)]
        federation = _federation(states[0], replies)
        warnings: list[str] = []
        federation.reporter.warn = warnings.append
        metrics, _, _ = federation.train_round(1)
        assert metrics["rejected"] == 1 and metrics["failures"] == 0
        assert metrics["clients-trained"] == 2
        assert warnings == [f"[fedavg] {expected[case]}; the reply is not read; the reply is "
                            "skipped."]
    # without per-record limits (an action that declares none): the bound on the whole reply
    flower = _federation(states[0], []).engine.flower
    flower.largest_sent = model_bytes  # the model went down to each client
    assert flower.reply_limit == 8 * model_bytes + (1 << 20)
    reply = flower.reply(2, _reply(102, cases["blob"]))
    sent = int(reply.error.split("sent ")[1].split(" bytes")[0].replace(",", ""))
    assert sent > 4 * (1 << 20) and reply.refused  # the serialized arrays, headers included
    assert reply.error == (f"sent {sent:,} bytes of arrays, more than any honest reply (at most "
                           f"{8 * model_bytes + (1 << 20):,}: 8 x the largest message it was "
                           "sent + 1 MiB); the reply is not read")
