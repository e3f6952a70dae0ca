"""The conversation behind the chat app: engine and session, settings, streaming, per-reply stats, history.

The app (tui/app.py) owns the screen: widgets, bindings, workers.  The
controller here owns the chat: it knows nothing of Textual.  A reply streams
from a worker thread into a locked hand-off (`ReplyStream`) that the app's UI
timer drains, so the UI never waits for the model and the model never waits
for the UI.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from pathlib import Path
from typing import Callable, Iterator

from edgespec import ChatSession, Done, Engine, Notice, Step
from edgespec.control_chars import visible_controls
from edgespec.errors import Setting, as_flag, flag_worded
from edgespec.limits import MODES
from edgespec.stats import Stats
from tui import stats as stats_text
from tui.config import ChatConfig, chat_sampling
from tui.export import chat_markdown, write_new_file
from tui.history import ChatStore, HistoryError, StoredChat, content_key
from tui.settings import ChatSettings

SPARKLINE_STEPS = 80
# What reading a saved chat of another shape than the app saves raises (a damaged or hand-edited history)
_DAMAGE = (TypeError, ValueError, KeyError, AttributeError, IndexError)


class ReplyStream:
    """Hand-off of one reply from the generation thread to the UI thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pieces: list[tuple[str, bool]] = []
        self._acceptance: list[float] = []
        self._notices: list[str] = []
        self._stats: Stats | None = None
        self.result = None  # the GenerationResult, once Done arrived
        self.error: str | None = None
        self.finished = threading.Event()
        self.stop_asked = threading.Event()  # ChatController.stop_reply

    def add_step(self, step: Step, acceptance: float | None) -> None:
        with self._lock:
            self._pieces.extend((token.text, token.drafted) for token in step.tokens if token.text)
            if acceptance is not None:
                self._acceptance.append(acceptance)
            self._stats = step.stats

    def add_text(self, text: str) -> None:
        """Text that came with no token of its own: what the reply held back until its end (Done.text)."""
        if text:
            with self._lock:
                self._pieces.append((text, False))

    def add_notice(self, text: str) -> None:
        with self._lock:
            self._notices.append(text)

    def take(self) -> tuple[list[tuple[str, bool]], list[float], list[str], Stats | None]:
        with self._lock:
            taken = self._pieces, self._acceptance, self._notices, self._stats
            self._pieces, self._acceptance, self._notices, self._stats = [], [], [], None
        return taken


def as_the_chat_can_act(setting: Setting) -> str:
    """A fix's setting as the chat's user can act on it: the chat has no switch to send a prompt without the
    chat template, which is what a failing template asks for; `edgespec run --raw` has."""
    return "edgespec run --raw" if setting.name == "raw" else as_flag(setting)


class ChatController:
    """One chat with the loaded engine: what the app shows and saves, kept apart from how it shows it."""

    def __init__(self, config: ChatConfig, store: ChatStore):
        self.store = store
        self.engine: Engine | None = None
        self.session: ChatSession | None = None
        self.defaults = ChatSettings(config.system_prompt, chat_sampling(config), config.draft_tokens, config.bit_exact)
        self.settings = self.defaults
        self.chat_id: int | None = None
        self.drafted_marks: dict[str, list] = {}  # reply content key -> drafted character ranges
        self.reply_labels: dict[str, str] = {}  # reply content key -> what it was written with ("model · mode")
        self.shown_stats: Stats | None = None  # live stats of the running reply, or the last reply's
        self.context_used = 0
        self.acceptance: deque[float] = deque(maxlen=SPARKLINE_STEPS)
        self.plain_steps = stats_text.PlainSpeedEstimate()  # of the loaded target

    # -- the engine --------------------------------------------------------------------

    def use_engine(self, engine: Engine) -> None:
        """Switch to newly loaded models; the chat so far goes on with them."""
        previous = self.session.to_dict() if self.session is not None else None
        if self.engine is not None:
            self.engine.close()
        self.engine = engine
        self.plain_steps = stats_text.PlainSpeedEstimate()
        if previous is not None:
            self.session = ChatSession.from_dict(engine, previous)
        else:
            self.session = ChatSession(engine, system_prompt=self.settings.system_prompt or None)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def available_modes(self) -> list[str]:
        return [mode for mode in MODES if mode in self.engine.modes]

    def plain_speed(self) -> tuple[float, str] | None:
        """This model's plain decoding speed in tok/s, and where it comes from.

        The median of the steps that drafted nothing (any mode) measures it
        best, once there are enough of them; until then the engine's
        calibrated one-token target pass stands in (None for a given curve).
        """
        if self.engine is None:
            return None
        measured = self.plain_steps.tokens_per_second()
        if measured is not None:
            return measured, "measured"
        seconds = self.engine.plain_step_seconds
        return (1 / seconds, "calibrated") if seconds else None

    # -- replies -------------------------------------------------------------------------

    def begin_reply(self) -> None:
        self.acceptance.clear()
        self.shown_stats = None

    def stream_reply(self, stream: ReplyStream, events: Callable[[], Iterator]) -> None:
        """Run a reply's events into `stream` (in the generation thread); errors are left to the caller."""
        decode_seconds = 0.0  # of the reply so far, to time each step
        plain_steps = self.plain_steps
        replying = events()
        if stream.stop_asked.is_set():  # a stop asked before the session's stream was made, which clears its cancel
            self.session.cancel()
        for event in replying:
            if isinstance(event, Step):
                stream.add_step(event, stats_text.step_acceptance(event.drafted, event.accepted))
                plain_steps.observe(event.drafted, event.stats.decode_seconds - decode_seconds)
                decode_seconds = event.stats.decode_seconds
            elif isinstance(event, Done):
                stream.add_text(event.text)
                stream.result = event.result
            elif isinstance(event, Notice):
                stream.add_notice(flag_worded(event.text))

    def stop_reply(self, stream: ReplyStream) -> None:
        """Stop the reply streaming into `stream` after its current step, or before its first: an Esc right after
        Enter can come before the generation thread has begun it."""
        stream.stop_asked.set()
        self.session.cancel()

    def show_stats(self, stats: Stats) -> None:
        self.shown_stats = stats
        self.context_used = stats_text.context_used(stats)

    def reply_finished(self, result, drafted_ranges: list, label: str) -> str:
        """Book a finished reply, written with what label names; returns its footer line."""
        self.show_stats(result.stats)
        self.drafted_marks[content_key(result.text)] = drafted_ranges
        self.reply_labels[content_key(result.text)] = label
        return stats_text.reply_footer(result.stats, self.plain_speed())

    def reply_failed(self, prompt: str | None) -> bool:
        """Save the chat after a reply that failed; True if it failed because its new message,
        prompt, was refused (too long for the context, say).

        A refused message is not in the session: it is saved neither as the chat's pending
        prompt nor as a chat of its own (the one saved for it as it was sent is deleted)."""
        messages = self.session.messages
        refused = prompt is not None and not (messages and messages[-1] == {"role": "user", "content": prompt})
        if messages:
            self.save()
        elif self.chat_id is not None:
            self.delete(self.chat_id)
        return refused

    def last_reply_text(self) -> str:
        for message in reversed(self.session.messages if self.session else []):
            if message["role"] == "assistant":
                return message["content"]
        return ""

    def turn_footers(self) -> dict[int, str]:
        """The footer line of every reply with stats, by message index."""
        plain = self.plain_speed()
        return {s["message_index"]: stats_text.reply_footer(Stats.from_dict(s), plain) for s in self.session.turn_stats}

    def drafted_ranges(self, text: str) -> list:
        return self.drafted_marks.get(content_key(text), [])

    def reply_label(self, text: str) -> str:
        """What the reply of this text was written with, as its title showed it then ("reply" if not known)."""
        return self.reply_labels.get(content_key(text), "reply")

    # -- the chat and its settings --------------------------------------------------------

    def new_chat(self) -> None:
        # What is kept per chat (its system prompt, seed and stop strings) starts from the defaults, as at a
        # start: a seed and a stop string carried into an unrelated chat without a word.  The rest goes on.
        defaults = self.defaults.sampling
        sampling = dataclasses.replace(self.settings.sampling, seed=defaults.seed, stop=defaults.stop)
        self.settings = dataclasses.replace(self.settings, system_prompt=self.defaults.system_prompt, sampling=sampling)
        self.session = ChatSession(self.engine, system_prompt=self.settings.system_prompt or None)
        self.chat_id = None
        self.drafted_marks, self.reply_labels = {}, {}
        self.shown_stats = None
        self.context_used = 0
        self.acceptance.clear()

    def apply_settings(self, settings: ChatSettings) -> None:
        if self.session is not None:
            self.session.set_system_prompt(settings.system_prompt or None)
        self.settings = settings
        if self.engine is not None:
            self.engine.configure(draft_tokens=settings.draft_tokens, bit_exact=settings.bit_exact)

    def save(self, pending_prompt: str | None = None, reply_so_far: tuple[str, str] | None = None) -> None:
        """Write the chat in one transaction: after each reply, with the prompt before it, and now and then with
        the reply so far while it streams (its text and label), as a stopped reply: what it is if the process
        dies then."""
        if self.session is None:
            return
        first_user = next((m["content"] for m in self.session.messages if m["role"] == "user"), pending_prompt)
        if first_user is None:
            return
        session = self.session.to_dict()
        messages = session["messages"]
        labels = self.reply_labels
        if reply_so_far and messages and messages[-1]["role"] == "user":  # the reply is not recorded yet
            text, label = reply_so_far
            messages.append({"role": "assistant", "content": text, "cancelled": True})
            labels = {**labels, content_key(text): label}
        replies = {content_key(m["content"]) for m in messages if m["role"] == "assistant"}
        self.drafted_marks = {k: v for k, v in self.drafted_marks.items() if k in replies}
        self.reply_labels = {k: v for k, v in self.reply_labels.items() if k in replies}
        extras = {"drafted": self.drafted_marks, "labels": {k: v for k, v in labels.items() if k in replies},
                  "pending_prompt": pending_prompt}
        settings = dict(self.settings.as_dict(), mode=self.engine.mode)
        title = first_user.strip().splitlines()[0][:80]
        target = str(self.engine.target_path)
        self.chat_id = self.store.save_chat(self.chat_id, title, target, settings, session, extras)

    def open(self, chat_id: int) -> StoredChat:
        """Continue a saved chat with the loaded engine; raises EdgespecError for a damaged one.  Its settings
        become the chat's, and the caller applies them to the engine (apply_settings), which bit-exact under
        flash attention's auto cannot take without loading the models again."""
        stored = self.store.open_chat(chat_id)
        # All read and checked before any is applied: a damaged chat must leave the open one as it was, or its
        # next save would write the open chat's id over with half of the damaged one.
        try:
            session, marks, settings = self._restored(stored)
            visible = session.visible_messages()
            context_used = len(self.engine.chat_tokens(visible)) if visible else 0
        except _DAMAGE as error:
            raise self._damaged(chat_id, error) from None
        self.session, self.chat_id, self.drafted_marks = session, stored.id, marks
        self.reply_labels = _reply_labels(stored.extras.get("labels"))
        self.settings = settings
        if stored.settings.get("mode") in self.available_modes():
            self.engine.configure(mode=stored.settings["mode"])
        self.shown_stats = None
        self.acceptance.clear()
        self.context_used = context_used
        return stored

    def _restored(self, stored: StoredChat) -> tuple[ChatSession, dict[str, list], ChatSettings]:
        """The session, draft marks and settings of a saved chat; TypeError, ValueError or KeyError if any part
        is not what the app saves (a damaged or hand-edited history), found here rather than when it is shown."""
        session = ChatSession.from_dict(self.engine, stored.session)  # checks the session's own parts
        for turn in session.turn_stats:  # each reply's footer, as the conversation will show it
            if type(turn["message_index"]) is not int:
                raise ValueError("reply figures of no message")
            stats_text.reply_footer(Stats.from_dict(turn), None)
        marks = _drafted_marks(stored.extras.get("drafted") or {})
        if not isinstance(stored.extras.get("pending_prompt") or "", str):
            raise ValueError("a prompt left unanswered that is not text")
        return session, marks, ChatSettings.from_dict(stored.settings, session.system_prompt or "", self.settings)

    def rename(self, chat_id: int, title: str) -> None:
        self.store.rename_chat(chat_id, title)

    def export(self, chat_id: int, path: Path, mark_drafts: bool) -> Path:
        """Write a saved chat as a new Markdown file; ExportError (an EdgespecError) if it cannot."""
        try:
            text = chat_markdown(self.store.load_chat(chat_id), mark_drafts)
        except _DAMAGE as error:  # messages without text, marks that are not ranges: a damaged history
            raise self._damaged(chat_id, error) from None
        return write_new_file(path, text)

    def _damaged(self, chat_id: int, error: Exception) -> HistoryError:
        return HistoryError(f"chat {chat_id} in {self.store.path} is damaged ({error}); delete it from the "
                            "history list")

    def delete(self, chat_id: int) -> None:
        self.store.delete_chat(chat_id)
        if chat_id == self.chat_id:
            self.chat_id = None


def _drafted_marks(stored: dict) -> dict[str, list]:
    """A saved chat's draft marks (reply content key -> [start, end] character ranges); ValueError if damaged."""
    marks = {}
    for key, ranges in dict(stored).items():
        if not isinstance(ranges, list) or not all(isinstance(r, list) and len(r) == 2
                                                   and all(type(i) is int for i in r) for r in ranges):
            raise ValueError("draft marks that are not character ranges")
        marks[str(key)] = ranges
    return marks


def _reply_labels(stored) -> dict[str, str]:
    """A saved chat's reply labels, those that are text: a label is only a title (chats saved before labels were
    kept have none, and their replies show as "reply"); its control characters drawn as symbols, as a hand-edited
    history's text is anybody's."""
    if not isinstance(stored, dict):
        return {}
    return {key: visible_controls(label) for key, label in stored.items() if isinstance(label, str)}
