"""edgespec: exact speculative decoding for local GGUF models.

    import edgespec

    with edgespec.load("qwen2.5-coder-1.5b-instruct", draft="auto") as engine:
        print(engine.generate("Write a haiku about caches.", max_tokens=60, temperature=0).text)
"""

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

__all__ = sorted([*_HOMES, "load"])


def load(model, draft="auto", **options):
    """Load a model (a catalog name or a GGUF path) and its drafter: an Engine, to close (or use in `with`).

    draft: "auto" (the catalog's draft model when it is present and pays
    here, else n-grams), a model, "ngram" or "none".  options are
    edgespec.loading.load_engine's: n_ctx, draft_tokens, bit_exact, kv_type,
    pull (download what is missing; default True), cost_curve, notice, ...
    What loading decides or measures goes to notice(text), by default to the
    "edgespec" logger at INFO level, naming settings as these parameters
    (draft='ngram'): nothing is printed.
    """
    from .loading import load_engine

    return load_engine(model, draft, **options)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{home}", __name__), name)
