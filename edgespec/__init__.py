"""edgespec: exact speculative decoding for local GGUF models."""

__version__ = "0.1.0"

from .engine import Done, Engine, GenerationResult, Step, Token
from .errors import EdgespecError
from .sampling import SamplingParams
from .session import ChatSession, Notice

__all__ = ["ChatSession", "Done", "Notice", "EdgespecError", "Engine", "GenerationResult", "SamplingParams", "Step", "Token"]
