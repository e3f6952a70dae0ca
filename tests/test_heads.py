"""Drafting heads: the target's hidden states, training tiny heads, and the heads file's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.backend import LlamaModel
from edgespec.backend.hidden import HiddenStateModel
from edgespec.heads.job import Budget, Sources, TrainingInterrupted, resume_path_for, train_heads
from edgespec.heads.network import Heads
from edgespec.heads.projection import LmHead
from edgespec.heads.store import HeadsFileError, load_heads, read_heads
from edgespec.heads.training import TrainingPlan
from tinygguf import write_tiny_model

TEXT = "Hello world, the cat sat on the mat and the dog sat with the cat. " * 3


@pytest.fixture(scope="module")
def target(tiny_models):
    model = HiddenStateModel(tiny_models["target"], n_ctx=512, n_threads=1)
    yield model
    model.close()


@pytest.fixture(scope="module")
def trained(tiny_models, target, tmp_path_factory):
    """Heads trained on a tiny model until their epoch limit, and where they were saved."""
    path = tmp_path_factory.mktemp("heads") / "target.npz"
    record = train_heads(target, LmHead(tiny_models["target"]), _sources(target), _PLAN, _BUDGET, path, _quiet)
    return path, record


_PLAN = TrainingPlan(vocab_size=64, batch=64, max_epochs=3.0)
_BUDGET = Budget(seconds=600.0, max_tokens=1500, max_reply=48, heldout_reply=48)


def _sources(model) -> Sources:
    prompt = model.tokenize("The cat", add_special=True)
    return Sources([("files", model.tokenize(TEXT, add_special=True))], [prompt, prompt[:2]], [prompt])


def _quiet(*_):
    pass


def test_every_row_pass_gives_the_lm_heads_input_and_the_same_logits(tiny_models, target):
    plain = LlamaModel(tiny_models["target"], n_ctx=512, n_threads=1)
    ids = plain.tokenize(TEXT, add_special=True)[:20]
    target.rewind(0)
    hidden, top = target.teacher_pass(ids)
    rows = plain.decode(ids, n_logits=20)
    plain.close()
    assert top.tolist() == rows.argmax(axis=1).tolist()
    lm_head = LmHead(tiny_models["target"])
    assert lm_head.tensor_name == "output.weight"
    recomputed = hidden.astype(np.float32) @ lm_head.rows(np.arange(lm_head.n_vocab)).T
    assert recomputed.argmax(axis=1).tolist() == top.tolist()


def test_a_verification_pass_keeps_the_hidden_state_that_chose_the_next_token(target):
    ids = target.tokenize(TEXT, add_special=True)[:12]
    target.rewind(0)
    target.decode(ids[:-1], n_logits=0)
    assert target.hidden_before(ids) is None  # a prefill outputs no rows
    target.decode([ids[-1], 7, 8], n_logits=3)
    assert target.hidden_before([*ids, 7, 8, 9]) is not None
    assert target.hidden_before([*ids, 99]) is not None  # the row after ids[-1]: the draft after it was rejected
    assert target.hidden_before([*ids[:-1], 5, 6]) is None  # other tokens than the pass saw
    target.rewind(len(ids) - 1)
    assert target.hidden_before([*ids, 99]) is None


def test_trained_heads_are_saved_with_what_they_were_trained_on(trained, tiny_models):
    path, record = trained
    assert path.is_file() and not resume_path_for(path).exists()
    assert record.n_heads == 3 and record.form == "hydra"
    assert record.training_tokens > 0 and set(record.sources) <= {"files", "built-in prompts"}
    assert record.heldout_tokens > 0 and len(record.heldout_top1) == 3
    assert all(0.0 <= a <= b <= 1.0 for a, b in zip(record.heldout_top1, record.heldout_top3))
    again, heads = load_heads(path, tiny_models["target"], LmHead(tiny_models["target"]).rows)
    assert again == record and isinstance(heads, Heads) and len(heads.vocab) <= 64


def test_a_heads_file_for_another_model_is_refused_with_one_line(trained, tmp_path):
    other = write_tiny_model(tmp_path / "other.gguf", seed=99, n_layer=2)
    with pytest.raises(HeadsFileError) as refused:
        load_heads(trained[0], other, LmHead(other).rows)
    assert "\n" not in str(refused.value) and "another model" in str(refused.value)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_a_damaged_heads_file_is_refused_with_one_line(trained, tmp_path, damage):
    data = bytearray(trained[0].read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF  # inside an array: the member's CRC no longer matches
    else:
        data = bytearray(b"not a heads file at all")
    broken = tmp_path / "broken.npz"
    broken.write_bytes(bytes(data))
    with pytest.raises(HeadsFileError) as refused:
        read_heads(broken)
    assert "\n" not in str(refused.value) and "damaged" in str(refused.value)


def test_ctrl_c_while_training_leaves_a_resume_file_and_no_half_written_heads(tiny_models, target, tmp_path):
    path = tmp_path / "heads" / "heads.npz"  # a folder of its own: the cache dir (model identities) is elsewhere
    steps = []

    def interrupt_while_training(phase, *_):
        if phase == "training":
            steps.append(phase)
            if len(steps) == 2:
                raise KeyboardInterrupt

    lm_head = LmHead(tiny_models["target"])
    with pytest.raises(TrainingInterrupted) as stopped:
        train_heads(target, lm_head, _sources(target), _PLAN, _BUDGET, path, interrupt_while_training)
    assert "\n" not in str(stopped.value) and stopped.value.exit_code == 130
    assert sorted(p.name for p in path.parent.iterdir()) == [resume_path_for(path).name]  # no temporary files either
    record = train_heads(target, lm_head, Sources(), _PLAN, _BUDGET, path, _quiet)  # resumes: no data needed
    assert record.training_tokens > 0
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_heads_draft_from_a_hidden_state_and_stop_when_unsure(trained, tiny_models):
    _, heads = load_heads(trained[0], tiny_models["target"], LmHead(tiny_models["target"]).rows)
    lm_head = LmHead(tiny_models["target"])
    hidden = np.ones(heads.projection.shape[1], dtype=np.float32)
    drafted = heads.draft(hidden, 5, 3, lm_head.row)
    assert len(drafted) == 3 and all(t in set(heads.vocab.tolist()) for t in drafted)
    assert heads.draft(hidden, 5, 3, lm_head.row, stop_below=(1.01,)) == []
