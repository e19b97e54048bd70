"""The Gradio chat's handlers and panels (plain data in, strings out)."""
