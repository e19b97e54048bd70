"""The command line: `commands` parses it without JAX; `run` runs what needs JAX."""
