"""Shared fixtures (helpers live in tiny_models.py), and the order files run in."""

import pytest

# The files that start vLLM engines (or servers with one) take most of the suite's time. `make test`
# hands whole files to two workers in collection order (pytest-xdist, --dist loadfile), so these go
# first, longest first: the two workers then finish together instead of one running the last
# engine file alone. Measured with `make test` (its --durations table); order only, nothing skipped.
LONGEST_FIRST = (
    "vllm/test_family_composition.py", "server/test_hardening_http.py", "vllm/test_compact_serving.py",
    "vllm/test_layerwise_load.py", "scale/test_cluster.py", "scale/test_gateway.py", "server/test_server.py",
    "vllm/test_connector.py", "benchmarks/test_cpu_paths.py", "scale/test_replicas.py",
    "benchmarks/test_gpu_check.py", "test_cli.py", "evaluation/test_calibrate.py", "server/test_run_cancel.py",
    "equivalence/test_conversation_encoding.py", "memory/test_service_engine.py", "jax/test_engine.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: every file keeps its own order

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
