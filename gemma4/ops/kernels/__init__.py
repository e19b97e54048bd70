"""Hand-written kernels: the native int8 CPU kernel (cpu_int8) and the fused int4 Pallas kernel
(int4_matmul). Each is used only where `gemma4.plan.hardware.policy` allows it."""
