"""Serving: the engine and its scheduler, the request layer, chat format, tools, quality, multi-host."""
