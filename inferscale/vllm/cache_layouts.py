"""vLLM's attention layers (`attention_layers`), and where the connector's worker writes memory KV
straight into their paged caches: each layer's cache layout, learned once per kind of layer from
the backend's own write (`kernels.paged_write.learn_layout`, on scratch caches), or None where it
must go through the backend's write (a GPU cache, another dtype, no Numba, no layout learned).

    layouts = CacheLayouts(spec, block_size)
    per_layer = layouts.of(layers)        # {layer index: PagedLayout} or None
"""

from __future__ import annotations

import logging
import re
from typing import Any

from inferscale.common.model.spec import ModelSpec
from inferscale.vllm.kernels import cpu_kernels
from inferscale.vllm.kernels.cache_layout import PagedLayout
from inferscale.vllm.kernels.paged_write import learn_layout

log = logging.getLogger("inferscale.connector")
_LAYER = re.compile(r"layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The layer index in a vLLM module or layer name (`model.layers.{i}.self_attn.attn`), or None."""
    m = _LAYER.search(name + ".")
    return int(m.group(1)) if m else None


def attention_layers(named: dict[str, Any]) -> dict[int, Any]:
    """Layer index -> attention layer, of vLLM's named modules (`model.layers.{i}.self_attn.attn`)."""
    out = {}
    for name, layer in named.items():
        i = layer_index(name)
        if i is not None and hasattr(layer, "impl") and hasattr(layer.impl, "do_kv_cache_update"):
            out[i] = layer
    return out


class CacheLayouts:
    """The layouts learned so far, by kind of layer: (isa, dtype, cache shape past the blocks)."""

    def __init__(self, spec: ModelSpec, block_size: int) -> None:
        self.spec, self.block_size = spec, block_size
        self.learned: dict[tuple, PagedLayout | None] = {}  # None: such caches take the backend's write

    def of(self, layers: dict[int, Any]) -> dict[int, PagedLayout] | None:
        """Each layer's cache layout, or None where some layer's could not be learned."""
        if not cpu_kernels.available():
            return None
        out = {}
        for i, layer in layers.items():
            cache = layer.kv_cache
            key = (getattr(layer, "isa", None), cache.dtype, tuple(cache.shape[1:]))
            if key not in self.learned:
                write = lambda k, v, c, s, layer=layer: layer.impl.do_kv_cache_update(layer, k, v, c, s)  # noqa: E731
                self.learned[key] = learn_layout(write, cache, self.block_size, self.spec.num_kv_heads,
                                                 self.spec.head_dim)
                log.info("memory KV into %s caches of %s (%s): %s", cache.dtype, tuple(cache.shape[1:]), key[0],
                         "written directly" if self.learned[key] else "through the backend's write")
            if self.learned[key] is None:
                return None
            out[i] = self.learned[key]
        return out
