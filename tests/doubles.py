"""Light, deterministic stand-ins for the engine and the embedder, so memory-service tests run in
milliseconds and in subprocesses. The KV they produce depends on the fact text and on its exact
window, which is what the re-encoding tests observe. (tests/memory/test_service_engine.py runs
the service with the real JAX engine and MiniLM.)"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

from inferscale.common.storage.format import FactKV, StoreMeta


class HashEmbedder:
    name, dim = "hash-bow", 64

    def embed(self, texts):
        out = np.zeros((len(texts), self.dim), np.float32)
        for i, t in enumerate(texts):
            for w in re.findall(r"[a-z0-9]+", t.lower()):
                out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % self.dim] += 1.0
            out[i] /= max(np.linalg.norm(out[i]), 1e-6)
        return out


class WindowEncoder:
    """KV = a pseudo-random function of (window turns, fact text); records what it encoded."""

    def __init__(self, fingerprint="test-encoder"):
        self.fingerprint = fingerprint
        self.calls: list[list[str]] = []

    def store_meta(self, w, context="turns"):
        return StoreMeta(self.fingerprint, 2, 1, 4, {"theta": 1e4, "rotary_dim": 4, "style": "split"}, w=w,
                         context=context)

    def encode_windowed(self, facts, windows, w):
        return self._encode(facts, windows)

    def encode_listed(self, facts, previous, w):
        return self._encode(facts, previous)

    def encode_conversation(self, facts, spans, w):
        return self._encode(facts, spans)

    def _encode(self, facts, contexts):
        """contexts: per fact, the turns or facts (anything with .id and .text) it is encoded after."""
        self.calls.append([f.id for f in facts])
        out = []
        for f, win in zip(facts, contexts):
            ids = np.frombuffer(f.text.encode(), np.uint8).astype(np.int32)
            ctx = "|".join(f"{t.id}:{t.text}" for t in win) + "#" + f.text
            rng = np.random.default_rng(int(hashlib.sha256(ctx.encode()).hexdigest()[:15], 16))
            k = rng.standard_normal((2, len(ids), 1, 4)).astype(np.float32)
            out.append(FactKV(f.id, ids, k, -k, text=f.text, source_turn=f.source_turn, meta={"ctx": ctx}))
        return out


class ChainEncoder(WindowEncoder):
    """A `WindowEncoder` that also encodes token ids (`encode_ids`) as a causal model would: the KV
    of each token a pseudo-random function of every token up to it. So a memory chain's links equal
    the joint encoding of the prefix they hold (`joint`), and any change before a token changes it."""

    HEADER = (7, 8, 9)  # the prompt header the chain's tests encode after

    def __init__(self, fingerprint="test-encoder"):
        super().__init__(fingerprint)
        self.encoded: list[tuple[int, int]] = []  # (context tokens, tokens) of each encode_ids item

    @staticmethod
    def joint(ids) -> tuple[np.ndarray, np.ndarray]:
        """(k, v) of every token of `ids`, [2, n, 1, 4] each, as one causal pass computes them."""
        ks, h = [], hashlib.sha256()
        for t in ids:
            h.update(f"{int(t)},".encode())
            rng = np.random.default_rng(int(h.hexdigest()[:15], 16))
            ks.append(rng.standard_normal((2, 1, 4)).astype(np.float32))
        k = np.stack(ks, axis=1)
        return k, -k

    def encode_ids(self, items, progress=None):
        out = []
        for ctx, ids in items:
            self.encoded.append((len(ctx), len(ids)))
            k, v = self.joint(list(ctx) + list(ids))
            out.append((k[:, len(ctx):], v[:, len(ctx):]))
        return out


class Clock:
    """A settable `MemoryService.clock` (expiry and a fact's times at chosen seconds)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def encoded_after(svc, user: str) -> dict[str, list[str]]:
    """fact id -> the ids of the turns or facts its stored KV was encoded after (`WindowEncoder`)."""
    return {kv.fact_id.split("~")[0]: [c.split(":")[0] for c in kv.meta["ctx"].split("#")[0].split("|") if c]
            for kv in svc.load_kv(user, [f.fact_id for f in svc.list(user)])}


def all_bytes(root: Path) -> bytes:
    """Every byte under `root` (to check that forgotten data is in no file)."""
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())
