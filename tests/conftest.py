"""Shared fixtures (helpers live in tiny_models.py), the order files run in, and which files run
on the same test worker."""

import os
from pathlib import Path

import pytest

# JAX compiles each jitted function per shape; many tests (and both test workers, and the engine
# processes) compile the same tiny models at the same shapes. XLA's own persistent cache keeps
# every compiled executable for the checkout (the default keeps only those over 1 s to compile).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The tests' models are tiny: compiling takes far longer than running. LLVM's cheapest optimisation
# level compiles in about three quarters of the time (no fast-math either way: the same float
# operations in the same order, so every comparison of two paths is unchanged).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

# The files that start vLLM engines (or servers with one) take most of the suite's time. `make test`
# hands whole files to two workers in collection order (pytest-xdist, --dist loadfile with
# --no-loadscope-reorder), so these go first, longest first: the two workers then finish together
# instead of one running the last engine file alone. Measured with `make test` (its --durations
# table); order only, nothing skipped.
LONGEST_FIRST = (
    "vllm/test_family_composition.py", "vllm/test_compact_serving.py", "vllm/test_layerwise_load.py",
    "vllm/test_extraction_engine.py",
    "server/test_hardening_http.py", "server/test_server.py", "server/test_extraction_server.py",
    "scale/test_cluster.py", "scale/test_gateway.py",
    "equivalence/test_composition.py", "vllm/test_connector.py", "scale/test_replicas.py",
    "equivalence/test_recovery_anchors.py", "benchmarks/test_gpu_check.py", "test_cli.py",
    "evaluation/test_calibrate.py", "server/test_run_cancel.py", "equivalence/test_conversation_encoding.py",
    "memory/test_service_engine.py", "jax/test_engine.py",
)
# Files that share an engine for the session go to one worker together, so it starts once: the
# engine cases' two processes (tests/vllm/conftest.py) and the server tests' in-process engine
# (tests/server/conftest.py).
SAME_WORKER = {
    "engine-cases": ("vllm/test_family_composition.py", "vllm/test_compact_serving.py", "vllm/test_layerwise_load.py",
                     "vllm/test_extraction_engine.py"),
    "live-server": ("server/test_hardening_http.py", "server/test_server.py", "server/test_extraction_server.py",
                    "server/test_memory_api.py"),
}
_GROUP_OF = {path: group for group, paths in SAME_WORKER.items() for path in paths}


def _path(nodeid: str) -> str:
    return nodeid.split("::")[0].removeprefix("tests/")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_path(item.nodeid), len(rank)))  # stable: every file keeps its order


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, except that each SAME_WORKER group of files is one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _GROUP_OF.get(_path(nodeid)) or super()._split_scope(nodeid)

    return Scheduling(config, log)


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
