"""Multi-turn chat over one engine, reusing the KV caches between turns.

Each turn renders the whole conversation with the model's chat template and
tokenizes it afresh, so the prompt is a function of the messages alone: a
resumed, edited or reloaded conversation gives exactly the tokens a fresh
session would.  The engine keeps what its caches share with that prompt (the
longest common token prefix, target and draft alike) and decodes only the
rest; an edit anywhere rolls the caches back to the first changed token.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import asdict, dataclass, replace
from typing import Iterator

from .engine import Done, Engine, GenerationResult, Step, result_of
from .errors import ContextOverflowError, EdgespecError, Setting, Wording
from .prompts import check_chat_fits
from .sampling import SamplingParams, sampling_params
from .text import check_text

CONTEXT_POLICIES = ("drop-oldest", "error")
SESSION_FORMAT = 1


@dataclass(frozen=True)
class Notice:
    """Something the user should know about this turn, e.g. turns dropped to fit the context.  The text
    names settings as Python parameters; an app words them as its own (errors.Wording)."""

    text: str


class ChatSession:
    """A conversation: messages in, streamed replies out.

    Context policy when the next turn would not fit in n_ctx:
    - "drop-oldest": leave the oldest user/assistant turns out of what the
      model sees (the system prompt always stays), and say so in a Notice.
      They stay in ``messages``; a message is never cut in the middle.
    - "error": raise ContextOverflowError and change nothing.
    Either way a turn needs room for its reply: the prompt must leave at least
    min(max_tokens, n_ctx // 4) tokens free.
    """

    def __init__(self, engine: Engine, system_prompt: str | None = None, context_policy: str = "drop-oldest"):
        if context_policy not in CONTEXT_POLICIES:
            raise ValueError(f"context_policy must be one of {CONTEXT_POLICIES}")
        if system_prompt is not None:  # else every turn would fail, naming it messages[0]
            check_text(system_prompt, "the system prompt")
        self.engine = engine
        self.system_prompt = system_prompt
        self.context_policy = context_policy
        self.messages: list[dict] = []
        self.turn_stats: list[dict] = []
        self.params: SamplingParams | None = None
        self.first_visible = 0  # messages before this index were dropped from the model's view
        # shift the dropped turns out of the engine's caches rather than compute the kept ones again
        # (the engine does not under bit_exact); False is the recomputing a benchmark compares with
        self.shift_dropped_turns = True
        self._cancel = threading.Event()
        self._replying = False  # a reply's stream is started and not yet ended or closed

    # -- turns ---------------------------------------------------------------

    # Sampling is params (a SamplingParams, None for the defaults), keyword arguments (temperature=0, ...), or
    # both, as Engine.generate takes it.

    def send(self, text: str, params: SamplingParams | None = None, **sampling) -> GenerationResult:
        return result_of(self.stream(text, params, **sampling))

    def stream(self, text: str, params: SamplingParams | None = None, **sampling) -> Iterator[Step | Done | Notice]:
        """The reply to text, step by step, recorded when it ends; leaving it early (a break, close()) is
        cancel(): the reply so far is recorded as cancelled.  One stopped before it wrote anything is not
        recorded: text stays the last message, unanswered, for stream_reply to answer."""
        check_text(text, "the message")
        params = sampling_params(params, sampling)  # a dict is refused here, not mid-turn
        self._check_no_reply_open()
        self.messages.append({"role": "user", "content": text})
        try:
            prompt_ids, notice = self._prompt_for_reply(params)
        except BaseException:  # whatever refused the turn, the conversation stays as it was
            self.messages.pop()
            raise
        return self._reply(prompt_ids, notice, params)

    def regenerate(self, params: SamplingParams | None = None, **sampling) -> GenerationResult:
        return result_of(self.stream_regenerate(params, **sampling))

    def stream_regenerate(self, params: SamplingParams | None = None, **sampling) -> Iterator[Step | Done | Notice]:
        """Replace the last reply with a new one sampled with a new seed.  A new reply that is stopped (cancel(),
        or leaving its stream) or fails keeps the one it was to replace: a stray regenerate, then Esc, lost a
        whole answer for a few words of another."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise EdgespecError("there is no reply to regenerate (send a message first)")
        params = sampling_params(params, sampling)
        self._check_no_reply_open()
        # the reply with its figures, where it has them (a chat edited by hand may have none)
        replaced = (self.messages.pop(), [s for s in self.turn_stats if s["message_index"] == len(self.messages)])
        self.turn_stats = [s for s in self.turn_stats if s["message_index"] < len(self.messages)]
        try:
            prompt_ids, notice = self._prompt_for_reply(params)
        except BaseException:
            self._put_back(replaced)
            raise
        return self._reply(prompt_ids, notice, replace(params, seed=secrets.randbits(32)), replaced)

    def stream_reply(self, params: SamplingParams | None = None, **sampling) -> Iterator[Step | Done | Notice]:
        """Reply to the conversation as it stands (after an edit, say)."""
        if not self.messages or self.messages[-1]["role"] != "user":
            raise EdgespecError("the conversation does not end with a user message")
        params = sampling_params(params, sampling)
        self._check_no_reply_open()
        prompt_ids, notice = self._prompt_for_reply(params)
        return self._reply(prompt_ids, notice, params)

    def _check_no_reply_open(self) -> None:
        # the engine would refuse the second generation only once the new turn's message was in, and the open
        # reply, when finished, would be recorded after it: as the answer to a message it never saw
        if self._replying:
            raise EdgespecError("a reply of this chat is still streaming: run its stream to the end or close() it "
                                "(cancel() stops it after the current step) before the next turn")

    def cancel(self) -> None:
        """Stop the reply being generated (from any thread) after the current step."""
        self._cancel.set()

    # -- edits ---------------------------------------------------------------

    def set_system_prompt(self, text: str | None) -> None:
        if text is not None:
            check_text(text, "the system prompt")
        self.system_prompt = text or None

    def edit_user_message(self, index: int, text: str) -> None:
        """Replace message `index` (a user message) and forget everything after it."""
        if not 0 <= index < len(self.messages) or self.messages[index]["role"] != "user":
            raise EdgespecError(f"message {index} is not a user message")
        check_text(text, "the message")
        self.messages[index] = {"role": "user", "content": text}
        del self.messages[index + 1 :]
        self.turn_stats = [s for s in self.turn_stats if s["message_index"] < index]
        self.first_visible = min(self.first_visible, index)

    # -- rendering and the context window ---------------------------------------

    def visible_messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        turns = [{"role": m["role"], "content": m["content"]} for m in self.messages[self.first_visible :]]
        return system + turns

    def reply_prompt(self, params: SamplingParams) -> list[int]:
        """The tokens the next reply would be generated after, as stream_reply would send them to the engine
        (raises ContextOverflowError as it would); for a caller that schedules the generation itself."""
        return self._prompt_for_reply(sampling_params(params, {}))[0]

    def _prompt_for_reply(self, params: SamplingParams) -> tuple[list[int], Notice | None]:
        reserve = min(params.max_tokens, self.engine.n_ctx // 4)
        if self.context_policy == "error":  # a request's conversation (batch): refused before it is rendered
            check_chat_fits(self.visible_messages(), self.engine.n_ctx)
        dropped = 0
        while True:
            prompt_ids = self.engine.chat_tokens(self.visible_messages())
            if len(prompt_ids) + reserve <= self.engine.n_ctx:
                break
            next_turn = self._next_turn_start()
            if self.context_policy == "error" or next_turn is None:
                self.first_visible -= dropped
                raise ContextOverflowError(
                    # Not "start a new chat": a shifting chat gets here with its last message alone in view, and
                    # a batch has no chat. OpenAI's words for the limit are how litellm and LangChain tell it.
                    f"the conversation needs {len(prompt_ids)} tokens plus {reserve} for the reply, and this "
                    f"model's maximum context length is {self.engine.n_ctx} tokens (shorten the messages, or raise ",
                    Setting("n_ctx"), ")")
            dropped += next_turn - self.first_visible
            self.first_visible = next_turn
        notice = None
        if dropped:
            notice = Notice(Wording(f"left the oldest {dropped} message(s) out of the model's view to fit the "
                                    f"{self.engine.n_ctx}-token context", self._shift_note()))
        return prompt_ids, notice

    def _shift_note(self) -> str:
        """How the engine makes room: by shifting the kept turns in its cache, or by computing them again."""
        if self.shift_dropped_turns and self.engine.shifts_context:
            return Wording("; the kept turns are shifted in the cache, not recomputed, so they still carry traces "
                           "of the dropped ones (", Setting("bit_exact", True), " recomputes)")
        return ""

    def _next_turn_start(self) -> int | None:
        """Index of the second visible user message: dropping up to it drops one whole turn."""
        users = [i for i in range(self.first_visible, len(self.messages)) if self.messages[i]["role"] == "user"]
        return users[1] if len(users) > 1 else None

    def _reply(self, prompt_ids, notice, params, replaced: tuple | None = None) -> Iterator[Step | Done | Notice]:
        # Cleared as the stream is made, not at its first step: a cancel() in between (an Esc right after
        # Enter) stops the reply as one after any step does.
        self._cancel.clear()
        return self._reply_events(prompt_ids, notice, params, replaced)

    def _reply_events(self, prompt_ids, notice, params, replaced) -> Iterator[Step | Done | Notice]:
        """The reply's events, recorded when it ends; replaced: the reply a regeneration replaces, with its
        figures, put back if the new one is stopped or fails."""
        self.params = params
        self._replying = True
        shift = notice is not None and self.shift_dropped_turns
        events = self.engine.stream_tokens(prompt_ids, params, cancel=self._cancel, shift_dropped_span=shift)
        recorded = False
        try:
            if notice is not None:
                yield notice
            for event in events:
                if isinstance(event, Done):
                    self._record(event.result, replaced)
                    recorded = True
                yield event
        except GeneratorExit:
            # The caller left the loop (a `break`) or closed the stream: that is cancel(), and the reply so far
            # is recorded as cancelled, as a cancelled one is; left unanswered, the message would stand beside
            # the next turn's, two user messages in a row.
            if not recorded:
                self._cancel.set()
                self._record(result_of(events), replaced)
            raise
        except BaseException:  # the reply failed: a regeneration keeps the reply it was to replace
            if not recorded and replaced is not None:
                self._put_back(replaced)
            raise
        finally:
            self._replying = False

    def _record(self, result: GenerationResult, replaced: tuple | None = None) -> None:
        if result.finish_reason == "cancelled" and replaced is not None:
            self._put_back(replaced)
            return
        if result.finish_reason == "cancelled" and not result.text:
            # Stopped before its first word (an Esc right after Enter): an empty reply is no answer, and the
            # message waits for stream_reply, as one whose stream never started does.
            return
        message = {"role": "assistant", "content": result.text}
        if result.finish_reason == "cancelled":
            message["cancelled"] = True
        self.messages.append(message)
        self.turn_stats.append({"message_index": len(self.messages) - 1, **result.stats.as_dict()})

    def _put_back(self, replaced: tuple) -> None:
        message, stats = replaced
        self.messages.append(message)
        self.turn_stats.extend(stats)

    # -- persistence ---------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": SESSION_FORMAT,
            "system_prompt": self.system_prompt,
            "context_policy": self.context_policy,
            "messages": [dict(m) for m in self.messages],
            "first_visible": self.first_visible,
            "turn_stats": [dict(s) for s in self.turn_stats],
            "params": asdict(self.params) if self.params else None,
            "mode": self.engine.mode,
        }

    @classmethod
    def from_dict(cls, engine: Engine, data: dict) -> "ChatSession":
        """The session to_dict saved (one saved before formats were numbered reads as format 1); EdgespecError
        for one written in a format this edgespec does not know, ValueError naming the part for one that is
        not what to_dict writes (a damaged or hand-edited file)."""
        if not isinstance(data, dict):
            raise ValueError(f"a saved chat is a JSON object, not {type(data).__name__}")
        saved_format = data.get("format", SESSION_FORMAT)
        if saved_format != SESSION_FORMAT:
            raise EdgespecError(f"this chat was saved in format {saved_format!r}, and this edgespec reads format "
                                f"{SESSION_FORMAT} only (update edgespec to open it)")
        _check_saved(data)
        session = cls(engine, data.get("system_prompt"), data.get("context_policy", "drop-oldest"))
        session.messages = [dict(m) for m in data.get("messages", [])]
        session.first_visible = data.get("first_visible", 0)
        session.turn_stats = [dict(s) for s in data.get("turn_stats", [])]
        if params := data.get("params"):
            try:
                session.params = SamplingParams(**{**params, "stop": tuple(params.get("stop", ()))})
            except TypeError as error:  # a field SamplingParams does not have
                raise ValueError(f"the saved chat's sampling settings are not edgespec's ({error})") from None
        return session


def _check_saved(data: dict) -> None:
    """ValueError naming the first part of a saved session that to_dict does not write so: the library reads
    these files back, and a Python error from deep inside would name nothing a user could fix."""
    messages = data.get("messages", [])
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError("the saved chat's messages are not a list of messages, each with a role and a text")
    if not isinstance(data.get("system_prompt"), (str, type(None))):
        raise ValueError("the saved chat's system prompt is not text")
    first_visible = data.get("first_visible", 0)
    if type(first_visible) is not int or not 0 <= first_visible <= len(messages):
        raise ValueError("the saved chat's first shown message is outside the chat")
    turn_stats = data.get("turn_stats", [])
    if not isinstance(turn_stats, list) or not all(isinstance(turn, dict) for turn in turn_stats):
        raise ValueError("the saved chat's reply figures are not a list of records")
    params = data.get("params")
    if params and not (isinstance(params, dict) and isinstance(params.get("stop", ()), (list, tuple))
                       and all(isinstance(stop, str) for stop in params.get("stop", ()))):
        raise ValueError("the saved chat's sampling settings are not a record with a list of stop texts")
