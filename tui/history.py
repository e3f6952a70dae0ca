"""Saved chats and sent prompts, in one SQLite file.

The file is platformdirs.user_data_dir("edgespec")/history.sqlite3 (or
$EDGESPEC_DATA_DIR/history.sqlite3).  Each save is one transaction in WAL
mode, so killing the app mid-reply loses at most the reply being generated.
The schema version is SQLite's user_version; _MIGRATIONS bring an older
file up to it, so a file any earlier edgespec wrote keeps its chats.

A file SQLite finds corrupt, when it opens or in any later query, is moved
aside to a timestamped backup (with its -wal and -shm files) and replaced by
an empty history, so a damaged history never stops the app; `notices` says
what happened, once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import platformdirs

from edgespec.errors import EdgespecError
from edgespec.files import parse_json

SCHEMA_VERSION = 4
HISTORY_FILE = "history.sqlite3"
_SIDECARS = ("-wal", "-shm")  # SQLite's names for a WAL database's other files

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
"""

# What brings a history of schema n (created by _SCHEMA as 1) up to n + 1.
_MIGRATIONS = {
    1: "ALTER TABLE chats ADD COLUMN renamed INTEGER NOT NULL DEFAULT 0;  -- 1: the user named it; saves keep the title",
    # Schemas 1 and 2 kept plain decoding speeds per model, which nothing read: the chat app
    # measures plain speed from the steps of its replies (ChatController.plain_speed).
    2: "DROP TABLE IF EXISTS plain_speed;",
    # A message being written when the app ended, put back in the input at the next start; one a start has not
    # taken yet (two apps ended with one) waits for the next.
    3: "CREATE TABLE unsent (id INTEGER PRIMARY KEY AUTOINCREMENT, text TEXT NOT NULL, saved_at REAL NOT NULL);",
}


# The list's title for a chat whose title is not text (a hand-edited or damaged file): it still shows, so that
# it can be deleted.
DAMAGED_TITLE = "(a damaged chat)"
# The latest time the list can show (the end of year 9999): time.localtime overflows on larger ones.
LATEST_SHOWN_TIME = 253402300799.0


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
    updated_at: float = 0.0  # when it was saved last (time.time())


def content_key(text: str) -> str:
    """The key of a reply's draft marks in a chat's extras["drafted"]."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def data_dir() -> Path:
    return Path(os.environ.get("EDGESPEC_DATA_DIR") or platformdirs.user_data_dir("edgespec"))


def _is_corruption(error: sqlite3.Error) -> bool:
    """True for "database disk image is malformed" and "file is not a database", not for locks or I/O."""
    code = getattr(error, "sqlite_errorcode", 0) & 0xFF  # the primary code, without the extended bits
    return code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


class _Corrupt(Exception):
    """The history file is damaged: SQLite said so, or its integrity check failed."""


def _recovering(query):
    """Run a query; if it finds the file corrupt, move the file aside and run it on a fresh history."""

    @functools.wraps(query)
    def run(self, *args, **kwargs):
        for first_try in (True, False):
            try:
                return query(self, *args, **kwargs)
            except sqlite3.Error as error:
                if not (first_try and _is_corruption(error)):
                    raise HistoryError(f"chat history {self.path}: {error}") from None
                self._db.close()
                self._start_afresh(str(error))

    return run


def _kept_in_memory_if_unwritable(fallback: Callable[..., object]):
    """A write of what the app keeps (a chat, a sent or unsent message), run so that a history that cannot be
    written now (another program holding it past the wait, a full disk, a read-only folder) is said through
    the notices, once until a write succeeds again, and the call returns fallback(*its arguments): the app goes
    on with what it holds, and the next save writes the chat whole.  It ended the app with a traceback, and
    lost the message being sent."""

    def wrap(write):
        @functools.wraps(write)
        def run(self, *args, **kwargs):
            try:
                done = write(self, *args, **kwargs)
            except HistoryError as error:
                if not self.unwritable:
                    self.unwritable = True
                    self._say(f"{error}; what is on screen stays, and is written at the next save that can be "
                              "(check that its folder can be written and has room, and that no other program "
                              "holds the file)")
                return fallback(*args, **kwargs)
            if self.unwritable:
                self.unwritable = False
                self._say(f"chat history {self.path} can be written again")
            return done

        return run

    return wrap


class ChatStore:
    def __init__(self, path: Path | None = None, lock_wait_seconds: float = 5.0):
        self.path = path or data_dir() / HISTORY_FILE
        self.lock_wait_seconds = lock_wait_seconds  # how long a write waits for another app holding the file
        self.notices: list[str] = []  # what the app should tell the user: each said once
        self.on_notice: Callable[[str], None] | None = None
        self.unwritable = False  # the last write failed (and was said): the next that works says so
        self._seen: dict[int, float] = {}  # chat id -> its updated_at as this store last read or wrote it
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = self._connect()
        except _Corrupt as damage:
            self._start_afresh(str(damage))
        except (sqlite3.Error, OSError) as error:
            raise HistoryError(
                f"cannot open chat history {self.path}: {error}; move the file away to start afresh"
            ) from None

    def _connect(self) -> sqlite3.Connection:
        """Open the file, check it and bring its schema up to date; _Corrupt if it is damaged."""
        db = sqlite3.connect(self.path, isolation_level=None, timeout=self.lock_wait_seconds)
        # Text another program wrote as bytes that are not UTF-8 is read with U+FFFD in their place: read strictly,
        # one such title refused the whole history list, and one such chat only an SQLite error.
        db.text_factory = lambda data: data.decode("utf-8", "replace")
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # Damage in pages the start-up does not read would only show in a later query.
            problems = [row[0] for row in db.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise _Corrupt(problems[0])
            self._db = db
            self._migrate()
        except sqlite3.Error as error:
            db.close()
            if _is_corruption(error):
                raise _Corrupt(str(error)) from None
            raise
        except BaseException:
            db.close()
            raise
        return db

    def _start_afresh(self, damage: str) -> None:
        """Move the damaged file aside, open an empty history in its place, and say so."""
        backup = self._move_aside()
        try:
            self._db = self._connect()
        except (_Corrupt, sqlite3.Error, OSError) as error:
            raise HistoryError(f"cannot start a new chat history at {self.path}: {error}") from None
        damage = "; ".join(line.strip() for line in damage.splitlines() if line.strip())
        self._say(f"The chat history was damaged ({damage[:120]}); it was moved to {backup} and a new, "
                  f"empty history started.")

    def _move_aside(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        backup = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while any(Path(f"{backup}{suffix}").exists() for suffix in ("", *_SIDECARS)):
            n += 1
            backup = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        try:
            for suffix in ("", *_SIDECARS):
                if Path(f"{self.path}{suffix}").exists():
                    os.replace(f"{self.path}{suffix}", f"{backup}{suffix}")
        except OSError as error:
            raise HistoryError(f"chat history {self.path} is damaged and cannot be moved aside: {error}; "
                               f"move it away by hand") from None
        return backup

    def _say(self, notice: str) -> None:
        self.notices.append(notice)
        if self.on_notice is not None:
            self.on_notice(notice)

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise HistoryError(
                f"chat history {self.path} has schema {version}, newer than this edgespec "
                f"understands ({SCHEMA_VERSION}); upgrade edgespec or set EDGESPEC_DATA_DIR"
            )
        steps = ([_SCHEMA] if version == 0 else []) + [_MIGRATIONS[n] for n in range(max(version, 1), SCHEMA_VERSION)]
        if steps:
            # executescript commits first, so the transaction is spelled out in the script.
            script = "\n".join(steps)
            self._db.executescript(f"BEGIN;\n{script}\nPRAGMA user_version = {SCHEMA_VERSION};\nCOMMIT;")

    @contextlib.contextmanager
    def _transaction(self):
        """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any error."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled back already (it does on some errors)
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()

    @_kept_in_memory_if_unwritable(lambda chat_id, *rest: chat_id)
    @_recovering
    def save_chat(self, chat_id: int | None, title: str, target: str,
                  settings: dict, session: dict, extras: dict) -> int:
        """Overwrite chat chat_id, or insert the chat when it is new or gone; return its id.

        A chat the user renamed keeps its name: `title` is only the one to show otherwise.

        A chat can be gone when the history was damaged and started afresh,
        or deleted from another window; the app then goes on with the new id.
        """
        now = time.time()
        row = (title, now, target, len(session.get("messages", ())),
               json.dumps(settings), json.dumps(session), json.dumps(extras))
        with self._transaction():
            stored = None if chat_id is None else self._db.execute(
                "SELECT updated_at FROM chats WHERE id = ?", (chat_id,)).fetchone()
            # another app (a second window on the same chat) saved it since this store read or wrote it: its
            # turns are kept, and this one's copy becomes a chat of its own
            elsewhere = stored is not None and chat_id in self._seen and stored[0] != self._seen[chat_id]
            if stored is not None and not elsewhere:
                self._db.execute(
                    "UPDATE chats SET title = CASE WHEN renamed THEN title ELSE ? END, updated_at = ?, target = ?,"
                    " n_messages = ?, settings = ?, session = ?, extras = ? WHERE id = ?", (*row, chat_id))
                self._seen[chat_id] = now
                return chat_id
            saved = self._db.execute(
                "INSERT INTO chats (title, updated_at, target, n_messages, settings, session,"
                " extras, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (*row, now)).lastrowid
        self._seen[saved] = now
        if elsewhere:
            self._say(f"chat {chat_id} was saved by another edgespec since this one opened it; its turns are kept "
                      f"there, and this chat is saved as chat {saved}")
        return saved

    @_recovering
    def list_chats(self, limit: int = 500) -> list[ChatSummary]:
        rows = self._db.execute(
            "SELECT id, title, updated_at, target, n_messages"
            " FROM chats ORDER BY updated_at DESC, id DESC LIMIT ?", (limit,))
        return [_summary(*row) for row in rows]

    @_recovering
    def load_chat(self, chat_id: int) -> StoredChat:
        row = self._db.execute(
            "SELECT id, title, target, settings, session, extras, updated_at FROM chats WHERE id = ?",
            (chat_id,)).fetchone()
        if row is None:
            raise HistoryError(f"chat {chat_id} is not in {self.path}; it may have been deleted")
        id, title, target, settings, session, extras, updated_at = row
        try:
            if not (isinstance(title, str) and isinstance(target, str) and _is_time(updated_at)):
                raise ValueError("its title, model or time is of another type than this app writes")
            parts = [parse_json(part) for part in (settings, session, extras)]
            if not all(isinstance(part, dict) for part in parts):
                raise ValueError("its settings, messages or marks are not JSON objects")
            return StoredChat(id, title, target, *parts, updated_at=updated_at)
        except (TypeError, ValueError) as error:
            raise HistoryError(f"chat {chat_id} in {self.path} is damaged ({error}); delete it from the history "
                               "list") from None

    def open_chat(self, chat_id: int) -> StoredChat:
        """load_chat for the app to go on with: a later save of it that finds it saved by another app since
        keeps that one's turns and is saved as a chat of its own (save_chat)."""
        stored = self.load_chat(chat_id)
        self._seen[chat_id] = stored.updated_at
        return stored

    @_recovering
    def rename_chat(self, chat_id: int, title: str) -> None:
        """Name a chat; later saves keep the name."""
        with self._transaction():
            self._db.execute("UPDATE chats SET title = ?, renamed = 1 WHERE id = ?", (title, chat_id))

    @_recovering
    def delete_chat(self, chat_id: int) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    @_kept_in_memory_if_unwritable(lambda *args: None)
    @_recovering
    def add_prompt(self, text: str) -> None:
        with self._transaction():
            self._db.execute("INSERT INTO prompts (text, created_at) VALUES (?, ?)", (text, time.time()))

    @_kept_in_memory_if_unwritable(lambda *args: None)
    @_recovering
    def keep_unsent(self, text: str) -> None:
        """Keep a message that was being written when the app ended (nothing for blank text)."""
        if text.strip():
            with self._transaction():
                self._db.execute("INSERT INTO unsent (text, saved_at) VALUES (?, ?)", (text, time.time()))

    @_kept_in_memory_if_unwritable(lambda *args: None)
    @_recovering
    def take_unsent(self) -> str | None:
        """The newest message kept by keep_unsent, removed from the store; None when there is none."""
        with self._transaction():
            row = self._db.execute("SELECT id, text FROM unsent ORDER BY id DESC LIMIT 1").fetchone()
            if row is None:
                return None
            self._db.execute("DELETE FROM unsent WHERE id = ?", (row[0],))
        return row[1] if isinstance(row[1], str) else None

    @_recovering
    def recent_prompts(self, limit: int = 200) -> list[str]:
        """Prompts sent before, oldest first, without repeats."""
        rows = self._db.execute(
            "SELECT text FROM prompts GROUP BY text ORDER BY MAX(id) DESC LIMIT ?", (limit,))
        return [text for (text,) in rows if isinstance(text, str)][::-1]  # another program's blob is not a prompt


def _summary(id: int, title, updated_at, target, n_messages) -> ChatSummary:
    """A row of the chats table as the history list shows it.  SQLite keeps whatever type a program wrote in a
    column; a value of another type than this app writes is shown as unknown, so the chat still lists (and can
    be deleted), and opening it says it is damaged (load_chat)."""
    return ChatSummary(
        id, title if isinstance(title, str) else DAMAGED_TITLE,
        float(updated_at) if _is_time(updated_at) and 0 <= updated_at <= LATEST_SHOWN_TIME else 0.0,
        target if isinstance(target, str) else "",
        n_messages if type(n_messages) is int else 0,
    )


def _is_time(value) -> bool:
    """Whether value is a time as save_chat writes it: a finite number."""
    return type(value) in (int, float) and math.isfinite(value)

