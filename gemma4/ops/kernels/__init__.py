"""Hand-written kernels (Pallas). Each is used only where `gemma4.plan.hardware.policy` allows it."""

from gemma4.ops.kernels.int4_matmul import int4_block_bytes, int4_matmul

__all__ = ["int4_block_bytes", "int4_matmul"]
