"""What edgespec reads back from disk, as a careless or hostile user, a crash or another version leaves it.

A cache that cannot be read is rebuilt without a word (or with one notice); a user's own file (config.toml,
models.json, a saved chat) gets one line naming it; nothing hangs on a FIFO, reads /dev/zero without end,
or lets a RecursionError or OverflowError out of JSON nested 100k deep or holding 1e999.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import zipfile

import numpy as np
import pytest

from edgespec.calibration import CalibrationCache, CalibrationKey
from edgespec.catalog import CatalogError, USER_CATALOG_NAME, read_user_catalog, store_dir
from edgespec.files import FileTooLarge, NotARegularFile, parse_json, read_arrays, read_regular
from edgespec.learned import LEARNED_FILE, LearnedAcceptance
from edgespec.model_identity import IdentityCache
from edgespec.prefix_files import SUFFIX, CorruptSnapshot, DiskPrefixCache, _read_header
from npy_member import npy_member
from test_prefix_cache import rewrite_header
from test_prompt_cache_hardening import FIXED_COST, engine_with_disk_cache, finishes, generate
from edgespec.loading import load_engine
from tui.config import ConfigError, config_path, load_config
from tui.history import ChatStore, HistoryError

DEEP = "[" * 100_000
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


def spoil(path, how: str) -> None:
    """Put at path what a careless user, a crash or another program might leave there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "dev-zero":
        path.symlink_to("/dev/zero")
    elif how == "directory":
        path.mkdir()
    else:
        path.write_bytes({"empty": b"", "truncated": b'{"version": 2, "entr', "not utf-8": b'{"\xff\xfe": 1}',
                          "deep": DEEP.encode(), "list": b"[1, 2]", "huge number": b'{"version": 1e999}'}[how])


SPOILS = ["empty", "truncated", "not utf-8", "deep", "list", "huge number", "directory",
          pytest.param("fifo", marks=needs_fifo), "dev-zero"]


# ---------------------------------------------------------------- the shared readers


@needs_fifo
def test_read_regular_refuses_what_would_hang_or_never_end(tmp_path):
    for how in ("fifo", "dev-zero", "directory"):
        with pytest.raises(NotARegularFile):
            assert finishes(lambda: read_regular(spoil(tmp_path / how, how) or tmp_path / how, 1 << 20), 20)
    (tmp_path / "big").write_bytes(b" " * 1001)
    with pytest.raises(FileTooLarge):
        read_regular(tmp_path / "big", 1000)
    assert read_regular(tmp_path / "big", 1001) == b" " * 1001


def test_json_nested_past_the_recursion_limit_is_a_value_error():
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_json(DEEP)
    assert parse_json("[[1]]") == [[1]]


# ---------------------------------------------------------------- caches: rebuilt without a word


def calibration_key() -> CalibrationKey:
    return CalibrationKey("/models/m.gguf", 1000, 1, 0, 2, "x86_64", "cpu", 2, "runtime")


@pytest.mark.parametrize("how", SPOILS)
def test_a_spoilt_calibration_cache_is_measured_again_and_rewritten(tmp_path, how):
    path = tmp_path / "cache" / "calibration.json"
    spoil(path, how)
    cache = CalibrationCache(path)
    assert finishes(lambda: cache.read(calibration_key()), 20)
    assert cache.read(calibration_key()) is None
    if how != "directory":  # a directory cannot be replaced by a rename: the cache is only not kept
        cache.store(calibration_key(), 4, (1.0, 1.2, 1.4, 1.6))
        assert cache.read(calibration_key()).forward_seconds == (1.0, 1.2, 1.4, 1.6)


def test_a_calibration_entry_holding_1e999_is_measured_again(tmp_path):
    cache = CalibrationCache(tmp_path / "calibration.json")
    cache.store(calibration_key(), 4, (1.0, 1.2, 1.4, 1.6))
    cache.path.write_text(cache.path.read_text().replace('"max_width": 4', '"max_width": 1e999'))
    assert cache.read(calibration_key()) is None


@pytest.mark.parametrize("how", SPOILS)
def test_a_spoilt_learned_priors_file_starts_from_the_built_in_priors(tmp_path, how):
    path = tmp_path / "cache" / LEARNED_FILE
    spoil(path, how)
    learned = LearnedAcceptance(tmp_path / "model.gguf", path=path)
    assert finishes(lambda: learned.prior("ngram"), 20)
    assert learned.prior("ngram") is None
    learned.learn("ngram", {0: ([1.0], [2.0])})  # learning goes on: the file is rebuilt
    if how != "directory":
        assert learned.prior("ngram") == {0: ([1.0], [2.0])}


@pytest.mark.parametrize("entry", [
    [1, 2],  # the model's entry a list, not an object
    {"ngram": {"0": [[float("nan")], [2.0]]}},
    {"ngram": {"0": [[1.0], [float("inf")]]}},
    {"ngram": {"0": [[-1.0], [2.0]]}},
    {"ngram": {"0": [[3.0], [2.0]]}},  # more hits than tries
    {"ngram": {"0": ["ab", "cd"]}},
    {"ngram": {"1e999": [[1.0], [2.0]]}},
])
def test_learned_counts_that_are_not_counts_are_not_learned_from(tmp_path, entry):
    path = tmp_path / LEARNED_FILE
    learned = LearnedAcceptance(tmp_path / "model.gguf", path=path)
    path.write_text(json.dumps({"format": 2, "models": {learned.model: entry}}))
    assert learned.prior("ngram") is None
    learned.learn("ngram", {0: ([1.0], [2.0])})  # the end of a generation: no exception, the entry replaced
    prior = learned.prior("ngram")
    assert prior == {0: ([1.0], [2.0])} and all(math.isfinite(v) for v in prior[0][1])


def test_a_deeply_nested_identity_cache_is_hashed_again(tmp_path, tiny_models):
    path = tmp_path / "model-identity.json"
    path.write_text(DEEP)
    assert IdentityCache(path).identity(tiny_models["target"])


# ---------------------------------------------------------------- the disk prompt cache


@pytest.mark.parametrize("changes", [
    {"n_tokens": 1e999}, {"payload_bytes": float("inf")}, {"n_tokens": 400.0}, {"payload_bytes": True},
    {"key": [1]}, {"key": {"model_identity": "x"}},
])
def test_a_snapshot_header_of_the_wrong_types_is_corrupt(tmp_path, tiny_models, changes):
    path = saved_snapshot(tmp_path, tiny_models)
    data = rewrite_header(path.read_bytes(), **changes)
    path.write_bytes(data)
    with pytest.raises(CorruptSnapshot, match="damaged"):
        with open(path, "rb") as f:
            _read_header(f, len(data))


def test_a_snapshot_header_nested_past_the_recursion_limit_is_corrupt(tmp_path, tiny_models):
    path = saved_snapshot(tmp_path, tiny_models)
    data = path.read_bytes()
    nested = b"[" * 60_000
    path.write_bytes(data[:12] + len(nested).to_bytes(4, "little") + nested)
    notices = []
    store = DiskPrefixCache(tmp_path, min_tokens=64, notice=notices.append)  # opens and trims: no exception
    assert store.longest_prefix(snapshot_key_of(tiny_models), list(range(300))) is None
    assert len(notices) == 1 and "header is damaged" in notices[0] and not path.exists()


def snapshot_key_of(tiny_models):
    from test_prompt_cache_hardening import key_for

    return key_for(tiny_models["target"])


def saved_snapshot(tmp_path, tiny_models):
    store = DiskPrefixCache(tmp_path, max_bytes=1 << 20, min_tokens=64)
    key, tokens = snapshot_key_of(tiny_models), list(range(300))
    store.save(key, tokens, lambda: bytes(100))
    assert store.save(key, tokens, lambda: bytes(100))  # kept the second time it comes
    return next(tmp_path.glob("*" + SUFFIX))


def nested_header(data: bytes) -> bytes:
    nested = b"[" * 60_000
    return data[:12] + len(nested).to_bytes(4, "little") + nested + data[12 + 4:]


@pytest.mark.parametrize("damage", [
    lambda data: data[: len(data) // 2],  # a crash mid-write by another program
    lambda data: data[:-64] + bytes(64),  # a torn payload
    lambda data: b"",
    nested_header,
    lambda data: rewrite_header(data, n_tokens=1e999),
])
def test_after_a_damaged_snapshot_the_reply_is_plain_decodings(tmp_path, tiny_models, damage):
    prompt = [100 + i % 150 for i in range(300)]  # ids the tiny vocabulary has
    cache = tmp_path / "prefix-cache"
    engine = engine_with_disk_cache(tiny_models["target"], cache)
    for _ in range(2):  # the second time, the prompt's snapshot is kept
        generate(engine, prompt)
        engine.forget_cache()
    engine.close()
    [path] = cache.glob("*" + SUFFIX)
    path.write_bytes(damage(path.read_bytes()))
    engine = engine_with_disk_cache(tiny_models["target"], cache)
    result = generate(engine, prompt)
    engine.close()
    plain = load_engine(tiny_models["target"], "none", n_ctx=1024, cost_curve=FIXED_COST, n_threads=1)
    expected = generate(plain, prompt)
    plain.close()
    assert result.stats.prompt_tokens_reused == 0 and result.token_ids == expected.token_ids
    with open(path, "rb") as f:  # discarded, and written afresh by this run
        _read_header(f, path.stat().st_size)


# ---------------------------------------------------------------- the user's own files: one line naming them


def refusals(call, kind) -> list[str]:
    """The messages of the `kind` errors call() raised, once it finished (a hang fails the test)."""
    errors = []

    def read():
        try:
            call()
        except kind as error:
            errors.append(str(error))

    assert finishes(read, 20)
    return errors


@pytest.mark.parametrize("how", ["not utf-8", "deep", "list", "directory", pytest.param("fifo", marks=needs_fifo),
                                 "dev-zero"])
def test_a_spoilt_models_json_is_one_line_naming_it(tmp_path, monkeypatch, how):
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path / "models"))
    path = store_dir() / USER_CATALOG_NAME
    spoil(path, how)
    errors = refusals(read_user_catalog, CatalogError)
    assert len(errors) == 1 and str(path) in errors[0] and "\n" not in errors[0] and "fix or delete" in errors[0]
    assert path.exists() or path.is_symlink()  # the user's file is left for them to mend


@pytest.mark.parametrize("how", ["not utf-8", "deep", "directory", pytest.param("fifo", marks=needs_fifo),
                                 "dev-zero"])
def test_a_spoilt_config_is_one_line_naming_it(how):
    path = config_path()
    if how == "deep":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("temperature = " + DEEP)
    else:
        spoil(path, how)
    errors = refusals(load_config, ConfigError)
    assert len(errors) == 1 and str(path) in errors[0] and "\n" not in errors[0] and "fix or delete" in errors[0]


@pytest.mark.parametrize("column, value", [("session", DEEP), ("session", "[1, 2]"), ("settings", '"text"'),
                                           ("extras", "null")])
def test_a_saved_chat_of_the_wrong_shape_is_named_damaged(tmp_path, column, value):
    store = ChatStore(tmp_path / "history.sqlite3")
    chat = store.save_chat(None, "title", "/models/m.gguf", {}, {"messages": []}, {})
    store.close()
    with sqlite3.connect(tmp_path / "history.sqlite3") as db:
        db.execute(f"UPDATE chats SET {column} = ? WHERE id = ?", (value, chat))
    db.close()
    store = ChatStore(tmp_path / "history.sqlite3")
    with pytest.raises(HistoryError, match=f"chat {chat} in .*history.sqlite3 is damaged"):
        store.load_chat(chat)
    assert [c.id for c in store.list_chats()] == [chat]  # still listed, to be deleted by the user


@pytest.mark.parametrize("session_changes", [
    {"messages": ["not a message"]},
    {"messages": [{"role": "user", "content": ["not", "text"]}]},
    {"messages": 7},
    {"first_visible": "x"},
    {"first_visible": 5},
    {"system_prompt": ["not text"]},
    {"turn_stats": [{"message_index": 0, "tokens_generated": "many", "seconds": "long"}]},
    {"turn_stats": [{"tokens_generated": 3}]},
    {"params": {"temperature": "hot"}},
])
def test_reopening_a_damaged_chat_says_so_and_leaves_the_open_chat_as_it_was(tiny_models, session_changes):
    from edgespec.session import SESSION_FORMAT
    from scripted_reply import ScriptedReply, use_script
    from test_tui import SIZE, loaded, make_app, pilot_test, send

    @pilot_test
    async def body():
        app = make_app(tiny_models)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot)
            use_script(app.chat.engine, ScriptedReply("Sure."))
            await send(pilot, "Hello")
            mine = app.chat.chat_id
            session = {"format": SESSION_FORMAT, "messages": [], **session_changes}
            damaged = app.store.save_chat(None, "damaged", "/models/m.gguf", {}, {"messages": []}, {})
            with sqlite3.connect(app.store.path) as db:  # as another program or a damaged disk left it
                db.execute("UPDATE chats SET session = ? WHERE id = ?", (json.dumps(session), damaged))
            db.close()
            app._reopen(damaged)
            await pilot.pause()
            assert app.chat.chat_id == mine and [m["content"] for m in app.chat.session.messages] == ["Hello", "Sure."]
            [notice] = [n for n in app._notifications if n.severity == "error"]
            assert f"chat {damaged} in" in notice.message and "damaged" in notice.message
            assert app.is_running

    body()


# ---------------------------------------------------------------- trained heads and their resume file


def heads_like_file(path, how: str) -> None:
    import numpy as np

    if how == "deep meta":
        np.savez(path, meta=np.frombuffer(DEEP.encode(), dtype=np.uint8), a=np.zeros(1))
    else:
        spoil(path, how)


@pytest.mark.parametrize("how", ["deep meta", "empty", "directory", pytest.param("fifo", marks=needs_fifo),
                                 "dev-zero"])
def test_a_spoilt_heads_file_is_one_line_naming_it(tmp_path, how):
    from edgespec.heads.store import HeadsFileError, read_heads

    path = tmp_path / "heads.npz"
    heads_like_file(path, how)
    errors = refusals(lambda: read_heads(path), HeadsFileError)
    assert len(errors) == 1 and str(path) in errors[0] and "\n" not in errors[0]


@pytest.mark.parametrize("how", ["deep meta", "directory", pytest.param("fifo", marks=needs_fifo)])
def test_a_spoilt_resume_file_starts_training_afresh(tmp_path, how):
    from edgespec.heads.job import _resumed

    path = tmp_path / "resume.npz"
    heads_like_file(path, how)
    found = []
    assert finishes(lambda: found.append(_resumed(path, None, 10)), 20)
    assert found == [None]


def test_a_crafted_snapshot_whose_cell_sits_at_the_last_position_leaves_no_ghost_cell(tmp_path, tiny_models):
    """A snapshot rewritten with a fresh checksum (crafted, or from a buggy writer) whose first cell has
    position 2**31 - 1: llama.cpp takes it, edgespec refuses it (its last position is not the prompt's), and
    llama_memory_seq_rm(seq, 0, -1), whose range ends before that position, used to leave the cell behind,
    so every later decode of the sequence failed.  Word 4 of this build's sequence state is that position."""
    import hashlib

    prompt = [100 + i % 150 for i in range(300)]
    cache = tmp_path / "prefix-cache"
    engine = engine_with_disk_cache(tiny_models["target"], cache)
    for _ in range(2):
        generate(engine, prompt)
        engine.forget_cache()
    engine.close()
    [path] = cache.glob("*" + SUFFIX)
    data = path.read_bytes()
    with open(path, "rb") as f:
        _, tokens, header = _read_header(f, len(data))
    payload = bytearray(data[len(data) - header["payload_bytes"]:])
    payload[16:20] = (2**31 - 1).to_bytes(4, "little")
    path.write_bytes(rewrite_header(data[:len(data) - len(payload)] + payload,
                                    payload_sha256=hashlib.sha256(payload).hexdigest()))
    engine = engine_with_disk_cache(tiny_models["target"], cache)
    result = generate(engine, prompt)
    again = generate(engine, prompt[:-1])
    engine.close()
    plain = load_engine(tiny_models["target"], "none", n_ctx=1024, cost_curve=FIXED_COST, n_threads=1)
    expected, expected_again = generate(plain, prompt), generate(plain, prompt[:-1])
    plain.close()
    assert result.token_ids == expected.token_ids and again.token_ids == expected_again.token_ids


def test_an_import_keeps_what_a_newer_edgespec_wrote_in_models_json(tmp_path, monkeypatch):
    from edgespec.model_import import import_model
    from tinygguf import write_tiny_model

    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path / "models"))
    path = store_dir() / USER_CATALOG_NAME
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"models": [], "pairs": [], "aliases": {"fast": "tiny"}}))
    import_model(write_tiny_model(tmp_path / "tiny.gguf", seed=0), name="tiny")
    data = json.loads(path.read_text())
    assert data["aliases"] == {"fast": "tiny"} and [m["name"] for m in data["models"]] == ["tiny"]


# ---------------------------------------------------------------- heads training data read from the user's files


def test_heads_training_skips_batch_lines_that_are_not_records(tmp_path):
    from edgespec.commands.heads import _batch_conversations

    good = {"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]},
            "response": {"body": {"choices": [{"message": {"content": "hello"}}]}}}
    lines = [DEEP, "[1]", '{"custom_id": {}}', '{"custom_id": "b", "body": [1]}', '{"custom_id": "c", "body": "x"}',
             json.dumps(good), "not json"]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines))
    assert list(_batch_conversations(path)) == [[{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "hello"}]]


def test_heads_training_from_history_skips_a_damaged_chat():
    from edgespec.commands.heads import _history_chats

    store = ChatStore()
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    store.save_chat(None, "good", "/m.gguf", {}, good, {})
    store.save_chat(None, "messages not a list", "/m.gguf", {}, {"messages": []}, {})
    damaged = store.save_chat(None, "damaged", "/m.gguf", {}, {"messages": []}, {})
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE chats SET session = ? WHERE id = ?", (DEEP, damaged))
        db.execute("UPDATE chats SET session = ? WHERE title = ?", ('{"messages": 7}', "messages not a list"))
    db.close()
    store.close()
    assert list(_history_chats()) == [good["messages"]]


@pytest.mark.parametrize("session, extras", [
    ({"messages": [{"role": "user"}]}, {}),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, {"drafted": "not marks"}),
    ({"messages": ["x"]}, {}),
])
def test_exporting_a_damaged_chat_says_so(tmp_path, session, extras):
    from tui.chat import ChatController
    from tui.settings import ChatConfig

    store = ChatStore(tmp_path / "history.sqlite3")
    chat = store.save_chat(None, "title", "/m.gguf", {}, {"messages": []}, {})
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE chats SET session = ?, extras = ? WHERE id = ?", (json.dumps(session), json.dumps(extras),
                                                                            chat))
    db.close()
    with pytest.raises(HistoryError, match=f"chat {chat} in .* is damaged"):
        ChatController(ChatConfig(), store).export(chat, tmp_path / "chat.md", mark_drafts=True)
    assert not (tmp_path / "chat.md").exists()


def test_a_symlink_in_place_of_the_sightings_file_is_replaced_not_written_through(tmp_path):
    from edgespec.prefix_sightings import PrefixSightings

    mine = tmp_path / "notes.txt"
    mine.write_bytes(b"sixteen bytes!!\n" * 4)  # a whole number of records: it used to be appended to
    (tmp_path / "cache").mkdir()
    link = tmp_path / "cache" / "seen-prefixes"
    link.symlink_to(mine)
    sightings = PrefixSightings(link)
    tokens = list(range(300))
    sightings.seen_then_note("model", tokens)
    assert sightings.seen_then_note("model", tokens) == 256  # the cache works on, in a file of its own
    assert mine.read_bytes() == b"sixteen bytes!!\n" * 4 and not link.is_symlink()


@pytest.mark.parametrize("crafted", ["deflated", "declares more", "object array", "claims more than the file"])
def test_an_archive_of_arrays_is_read_only_within_the_bytes_it_holds(tmp_path, crafted):
    """read_arrays (heads, training state, usage chunks) refuses, before allocating, what np.load would grow."""
    path = tmp_path / "arrays.npz"
    np.savez(path, kept=np.arange(6, dtype=np.int32).reshape(2, 3), empty=np.zeros((0, 4)))
    read = read_arrays(path)
    assert read["kept"].tolist() == [[0, 1, 2], [3, 4, 5]] and read["empty"].shape == (0, 4)

    compression = zipfile.ZIP_DEFLATED if crafted == "deflated" else zipfile.ZIP_STORED
    member = {"deflated": npy_member((4_000_000,), bytes(16_000_000)),
              "declares more": npy_member((10**12,), bytes(64)),
              "object array": npy_member((1,), bytes(8), "|O"),
              "claims more than the file": npy_member((2,), bytes(8))}[crafted]
    with zipfile.ZipFile(path, "w", compression) as archive:
        archive.writestr("a.npy", member)
    if crafted == "claims more than the file":  # the central directory's size for the member, made up
        data = path.read_bytes()
        directory = data.rindex(b"PK\x01\x02")
        size_at = directory + 24  # uncompressed size in the central directory entry
        path.write_bytes(data[:size_at] + (10**9).to_bytes(4, "little") + data[size_at + 4:])
    with pytest.raises(ValueError):
        read_arrays(path)



# -- a batch's --summary, at the path the user named ---------------------------------------------


def test_a_batch_summary_through_a_symlink_keeps_the_symlink(tmp_path):
    # the rename made the link a plain file and left the file it pointed at as it was
    from edgespec.commands.batch.runner import write_summary

    target = tmp_path / "kept" / "summary.json"
    target.parent.mkdir()
    target.write_text("{}")
    link = tmp_path / "summary.json"
    link.symlink_to(target)
    write_summary(link, {"requests": 3})
    assert link.is_symlink() and json.loads(target.read_text()) == {"requests": 3}


def test_a_batch_summary_to_a_fifo_is_written_into_it(tmp_path):
    # --summary /dev/stdout is the common case; run as root, --summary /dev/full replaced the machine's /dev/full
    import threading

    from edgespec.commands.batch.runner import write_summary

    fifo = tmp_path / "summary"
    os.mkfifo(fifo)
    read = []
    reader = threading.Thread(target=lambda: read.append(fifo.read_text()), daemon=True)
    reader.start()
    write_summary(fifo, {"requests": 3})
    reader.join(timeout=30)
    assert json.loads(read[0]) == {"requests": 3} and fifo.is_fifo()
