"""Shared fixtures (helpers live in tiny_models.py)."""

import pytest

from tiny_models import FAMILIES, make_tiny_model


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    make_tiny_model(path, request.param)
    return path


@pytest.fixture(scope="session")
def postgres_admin(tmp_path_factory):
    """A real PostgreSQL server for the session (admin URI); tests take a fresh database each."""
    from services import postgres_server

    with postgres_server(tmp_path_factory.mktemp("pg") / "data") as uri:
        yield uri


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real Redis server for the session; `shared_storage` empties it before each test."""
    from services import redis_server

    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def shared_storage(postgres_admin, redis_url):
    """(catalog URL of a fresh PostgreSQL database, the emptied Redis URL): what replicas share."""
    import redis

    from services import new_database

    redis.Redis.from_url(redis_url).flushall()
    return new_database(postgres_admin), redis_url
