"""InferScale: a memory layer for LLM serving.

Facts are encoded once into pre-RoPE KV, stored in a shared format (`inferscale.common`), and
injected into a paged KV cache with Chunked RoPE, either by the JAX reference
(`inferscale.jax`) or by the vLLM connector (`inferscale.vllm`). Importing this package needs
only numpy; the engines are optional extras.
"""

__version__ = "0.1.0"
