"""OpenAI's Predicted Outputs: the `prediction` field of a request, read as untrusted text.

A client sends the text it expects the answer to mostly repeat (the file being edited), as
{"type": "content", "content": "..."} or with content as a list of text parts.  edgespec looks it
up like the context for n-gram drafts (ngram_pool.TokenIndex) and verifies every token it
drafts from it, so a wrong prediction costs speed, never correctness.
"""

from __future__ import annotations

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
        raise ValueError(f"prediction.{unknown[0]} is not supported; send only type and content")
    content = value["content"]
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise ValueError('prediction.content as a list must hold text parts: {"type": "text", "text": "..."}')
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ValueError("prediction.content must be a string or a list of text parts")
    if len(content) > MAX_PREDICTION_CHARS:
        raise ValueError(f"prediction.content has {len(content):,} characters; at most {MAX_PREDICTION_CHARS:,} are accepted")
    return content
