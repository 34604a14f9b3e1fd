"""serving — the inference engine (engine.py: a paged KV cache and continuous batching) and an OpenAI-compatible HTTP
server over it (server.py, run as `python tools.py serve`)."""
