"""Vector index: faiss agrees with the numpy reference, replace/remove, persistence, refusals."""

import os
import subprocess
import sys

import numpy as np
import pytest

from inferscale.common.modes import INDEX_KINDS
from inferscale.retrieval.faiss_index import FaissIndex
from inferscale.retrieval.index_factory import make_index
from inferscale.retrieval.vector_index import ExactIndex

TOL = 1e-5


def has_faiss() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


needs_faiss = pytest.mark.skipif(not has_faiss(), reason="faiss is not installed")
KINDS = [pytest.param("exact", id="exact"), pytest.param("faiss", id="faiss", marks=needs_faiss)]


def new(kind: str, dim: int):
    return ExactIndex(dim) if kind == "exact" else FaissIndex(dim, use_gpu=False)


def cls_of(kind: str):
    return ExactIndex if kind == "exact" else FaissIndex


def data(n: int, dim: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def assert_same_topk(s_ref, i_ref, s_got, i_got):
    """Scores equal within TOL position by position; ids equal except among near-tied scores."""
    assert s_ref.shape == s_got.shape == i_ref.shape == i_got.shape
    np.testing.assert_array_equal(i_ref == -1, i_got == -1)
    real = i_ref != -1
    np.testing.assert_allclose(s_got[real], s_ref[real], atol=TOL, rtol=0)
    assert np.isneginf(s_got[~real]).all() and np.isneginf(s_ref[~real]).all()
    for r in range(i_ref.shape[0]):
        n_real = int(real[r].sum())
        if n_real == 0:
            continue
        kth = s_ref[r, n_real - 1]
        # ids whose score is clearly above the k-th (no tie can move them out) must match as a set
        clear = s_ref[r, :n_real] > kth + 2 * TOL
        assert set(i_ref[r, :n_real][clear]) <= set(i_got[r, :n_real]), (r, i_ref[r], i_got[r])
        for j in np.flatnonzero(i_ref[r, :n_real] != i_got[r, :n_real]):
            near = [abs(s_ref[r, j] - s_ref[r, j2]) <= 2 * TOL for j2 in (j - 1, j + 1) if 0 <= j2 < n_real]
            assert any(near), f"row {r} position {j}: {i_ref[r]} vs {i_got[r]} with scores {s_ref[r]}"


# -- agreement ---------------------------------------------------------------------------------
@needs_faiss
@pytest.mark.parametrize("dim", [16, 384])
@pytest.mark.parametrize("n", [1, 7, 100, 2000])
@pytest.mark.parametrize("k", [1, 5, 10, 50, 3000])
def test_faiss_matches_exact(n, k, dim):
    x = data(n, dim, seed=n + dim)
    ids = np.random.default_rng(1).permutation(10 * n)[:n]  # arbitrary, non-contiguous ids
    q = data(13, dim, seed=99)
    ex, fa = ExactIndex(dim), FaissIndex(dim, use_gpu=False)
    ex.add(ids, x)
    fa.add(ids, x)
    s1, i1 = ex.search(q, k)
    s2, i2 = fa.search(q, k)
    assert s1.dtype == s2.dtype == np.float32 and i1.dtype == i2.dtype == np.int64
    assert s1.shape == (13, k)
    assert_same_topk(s1, i1, s2, i2)
    # sorted descending, padding last
    assert (s1[:, :-1] >= s1[:, 1:]).all() and (s2[:, :-1] >= s2[:, 1:]).all()
    assert ((i1 == -1).sum(axis=1) == max(0, k - n)).all()


@needs_faiss
@pytest.mark.parametrize("brute", [8192, 0], ids=["scored-directly", "id-selector"])
@pytest.mark.parametrize("k", [1, 10, 500])
def test_faiss_matches_exact_among_a_subset(k, brute, monkeypatch):
    """A filter's matches (`among`): faiss scores a few directly, or searches with IDSelectorBatch;
    both agree with the reference, and no id outside the subset comes back."""
    import inferscale.retrieval.faiss_index as faiss_index

    monkeypatch.setattr(faiss_index, "BRUTE_AMONG", brute)
    x, ids = data(400, 16, seed=3), np.arange(0, 800, 2)
    among = np.concatenate([ids[::7], [1, 3, 999]])  # ids the index lacks are ignored
    ex, fa = ExactIndex(16), FaissIndex(16, use_gpu=False)
    ex.add(ids, x)
    fa.add(ids, x)
    q = data(5, 16, seed=4)
    s1, i1 = ex.search(q, k, among=among)
    s2, i2 = fa.search(q, k, among=among)
    assert_same_topk(s1, i1, s2, i2)
    assert set(i2[i2 >= 0].tolist()) <= set(ids[::7].tolist())


def test_exact_matches_float64_brute_force():
    x, q = data(500, 32), data(20, 32, seed=5)
    ex = ExactIndex(32)
    ex.add(np.arange(500) * 3, x)
    xn = x / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    qn = q / np.linalg.norm(q.astype(np.float64), axis=1, keepdims=True)
    sims = qn @ xn.T
    want = np.argsort(-sims, axis=1, kind="stable")[:, :10] * 3
    s, i = ex.search(q, 10)
    np.testing.assert_array_equal(i, want)
    np.testing.assert_allclose(s, np.take_along_axis(sims, want // 3, axis=1), atol=TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_single_query_and_normalisation(kind):
    idx = new(kind, 8)
    x = data(20, 8)
    idx.add(range(20), x * np.arange(1, 21)[:, None])  # scale must not matter
    s, i = idx.search(x[4] * 1e-3, 3)
    assert s.shape == i.shape == (1, 3)
    assert i[0, 0] == 4 and abs(s[0, 0] - 1.0) < TOL
    np.testing.assert_allclose(np.linalg.norm(idx.vectors([4, 7]), axis=1), 1.0, atol=1e-6)


def test_exact_ties_break_by_smaller_id():
    v = data(1, 8)
    ex = ExactIndex(8)
    ex.add([9, 3, 7, 1, 12], np.repeat(v, 5, axis=0))
    s, i = ex.search(v, 3)
    np.testing.assert_array_equal(i, [[1, 3, 7]])
    assert s[0, 0] == s[0, 1] == s[0, 2]
    _, i = ex.search(v, 7)
    np.testing.assert_array_equal(i, [[1, 3, 7, 9, 12, -1, -1]])


@needs_faiss
def test_faiss_orders_returned_ties_by_id():
    v = data(1, 8)
    fa = FaissIndex(8, use_gpu=False)
    fa.add([9, 3, 7, 1, 12], np.repeat(v, 5, axis=0))
    _, i = fa.search(v, 7)
    np.testing.assert_array_equal(i, [[1, 3, 7, 9, 12, -1, -1]])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 4])
def test_empty_index_search_is_all_padding(kind, k):
    idx = new(kind, 6)
    assert len(idx) == 0 and idx.ids().dtype == np.int64 and idx.ids().size == 0
    s, i = idx.search(data(3, 6), k)
    assert s.shape == i.shape == (3, k)
    assert (i == -1).all() and np.isneginf(s).all()
    assert s.dtype == np.float32 and i.dtype == np.int64


# -- mutation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_readd_replaces_vector(kind):
    idx = new(kind, 8)
    x = data(10, 8)
    idx.add(range(10), x)
    idx.add([3, 42], np.stack([-x[3], x[0] + x[1]]))
    assert len(idx) == 11
    np.testing.assert_array_equal(idx.ids(), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 42])
    s, i = idx.search(-x[3], 1)
    assert i[0, 0] == 3 and abs(s[0, 0] - 1) < TOL
    _, i = idx.search(x[3], 11)
    assert i[0, -1] == 3  # the old direction is gone: id 3 now points the other way
    np.testing.assert_allclose(idx.vectors([3])[0], -x[3] / np.linalg.norm(x[3]), atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_remove(kind):
    idx = new(kind, 8)
    x = data(10, 8)
    idx.add(np.arange(10) + 100, x)
    assert idx.remove([103, 105, 999]) == 2
    assert idx.remove([103]) == 0
    assert idx.remove([]) == 0
    assert len(idx) == 8 and 103 not in idx and 104 in idx
    np.testing.assert_array_equal(idx.ids(), [100, 101, 102, 104, 106, 107, 108, 109])
    s, i = idx.search(x, 10)
    assert not np.isin(i, [103, 105]).any()
    assert (i[:, -2:] == -1).all()
    assert i[4, 0] == 104 and i[6, 0] == 106  # rows after a removed one still map to their ids
    assert idx.remove(idx.ids()) == 8 and len(idx) == 0
    assert (idx.search(x[0], 2)[1] == -1).all()
    idx.add([7], x[:1])
    assert idx.search(x[0], 1)[1][0, 0] == 7


# -- persistence -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [0, 1, 300])
def test_save_load_round_trip_is_exact(kind, n, tmp_path):
    idx = new(kind, 24)
    if n:
        idx.add(np.random.default_rng(2).permutation(5 * n)[:n], data(n, 24))
        idx.remove(idx.ids()[: n // 3])
    path = tmp_path / "sub" / "user.idx"
    idx.save(path)
    idx.save(path)  # overwriting is fine
    assert sorted(os.listdir(path.parent)) == ["user.idx"]  # no temp files left behind
    got = cls_of(kind).load(path)
    assert type(got) is type(idx) and got.dim == 24 and len(got) == len(idx)
    np.testing.assert_array_equal(got.ids(), idx.ids())
    np.testing.assert_array_equal(got.vectors(got.ids()), idx.vectors(idx.ids()))
    q = data(5, 24, seed=7)
    for a, b in zip(idx.search(q, 12), got.search(q, 12)):
        np.testing.assert_array_equal(a, b)
    got.add([10**6], data(1, 24))  # a loaded index is fully usable
    assert len(got) == len(idx) + 1


@pytest.mark.parametrize("kind", KINDS)
def test_load_missing_or_corrupt_names_the_path(kind, tmp_path):
    cls = cls_of(kind)
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        cls.load(tmp_path / "nope.idx")
    with pytest.raises(ValueError, match="dir.idx"):
        (tmp_path / "dir.idx").mkdir()
        cls.load(tmp_path / "dir.idx")
    (tmp_path / "junk.idx").write_bytes(b"definitely not an index")
    with pytest.raises(ValueError, match="junk.idx"):
        cls.load(tmp_path / "junk.idx")
    idx = new(kind, 8)
    idx.add(range(5), data(5, 8))
    idx.save(tmp_path / "ok.idx")
    blob = (tmp_path / "ok.idx").read_bytes()
    for cut in (3, 20, len(blob) // 2, len(blob) - 1):
        (tmp_path / "cut.idx").write_bytes(blob[:cut])
        with pytest.raises(ValueError, match="cut.idx"):
            cls.load(tmp_path / "cut.idx")


@needs_faiss
def test_load_refuses_the_other_kind_and_other_faiss_indexes(tmp_path):
    import faiss

    ex, fa = ExactIndex(8), FaissIndex(8, use_gpu=False)
    ex.save(tmp_path / "e.idx")
    fa.save(tmp_path / "f.idx")
    with pytest.raises(ValueError, match="e.idx"):
        FaissIndex.load(tmp_path / "e.idx")
    with pytest.raises(ValueError, match="f.idx"):
        ExactIndex.load(tmp_path / "f.idx")
    faiss.write_index(faiss.IndexFlatIP(8), str(tmp_path / "flat.idx"))
    with pytest.raises(ValueError, match="expected IndexIDMap2"):
        FaissIndex.load(tmp_path / "flat.idx")
    faiss.write_index(faiss.IndexIDMap2(faiss.IndexFlatL2(8)), str(tmp_path / "l2.idx"))
    with pytest.raises(ValueError, match="inner-product"):
        FaissIndex.load(tmp_path / "l2.idx")


def test_exact_file_is_safetensors_not_pickle(tmp_path):
    from safetensors.numpy import load_file

    ex = ExactIndex(4)
    ex.add([5, 2], data(2, 4))
    ex.save(tmp_path / "e.idx")
    t = load_file(tmp_path / "e.idx")
    assert set(t) == {"ids", "vectors"}
    np.testing.assert_array_equal(t["ids"], [2, 5])
    assert t["vectors"].dtype == np.float32 and t["vectors"].shape == (2, 4)


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_bad_inputs_raise_value_error(kind):
    idx = new(kind, 4)
    good = data(2, 4)
    cases = [
        (lambda: idx.add([1, 2], data(2, 5)), r"vectors must have shape \[n, 4\]"),
        (lambda: idx.add([1], good[0]), r"vectors must have shape \[n, 4\]"),
        (lambda: idx.add([1, 2], good[None]), r"vectors must have shape"),
        (lambda: idx.add([1, 2], np.array([[1, np.nan, 0, 0], [1, 0, 0, 0]])), "NaN or inf"),
        (lambda: idx.add([1, 2], np.array([[1, 0, 0, 0], [np.inf, 0, 0, 0]])), r"NaN or inf \(rows \[1\]\)"),
        (lambda: idx.add([1, 2], np.array([[1, 0, 0, 0], [0, 0, 0, 0]])), r"zero vectors.*rows \[1\]"),
        (lambda: idx.add([1, 2, 3], good), "3 ids but 2 vectors"),
        (lambda: idx.add([1, 1], good), "more than once"),
        (lambda: idx.add([1, -2], good), "ids must be >= 0"),
        (lambda: idx.add([1.0, 2.0], good), "ids must be integers"),
        (lambda: idx.add([[1, 2]], good), "ids must be a 1-D"),
        (lambda: idx.add([1, 2], np.array([["a"] * 4] * 2)), "real numeric"),
        (lambda: idx.remove([-1]), "ids must be >= 0"),
        (lambda: idx.search(good, 0), "k must be a positive integer"),
        (lambda: idx.search(good, True), "k must be a positive integer"),
        (lambda: idx.search(good, 2.0), "k must be a positive integer"),
        (lambda: idx.search(data(2, 3), 1), r"queries must have shape \[n, 4\]"),
        (lambda: idx.search(good[None], 1), r"queries must have shape \[4\] or \[m, 4\]"),
        (lambda: idx.search(np.zeros(4), 1), "queries contain zero vectors"),
        (lambda: idx.search(np.full(4, np.nan), 1), "queries contain NaN"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()
    assert len(idx) == 0  # nothing half-added


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim", [0, -3, 2.5, True, "8"])
def test_bad_dim(kind, dim):
    with pytest.raises(ValueError, match="dim must be a positive integer"):
        cls_of(kind)(dim)


def test_make_index_choices():
    assert INDEX_KINDS == ("auto", "faiss", "exact")
    ex = make_index("exact", dim=8)
    assert isinstance(ex, ExactIndex) and ex.dim == 8
    auto = make_index(dim=8)
    assert isinstance(auto, FaissIndex if has_faiss() else ExactIndex)
    if has_faiss():
        assert isinstance(make_index("faiss", dim=8), FaissIndex)
    with pytest.raises(ValueError, match="unknown index kind 'hnsw'; choose one of auto, faiss, exact"):
        make_index("hnsw", dim=8)
    with pytest.raises(ValueError, match="dim"):
        make_index("exact", dim=0)


BLOCK_FAISS = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"faiss", "jax", "torch", "vllm"}:
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import numpy as np
from inferscale.retrieval.vector_index import ExactIndex
from inferscale.retrieval.faiss_index import FaissIndex
from inferscale.retrieval.index_factory import make_index
idx = make_index("auto", dim=4)
assert type(idx) is ExactIndex, type(idx)
idx.add([1], np.ones((1, 4)))
assert idx.search(np.ones(4), 2)[1].tolist() == [[1, -1]]
for fn in (lambda: make_index("faiss", dim=4), lambda: FaissIndex(4)):
    try:
        fn()
    except ImportError as e:
        assert "inferscale[index]" in str(e), e
    else:
        raise SystemExit("expected ImportError")
print("ok")
"""


def test_works_without_faiss():
    out = subprocess.run([sys.executable, "-c", BLOCK_FAISS], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_import_does_not_import_faiss():
    code = "import sys, inferscale.retrieval.vector_index; print(sorted(m for m in sys.modules if m.split('.')[0] in {'faiss', 'jax', 'torch', 'vllm'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- GPU path, simulated with a CPU clone ------------------------------------------------------
@needs_faiss
def test_gpu_path_with_simulated_device(monkeypatch):
    import faiss

    clones = []

    def fake_to_gpus(index, *a, **kw):
        clones.append(index.ntotal)
        return faiss.clone_index(index)  # a flat index searched by row, like GpuIndexFlat

    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", fake_to_gpus)
    gpu = FaissIndex(16)
    assert gpu.use_gpu
    ref = ExactIndex(16)
    x, q = data(200, 16), data(9, 16, seed=3)
    ids = np.arange(200) * 7 + 1
    for idx in (gpu, ref):
        idx.add(ids, x)
        idx.remove(ids[::3])
        idx.add(ids[:5], -x[:5])
    for k in (1, 10, 500):
        assert_same_topk(*ref.search(q, k), *gpu.search(q, k))
    assert len(clones) == 1  # cloned once, on the first search after the writes
    gpu.remove(ids[1:2])
    ref.remove(ids[1:2])
    assert_same_topk(*ref.search(q, 10), *gpu.search(q, 10))
    assert clones == [len(ref) + 1, len(ref)]
    gpu.remove([10**9])  # nothing removed: the device copy stays valid
    gpu.search(q, 3)
    assert len(clones) == 2
