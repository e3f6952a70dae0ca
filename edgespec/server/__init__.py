"""`edgespec serve`: an OpenAI-compatible HTTP server on one engine (see edgespec/serve.py)."""
