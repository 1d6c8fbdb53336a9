import pytest

from doubles import HashEmbedder, WindowEncoder


@pytest.fixture
def encoder():
    return WindowEncoder()


@pytest.fixture
def embedder():
    return HashEmbedder()
