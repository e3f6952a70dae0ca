"""The OpenAI wire format: request bodies in, response bodies and stream chunks out.

Only what edgespec really does is accepted.  A parameter it cannot honour
(n > 1, logprobs, tools, penalties...) or does not know gets a 400 that names
it, never a silent default: a client relying on it must find out.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

from ..sampling import SamplingParams
from ..stats import Stats

CHAT_ROLES = {"system", "developer", "user", "assistant"}
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # the stop check holds back text that could start a stop string: keep that small

# Fields edgespec cannot honour, with the one value that means "not used".
_INERT_VALUES = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "parallel_tool_calls": (False,),
}
_SAMPLING_FIELDS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop"}
_COMMON_FIELDS = {"model", "stream", "stream_options", "user"} | _SAMPLING_FIELDS | set(_INERT_VALUES)
CHAT_FIELDS = _COMMON_FIELDS | {"messages"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}


class ApiError(Exception):
    """A request that gets an OpenAI-style error body instead of a completion."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_param(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class CompletionRequest:
    chat: bool  # /v1/chat/completions rather than /v1/completions
    params: SamplingParams
    messages: tuple[dict, ...] = ()
    prompt: str = ""  # completions only
    stream: bool = False
    include_usage: bool = False


def parse_request(body: Any, chat: bool, defaults: SamplingParams) -> CompletionRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for field, value in body.items():
        if field not in allowed:
            raise bad_param(field, f"unrecognized request argument {field!r}: edgespec does not support it", "unsupported_parameter")
        if field in _INERT_VALUES and value is not None and value not in _INERT_VALUES[field]:
            raise bad_param(field, f"{field}={value!r} is not supported by edgespec; leave it out", "unsupported_parameter")
    stream = _boolean(body, "stream")
    include_usage = _stream_options(body, stream)
    params = _sampling(body, defaults)
    if chat:
        return CompletionRequest(True, params, messages=_messages(body), stream=stream, include_usage=include_usage)
    return CompletionRequest(False, params, prompt=_prompt(body), stream=stream, include_usage=include_usage)


def _boolean(body: dict, field: str) -> bool:
    value = body.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_param(field, f"{field} must be true or false")
    return value


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_param("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict):
        raise bad_param("stream_options", "stream_options must be an object")
    for key in options:
        if key != "include_usage":
            raise bad_param(f"stream_options.{key}", f"stream_options.{key} is not supported by edgespec", "unsupported_parameter")
    return _boolean(options, "include_usage")


def _sampling(body: dict, defaults: SamplingParams) -> SamplingParams:
    fields: dict[str, Any] = {}
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name, last, wins when both are given
        if body.get(name) is not None:
            fields["max_tokens"] = _number(body, name, integer=True, low=1)
    for name, low, high in (("temperature", 0, None), ("top_p", 0, 1), ("top_k", 0, None), ("min_p", 0, 1)):
        if body.get(name) is not None:
            fields[name] = _number(body, name, integer=name == "top_k", low=low, high=high)
    if body.get("seed") is not None:
        fields["seed"] = _number(body, "seed", integer=True)
    if body.get("stop") is not None:
        fields["stop"] = _stop(body["stop"])
    try:
        return replace(defaults, **fields)
    except ValueError as error:  # the limits SamplingParams checks beyond the ranges above
        raise ApiError(400, f"bad sampling setting: {error}") from None


def _number(body: dict, field: str, integer: bool = False, low=None, high=None):
    value = body[field]
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise bad_param(field, f"{field} must be {'an integer' if integer else 'a number'}")
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"at least {low}" if high is None else f"between {low} and {high}"
        raise bad_param(field, f"{field} must be {span}, not {value}")
    return value


def _stop(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_param("stop", "stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_param("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_param("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters")
    return tuple(stops)


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "messages must be a non-empty list of {role, content} objects")
    return tuple(_message(m, i) for i, m in enumerate(messages))


def _message(message: Any, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_param(where, f"{where} must be an object with role and content")
    for key in message:
        if key not in ("role", "content"):
            raise bad_param(f"{where}.{key}", f"{where}.{key} is not supported by edgespec (only role and content)", "unsupported_parameter")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_param(f"{where}.role", f"{where}.role must be one of {sorted(CHAT_ROLES)}, not {role!r}")
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_param(f"{where}.content", f"{where}.content must be a string or a list of text parts")
    return {"role": "system" if role == "developer" else role, "content": content}


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # a batch of one prompt
    if not isinstance(prompt, str) or not prompt:
        # token-id prompts are left out on purpose: ids could smuggle in control tokens
        raise bad_param("prompt", "prompt must be one non-empty string (one prompt per request, no token ids)")
    return prompt


# -- responses -------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def finish_reason(engine_reason: str) -> str:
    return "length" if engine_reason in ("length", "context") else "stop"


def usage(stats: Stats) -> dict:
    """OpenAI's usage fields, plus what speculation did for this request."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.tokens_generated,
        "total_tokens": stats.prompt_tokens + stats.tokens_generated,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_tokens_reused},
        "speculative": {
            "mode": stats.mode,
            "draft_tokens": stats.draft_tokens_proposed,
            "draft_tokens_accepted": stats.draft_tokens_accepted,
            "acceptance_rate": stats.acceptance_rate,
            "target_forward_passes": stats.target_forward_passes,
            "target_passes_per_token": stats.target_passes_per_token,
            "decode_tokens_per_second": stats.decode_tokens_per_second,
            "prompt_tokens_reused": stats.prompt_tokens_reused,
            "prompt_tokens_evaluated": stats.prompt_tokens_evaluated,
            "accepted_by_drafter": stats.accepted_by_drafter,
            "acceptance_by_position": {name: stats.acceptance_by_position(name) for name in stats.drafted_by_position},
        },
    }


class ResponseWriter:
    """Builds the bodies of one request's response, whole or as stream chunks."""

    def __init__(self, request: CompletionRequest, model: str):
        self.request, self.model = request, model
        self.id = new_id(request.chat)
        self.created = int(time.time())

    def _envelope(self, choices: list, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.request.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, text: str, engine_reason: str, stats: Stats) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason(engine_reason)}
        choice.update({"message": {"role": "assistant", "content": text}} if self.request.chat else {"text": text})
        return {**self._envelope([choice], chunk=False), "usage": usage(stats)}

    def chunk(self, text: str | None = None, engine_reason: str | None = None, first: bool = False) -> dict:
        reason = finish_reason(engine_reason) if engine_reason else None
        if self.request.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        body = self._envelope([choice], chunk=True)
        if self.request.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, stats: Stats) -> dict:
        return {**self._envelope([], chunk=True), "usage": usage(stats)}
