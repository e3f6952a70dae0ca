"""Learning from usage: what verification kept while heads drafted, on disk, bounded, and trained on."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec import SamplingParams
from edgespec.backend.hidden import HiddenStateModel
from edgespec.heads.attach import LEARN_FROM_USAGE
from edgespec.heads.job import Budget, Sources, train_heads
from edgespec.heads.projection import LmHead
from edgespec.heads.store import default_heads_path
from edgespec.heads.teacher import TeacherData
from edgespec.heads.training import TrainingPlan
from edgespec.heads.usage import UsageLog, read_usage, usage_dir
from edgespec.loading import load_engine
from test_heads_drafting import FIXED_COST, PROMPTS, trained_heads


@pytest.fixture(scope="module")
def heads_path(tiny_models, tmp_path_factory):
    return trained_heads(tiny_models, tmp_path_factory.mktemp("heads"), epochs=20.0)


def _generate(tiny_models, heads_path, prompts) -> list[list[int]]:
    """The prompt and reply tokens of each prompt, answered greedily with heads drafting."""
    engine = load_engine(tiny_models["target"], "heads", heads_path=heads_path, n_ctx=512, draft_tokens=3,
                         cost_curve=FIXED_COST, n_threads=1, notice=lambda _: None)
    try:
        texts = []
        for prompt in prompts:
            ids = engine.prompt_tokens(prompt, raw=True)
            texts.append(ids + engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40), raw=True).token_ids)
    finally:
        engine.close()
    return texts


def _kept(tiny_models) -> TeacherData:
    return read_usage(usage_dir(default_heads_path(tiny_models["target"])), 64, 100_000).join()


def test_what_verification_kept_is_kept_with_the_tokens_that_followed(tiny_models, heads_path, monkeypatch):
    monkeypatch.setenv(LEARN_FROM_USAGE, "1")
    texts = _generate(tiny_models, heads_path, PROMPTS)
    data = _kept(tiny_models)
    assert len(data) > 0 and data.hidden.shape == (len(data), 64) and set(data.sources) == {"usage"}
    starts = np.concatenate([[0], data.ends[:-1]])
    for start, end in zip(starts, data.ends):
        stretch = [*data.tokens[start:end].tolist(), int(data.top[end - 1])]
        assert data.top[start:end - 1].tolist() == stretch[1:-1]  # each row's label is the token after it
        assert any(_contains(text, stretch) for text in texts)  # tokens the generation really had, in order
    lm_head = LmHead(tiny_models["target"])
    guessed = (data.hidden.astype(np.float32) @ lm_head.rows(np.arange(lm_head.n_vocab)).T).argmax(axis=1)
    assert (guessed == data.top).mean() > 0.9  # greedy: the kept hidden state chose the token that followed


def test_nothing_is_kept_unless_asked_for(tiny_models, heads_path, monkeypatch):
    monkeypatch.delenv(LEARN_FROM_USAGE, raising=False)
    _generate(tiny_models, heads_path, PROMPTS[:1])
    assert not usage_dir(default_heads_path(tiny_models["target"])).exists()


def test_heads_train_trains_on_usage_first(tiny_models, heads_path, monkeypatch, tmp_path):
    monkeypatch.setenv(LEARN_FROM_USAGE, "1")
    _generate(tiny_models, heads_path, PROMPTS)
    usage = _kept(tiny_models)
    target = HiddenStateModel(tiny_models["target"], n_ctx=512, n_threads=1)
    try:
        heldout = [target.tokenize("The dog", add_special=True)]
        record = train_heads(target, LmHead(tiny_models["target"]), Sources([], [], heldout, usage),
                             TrainingPlan(vocab_size=64, batch=64, max_epochs=2.0),
                             Budget(seconds=600.0, heldout_reply=16), tmp_path / "heads.npz", lambda *_: None)
    finally:
        target.close()
    assert record.sources == {"usage": len(usage)} and record.training_tokens == len(usage)


def test_usage_on_disk_stays_within_its_bound_and_damaged_chunks_are_left_out(tmp_path):
    log = UsageLog(tmp_path / "usage", n_embd=8, max_bytes=20_000)
    rng = np.random.default_rng(0)
    for _ in range(12):
        log(list(range(101)), rng.normal(size=(100, 8)))
        log.flush()
    chunks = sorted((tmp_path / "usage").glob("*.npz"))
    assert 1 <= len(chunks) < 12 and sum(c.stat().st_size for c in chunks) <= 20_000
    chunks[-1].write_bytes(b"damaged")
    data = read_usage(tmp_path / "usage", 8, 100_000)
    assert len(data) == 100 * (len(chunks) - 1) and data.join().top[:99].tolist() == list(range(1, 100))


def _contains(text: list[int], part: list[int]) -> bool:
    return any(text[i:i + len(part)] == part for i in range(len(text) - len(part) + 1))
