"""Drafting with heads through the engine: exact output, and a controller that finds where heads pay."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from edgespec import SamplingParams
from edgespec.backend import LlamaModel
from edgespec.backend.hidden import HiddenStateModel
from edgespec.costs import CostModel
from edgespec.errors import EdgespecError
from edgespec.generation import Step
from edgespec.heads.job import Budget, Sources, train_heads
from edgespec.heads.projection import LmHead
from edgespec.heads.training import TrainingPlan
from edgespec.loading import load_engine
from edgespec.sampling import to_probs

PROMPTS = ["the cat sat on the mat and the cat", "Hello world, the", "I was not the one"]
FIXED_COST = (1.0, 1.3, 1.6, 1.9)
CPU_CURVE = CostModel((1.0, 1.58, 2.1, 2.6), heads_seconds_per_token=0.05)  # T(2)/T(1) as on this 2-core CPU
FLAT_CURVE = CostModel((1.0, 1.0, 1.0, 1.0), heads_seconds_per_token=0.02)  # a GPU-like curve


def trained_heads(tiny_models, directory, epochs: float):
    target = HiddenStateModel(tiny_models["target"], n_ctx=512, n_threads=1)
    text = " ".join(PROMPTS) * 4
    sources = Sources([("files", target.tokenize(text, add_special=True))],
                      [target.tokenize(p, add_special=True) for p in PROMPTS], [target.tokenize("The dog", add_special=True)])
    path = directory / "target.npz"
    train_heads(target, LmHead(tiny_models["target"]), sources, TrainingPlan(vocab_size=128, batch=64, max_epochs=epochs),
                Budget(seconds=600.0, max_tokens=2000, max_reply=64, heldout_reply=64), path, lambda *_: None)
    target.close()
    return path


@pytest.fixture(scope="module")
def heads_path(tiny_models, tmp_path_factory):
    """Heads trained until they guess this tiny model's loops well (about half of held-out tokens at head 1)."""
    return trained_heads(tiny_models, tmp_path_factory.mktemp("heads"), epochs=150.0)


@pytest.fixture(scope="module")
def weak_heads_path(tiny_models, tmp_path_factory):
    """Heads barely trained: mostly wrong, like real heads on a CPU-sized budget are more often than not."""
    return trained_heads(tiny_models, tmp_path_factory.mktemp("weak-heads"), epochs=2.0)


@pytest.fixture(scope="module")
def engine(tiny_models, heads_path):
    engine = load_engine(tiny_models["target"], "heads", heads_path=heads_path, n_ctx=512, draft_tokens=3,
                         cost_curve=FIXED_COST, n_threads=1, notice=lambda _: None)
    yield engine
    engine.close()


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("bit_exact", [False, True])
def test_greedy_output_with_heads_is_plain_decodings(engine, prompt, bit_exact):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    engine.configure(mode="none", draft_tokens=3, bit_exact=bit_exact)
    plain = engine.generate(prompt, params, raw=True)
    for mode in ("heads", "combined"):
        engine.configure(mode=mode)
        result = engine.generate(prompt, params, raw=True)
        assert result.token_ids == plain.token_ids, mode
        assert result.stats.draft_tokens_accepted <= result.stats.draft_tokens_proposed
    engine.configure(mode="heads")
    if engine.max_draft_tokens > 0:
        assert engine.generate(prompt, params, raw=True).stats.draft_tokens_proposed > 0


def test_heads_drafts_are_counted_per_head_position(engine):
    engine.configure(mode="heads", draft_tokens=3, bit_exact=False)
    stats = engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40), raw=True).stats
    drafted, accepted = stats.drafted_by_position["heads"], stats.accepted_by_position.get("heads", [])
    assert 1 <= len(drafted) <= 3 and sum(drafted) == stats.draft_tokens_proposed
    assert sum(accepted) == stats.draft_tokens_accepted == stats.accepted_by_drafter.get("heads", 0)
    assert drafted == sorted(drafted, reverse=True)  # position i is drafted only after position i - 1
    assert all(0.0 <= rate <= 1.0 for rate in stats.acceptance_by_position("heads"))
    assert stats.from_dict(stats.as_dict()) == stats


def test_greedy_heads_output_is_a_plain_models(tiny_models, engine):
    plain = LlamaModel(tiny_models["target"], n_ctx=512, n_threads=1)
    ids = engine.prompt_tokens(PROMPTS[0], raw=True)
    plain.decode(ids[:-1], n_logits=0)
    expected, last = [], ids[-1]
    for _ in range(24):
        last = int(np.argmax(plain.decode([last], 1)[0]))
        expected.append(last)
    plain.close()
    engine.configure(mode="heads", draft_tokens=3, bit_exact=True)
    assert engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24), raw=True).token_ids == expected


def three_token_law(target_path, prompt_ids, params):
    model = LlamaModel(target_path, n_ctx=256, n_threads=1)
    law = {}

    def walk(prefix, prob):
        model.rewind(len(prompt_ids) + len(prefix) - 1 if prefix else 0)
        row = to_probs(model.decode(prompt_ids if not prefix else [prefix[-1]], 1)[0], params)
        for token in np.flatnonzero(row):
            if len(prefix) == 2:
                law[(*prefix, int(token))] = prob * row[token]
            else:
                walk([*prefix, int(token)], prob * row[token])

    walk([], 1.0)
    model.close()
    return law


def test_sampled_output_with_heads_has_the_targets_distribution(engine, tiny_models):
    prompt_ids = engine.prompt_tokens(PROMPTS[1], raw=True)
    sampling = {"temperature": 1.0, "top_k": 3, "top_p": 1.0, "min_p": 0.0}
    law = three_token_law(tiny_models["target"], prompt_ids, SamplingParams(**sampling))
    engine.configure(mode="heads", draft_tokens=2, bit_exact=False)
    n, counts, proposed = 2000, Counter(), 0
    for seed in range(n):
        result = engine.generate(PROMPTS[1], SamplingParams(**sampling, max_tokens=3, seed=seed), raw=True)
        counts[tuple(result.token_ids)] += 1
        proposed += result.stats.draft_tokens_proposed
    assert proposed > n / 2, "the heads must draft in most generations"
    assert set(counts) <= set(law), "emitted a sequence the target gives probability 0"
    stat, pooled_expected, pooled_count, bins = 0.0, 0.0, 0, 0
    for outcome, prob in law.items():
        if prob * n >= 5:
            stat += (counts[outcome] - prob * n) ** 2 / (prob * n)
            bins += 1
        else:
            pooled_expected, pooled_count = pooled_expected + prob * n, pooled_count + counts[outcome]
    if pooled_expected > 0:
        stat += (pooled_count - pooled_expected) ** 2 / pooled_expected
        bins += 1
    assert stat < 2 * (bins - 1) + 25, (stat, bins)  # below the 1e-4 quantile; the seeds are fixed


@pytest.mark.parametrize("weak, curve, pays", [(True, CPU_CURVE, False), (False, FLAT_CURVE, True)])
def test_the_controller_drafts_with_heads_only_where_they_pay(tiny_models, request, weak, curve, pays):
    path = request.getfixturevalue("weak_heads_path" if weak else "heads_path")
    engine = load_engine(tiny_models["target"], "heads", heads_path=path, n_ctx=512, cost_curve=curve,
                         n_threads=1, notice=lambda _: None)
    stats = engine.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=200), raw=True).stats
    engine.close()
    drafting_steps = stats.steps - stats.k0_steps
    if pays:
        assert drafting_steps > stats.steps / 2
    else:  # what finding out costs: probes within the controller's 1% budget, and the first guess
        assert drafting_steps <= 0.03 * stats.steps + 1


@pytest.mark.parametrize("mode", ["heads", "combined"])
def test_hidden_states_are_kept_only_for_steps_that_heads_draft_from(tiny_models, weak_heads_path, mode):
    # Weak heads on a CPU-like curve: the controller never plans a heads draft, only probes now and then
    # (on their own, or where n-grams have no match), so the target's passes keep hidden states only in
    # the steps before a probe and in the probe's own step.
    engine = load_engine(tiny_models["target"], "heads", heads_path=weak_heads_path, n_ctx=512, cost_curve=CPU_CURVE,
                         n_threads=1, bit_exact=True, notice=lambda _: None)
    params = SamplingParams(temperature=0.0, max_tokens=160)
    prompt_ids = engine.prompt_tokens(PROMPTS[2], raw=True)
    runs = {}
    for run_mode in ("none", mode):
        engine.configure(mode=run_mode)
        engine.forget_learning()
        kept, heads_drafts, drafted_any, tokens = [], [0], [], []
        for event in engine.stream_tokens(prompt_ids, params):
            if isinstance(event, Step):
                kept.append(engine.target.last_hidden(0) is not None)
                heads_drafts.append(sum(event.stats.drafted_by_position.get("heads", [0])[:1]))
                drafted_any.append(event.drafted > 0)
                tokens += [token.id for token in event.tokens]
        runs[run_mode] = kept, np.diff(heads_drafts) > 0, drafted_any, tokens
    engine.close()
    (plain_kept, _, _, plain_tokens), (kept, heads, drafted_any, tokens) = runs["none"], runs[mode]
    assert tokens == plain_tokens
    assert not any(plain_kept)
    assert all(kept[t - 1] for t in range(1, len(kept)) if heads[t])  # heads draft only from kept rows
    assert all(heads[t] or not drafted_any[t] for t in range(len(kept)) if kept[t])  # never beside n-grams' drafts
    if mode == "heads":  # there, a probe waits for nothing: rows are kept only just before it and in it
        assert heads.any()
        assert all(heads[t] or heads[t + 1] for t in range(len(kept) - 2) if kept[t])
        assert sum(kept) <= 2 * heads.sum()


def test_drafting_with_heads_needs_trained_heads(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))
    with pytest.raises(EdgespecError) as refused:
        load_engine(tiny_models["target"], "heads", n_ctx=256, cost_curve=FIXED_COST, notice=lambda _: None)
    assert "edgespec heads train" in str(refused.value) and "\n" not in str(refused.value)


def test_sequences_decoded_together_draft_with_heads_of_their_own(tiny_models, heads_path):
    from edgespec.generation import Done
    from edgespec.scheduler import Job

    engine = load_engine(tiny_models["target"], "heads", heads_path=heads_path, n_ctx=512, cost_curve=FLAT_CURVE,
                         n_threads=1, notice=lambda _: None)  # on a flat curve drafted rows pay even beside others
    params = SamplingParams(temperature=0.0, max_tokens=40)
    alone = [engine.generate(p, params, raw=True).token_ids for p in PROMPTS]
    jobs = iter([Job(i, engine.prompt_tokens(p, raw=True), params) for i, p in enumerate(PROMPTS)])
    together, by_drafter = {}, Counter()
    for key, event in engine.scheduler(3).run(lambda wait: next(jobs, None)):
        if isinstance(event, Done):
            together[key] = event.result.token_ids
            by_drafter.update(event.result.stats.accepted_by_drafter)
    engine.close()
    assert [together[i] for i in range(len(PROMPTS))] == alone
    assert by_drafter["heads"] > 0


def test_heads_draft_on_the_cores_llama_cpp_leaves_and_leave_the_process_setting_alone(engine, monkeypatch):
    """BLAS's spinning worker threads would take cores from the llama.cpp pass after each draft."""
    from threadpoolctl import ThreadpoolController, threadpool_limits

    from edgespec.heads.network import Heads
    from edgespec.limits import usable_cores

    free = max(1, usable_cores() - 1)  # the engine's llama.cpp runs one thread

    def blas_threads():
        return [lib["num_threads"] for lib in ThreadpoolController().info() if lib["user_api"] == "blas"]

    seen, draft = [], Heads.draft
    monkeypatch.setattr(Heads, "draft", lambda *args, **kwargs: (seen.append(blas_threads()), draft(*args, **kwargs))[1])
    engine.configure(mode="heads", draft_tokens=3, bit_exact=False)
    with threadpool_limits(limits=free + 1, user_api="blas"):
        engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12), raw=True)
        after = blas_threads()
    assert seen and all(threads == [free] for threads in seen)
    assert after == [free + 1]


def test_a_heads_draft_ends_at_an_end_token(engine, tiny_models, monkeypatch):
    from edgespec.heads.drafter import HeadsDrafter
    from edgespec.heads.network import Heads
    from tinygguf import bos_eos_ids

    eos = bos_eos_ids()[1]
    proposals, propose = [], HeadsDrafter.propose
    monkeypatch.setattr(HeadsDrafter, "propose", lambda self, *args: proposals.append(propose(self, *args)) or proposals[-1])
    # heads that guess an end token second (tiny models' heads never learn one: their EOS is never written)
    monkeypatch.setattr(Heads, "draft", lambda self, hidden, chosen, k, token_row, stop_below=(): [7, eos, 7][:k])
    engine.configure(mode="heads", draft_tokens=3, bit_exact=False)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    result = engine.generate(PROMPTS[0], params, raw=True)
    drafted = [p.tokens for p in proposals if p.tokens]
    assert [7, eos] in drafted and all(tokens == [7, eos][: len(tokens)] for tokens in drafted)  # k 1 near the end
    engine.configure(mode="none")
    assert engine.generate(PROMPTS[0], params, raw=True).token_ids == result.token_ids


def test_the_plan_and_the_run_s_reason_name_the_heads_auto_drafts_with(tiny_models, heads_path, tmp_path, monkeypatch):
    # `edgespec plan` said "ngram" while a run with the same flags drafted with heads too (mode "combined")
    import shutil

    from edgespec.heads.store import default_heads_path
    from edgespec.loading import plan_load
    from edgespec.planner import HEADS_TOO

    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))
    assert not plan_load(tiny_models["target"], "auto", n_ctx=512, notice=lambda _: None).plan.heads
    own = default_heads_path(tiny_models["target"])
    own.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(heads_path, own)
    plan = plan_load(tiny_models["target"], "auto", n_ctx=512, notice=lambda _: None).plan
    assert plan.heads and plan.drafting == f"{plan.mode} + heads" and plan.reason.endswith(HEADS_TOO)
    engine = load_engine(tiny_models["target"], "auto", n_ctx=512, cost_curve=FIXED_COST, n_threads=1,
                         notice=lambda _: None)
    stats = engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4), raw=True).stats
    engine.close()
    assert stats.mode == "combined" and stats.plan_reason.endswith(HEADS_TOO)
    engine.drop_draft_model("n-grams only: it cannot pay here")  # as --draft auto does where a draft model cannot
    assert engine.plan.heads and engine.plan.reason == "n-grams only: it cannot pay here" + HEADS_TOO
    own.write_bytes(b"not heads")  # unusable: said in a notice, and claimed by no reason
    engine = load_engine(tiny_models["target"], "auto", n_ctx=512, cost_curve=FIXED_COST, n_threads=1,
                         notice=lambda _: None)
    assert not engine.plan.heads and not engine.plan.reason.endswith(HEADS_TOO)
    engine.close()
