"""edgespec: exact speculative decoding for local GGUF models."""

import importlib

__version__ = "0.1.0"

# The public names, imported on first use: `import edgespec.planner` (GGUF
# arithmetic) must not load the engine, whose backend starts llama.cpp.
_HOMES = {
    "ChatSession": "session", "Notice": "session",
    "Done": "engine", "Engine": "engine", "GenerationResult": "engine", "Step": "engine", "Token": "engine",
    "EdgespecError": "errors",
    "SamplingParams": "sampling",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{home}", __name__), name)
