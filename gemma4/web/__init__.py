"""HTTP: the server's start-up settings, the FastAPI server, the OpenAI-compatible API, its schema
and rate limits."""
