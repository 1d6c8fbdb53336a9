"""Where a memory root keeps each user's files. Shared by the service and the vLLM connector.

    <root>/catalog.sqlite
    <root>/users/<sha256(user)[:40]>/kv/         the user's KV store (common format)
    <root>/users/<sha256(user)[:40]>/index.bin   the user's vector index
    <root>/shared/kv/                             model-level KV (the prompt header), not per user

Directories are named by a hash of the validated user id, so no user-supplied text reaches a path.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from inferscale.common.facts import validate_id


def user_dir_name(user: str) -> str:
    """The hash naming a user's directory (and its writer lock file)."""
    validate_id("user", user)
    return hashlib.sha256(user.encode()).hexdigest()[:40]


def user_dir(root: str | Path, user: str) -> Path:
    return Path(root) / "users" / user_dir_name(user)


def user_store_dir(root: str | Path, user: str) -> Path:
    return user_dir(root, user) / "kv"


def shared_store_dir(root: str | Path) -> Path:
    return Path(root) / "shared" / "kv"
