"""The chat history store: SQLite file, schema version, transactional saves."""

import sqlite3
import subprocess
import sys
import textwrap

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


def test_plain_speed_accumulates_tokens_and_seconds(tmp_path):
    store = ChatStore(tmp_path / "h.sqlite3")
    assert store.plain_speed("m") is None
    store.add_plain_speed("m", 10, 0.5)
    store.add_plain_speed("m", 30, 1.5)
    assert store.plain_speed("m") == (40, 2.0)


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
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
    [old] = store.list_chats()
    assert old.title == "old chat"
    store.rename_chat(old.id, "named by me")
    store.save_chat(old.id, "first message", "/m/a.gguf", {}, {"messages": []}, {})
    assert store.list_chats()[0].title == "named by me", "a save keeps the user's name"
    other = store.save_chat(None, "from the first message", "/m/a.gguf", {}, {"messages": []}, {})
    store.save_chat(other, "a new first message", "/m/a.gguf", {}, {"messages": []}, {})
    assert {c.title for c in store.list_chats()} == {"named by me", "a new first message"}
