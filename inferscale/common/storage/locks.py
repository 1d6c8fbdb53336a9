"""Per-user writer locks, across the threads of one process and across processes sharing a root.

    locks = UserLocks(root / "locks")
    with locks.hold(user):   # one writer per user; other users' writers and every reader go on
        ...

A thread lock per user (keyed by the same hash as the user's directory) (created on demand, dropped when nobody holds or waits for it) is taken
first, then an exclusive `flock` on `<root>/locks/<user_dir_name(user)>.lock`. The lock files are
empty and named by a hash, so no user id reaches a path; they are never unlinked (unlinking a
lock file while another process waits on it would let two writers in).
"""

from __future__ import annotations

import fcntl
import threading
import weakref
from contextlib import contextmanager
from pathlib import Path

from inferscale.common.storage.paths import user_dir_name


class UserLocks:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._guard = threading.Lock()
        self._locks: weakref.WeakValueDictionary[str, threading.Lock] = weakref.WeakValueDictionary()

    def _thread_lock(self, name: str) -> threading.Lock:
        with self._guard:
            lock = self._locks.get(name)
            if lock is None:
                lock = threading.Lock()
                self._locks[name] = lock
            return lock

    def hold(self, user: str):
        """Exclusive access for writing `user`'s memory."""
        return self.hold_name(user_dir_name(user))

    @contextmanager
    def hold_name(self, name: str):
        """The same lock, named by the user's directory name (what `paths.user_dir` uses)."""
        lock = self._thread_lock(name)  # this strong reference keeps it alive while we wait and hold
        with lock, open(self.directory / f"{name}.lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
