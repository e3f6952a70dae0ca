"""Drafts end where generation would: nothing after an end-of-generation token can be kept, so none is drafted."""

import numpy as np
import pytest

from edgespec.backend import LlamaModel
from edgespec.drafters import DraftModelDrafter
from edgespec.loading import load_engine
from edgespec.sampling import SamplingParams
from tinygguf import bos_eos_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def test_the_engines_n_gram_drafters_know_the_targets_end_tokens(tiny_models):
    engine = load_engine(tiny_models["target"], tiny_models["draft"], n_ctx=256, draft_tokens=3,
                         cost_curve=[1.0, 1.2, 1.4, 1.6])
    try:
        bos, eos = bos_eos_ids()
        ends = engine.target.end_of_generation_ids
        assert eos in ends and bos not in ends
        assert engine.planner.drafters["ngram"].end_tokens == ends
        assert engine.planner.sequence_drafter_set(1).drafters["ngram"].end_tokens == ends
    finally:
        engine.close()


@pytest.fixture
def draft(tiny_models):
    model = LlamaModel(tiny_models["draft"], n_ctx=128, n_threads=1)
    yield model
    model.close()


def test_a_draft_model_stops_drafting_after_an_end_token(draft, monkeypatch):
    context = draft.tokenize("the cat sat on the mat and the", add_special=True)
    rng = np.random.default_rng(0)
    free = DraftModelDrafter(draft, draft.n_vocab).propose(context, 6, GREEDY, rng).tokens
    assert len(free) == 6
    # Tiny models never emit their real EOS, so the test calls the draft's third token an end of generation
    monkeypatch.setattr(draft, "is_end_of_generation", lambda token: token == free[2])
    proposal = DraftModelDrafter(draft, draft.n_vocab).propose(context, 6, GREEDY, rng)
    assert proposal.tokens == free[: free.index(free[2]) + 1]
    assert len(proposal.probs) == len(proposal.tokens)
