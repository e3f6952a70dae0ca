"""The sparse sampling path gives what the dense one gave: the same support, probabilities and token ids.

The reference below is the dense implementation edgespec used before rows
became sparse, kept verbatim: full-vocabulary float64 softmax, dense
residuals, inverse CDF over the dense vector.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import edgespec.drafters
import edgespec.decoder
from edgespec.loading import load_engine
from edgespec.sampling import SamplingParams, SparseProbs, sample, to_probs
from edgespec.verify import Verdict, _residual, verify

# ---------------------------------------------------------------- the old code

REFERENCE_HEAD_CANDIDATES = 1024


def reference_to_probs(logits, params):
    if params.greedy:
        probs = np.zeros(logits.shape[-1], dtype=np.float64)
        probs[int(np.argmax(logits))] = 1.0
        return probs
    full = _reference_softmax(logits.astype(np.float64) / params.temperature)
    if params.top_k == 0 and params.top_p == 1.0:
        if params.min_p > 0.0:
            full[full < params.min_p * full.max()] = 0.0
        return full / full.sum()
    ids, kept = _reference_sorted_head(full, params)
    if params.top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(kept), params.top_p * kept.sum())) + 1
        ids, kept = ids[:cut], kept[:cut]
    if params.min_p > 0.0:
        keep = kept >= params.min_p * kept[0]
        ids, kept = ids[keep], kept[keep]
    probs = np.zeros_like(full)
    probs[ids] = kept / kept.sum()
    return probs


def _reference_sorted_head(full, params):
    if params.top_k > 0:
        ids = _reference_top_ids(full, params.top_k)
    else:
        ids = _reference_top_ids(full, REFERENCE_HEAD_CANDIDATES)
        if full[ids].sum() < params.top_p:
            ids = np.argsort(-full, kind="stable")
    return ids, full[ids]


def _reference_top_ids(probs, n):
    if n >= probs.size:
        return np.argsort(-probs, kind="stable")
    head = np.argpartition(-probs, n - 1)[:n]
    return head[np.argsort(-probs[head], kind="stable")]


def _reference_softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_sample(probs, rng):
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.size - 1))


def reference_verify(p, draft_tokens, q, rng):
    k = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        if q is None:  # a point proposal: sample the target's token as plain decoding does, accept it if it is x
            token = reference_sample(p[i], rng)
            if token == x:
                continue
            return Verdict(i, token)
        if p[i][x] >= q[i][x] or (p[i][x] > 0.0 and rng.random() * q[i][x] < p[i][x]):
            continue
        return Verdict(i, reference_sample(reference_residual(p[i], q[i]), rng))
    return Verdict(k, reference_sample(p[k], rng))


def reference_residual(p_row, q_row):
    residual = np.maximum(p_row - q_row, 0.0)
    if residual.sum() <= 0.0:
        return p_row
    return residual


# ------------------------------------------------------------------- helpers

PARAMS = [
    SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    for t, k, p, m in itertools.product((0.3, 0.8, 1.0, 1.7), (0, 1, 5, 40, 2000), (1.0, 0.95, 0.5), (0.0, 0.05, 0.3))
]


def distinct_logits(rng, n_vocab, scale, peaks=3):
    """float32 logits whose head has no two equal (ties at a cut are an arbitrary choice in either implementation)."""
    while True:
        logits = (rng.standard_normal(n_vocab) * scale).astype(np.float32)
        logits[rng.integers(0, n_vocab, peaks)] += np.float32(4 * scale)
        head = np.partition(logits, n_vocab - min(n_vocab, 3000))[-3000:]
        if np.unique(head).size == head.size:
            return logits


def assert_same_row(sparse: SparseProbs, dense: np.ndarray):
    assert isinstance(sparse, SparseProbs)
    np.testing.assert_array_equal(sparse.ids, np.flatnonzero(dense))
    np.testing.assert_allclose(sparse.probs, dense[sparse.ids], rtol=1e-12, atol=0)
    assert np.all(np.diff(sparse.ids) > 0)


# --------------------------------------------------------------------- tests


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat rows reach the full-vocabulary fallbacks
def test_sparse_rows_equal_the_dense_reference(scale):
    rng = np.random.default_rng(int(scale * 10))
    for _ in range(4):
        logits = distinct_logits(rng, 3000, scale)
        for params in PARAMS:
            assert_same_row(to_probs(logits, params), reference_to_probs(logits, params))


def test_greedy_is_the_argmax_alone():
    rng = np.random.default_rng(5)
    logits = distinct_logits(rng, 151_936, 3.0)
    row = to_probs(logits, SamplingParams(temperature=0.0))
    assert row.ids.tolist() == [int(np.argmax(logits))] and row.probs.tolist() == [1.0]
    assert sample(row, np.random.default_rng(0)) == int(np.argmax(logits))


def test_a_full_vocabulary_row_with_the_default_filters():
    rng = np.random.default_rng(6)
    for _ in range(5):
        logits = distinct_logits(rng, 151_936, 3.0)
        for params in (SamplingParams(), SamplingParams(top_k=0), SamplingParams(top_k=0, top_p=1.0)):
            assert_same_row(to_probs(logits, params), reference_to_probs(logits, params))


def test_top_k_off_answers_a_models_peaked_row_without_an_exponential_over_the_vocabulary(monkeypatch):
    """The tail outside the head weighs at most the head's lightest token each; on rows as peaked as a model's
    that bound alone shows the head holds top_p, and the row is still the reference's."""
    from edgespec.commands.bench.microbench import model_like_rows

    rows = model_like_rows(4, 151_936, np.random.default_rng(11))
    cases = [SamplingParams(temperature=0.8, top_k=0), SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0)]
    exp, widest = np.exp, []
    monkeypatch.setattr(np, "exp", lambda x, *args, **kwargs: widest.append(np.size(x)) or exp(x, *args, **kwargs))
    answered = [to_probs(logits, params) for logits in rows for params in cases]
    monkeypatch.undo()
    assert max(widest) <= 1024, "only the head's weights were computed"
    expected = [reference_to_probs(logits, params) for logits in rows for params in cases]
    for row, dense in zip(answered, expected):
        assert_same_row(row, dense)


def test_top_k_keeps_the_lower_ids_among_equal_logits():
    logits = np.zeros(50, dtype=np.float32)
    logits[[7, 30]] = 2.0
    row = to_probs(logits, SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0))
    assert row.ids.tolist() == [0, 1, 2, 7, 30]


def test_top_p_zero_keeps_the_likeliest_token_alone():
    rng = np.random.default_rng(8)
    logits = distinct_logits(rng, 151_936, 3.0)
    for top_k in (0, 40):
        row = to_probs(logits, SamplingParams(temperature=1.0, top_k=top_k, top_p=0.0, min_p=0.0))
        assert row.ids.tolist() == [int(np.argmax(logits))] and row.probs.tolist() == [1.0]


def test_the_sparse_row_reads_like_the_dense_vector():
    rng = np.random.default_rng(7)
    logits = distinct_logits(rng, 500, 3.0)
    row = to_probs(logits, SamplingParams(temperature=1.0, top_k=10))
    dense = reference_to_probs(logits, SamplingParams(temperature=1.0, top_k=10))
    assert len(row) == 500
    np.testing.assert_allclose(np.asarray(row), dense, rtol=1e-12, atol=0)
    assert all(row[token] == pytest.approx(dense[token], rel=1e-12, abs=0) for token in range(500))


def test_residuals_equal_the_dense_reference():
    rng = np.random.default_rng(8)
    for _ in range(200):
        p_params, q_params = (PARAMS[i] for i in rng.integers(0, len(PARAMS), 2))
        p_dense = reference_to_probs(distinct_logits(rng, 400, 2.0), p_params)
        q_dense = reference_to_probs(distinct_logits(rng, 400, 2.0), q_params)
        p, q = SparseProbs.from_dense(p_dense), SparseProbs.from_dense(q_dense)
        # the same float operations on the same values: equal bit for bit
        np.testing.assert_array_equal(np.asarray(_residual(p, q)), reference_residual(p_dense, q_dense))


def test_equal_rows_fall_back_to_p():
    p = SparseProbs(np.array([1, 4]), np.array([0.25, 0.75]), 6)
    assert _residual(p, p) is p


def test_sampling_draws_the_same_ids_as_the_dense_reference():
    rng = np.random.default_rng(9)
    for params in PARAMS[::7]:
        logits = distinct_logits(rng, 3000, 2.0)
        sparse, dense = to_probs(logits, params), reference_to_probs(logits, params)
        new_rng, old_rng = np.random.default_rng(11), np.random.default_rng(11)
        assert [sample(sparse, new_rng) for _ in range(300)] == [reference_sample(dense, old_rng) for _ in range(300)]


def test_verification_matches_the_dense_reference_draw_for_draw():
    rng = np.random.default_rng(10)
    params = SamplingParams(temperature=1.0, top_k=8, top_p=0.9, min_p=0.0)
    for trial in range(300):
        k = int(rng.integers(0, 4))
        p_logits = [distinct_logits(rng, 200, 1.0) for _ in range(k + 1)]
        q_logits = [logits + rng.standard_normal(200).astype(np.float32) for logits in p_logits[:k]]
        q_dense = [reference_to_probs(logits, params) for logits in q_logits]
        drafts = [reference_sample(row, rng) for row in q_dense]
        for one_hot in (False, True):
            new_rng, old_rng = np.random.default_rng(trial), np.random.default_rng(trial)
            new = verify([to_probs(x, params) for x in p_logits], drafts,
                         None if one_hot else [to_probs(x, params) for x in q_logits], new_rng)
            old = reference_verify([reference_to_probs(x, params) for x in p_logits], drafts,
                                   None if one_hot else q_dense, old_rng)
            assert new == old


def generate_with(engine, mode, prompt, params, draft_tokens, monkeypatch, reference: bool):
    """The engine's output, with the sampling path swapped for the dense reference when asked."""
    with monkeypatch.context() as patch:
        if reference:
            patch.setattr(edgespec.decoder, "to_probs", reference_to_probs)
            patch.setattr(edgespec.decoder, "verify", reference_verify)
            patch.setattr(edgespec.drafters, "to_probs", reference_to_probs)
            patch.setattr(edgespec.drafters, "sample", reference_sample)
        engine.configure(mode=mode)
        engine.configure(draft_tokens=draft_tokens)
        return engine.generate(prompt, params, raw=True).token_ids


def assert_same_ids_as_the_old_code(engine, modes, prompts, monkeypatch, seeds, max_tokens):
    compared = 0
    for mode, prompt, seed in itertools.product(modes, prompts, seeds):
        params = SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=seed)
        new = generate_with(engine, mode, prompt, params, 3, monkeypatch, reference=False)
        old = generate_with(engine, mode, prompt, params, 3, monkeypatch, reference=True)
        assert new == old, (mode, prompt, seed)
        compared += len(new)
    assert compared > 0


# A given cost curve: the draft lengths then do not depend on how fast or busy the machine is.
FIXED_COST = (1.0, 1.2, 1.4, 1.6)


def test_fixed_seeds_give_the_old_token_ids_on_tiny_models(tiny_models, monkeypatch):
    engine = load_engine(tiny_models["target"], tiny_models["draft"], n_ctx=512, draft_tokens=3, cost_curve=FIXED_COST)
    try:
        assert_same_ids_as_the_old_code(engine, ("none", "ngram", "draft-model"),
                                        ["the cat sat on the mat and the cat", "hello world, hello"],
                                        monkeypatch, seeds=range(6), max_tokens=24)
    finally:
        engine.close()


def test_fixed_seeds_give_the_old_token_ids_on_smollm2(smollm2_path, monkeypatch):
    engine = load_engine(smollm2_path, "ngram", n_ctx=512, draft_tokens=3, cost_curve=FIXED_COST)
    try:
        assert_same_ids_as_the_old_code(engine, ("none", "ngram"), ["def add(a, b):\n    return a + b\n\ndef"],
                                        monkeypatch, seeds=range(2), max_tokens=16)
    finally:
        engine.close()
