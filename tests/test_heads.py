"""Drafting heads: the target's hidden states, training tiny heads, and the heads file's refusals."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from edgespec.backend import LlamaModel
from edgespec.errors import EdgespecError
from edgespec.backend.hidden import HiddenStateModel
from edgespec.heads.job import Budget, Sources, TrainingInterrupted, resume_path_for, train_heads
from edgespec.heads.network import Adam, Heads
from edgespec.heads.projection import LmHead
from edgespec.heads.store import HeadsFileError, load_heads, read_heads, save_heads
from edgespec.heads.teacher import TeacherData
from edgespec.heads.training import Trainer, TrainingPlan, reduced_vocabulary, seconds_per_example
from npy_member import npy_member
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


def test_a_sequence_told_no_hidden_states_gets_the_same_logits_and_no_rows(target):
    ids = target.tokenize(TEXT, add_special=True)[:24]
    target.reserve_sequences(2)
    try:
        target.decode(ids[:10], n_logits=0, seq=0)
        with_rows = target.decode(ids[10:14], n_logits=4, seq=0).copy()
        assert target.last_hidden(0).shape == (4, target.n_embd)
        target.rewind(10, seq=0)
        target.want_hidden(0, False)
        assert np.array_equal(target.decode(ids[10:14], n_logits=4, seq=0), with_rows)
        assert target.last_hidden(0) is None
        target.decode(ids[:10], n_logits=0, seq=1)
        target.decode_sequences([(0, ids[14:16], 2), (1, ids[10:12], 2)])
        assert target.last_hidden(0) is None and target.last_hidden(1).shape == (2, target.n_embd)
        target.want_hidden(1, False)
        target.decode_sequences([(0, ids[16:17], 1), (1, ids[12:13], 1)])
        assert target.last_hidden(0) is None and target.last_hidden(1) is None
        target.want_hidden(0, True)
        target.decode(ids[17:18], n_logits=1, seq=0)
        assert target.last_hidden(0).shape == (1, target.n_embd)
        hidden, _ = target.teacher_pass(ids[13:15], seq=1)  # a teacher pass has them, whatever it was told
        assert np.isfinite(hidden.astype(np.float32)).all() and target.last_hidden(1) is not None
    finally:
        target.want_hidden(0, True)
        target.want_hidden(1, True)
        target.reserve_sequences(1)


def test_trained_heads_are_saved_with_what_they_were_trained_on(trained, tiny_models):
    path, record = trained
    assert path.is_file() and not resume_path_for(path).exists()
    assert record.n_heads == 3 and record.form == "hydra"
    assert record.training_tokens > 0 and set(record.sources) <= {"files", "built-in prompts"}
    assert record.heldout_tokens > 0 and len(record.heldout_top1) == 3
    assert all(0.0 <= a <= b <= 1.0 for a, b in zip(record.heldout_top1, record.heldout_top3))
    again, heads = load_heads(path, tiny_models["target"], LmHead(tiny_models["target"]))
    assert again == record and isinstance(heads, Heads) and len(heads.vocab) <= 64


def test_a_heads_file_for_another_model_is_refused_with_one_line(trained, tmp_path):
    other = write_tiny_model(tmp_path / "other.gguf", seed=99, n_layer=2)
    with pytest.raises(HeadsFileError) as refused:
        load_heads(trained[0], other, LmHead(other))
    assert "\n" not in str(refused.value) and "another model" in str(refused.value)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "declares 149 GiB", "compressed"])
def test_a_damaged_heads_file_is_refused_with_one_line(trained, tmp_path, damage):
    broken = tmp_path / "broken.npz"
    data = bytearray(trained[0].read_bytes())
    if damage == "truncate":
        broken.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF  # inside an array: the member's CRC no longer matches
        broken.write_bytes(bytes(data))
    elif damage == "garbage":
        broken.write_bytes(b"PK\x03\x04 then not an archive at all")
    elif damage == "declares 149 GiB":  # np.load allocated it before reading: a MemoryError's traceback
        with zipfile.ZipFile(broken, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr("meta.npy", npy_member((2,), b"{}", "|u1"))
            archive.writestr("a.npy", npy_member((40_000_000_000,)))
    else:  # np.load inflated a member whatever it grew to (a 2 MB file took 2 GB); np.savez never compresses
        with np.load(trained[0]) as archive:
            np.savez_compressed(broken, **{name: archive[name] for name in archive.files})
    with pytest.raises(HeadsFileError) as refused:
        read_heads(broken)
    assert "\n" not in str(refused.value) and "damaged" in str(refused.value)


@pytest.mark.parametrize("kind", ["text", "folder"])
def test_a_path_that_is_no_heads_file_is_not_called_damaged(tmp_path, kind):
    # heads show --heads verify.py said the user's source file was damaged, "or delete the file"
    path = tmp_path / "verify.py"
    if kind == "folder":
        path.mkdir()
    else:
        path.write_text("import numpy\n")
    with pytest.raises(HeadsFileError) as refused:
        read_heads(path)
    assert "is not a heads file" in str(refused.value) and "delete" not in str(refused.value)


def _rewritten(source, target, *, meta_changes=None, array_changes=None):
    """A copy of the heads file at source with some record fields and arrays replaced, as another program might
    write it (np.savez, no pickles)."""
    with np.load(source) as archive:
        arrays = {name: archive[name] for name in archive.files}
    meta = {**json.loads(arrays.pop("meta").tobytes()), **(meta_changes or {})}
    arrays.update(array_changes or {})
    np.savez(target, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    return target


@pytest.mark.parametrize("change", [
    {"meta_changes": {"heldout_top1": [float("nan"), 0.1, 0.1]}},  # json writes NaN: the prior raised on it
    {"meta_changes": {"heldout_top1": [5.0, 0.1, 0.1]}},
    {"meta_changes": {"heldout_top1": ["x", 0.1, 0.1]}},  # heads show's format code raised
    {"meta_changes": {"training_seconds": "soon"}},
    {"meta_changes": {"n_heads": "3"}},
    {"array_changes": {"bias": np.array([["x"]])}},
    {"array_changes": {"a": np.full((3, 8, 8), 0.1, dtype=np.float32), "b": np.full((3, 8, 8), 0.1, dtype=np.float32),
                       "bias": np.zeros((3, 8), dtype=np.float32)}},  # another hidden size: matmul raised
    {"array_changes": {"a": None}},  # filled below with NaN weights of the right shape
], ids=["nan prior", "prior over 1", "text prior", "text seconds", "text head count", "text bias", "other hidden size",
        "nan weights"])
def test_a_heads_file_whose_contents_do_not_hold_together_is_refused_with_one_line(trained, tiny_models, tmp_path,
                                                                                   change):
    # each was read, then failed while drafting: a traceback on every run, --draft auto's included
    if change.get("array_changes", {}).get("a", 0) is None:
        with np.load(trained[0]) as archive:
            change = {"array_changes": {"a": np.full_like(archive["a"], np.nan)}}
    broken = _rewritten(trained[0], tmp_path / "broken.npz", **change)
    with pytest.raises(HeadsFileError) as refused:
        load_heads(broken, tiny_models["target"], LmHead(tiny_models["target"]))
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


def test_a_resume_with_other_heads_asked_for_is_refused_with_the_way_on(tiny_models, target, tmp_path):
    # the stopped run's plan was used as it was: --n-heads, --form and --vocab of the new command were dropped
    # without a word, and its heads saved as if they were what was asked for
    from dataclasses import replace

    path = tmp_path / "heads" / "heads.npz"
    lm_head = LmHead(tiny_models["target"])

    def interrupt_while_training(phase, *_):
        if phase == "training":
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted):
        train_heads(target, lm_head, _sources(target), _PLAN, _BUDGET, path, interrupt_while_training)
    other = replace(_PLAN, n_heads=_PLAN.n_heads + 1)
    with pytest.raises(EdgespecError) as refused:
        train_heads(target, lm_head, Sources(), other, _BUDGET, path, _quiet)
    message = str(refused.value)
    assert "\n" not in message and "--restart" in message and f"{_PLAN.n_heads} {_PLAN.form} heads" in message
    assert resume_path_for(path).exists() and not path.exists()  # the work is still there to go on with


def test_heads_draft_from_a_hidden_state_and_stop_when_unsure(trained, tiny_models):
    _, heads = load_heads(trained[0], tiny_models["target"], LmHead(tiny_models["target"]))
    lm_head = LmHead(tiny_models["target"])
    hidden = np.ones(heads.projection.shape[1], dtype=np.float32)
    drafted = heads.draft(hidden, 5, 3, lm_head.row)
    assert len(drafted) == 3 and all(t in set(heads.vocab.tolist()) for t in drafted)
    assert heads.draft(hidden, 5, 3, lm_head.row, stop_below=(1.01,)) == []


def test_the_built_in_prompts_are_many_distinct_and_never_the_held_out_ones():
    from edgespec.heads.prompts import HELDOUT_PROMPTS, TRAINING_PROMPTS

    assert len(TRAINING_PROMPTS) >= 500 and len(set(TRAINING_PROMPTS)) == len(TRAINING_PROMPTS)
    assert not set(HELDOUT_PROMPTS) & set(TRAINING_PROMPTS)
    first = TRAINING_PROMPTS[:40]  # what a short run answers: code, explanations, changes and prose mixed
    assert any(p.startswith("Write a ") and "function" in p for p in first)
    assert any(p.startswith(("Explain", "What is")) for p in first) and any("\n\n" in p for p in first)


def test_a_reduced_vocabulary_is_by_frequency_and_filled_up_from_the_lowest_ids_when_asked():
    top = np.array([7, 7, 7, 3, 3, 9])
    assert reduced_vocabulary(top, 2).tolist() == [7, 3]
    assert reduced_vocabulary(top, 5).tolist() == [7, 3, 9]
    assert reduced_vocabulary(top, 5, fill=True).tolist() == [7, 3, 9, 0, 1]


def test_a_grown_trainer_carries_its_heads_on_over_more_data(tiny_models, target):
    lm_head = LmHead(tiny_models["target"])
    ids = target.tokenize(TEXT, add_special=True)
    data, heldout = TeacherData.empty(target.n_embd), TeacherData.empty(target.n_embd)
    target.rewind(0)
    heldout.add(ids[:20], *target.teacher_pass(ids[:20]), "heldout")
    target.rewind(0)
    data.add(ids[:30], *target.teacher_pass(ids[:30]), "files")
    plan = TrainingPlan(vocab_size=64, batch=16)
    vocab = reduced_vocabulary(data.join().top, plan.vocab_size)
    trainer = Trainer(Heads.fresh("hydra", 3, vocab, lm_head.rows(vocab)), Adam(plan.rate), data, heldout, lm_head,
                      target.n_vocab, plan)
    trainer.step()
    target.rewind(0)
    hidden, top = target.teacher_pass(ids)
    data.add(ids, hidden, top, "files")
    grown = trainer.grown(data, lm_head)
    assert grown.heads.a is trainer.heads.a and grown.adam is trainer.adam
    assert len(grown.data) == 30 + len(ids) and grown.examples_seen == trainer.examples_seen
    assert grown.heads.vocab.tolist() == reduced_vocabulary(data.join().top, 64).tolist()
    assert seconds_per_example(plan, heldout, lm_head, target.n_vocab) > 0


@pytest.mark.parametrize("vocab", ["negative id", "past the vocabulary", "not whole numbers", "empty"])
def test_a_heads_file_whose_token_ids_are_not_the_models_is_refused_with_one_line(trained, tiny_models, tmp_path, vocab):
    record, arrays = read_heads(trained[0])
    ids = arrays["vocab"].astype(np.int64)
    bad = {"negative id": np.concatenate([ids[:-1], [-1]]),
           "past the vocabulary": np.concatenate([ids[:-1], [LmHead(tiny_models["target"]).n_vocab + 5]]),
           "not whole numbers": ids.astype(np.float32) + 0.5, "empty": ids[:0]}[vocab]
    crafted = save_heads(tmp_path / "crafted.npz", Heads(record.form, bad, None, arrays["a"], arrays["b"], arrays["bias"]),
                         record)
    with pytest.raises(HeadsFileError) as refused:
        load_heads(crafted, tiny_models["target"], LmHead(tiny_models["target"]))
    assert "\n" not in str(refused.value) and "token ids" in str(refused.value)


@pytest.mark.parametrize("token", [-1, 10**6])
def test_a_token_id_outside_the_vocabulary_is_a_value_error_not_an_abort(target, token):
    # llama.cpp's std::vector::at would throw through the C API and abort the process
    for read in (target.token_bytes, target.token_text):
        with pytest.raises(ValueError, match=f"token id {token} is outside the vocabulary"):
            read(token)


def test_heads_that_got_no_time_to_train_are_not_saved_as_trained(tiny_models, target, tmp_path, monkeypatch):
    # collecting ran to the end of the budget, and heads trained for 0 s were saved, exit 0
    from edgespec.heads import job

    path = tmp_path / "heads" / "heads.npz"
    lm_head = LmHead(tiny_models["target"])
    with monkeypatch.context() as patched:
        patched.setattr(job, "_train", lambda trainer, end, progress: None)
        with pytest.raises(EdgespecError, match="no heads were saved.*run the same command again") as stopped:
            train_heads(target, lm_head, _sources(target), _PLAN, _BUDGET, path, _quiet)
    assert "\n" not in str(stopped.value)
    assert sorted(p.name for p in path.parent.iterdir()) == [resume_path_for(path).name]
    record = train_heads(target, lm_head, Sources(), _PLAN, _BUDGET, path, _quiet)  # trains on from there
    assert record.training_tokens > 0 and path.exists()
