"""The OpenAI wire format, answers: response bodies and stream chunks, with OpenAI's usage fields and what
speculation did for the request."""

from __future__ import annotations

import secrets
import time

from ..stats import Stats
from .protocol import CompletionRequest


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
        "completion_tokens_details": {"accepted_prediction_tokens": stats.accepted_prediction_tokens,
                                      "rejected_prediction_tokens": stats.rejected_prediction_tokens},
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
