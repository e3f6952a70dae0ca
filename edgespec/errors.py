"""Errors that reach a user.

Every class here carries a one-line message that names the problem and the
fix; the CLI (edgespec.commands.main) and the chat app print ``str(error)``
and never a traceback.
"""


class EdgespecError(Exception):
    """Base class for errors meant for the user."""

    exit_code = 1  # what `edgespec` exits with when this error ends a command


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
