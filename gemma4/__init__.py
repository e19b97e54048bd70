"""gemma4-jax: a pure-JAX port of Google's Gemma 4 (and Gemma 3) text decoder with a serving engine."""

__version__ = "0.1.0"
