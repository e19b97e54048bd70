"""HTTP: the FastAPI server, the OpenAI-compatible API, its schema and rate limits."""
