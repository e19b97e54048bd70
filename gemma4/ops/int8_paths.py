"""The names of the int8 matmul formulations (`gemma4.ops.int8_matmul` runs them), in the order
they are measured and shown: native first, the likely winner. `native-panels` and `native-gemm`
are the two that run a weight stored as panels (`QuantArray.layout`); the others read rows. Without JAX, so the reports that
list the paths (`gemma4.plan.tuning_report`, the app's Hardware panel) load none."""

PATHS = ("native-panels", "native", "native-gemm", "native-gemm-i8", "xla-fused", "xla-chunked", "xla-dequant", "xla-i8x2", "xla-i8")
