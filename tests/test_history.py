"""The chat history store: SQLite file, schema version, transactional saves."""

import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from tui.history import SCHEMA_VERSION, ChatStore, HistoryError, data_dir


def test_chats_round_trip_newest_first(tmp_path):
    store = ChatStore(tmp_path / "h.sqlite3")
    first = store.save_chat(None, "first", "/m/a.gguf", {"draft_tokens": 3},
                            {"messages": [{"role": "user", "content": "hi"}]}, {})
    second = store.save_chat(None, "second", "/m/a.gguf", {}, {"messages": []}, {"x": 1})
    store.save_chat(first, "first again", "/m/a.gguf", {"draft_tokens": 5},
                    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, {})

    assert [(c.id, c.title, c.n_messages) for c in store.list_chats()] == [(first, "first again", 2), (second, "second", 0)]
    chat = store.load_chat(first)
    assert chat.settings == {"draft_tokens": 5}
    assert chat.session["messages"][1]["content"] == "yo"
    store.delete_chat(second)
    assert [c.id for c in store.list_chats()] == [first]
    with pytest.raises(HistoryError, match="not in"):
        store.load_chat(second)


def test_schema_version_is_recorded_and_newer_files_are_refused(tmp_path):
    path = tmp_path / "h.sqlite3"
    ChatStore(path).close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(HistoryError, match="newer"):
        ChatStore(path)


def test_prompts_are_recalled_oldest_first_without_repeats(tmp_path):
    store = ChatStore(tmp_path / "h.sqlite3")
    for text in ("a", "b", "a", "c"):
        store.add_prompt(text)
    assert store.recent_prompts() == ["b", "a", "c"]


# A history as edgespec wrote it at schema 2: chats (renamed), prompts and the plain_speed table.
SCHEMA_2 = """
CREATE TABLE chats (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, created_at REAL NOT NULL,
    updated_at REAL NOT NULL, target TEXT NOT NULL, n_messages INTEGER NOT NULL, settings TEXT NOT NULL,
    session TEXT NOT NULL, extras TEXT NOT NULL, renamed INTEGER NOT NULL DEFAULT 0);
CREATE INDEX chats_by_update ON chats (updated_at DESC);
CREATE TABLE prompts (id INTEGER PRIMARY KEY AUTOINCREMENT, text TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE plain_speed (target TEXT PRIMARY KEY, tokens INTEGER NOT NULL, seconds REAL NOT NULL);
INSERT INTO chats VALUES (7, 'kept', 1.0, 2.0, '/m/a.gguf', 1, '{"draft_tokens": 3}',
    '{"messages": [{"role": "user", "content": "hi"}]}', '{}', 1);
INSERT INTO prompts (text, created_at) VALUES ('hi', 1.0);
INSERT INTO plain_speed VALUES ('/m/a.gguf:100', 40, 2.0);
PRAGMA user_version = 2;
"""


def test_a_schema_2_history_keeps_its_chats_and_prompts_and_loses_the_unused_plain_speed_table(tmp_path):
    path = tmp_path / "h.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(SCHEMA_2)
    old.close()

    store = ChatStore(path)
    assert [(c.id, c.title, c.n_messages) for c in store.list_chats()] == [(7, "kept", 1)]
    chat = store.load_chat(7)
    assert (chat.settings, chat.session["messages"][0]["content"]) == ({"draft_tokens": 3}, "hi")
    assert store.recent_prompts() == ["hi"]
    store.save_chat(7, "a new title", "/m/a.gguf", {}, {"messages": []}, {})
    assert store.load_chat(7).title == "kept"  # the user's name survives the migration
    store.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "plain_speed" not in tables and {"chats", "prompts"} <= tables


def test_a_new_history_has_no_plain_speed_table(tmp_path):
    ChatStore(tmp_path / "h.sqlite3").close()
    db = sqlite3.connect(tmp_path / "h.sqlite3")
    assert db.execute("SELECT name FROM sqlite_master WHERE name = 'plain_speed'").fetchone() is None


def test_data_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path


def test_a_killed_writer_loses_only_the_unfinished_save(tmp_path):
    """A process killed inside a transaction leaves the last committed chat intact."""
    path = tmp_path / "h.sqlite3"
    store = ChatStore(path)
    chat = store.save_chat(None, "kept", "m", {}, {"messages": [{"role": "user", "content": "one"}]}, {})
    store.close()
    script = textwrap.dedent(f"""
        import os, sqlite3
        db = sqlite3.connect({str(path)!r}, isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        db.execute("UPDATE chats SET title = 'torn', session = '{{}}' WHERE id = {chat}")
        os._exit(9)
    """)
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    reopened = ChatStore(path)
    assert reopened.load_chat(chat).title == "kept"
    assert reopened.load_chat(chat).session["messages"][0]["content"] == "one"


def test_a_schema_1_history_is_migrated_and_a_renamed_chat_keeps_its_name(tmp_path):
    from tui.history import _SCHEMA

    path = tmp_path / "h.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(f"{_SCHEMA} PRAGMA user_version = 1;")  # as edgespec wrote it before chats could be renamed
    db.execute("INSERT INTO chats (title, created_at, updated_at, target, n_messages, settings, session, extras)"
               " VALUES ('old chat', 1, 1, '/m/a.gguf', 0, '{}', '{\"messages\": []}', '{}')")
    db.commit()
    db.close()
    store = ChatStore(path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    [old] = store.list_chats()
    assert old.title == "old chat"
    store.rename_chat(old.id, "named by me")
    store.save_chat(old.id, "first message", "/m/a.gguf", {}, {"messages": []}, {})
    assert store.list_chats()[0].title == "named by me", "a save keeps the user's name"
    other = store.save_chat(None, "from the first message", "/m/a.gguf", {}, {"messages": []}, {})
    store.save_chat(other, "a new first message", "/m/a.gguf", {}, {"messages": []}, {})
    assert {c.title for c in store.list_chats()} == {"named by me", "a new first message"}


def test_an_unsent_message_is_kept_until_a_start_takes_it_and_none_is_lost_to_another(tmp_path):
    store = ChatStore(tmp_path / "h.sqlite3")
    assert store.take_unsent() is None
    store.keep_unsent("  \n")  # nothing written: nothing kept
    store.keep_unsent("half a question")
    ChatStore(tmp_path / "h.sqlite3").keep_unsent("another app's\nmessage")  # two apps ended, each with one
    store.close()
    reopened = ChatStore(tmp_path / "h.sqlite3")
    assert reopened.take_unsent() == "another app's\nmessage"  # the newest first
    assert reopened.take_unsent() == "half a question"
    assert reopened.take_unsent() is None


def test_a_schema_3_history_gains_a_place_for_an_unsent_message(tmp_path):
    path = tmp_path / "h.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(SCHEMA_2.replace("PRAGMA user_version = 2;", "DROP TABLE plain_speed; PRAGMA user_version = 3;"))
    old.close()
    store = ChatStore(path)
    assert [c.title for c in store.list_chats()] == ["kept"]
    store.keep_unsent("typed")
    assert store.take_unsent() == "typed"


def test_text_that_is_not_utf8_is_read_with_replacement_characters_not_refused(tmp_path):
    path = tmp_path / "h.sqlite3"
    store = ChatStore(path)
    chat = store.save_chat(None, "kept", "m", {}, {"messages": [{"role": "user", "content": "hi"}]}, {})
    store.close()
    db = sqlite3.connect(path)  # as another program might write it: bytes that are not UTF-8, stored as text
    db.execute("UPDATE chats SET title = CAST(X'6b65ff74' AS TEXT), "
               "session = CAST(X'7b226d65737361676573223a205b7b22726f6c65223a202275736572222c2022636f6e74656e74223a20226869ff227d5d7d' AS TEXT)"
               " WHERE id = ?", (chat,))
    db.commit()
    db.close()
    reopened = ChatStore(path)
    assert [c.title for c in reopened.list_chats()] == ["ke\ufffdt"]
    assert reopened.load_chat(chat).session["messages"][0]["content"] == "hi\ufffd"


def test_a_chat_saved_by_another_app_since_it_was_opened_keeps_its_turns_and_this_copy_becomes_a_new_chat(tmp_path):
    # two apps on one chat: the last to save wrote over the other's turns without a word
    path = tmp_path / "h.sqlite3"
    first, second = ChatStore(path), ChatStore(path)
    turns = lambda *texts: {"messages": [{"role": "user", "content": text} for text in texts]}  # noqa: E731
    chat = first.save_chat(None, "shared", "m", {}, turns("one"), {})
    second.open_chat(chat)
    assert second.save_chat(chat, "shared", "m", {}, turns("one", "from the second app"), {}) == chat
    copy = first.save_chat(chat, "shared", "m", {}, turns("one", "from the first app"), {})
    assert copy != chat and f"saved as chat {copy}" in first.notices[-1]
    assert first.load_chat(chat).session == turns("one", "from the second app")
    assert first.load_chat(copy).session == turns("one", "from the first app")
    assert first.save_chat(copy, "shared", "m", {}, turns("one", "again"), {}) == copy  # its own from now on
    first.close()
    second.close()


@pytest.mark.parametrize("column, value", [
    ("updated_at", "yesterday"), ("updated_at", 1e300), ("title", b"\x00blob"), ("target", b"blob"),
    ("n_messages", "two"),
])
def test_a_row_another_program_wrote_with_other_types_still_lists_and_opening_it_says_it_is_damaged(
        tmp_path, column, value):
    path = tmp_path / "h.sqlite3"
    store = ChatStore(path)
    chat = store.save_chat(None, "kept", "/m/a.gguf", {}, {"messages": [{"role": "user", "content": "hi"}]}, {})
    store.close()
    db = sqlite3.connect(path)  # SQLite keeps whatever type a program writes into a column
    db.execute(f"UPDATE chats SET {column} = ? WHERE id = ?", (value, chat))
    db.commit()
    db.close()
    reopened = ChatStore(path)

    [summary] = reopened.list_chats()
    assert isinstance(summary.title, str) and isinstance(summary.target, str) and type(summary.n_messages) is int
    time.localtime(summary.updated_at)  # the list shows when it was saved: a time it can show
    if column in ("n_messages",) or (column, value) == ("updated_at", 1e300):
        assert reopened.load_chat(chat).id == chat  # nothing the chat needs: it opens
    else:
        with pytest.raises(HistoryError, match="damaged"):
            reopened.load_chat(chat)
    reopened.delete_chat(chat)
    assert reopened.list_chats() == []


def test_prompts_and_an_unsent_message_of_another_type_are_not_given_back_as_text(tmp_path):
    path = tmp_path / "h.sqlite3"
    store = ChatStore(path)
    store.add_prompt("kept")
    store.close()
    db = sqlite3.connect(path)
    db.execute("INSERT INTO prompts (text, created_at) VALUES (?, 0)", (b"blob",))
    db.execute("INSERT INTO unsent (text, saved_at) VALUES (?, 0)", (b"blob",))
    db.commit()
    db.close()
    reopened = ChatStore(path)
    assert reopened.recent_prompts() == ["kept"]
    assert reopened.take_unsent() is None
