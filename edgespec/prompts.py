"""Prompts as a model reads them: a conversation through its chat template, a raw prompt, a predicted output.

The engine builds every generation's prompt here, and `edgespec heads train`
its teacher texts, so heads learn from exactly the tokens the engine feeds
the target.  Untrusted text stays data: message contents and a prediction
are tokenized as plain text, and only the template's own markers (or a raw
prompt, written so on purpose) become control tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .chat_template import ChatTemplate
from .errors import BadValueError, ContextOverflowError, Setting
from .prediction import checked_prediction_length, prediction_text
from .text import check_text


# A token is a few bytes of text: about 4 in English, and at most the longest vocabulary entry, a run
# of spaces or of one symbol (81 bytes in SmolLM2's vocabulary, 128 in Qwen2.5's). A prompt of more
# than this many bytes per token of the context cannot fit in it whatever it says.
MAX_PROMPT_BYTES_PER_TOKEN = 256
# Of a predicted output, no more than a context's worth of tokens can ever be copied into a reply, so no more is
# tokenized (at this many characters a token, more than text and code take) or indexed: a 650,000-character
# prediction that a client may send held a server's engine for 40 s and took 5.7 GB to index whole.
PREDICTION_CHARS_PER_TOKEN = 16


class PromptBuilder:
    """Tokens for a model (a LlamaModel or a HiddenStateModel): its template, its tokenizer, its BOS rule."""

    def __init__(self, model):
        self.model = model
        # their text, so that a template's turn ends ({{ eos_token }}) are the model's end token, not nothing
        bos, eos = (model.token_spelling(token) if token >= 0 else "" for token in (model.bos_id, model.eos_id))
        self.chat_template = ChatTemplate(model.metadata("tokenizer.chat_template"), bos_token=bos, eos_token=eos)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the template writes it, as text."""
        return self.chat_template.render(messages, add_generation_prompt).text

    def chat_tokens(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The conversation as the template writes it; message contents never become control tokens."""
        rendered = self.chat_template.render(messages, add_generation_prompt)
        bos, spans = self.chat_template.bos_token, rendered.content_spans
        # a template that writes the BOS token itself must not get a second one; a message that does, must
        template_wrote_bos = bool(bos) and rendered.text.startswith(bos) and all(a >= len(bos) or a == b for a, b in spans)
        return self.model.tokenize(rendered.text, add_special=not template_wrote_bos, parse_special=True,
                                   plain_spans=spans)

    def user_prompt_tokens(self, prompt: str, raw: bool = False) -> list[int]:
        """prompt as one user message (raw: as written, its control-token spellings parsed on purpose)."""
        check_text(prompt, "the prompt")
        n_ctx = self.model.n_ctx
        if len(prompt) > n_ctx * MAX_PROMPT_BYTES_PER_TOKEN:  # a character is a byte at least
            # refused before the tokenizer spends seconds and gigabytes on it (a 30 MB batch prompt did)
            raise ContextOverflowError(
                f"the prompt is too long: its {len(prompt):,} characters are more tokens than fit, and this model's "
                f"maximum context length is {n_ctx} tokens (raise ", Setting("n_ctx"), " or shorten the prompt)")
        if raw:
            return self.model.tokenize(prompt, add_special=True, parse_special=True)
        return self.chat_tokens([{"role": "user", "content": prompt}])

    def prediction_tokens(self, prediction: str | dict | None) -> list[int] | None:
        """A predicted output as tokens, its text never read as control tokens; None for none.  prediction: the
        text, or the request field as OpenAI writes it, {"type": "content", "content": ...} (prediction.py)."""
        if prediction is not None and not isinstance(prediction, (str, dict)):
            raise ValueError('prediction must be the expected text, or {"type": "content", "content": "..."}, '
                             f"not {type(prediction).__name__}")
        if isinstance(prediction, str):
            text = checked_prediction_length(prediction, "the prediction")
        else:
            text = prediction_text(prediction)
        check_text(text, "the prediction")
        n_ctx = self.model.n_ctx
        text = text[: n_ctx * PREDICTION_CHARS_PER_TOKEN]
        return self.model.tokenize(text, add_special=False)[:n_ctx] if text else None


def check_chat_fits(messages: Sequence[dict], n_ctx: int) -> None:
    """ContextOverflowError for a conversation no context of n_ctx tokens could hold, found before the template
    renders it and the tokenizer reads it (seconds, for 70,000 messages): more text than MAX_PROMPT_BYTES_PER_TOKEN
    a token, or more messages than tokens.  For a request's conversation, not a chat that drops its oldest turns
    to fit."""
    chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    if len(messages) > n_ctx or chars > n_ctx * MAX_PROMPT_BYTES_PER_TOKEN:
        raise ContextOverflowError(
            f"the conversation is too long: its {len(messages):,} messages and {chars:,} characters are more tokens "
            f"than fit, and this model's maximum context length is {n_ctx} tokens (raise ", Setting("n_ctx"),
            " or shorten the messages)")


def check_prompt_ids(prompt_ids: Sequence[int], n_vocab: int, n_ctx: int) -> None:
    """Refuse a prompt of token ids that cannot run: an empty one, one with ids outside the vocabulary, or one that
    leaves no room in a context of n_ctx tokens."""
    if not prompt_ids:
        raise BadValueError("the prompt is empty (give some text to continue)")
    # llama.cpp fails an id outside the vocabulary with a bare status, or reads past its tables
    ids = np.asarray(prompt_ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= n_vocab:
        raise BadValueError(f"the prompt must be token ids from 0 to {n_vocab - 1} (the model's "
                            "vocabulary), as engine.tokenize gives them")
    if len(prompt_ids) >= n_ctx:
        # Worded as OpenAI words it ("This model's maximum context length is ..."): litellm, aider and
        # LangChain tell a context overflow from other refusals by the message alone.
        no_room = ", which leaves no room for a reply" if len(prompt_ids) == n_ctx else ""
        raise ContextOverflowError(
            f"the prompt is too long: it has {len(prompt_ids)} tokens{no_room}, and this model's maximum "
            f"context length is {n_ctx} tokens (raise ", Setting("n_ctx"), " or shorten the prompt)")
