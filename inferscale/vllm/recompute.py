"""Positions inside the memory computed by the engine's own model (`heads:N` through vLLM).

vLLM's connector API reports one count of leading tokens the connector provides, so a plan that
recomputes positions *inside* the memory cannot ask vLLM to compute them. The connector computes
them itself, before the forward pass that reads the memory: the recomputed tokens run through the
model vLLM loaded (`model_access.ModelAccess` hands it over; no second copy of the weights), layer
by layer, each attending to every position before it in serving order, injected (the stored KV,
rotated) or recomputed, exactly as joint prefill would; their K and V are written at their
serving positions over the injected ones, and vLLM is told the whole memory is injected.

    m: recomputed positions; n: the plan's positions [0, end); H / KVH query / KV heads; hd head dim
    x [m, hidden] -> per layer: q [m, H, hd], k / v [m, KVH, hd] -> K, V [n, KVH, hd] with rows
    `positions` replaced -> attention of q over K[:p + 1] (a sliding layer: its last `window`)

The layer is the family's, from vLLM's own modules (`qkv_proj`, `o_proj`, the norms, `mlp`) and
the family's switches in `ModelSpec` (q/k norms, sandwich norms, query scale, sliding windows,
per-layer RoPE); attention is plain masked SDPA in float32. `check_model` says why a model
cannot be served this way (then the plan is injected plainly, never computed wrongly). The JAX
engine's `heads:N` is the oracle (tests/vllm/test_family_composition.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from inferscale.common.model.spec import ModelSpec
from inferscale.vllm.kernels.chunked_rope import RopeTable, rotate_reference
from inferscale.vllm.kernels.compact import LoadPart, layer_kv

# layer -> (K, V) [n, KVH, hd] float32 of the plan's positions, injected K rotated (the caller's copy)
MemoryKV = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
# layer, positions [m], K rotated, V [m, KVH, hd] float32 -> written into the paged cache
Write = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


def plan_kv(parts: list[tuple[LoadPart, list]], spec: ModelSpec, end: int, device) -> MemoryKV:
    """Layer i's K (rotated) and V of the plan's positions [0, end) from its parts (a part, its RoPE
    tables at the part's positions), fresh float32 tensors the caller may overwrite."""
    def memory_kv(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = spec.layer_rope_index(i)
        K = torch.empty(end, spec.num_kv_heads, spec.head_dim, device=device)  # [n, KVH, hd]
        V = torch.empty_like(K)
        for part, tables in parts:
            at = torch.from_numpy(part.positions).to(device)
            K[at], V[at] = layer_kv(part, i, *tables[r], spec.ropes[r], torch.float32, device)
        return K, V

    return memory_kv


def paged_writer(layers: dict, block_ids: list[int], block_size: int, first: int, device) -> Write:
    """Writes recomputed K / V at their slots through each layer's backend write; positions below
    `first` (in vLLM's prefix cache already) are left alone."""
    blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)

    def write(i: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        mine = positions >= first
        positions, k, v = positions[mine], k[mine], v[mine]
        layer = layers[i]
        dtype = layer.kv_cache.dtype if layer.kv_cache.is_floating_point() else torch.float32
        slots = blocks[positions // block_size] * block_size + positions % block_size
        layer.impl.do_kv_cache_update(layer, k.to(dtype), v.to(dtype), layer.kv_cache, slots)

    return write


class Unsupported(Exception):
    """Why this model's recompute plans are injected plainly."""


def _has(obj, *names: str) -> bool:
    return all(hasattr(obj, n) for n in names)


def check_model(model, spec: ModelSpec):
    """The decoder (embeddings and layers) of vLLM's loaded model, or `Unsupported` naming what
    the recompute path does not cover (a missing module, several tensor-parallel ranks)."""
    inner = getattr(model, "model", None)
    if inner is None or not _has(inner, "embed_input_ids", "layers"):
        raise Unsupported(f"{type(model).__name__} has no decoder with embed_input_ids and layers")
    layers = list(inner.layers)
    if len(layers) != spec.num_layers:
        raise Unsupported(f"the model has {len(layers)} layers on this worker, its config {spec.num_layers} "
                          "(pipeline parallelism is not supported)")
    norms = ("input_layernorm", "post_attention_layernorm", "mlp")
    norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm") if spec.sandwich_norm else ()
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if not _has(layer, *norms) or attn is None or not _has(attn, "qkv_proj", "o_proj"):
            raise Unsupported(f"layer {i} ({type(layer).__name__}) lacks the modules of the family's layer")
        if spec.qk_norm and not _has(attn, "q_norm", "k_norm"):
            raise Unsupported(f"layer {i} has no q_norm / k_norm")
        heads = (getattr(attn, "num_heads", spec.num_heads), getattr(attn, "num_kv_heads", spec.num_kv_heads))
        if heads != (spec.num_heads, spec.num_kv_heads):
            raise Unsupported(f"layer {i} holds {heads[0]} of {spec.num_heads} query heads on this worker "
                              "(tensor parallelism is not supported)")
    return inner


class ModelRecompute:
    """The recompute path of one worker: vLLM's model and the RoPE tables of its spec."""

    def __init__(self, model, spec: ModelSpec, max_position: int) -> None:
        self.spec = spec
        self.decoder = check_model(model, spec)
        self.device = next(model.parameters()).device
        self.tables = [RopeTable(r, max_position, self.device) for r in spec.ropes]

    @torch.inference_mode()
    def run(self, positions: torch.Tensor, tokens: torch.Tensor, memory_kv: MemoryKV, write: Write) -> None:
        """Compute K and V of `tokens` at `positions` ([m] int64, ascending, all inside the plan)
        and `write` them per layer; `memory_kv(i)` is layer i's K (rotated) and V of the plan."""
        s = self.spec
        H, KVH, hd = s.num_heads, s.num_kv_heads, s.head_dim
        m = len(positions)
        x = self.decoder.embed_input_ids(tokens.to(self.device))  # [m, hidden]
        for i, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            qkv, _ = attn.qkv_proj(layer.input_layernorm(x))
            q, k, v = qkv.split([H * hd, KVH * hd, KVH * hd], dim=-1)
            if s.qk_norm:  # per head, before RoPE (the stored key is k_norm's output)
                q = attn.q_norm(q.reshape(m * H, hd))
                k = attn.k_norm(k.reshape(m * KVH, hd))
            r = s.layer_rope_index(i)
            cos, sin = self.tables[r](positions)
            q = rotate_reference(q.reshape(m, H, hd).float(), cos, sin, s.ropes[r])
            k = rotate_reference(k.reshape(m, KVH, hd).float(), cos, sin, s.ropes[r])
            v = v.reshape(m, KVH, hd).float()
            K, V = memory_kv(i)
            K[positions], V[positions] = k, v
            o = attend(q, K, V, positions, s.query_scale, s.layer_window(i))  # [m, H * hd]
            o, _ = attn.o_proj(o.to(x.dtype))
            if s.sandwich_norm:  # Gemma: norms around both blocks' outputs
                x = x + layer.post_attention_layernorm(o)
                x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
            else:
                x = x + o
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            write(i, positions, k, v)


def attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, positions: torch.Tensor, scale: float,
           window: int | None) -> torch.Tensor:
    """Causal attention of queries at `positions` over the keys at every position [0, n).

        q [m, H, hd]; K, V [n, KVH, hd]; positions [m] -> [m, H * hd] (float32)
    """
    m, H, hd = q.shape
    group = H // K.shape[1]  # query heads per KV head
    n = int(positions.max()) + 1  # no query sees past the last recomputed position
    K, V = K[:n].repeat_interleave(group, dim=1), V[:n].repeat_interleave(group, dim=1)
    j = torch.arange(n, device=q.device)
    allowed = j[None, :] <= positions[:, None]  # [m, n]
    if window is not None:
        allowed &= positions[:, None] - j[None, :] < window
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), K.transpose(0, 1), V.transpose(0, 1),
                                                         attn_mask=allowed, scale=scale)  # [H, m, hd]
    return o.transpose(0, 1).reshape(m, H * hd)
