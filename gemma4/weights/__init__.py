"""Where weights and tokenizers come from: sources, safetensors, GGUF, host-side quantization."""
