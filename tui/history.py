"""Saved chats, sent prompts and measured plain decoding speeds, in one SQLite file.

The file is platformdirs.user_data_dir("edgespec")/history.sqlite3 (or
$EDGESPEC_DATA_DIR/history.sqlite3).  Each save is one transaction in WAL
mode, so killing the app mid-reply loses at most the reply being generated.
The schema version is SQLite's user_version.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from edgespec.errors import EdgespecError

SCHEMA_VERSION = 1
HISTORY_FILE = "history.sqlite3"

_SCHEMA = """
CREATE TABLE chats (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    target TEXT NOT NULL,
    n_messages INTEGER NOT NULL,
    settings TEXT NOT NULL,  -- JSON: sampling settings, mode, draft tokens
    session TEXT NOT NULL,   -- JSON: ChatSession.to_dict()
    extras TEXT NOT NULL     -- JSON: what only the app shows (draft marks, reply footers)
);
CREATE INDEX chats_by_update ON chats (updated_at DESC);
CREATE TABLE prompts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    text TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE plain_speed (
    target TEXT PRIMARY KEY,  -- model path and size: a replaced file is a new model
    tokens INTEGER NOT NULL,
    seconds REAL NOT NULL
);
"""


class HistoryError(EdgespecError):
    """The history database cannot be opened or was written by a newer edgespec."""


@dataclass(frozen=True)
class ChatSummary:
    id: int
    title: str
    updated_at: float
    target: str
    n_messages: int


@dataclass(frozen=True)
class StoredChat:
    id: int
    title: str
    target: str
    settings: dict
    session: dict
    extras: dict


def data_dir() -> Path:
    return Path(os.environ.get("EDGESPEC_DATA_DIR") or platformdirs.user_data_dir("edgespec"))


class ChatStore:
    def __init__(self, path: Path | None = None):
        self.path = path or data_dir() / HISTORY_FILE
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._migrate()
        except sqlite3.Error as error:
            raise HistoryError(
                f"cannot open chat history {self.path}: {error}; move the file away to start afresh"
            ) from None

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise HistoryError(
                f"chat history {self.path} has schema {version}, newer than this edgespec "
                f"understands ({SCHEMA_VERSION}); upgrade edgespec or set EDGESPEC_DATA_DIR"
            )
        if version == 0:
            # executescript commits first, so the transaction is spelled out in the script.
            self._db.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")

    def _transaction(self):
        return _Transaction(self._db)

    def close(self) -> None:
        self._db.close()

    def save_chat(self, chat_id: int | None, title: str, target: str,
                  settings: dict, session: dict, extras: dict) -> int:
        """Insert (chat_id None) or overwrite a chat; return its id."""
        now = time.time()
        row = (title, now, target, len(session.get("messages", ())),
               json.dumps(settings), json.dumps(session), json.dumps(extras))
        with self._transaction():
            if chat_id is None:
                cursor = self._db.execute(
                    "INSERT INTO chats (title, updated_at, target, n_messages, settings, session,"
                    " extras, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (*row, now))
                return cursor.lastrowid
            self._db.execute(
                "UPDATE chats SET title = ?, updated_at = ?, target = ?, n_messages = ?,"
                " settings = ?, session = ?, extras = ? WHERE id = ?", (*row, chat_id))
            return chat_id

    def list_chats(self, limit: int = 500) -> list[ChatSummary]:
        rows = self._db.execute(
            "SELECT id, title, updated_at, target, n_messages"
            " FROM chats ORDER BY updated_at DESC, id DESC LIMIT ?", (limit,))
        return [ChatSummary(*row) for row in rows]

    def load_chat(self, chat_id: int) -> StoredChat:
        row = self._db.execute(
            "SELECT id, title, target, settings, session, extras FROM chats WHERE id = ?",
            (chat_id,)).fetchone()
        if row is None:
            raise HistoryError(f"chat {chat_id} is not in {self.path}; it may have been deleted")
        id, title, target, settings, session, extras = row
        return StoredChat(id, title, target, json.loads(settings), json.loads(session), json.loads(extras))

    def delete_chat(self, chat_id: int) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def add_prompt(self, text: str) -> None:
        with self._transaction():
            self._db.execute("INSERT INTO prompts (text, created_at) VALUES (?, ?)", (text, time.time()))

    def recent_prompts(self, limit: int = 200) -> list[str]:
        """Prompts sent before, oldest first, without repeats."""
        rows = self._db.execute(
            "SELECT text FROM prompts GROUP BY text ORDER BY MAX(id) DESC LIMIT ?", (limit,))
        return [text for (text,) in rows][::-1]

    def add_plain_speed(self, target: str, tokens: int, seconds: float) -> None:
        """Add a reply decoded without drafting to the model's plain-speed measurement."""
        with self._transaction():
            self._db.execute(
                "INSERT INTO plain_speed (target, tokens, seconds) VALUES (?, ?, ?)"
                " ON CONFLICT (target) DO UPDATE SET tokens = tokens + excluded.tokens,"
                " seconds = seconds + excluded.seconds", (target, tokens, seconds))

    def plain_speed(self, target: str) -> tuple[int, float] | None:
        """(tokens, seconds) decoded without drafting so far, or None."""
        row = self._db.execute(
            "SELECT tokens, seconds FROM plain_speed WHERE target = ?", (target,)).fetchone()
        return (row[0], row[1]) if row else None


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any error."""

    def __init__(self, db: sqlite3.Connection):
        self._db = db

    def __enter__(self):
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, error, traceback):
        self._db.execute("COMMIT" if kind is None else "ROLLBACK")
        return False
