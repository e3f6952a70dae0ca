"""OpenAI's Predicted Outputs: the `prediction` field of a request, read as untrusted text.

A client sends the text it expects the answer to mostly repeat (the file being edited), as
{"type": "content", "content": "..."} or with content as a list of text parts.  edgespec looks it
up like the context for n-gram drafts (ngram_pool.TokenIndex) and verifies every token it
drafts from it, so a wrong prediction costs speed, never correctness.  The usage it reports is OpenAI's:
how many of the prediction's tokens appeared in the completion, and how many did not (prediction_usage).
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

# A prediction longer than any context is no use; refuse one that would only cost memory to index.
MAX_PREDICTION_CHARS = 1_000_000


def prediction_text(value: object) -> str:
    """The predicted text of a `prediction` field ("" for null); ValueError names what is wrong and the fix."""
    if value is None:
        return ""
    if not isinstance(value, dict) or value.get("type") != "content" or "content" not in value:
        raise ValueError('prediction must be {"type": "content", "content": "..."}')
    unknown = sorted(set(value) - {"type", "content"})
    if unknown:
        # a client's key is quoted back in part: enough to find it, never a body's worth
        raise ValueError(f"prediction.{unknown[0][:40]} is not supported; send only type and content")
    content = value["content"]
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise ValueError('prediction.content as a list must hold text parts: {"type": "text", "text": "..."}')
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ValueError("prediction.content must be a string or a list of text parts")
    return checked_prediction_length(content, "prediction.content")


def checked_prediction_length(text: str, name: str) -> str:
    """text, a prediction's, unless it is longer than MAX_PREDICTION_CHARS: ValueError, before seconds of
    tokenizing it."""
    if len(text) > MAX_PREDICTION_CHARS:
        raise ValueError(f"{name} has {len(text):,} characters; at most {MAX_PREDICTION_CHARS:,} are accepted")
    return text


# A prediction token appeared in the completion when it lies in a run of this many tokens that the completion
# also has: long enough that unrelated texts share few, short enough that the tokens beside an edit still count.
MATCH_TOKENS = 4


def prediction_usage(prediction: Sequence[int], completion: Sequence[int]) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens as OpenAI reports them: those that appeared in the completion and
    those that did not.  Each of the completion's runs of MATCH_TOKENS matches one run of the prediction, so a
    block the prediction repeats counts once for each time the completion has it; linear in both lengths."""
    n = min(MATCH_TOKENS, len(prediction), len(completion))
    if n == 0:
        return 0, len(prediction)
    unmatched = Counter(tuple(completion[i:i + n]) for i in range(len(completion) - n + 1))
    appeared = bytearray(len(prediction))
    for i in range(len(prediction) - n + 1):
        run = tuple(prediction[i:i + n])
        if unmatched[run] > 0:
            unmatched[run] -= 1
            appeared[i:i + n] = b"\x01" * n
    accepted = sum(appeared)
    return accepted, len(prediction) - accepted
