"""Errors that reach a user.

Every class here carries a one-line message that names the problem and the
fix; the CLI (edgespec.commands.main), the chat app and the server show it
and never a traceback.

A fix that changes a setting names it as a Setting, so that each audience
reads it in its own words: str(error) names the Python parameter, as library
users pass it (``raise n_ctx``, ``draft='ngram'``); the CLI and the chat app
word it as a flag (``--n-ctx``, ``--draft ngram``: ``error.worded(as_flag)``);
the server as what a request or its operator can change.  Notices that name a
setting (edgespec.notices) are a Wording too, worded the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Setting:
    """A setting an error's fix names: a keyword of edgespec.load or Engine.generate, and the value to
    give it, if the fix says one."""

    name: str
    value: object = None

    def __str__(self) -> str:
        return self.name if self.value is None else f"{self.name}={self.value!r}"


# The command line's flag for a setting whose flag is not its name with dashes (n_ctx -> --n-ctx).
_FLAGS = {"n_threads": "--threads", "n_gpu_layers": "--gpu-layers", "draft_gpu_layers": "--draft-gpu-layers"}


def as_flag(setting: Setting) -> str:
    """The setting as the command line spells it: --n-ctx, --draft ngram, --flash-attn (for True)."""
    flag = _FLAGS.get(setting.name, "--" + setting.name.replace("_", "-"))
    return flag if setting.value is None or setting.value is True else f"{flag} {setting.value}"


class Wording(str):
    """Text that names Settings.  As a str it names them as Python parameters, for library users;
    worded(word) as another reader spells them (as_flag for the command line).

    Wording("drafting with n-grams; ", Setting("draft", "ngram"), " may be faster")
    """

    parts: tuple[str | Setting, ...]

    def __new__(cls, *parts: str | Setting) -> Wording:
        # a Wording among the parts lends its own parts, so a message built around another keeps its Settings
        flat = tuple(piece for part in parts for piece in (part.parts if isinstance(part, Wording) else (part,)))
        text = super().__new__(cls, "".join(map(str, flat)))
        text.parts = flat
        return text

    def worded(self, word: Callable[[Setting], str]) -> str:
        """The text with each Setting worded by word."""
        return "".join(part if isinstance(part, str) else word(part) for part in self.parts)


def flag_worded(text: str) -> str:
    """The text as the command line (and the chat app, and a server's operator) reads it: a Wording's
    settings as flags; any other text as it is."""
    return text.worded(as_flag) if isinstance(text, Wording) else text


class EdgespecError(Exception):
    """Base class for errors meant for the user.

    The message comes in parts, text and the Settings its fix names:
    EdgespecError("the prompt is too long (raise ", Setting("n_ctx"), " or shorten it)").
    """

    exit_code = 1  # what `edgespec` exits with when this error ends a command

    def __init__(self, *message: str | Setting):
        self.wording = Wording(*message)
        super().__init__(str(self.wording))
        self.message = self.wording.parts

    def worded(self, word: Callable[[Setting], str]) -> str:
        """The message with each Setting worded by word (str(error) words them as Python parameters)."""
        return self.wording.worded(word)


class BadValueError(EdgespecError, ValueError):
    """A value given to edgespec that it cannot take (a setting out of range, an empty prompt): an EdgespecError,
    which the commands word as theirs, and a ValueError, as a library caller catches a bad value."""


class UsageError(EdgespecError):
    """A command's flags or arguments are wrong, alone or together: the command exits 2, as for the
    usage errors argparse finds itself."""

    exit_code = 2


class ModelFileError(EdgespecError):
    """A GGUF file is missing, unreadable, truncated or not GGUF at all."""


class CorruptModelError(ModelFileError):
    """A model computed NaN or infinite logits: its weights are garbage."""


class ChatTemplateError(EdgespecError):
    """The model's chat template failed to compile or render, or ran past its bounds."""


class ModelLoadError(EdgespecError):
    """llama.cpp refused to load a model or to create its context."""


class VocabMismatchError(EdgespecError):
    """The draft model's vocabulary is not the target's."""


class ContextOverflowError(EdgespecError):
    """The prompt (or the conversation) does not fit in the context window."""


class DecodeError(EdgespecError):
    """llama.cpp failed a forward pass over a loaded model (llama_decode returned an error)."""
