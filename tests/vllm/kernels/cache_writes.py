"""Cache writes the paged-write tests learn layouts from: vLLM's CPU backend's own, and a layout of
short rows. A cache is [num_blocks, heads, block_size, 2 * head_dim], as vLLM's CPU backend keeps it."""

import torch


def isa_of(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The ISA vLLM's CPU backend picks for caches of `dtype` ("vec", "amx", ...)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim)


def backend(isa: str):
    """vLLM's CPU backend cache write for `isa` (what `do_kv_cache_update` calls)."""
    import vllm._custom_ops as ops

    def write(k, v, cache, slots):
        nb, heads, bs, _ = cache.shape
        key_cache, value_cache = cache.view(nb, heads, 2 * bs, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
    return write


def paired(k, v, cache, slots):
    """A layout of short rows, as "amx": per head [K/V][channel pair][slot][2] (the kernel scatters it)."""
    nb, heads, bs, two_d = cache.shape
    d = two_d // 2
    view = cache.view(nb, heads, 2, d // 2, bs, 2)
    blk, s = slots // bs, slots % bs
    view[blk, :, 0, :, s] = k.view(-1, heads, d // 2, 2)
    view[blk, :, 1, :, s] = v.view(-1, heads, d // 2, 2)
