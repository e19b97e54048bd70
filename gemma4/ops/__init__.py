"""Array operations the model calls: quantized weight leaves, their matmul paths, native kernels."""
