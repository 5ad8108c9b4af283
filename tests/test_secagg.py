"""SecAgg+ (pflalign/wire/secagg.py): the server's unmasked sum is exactly the sum of the survivors'
quantized vectors, with and without a client dropping after sharing its keys, and dequantizes to
within the stated error of the plain sum."""

from __future__ import annotations

import numpy as np
import pytest

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
