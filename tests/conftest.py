"""Shared fixtures (helpers live in tiny_models.py)."""

import pytest

from tiny_models import FAMILIES, make_tiny_model


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    make_tiny_model(path, request.param)
    return path
