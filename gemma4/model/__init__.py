"""The model: config, parameter specs, the forward pass, KV cache, sampling. Pure JAX; imports only ops/."""
