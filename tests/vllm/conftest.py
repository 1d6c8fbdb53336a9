"""The engine cases of this folder's test files, run together for the session.

A test file that needs engines of its own configuration (another model, KV dtype or load mode)
defines `engine_cases(items, root) -> {name: script}` for its selected tests `items`; the
session fixture `engine_runs` gathers the cases of every such file the session runs and starts
them at once in two engine processes (`tests/engine_scripts.py`), and each test waits for its
own case's result (`engine_runs["family:llama"].result()`). `tests/conftest.py` keeps these files
on one test worker, so the cases are started once."""

import pytest

from engine_scripts import run_engine_cases


@pytest.fixture(scope="session")
def engine_runs(request, tmp_path_factory):
    modules = list(dict.fromkeys(it.module for it in request.session.items if hasattr(it.module, "engine_cases")))
    cases: dict[str, str] = {}
    for module in modules:
        items = [it for it in request.session.items if it.module is module]
        short = module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
        cases.update(module.engine_cases(items, tmp_path_factory.mktemp(short)))
    return run_engine_cases(cases)
