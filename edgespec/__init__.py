"""edgespec: exact speculative decoding for local GGUF models."""

__version__ = "0.1.0"

from .engine import Done, Engine, GenerationResult, Step, Token
from .errors import EdgespecError
from .sampling import SamplingParams

__all__ = ["Done", "EdgespecError", "Engine", "GenerationResult", "SamplingParams", "Step", "Token"]
