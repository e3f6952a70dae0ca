"""The OpenAI wire format, requests: bodies in, checked (responses.py writes the answers).

Only what edgespec really does is accepted.  A parameter it cannot honour
(n > 1, logprobs, tools, penalties...) or does not know gets a 400 that names
it, never a silent default: a client relying on it must find out.  What
cannot change the output (model, user, metadata, store, service_tier, a
message's name) is accepted and left unused.  check_body is edgespec's one
check of a body: the server's, and a local `edgespec batch`'s.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from ..errors import EdgespecError, Setting, as_flag
from ..prediction import prediction_text
from ..sampling import MAX_STOPS, SamplingParams
from ..text import surrogate_problem, surrogates_escaped

CHAT_ROLES = {"system", "developer", "user", "assistant"}
MAX_STOP_CHARS = 512  # the stop check holds back text that could start a stop string: keep that small
# The stop check's cost per token grows with the characters of all the stop strings, on the decode loop every
# request shares: the 16 x 512 the server took before it took the library's 64 strings.
MAX_STOP_TOTAL_CHARS = 8192
MAX_QUOTED_CHARS = 80  # of a client's name or value an error quotes back: enough to know it, never a whole body

# Fields edgespec cannot honour, with the one value that means "not used", of the JSON type the field has.
_INERT_VALUES = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False,),  # a chat body's; a completions body's is a count (_COMPLETION_INERT_VALUES)
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
    "modalities": (["text"],),  # what a reply is made of: text is all there is
}
_COMPLETION_INERT_VALUES = {**_INERT_VALUES, "logprobs": (0,)}
# The JSON types of the inert values above, as a message names them.
_SCALAR_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number"}
_SAMPLING_FIELDS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop"}
# Fields that cannot change the output, with the JSON type each must have: accepted and left unused.
# (metadata and store are for OpenAI's dashboard, service_tier its pricing, user and safety_identifier its abuse
# checks, prompt_cache_key the routing to its cache; edgespec's prompt cache is keyed by the prompt itself.)
_UNUSED_FIELDS = {"model": str, "user": str, "safety_identifier": str, "prompt_cache_key": str, "metadata": dict,
                  "store": bool, "service_tier": str}
# include_obfuscation pads OpenAI's stream chunks (on by default there) against an eavesdropper who measures their
# sizes. edgespec pads none: either value is taken, as the field is OpenAI's, and left unused (README: Server).
_STREAM_OPTIONS = {"include_usage", "include_obfuscation"}
_COMMON_FIELDS = {"stream", "stream_options", "prediction"} | set(_UNUSED_FIELDS) | _SAMPLING_FIELDS | set(_INERT_VALUES)
CHAT_FIELDS = _COMMON_FIELDS | {"messages"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}
# The field that says a body was meant for the other endpoint, with the fix.
_OTHER_ENDPOINTS_FIELDS = {
    "prompt": "a prompt is for /v1/completions; /v1/chat/completions takes messages: [{role, content}, ...]",
    "messages": "messages are for /v1/chat/completions; /v1/completions takes a prompt string",
}
_JSON_TYPE_NAMES = {str: "a string", dict: "an object", bool: "true or false"}


class ApiError(Exception):
    """A request that gets an OpenAI-style error body instead of a completion."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        # A message or param may quote a client's key, which JSON's escapes can make a lone surrogate: no
        # UTF-8 answer could hold that, so it is quoted as its escape.
        message, param = (None if text is None else surrogates_escaped(text) for text in (self.message, self.param))
        return {"error": {"message": message, "type": self.type, "param": param, "code": self.code}}


def worded_for_requests(error: EdgespecError, operator: str = "the server's ") -> str:
    """An engine's error as the sender of a request reads it: a prompt sent as is is a /v1/completions
    request, and the other settings are the flags the server (operator: or a local batch) was started with."""

    def word(setting: Setting) -> str:
        return 'a "/v1/completions" request' if setting.name == "raw" else operator + as_flag(setting)

    return error.worded(word)


def bad_param(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class RequestBody:
    """A request body as checked: what edgespec serve runs, and a local `edgespec batch` too."""

    chat: bool  # a /v1/chat/completions body rather than a /v1/completions one
    sampling: tuple[tuple[str, Any], ...]  # the SamplingParams fields the body sets
    messages: tuple[dict, ...] = ()  # chat only: {role, content}, roles as the template knows them
    prompt: str = ""  # completions only
    stream: bool = False
    include_usage: bool = False
    prediction: str = ""  # OpenAI's Predicted Outputs: text the answer is expected to mostly repeat


@dataclass(frozen=True)
class CompletionRequest:
    chat: bool  # /v1/chat/completions rather than /v1/completions
    params: SamplingParams
    messages: tuple[dict, ...] = ()
    prompt: str = ""  # completions only
    stream: bool = False
    include_usage: bool = False
    prediction: str = ""  # the text the answer is expected to mostly repeat: a draft source, never trusted


def parse_request(body: Any, chat: bool, defaults: SamplingParams) -> CompletionRequest:
    """The request a body makes of the server, its sampling filled in from the server's defaults."""
    checked = check_body(body, chat)
    params = defaults
    for name, value in checked.sampling:  # the limits SamplingParams checks beyond the ranges checked here
        try:
            params = replace(params, **{name: value})
        except ValueError as error:  # one field at a time, so that the answer names it
            raise bad_param(name, f"bad sampling setting: {error}") from None
    return CompletionRequest(chat, params, checked.messages, checked.prompt, checked.stream, checked.include_usage,
                             checked.prediction)


def check_body(body: Any, chat: bool) -> RequestBody:
    """The body checked field by field; anything edgespec would not honour raises an ApiError naming it.

    The one body check of edgespec: the server's, and the local batch's (commands/batch/requests.py).
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    inert_values = _INERT_VALUES if chat else _COMPLETION_INERT_VALUES
    for field, value in body.items():
        if field not in allowed:
            if value is None:  # "not set", as OpenAI reads a null: clients that send every field unset send these
                continue
            if field in _OTHER_ENDPOINTS_FIELDS:  # a client posting to the wrong path: say which is right
                raise bad_param(field, _OTHER_ENDPOINTS_FIELDS[field], "unsupported_parameter")
            raise bad_param(_cut(field), f"unrecognized request argument {_cut(repr(field))}: edgespec does not support it",
                            "unsupported_parameter")
        if field in inert_values and value is not None:
            _check_inert(field, value, inert_values[field])
        kind = _UNUSED_FIELDS.get(field)
        if kind is not None and value is not None and not isinstance(value, kind):
            raise bad_param(field, f"{field} must be {_JSON_TYPE_NAMES[kind]}")
    stream = _boolean(body, "stream")
    include_usage = _stream_options(body, stream)
    sampling = tuple(_sampling(body).items())
    try:
        prediction = prediction_text(body.get("prediction"))
    except ValueError as error:
        raise bad_param("prediction", str(error)) from None
    prediction = _unicode(prediction, "prediction.content")  # it is tokenized like a message
    messages, prompt = (_messages(body), "") if chat else ((), _prompt(body))
    if surrogate_problem(json.dumps(body, ensure_ascii=False)):  # in what the checks above do not read (model,
        # user, metadata, a message's name): the README promises a 400 for a lone surrogate anywhere in a body
        raise ApiError(400, "the request body holds a lone UTF-16 surrogate, which is not text; send the "
                            "character whole or leave it out", code="invalid_value")
    return RequestBody(chat, sampling, messages=messages, prompt=prompt, stream=stream, include_usage=include_usage,
                       prediction=prediction)


def _check_inert(field: str, value: Any, inert_values: tuple) -> None:
    """Raises unless value is one of the field's inert values, as JSON has it.

    Python's == takes true for 1 and 0.0 for false, so a value is inert only with its inert value's type
    too: "n": true is no count, and "logprobs": 0.0 no answer to a yes-or-no question.
    """
    if any(type(value) is type(inert) and value == inert for inert in inert_values):
        return
    kinds = {type(inert) for inert in inert_values}
    if float in kinds:
        kinds.add(int)  # a float field takes an integer, as JSON has no separate kinds of number
    if kinds <= set(_SCALAR_KIND_NAMES) and type(value) not in kinds:
        wanted = _SCALAR_KIND_NAMES[float if float in kinds else kinds.pop()]
        raise bad_param(field, f"{field} must be {wanted}, not {_cut(json.dumps(value))}; leave it out "
                               f"(edgespec supports only {json.dumps(inert_values[0])})")
    raise bad_param(field, f"{field}={_cut(json.dumps(value))} is not supported by edgespec; leave it out", "unsupported_parameter")


def _boolean(body: dict, field: str, param: str | None = None) -> bool:
    value = body.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        param = param or field
        raise bad_param(param, f"{param} must be true or false")
    return value


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_param("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict):
        raise bad_param("stream_options", "stream_options must be an object")
    for key, value in options.items():
        if key not in _STREAM_OPTIONS and value is not None:  # null: "not set", as at the top level
            param = f"stream_options.{_cut(key)}"
            raise bad_param(param, f"{param} is not supported by edgespec", "unsupported_parameter")
    _boolean(options, "include_obfuscation", "stream_options.include_obfuscation")
    return _boolean(options, "include_usage", "stream_options.include_usage")


def _sampling(body: dict) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name, last, wins when both are given
        if body.get(name) is not None:
            fields["max_tokens"] = _number(body, name, integer=True, low=1)
    # min_p's bound above (1, which it may not reach) is SamplingParams' to state, in the words every front end uses
    for name, low, high in (("temperature", 0, None), ("top_p", 0, 1), ("top_k", 0, None), ("min_p", 0, None)):
        if body.get(name) is not None:
            fields[name] = _number(body, name, integer=name == "top_k", low=low, high=high)
    if body.get("seed") is not None:
        fields["seed"] = _number(body, "seed", integer=True)
    if body.get("stop") is not None:
        fields["stop"] = _stop(body["stop"])
    return fields


def _number(body: dict, field: str, integer: bool = False, low=None, high=None):
    value = body[field]
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise bad_param(field, f"{field} must be {'an integer' if integer else 'a number'}")
    if not integer:
        # JSON as Python reads it has NaN, Infinity, 1e999 and 400-digit integers: none of them is a setting
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if math.isnan(value):
            raise bad_param(field, f"{field} must be a number, not NaN")
        if math.isinf(value):  # Infinity, or a number such as 1e999 that a double cannot hold
            raise bad_param(field, f"{field} is too large: beyond ±1.8e308, the most a number here may be")
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"at least {low}" if high is None else f"between {low} and {high}"
        raise bad_param(field, f"{field} must be {span}, not {_cut(str(value))}")
    return value


def _stop(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_param("stop", "stop must be a string or a list of strings")
    if len(stops) > MAX_STOPS:  # the library's limit: one README line states it for both
        raise bad_param("stop", f"at most {MAX_STOPS} stop strings are allowed")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_param("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters")
    if sum(map(len, stops)) > MAX_STOP_TOTAL_CHARS:
        raise bad_param("stop", f"the stop strings may have at most {MAX_STOP_TOTAL_CHARS} characters in all; "
                                "send fewer or shorter ones")
    if "" in stops:  # the stop check (text.py) skips it: accepted, it would silently stop nothing
        raise bad_param("stop", "a stop string may not be empty (it would stop nothing); leave it out of stop")
    return tuple(_unicode(s, "stop") for s in stops)


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "messages must be a non-empty list of {role, content} objects")
    return tuple(_message(m, i) for i, m in enumerate(messages))


def _message(message: Any, index: int) -> dict:
    """The message as the chat template gets it: its role and its text, nothing else."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_param(where, f"{where} must be an object with role and content")
    # The role first: a tool's result (role "tool", with its tool_call_id) fails for the tool calling it needs
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:  # a list or an object cannot even be looked up
        why = " (tool results need tool calling, which edgespec does not support)" if role in ("tool", "function") else ""
        raise bad_param(f"{where}.role", f"{where}.role must be one of {json.dumps(sorted(CHAT_ROLES))}, "
                                         f"not {_cut(json.dumps(role))}{why}")
    for key, value in message.items():
        # null is "not set" here as at the top level: the openai client's message.model_dump() writes an
        # assistant message's refusal, tool_calls, audio... back as null, and other clients write every field
        if value is None:
            continue
        if key not in ("role", "content", "name"):
            param = f"{where}.{_cut(key)}"
            raise bad_param(param, f"{param} is not supported by edgespec (only role, content and name)",
                            "unsupported_parameter")
    # A participant's name (AutoGen and LangChain send one) is accepted and left out: the templates get a
    # message's role and content only (chat_template.py), so no text of it can reach the model.
    if message.get("name") is not None and not isinstance(message["name"], str):
        raise bad_param(f"{where}.name", f"{where}.name must be a string")
    content = message.get("content")
    if isinstance(content, list):
        content = _text_of_parts(content, f"{where}.content")
    if not isinstance(content, str):
        raise bad_param(f"{where}.content", f"{where}.content must be a string or a list of text parts")
    return {"role": "system" if role == "developer" else role, "content": _unicode(content, f"{where}.content")}


def _cut(text: str) -> str:
    """A client's name or value as an error quotes it: cut short, so that a huge one is not sent back whole."""
    return text if len(text) <= MAX_QUOTED_CHARS else text[:MAX_QUOTED_CHARS] + "..."


def _text_of_parts(parts: list, param: str) -> str:
    """A content list's text; a part that is not text (an image, audio) is named: the models read text only."""
    for index, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            where = f"{param}[{index}]"
            if not isinstance(part, dict):
                problem = f"{where} is {_cut(json.dumps(part))}, not a part object"
            elif part.get("type") == "text":
                problem = f'{where}, a text part, has no string "text"'
            else:
                problem = f"{where} is of type {_cut(json.dumps(part.get('type')))}: edgespec's models read text only"
            raise bad_param(param, problem + '; send a string, or parts {"type": "text", "text": "..."}')
    return "".join(part["text"] for part in parts)


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # a batch of one prompt
    if not isinstance(prompt, str) or not prompt:
        # token-id prompts are left out on purpose: ids could smuggle in control tokens
        raise bad_param("prompt", "prompt must be one non-empty string (one prompt per request, no token ids)")
    return _unicode(prompt, "prompt")


def _unicode(text: str, param: str) -> str:
    """text, if it is Unicode text: JSON's escapes can spell a lone surrogate ("\\ud800"), which no tokenizer takes."""
    problem = surrogate_problem(text)
    if problem:
        raise bad_param(param, f"{param} {problem}; send the character whole or leave it out")
    return text
