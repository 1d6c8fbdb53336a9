"""Fact encoders outside the JAX reference: `torch_encoder.TorchFactEncoder` (transformers on
torch), used by the memory service's CLI and by vLLM serving, writing the common store format.
Kept apart from `inferscale.common`, which imports no engine (torch, jax, vllm)."""
