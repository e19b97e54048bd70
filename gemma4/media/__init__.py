"""Media inputs, before any model sees them: files and data URIs as `MediaItem`s, image decoding
and the exact preprocessing transformers' Gemma 4 processors do (resize, patches, positions),
video frame sampling, and the prompt layout of soft tokens. No jax here: numpy, Pillow, PyAV."""
