import pytest

from doubles import HashEmbedder, WindowEncoder


@pytest.fixture
def encoder():
    return WindowEncoder()


@pytest.fixture
def embedder():
    return HashEmbedder()


@pytest.fixture(params=["embedded", "shared"])
def storage(request):
    """MemoryConfig storage fields: the embedded default (SQLite + local files in the root), or a
    real PostgreSQL catalog + Redis KV tier, as replicas share them."""
    if request.param == "embedded":
        return {}
    catalog, kv = request.getfixturevalue("shared_storage")
    return {"catalog": catalog, "kv_store": kv}
