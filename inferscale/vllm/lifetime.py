"""The engine's processes die with the process that started the engine.

vLLM runs the engine core (and, by default, the model worker) in child processes. When the server
exits normally it shuts them down; when it is killed outright (SIGKILL, the OOM killer) nothing
runs, and the children would go on as orphans (parent 1), holding the model and the KV cache.
`die_with_parent(parent_pid)`, called in each of those processes (the connector is built in both),
asks Linux to SIGKILL the calling process when its parent dies (`prctl(PR_SET_PDEATHSIG)`): the
engine core dies with the server, the worker with the engine core. Because the request only covers
deaths after the call, it then checks that `parent_pid` (the server's pid, passed by whoever built
the engine) is still alive, and exits at once if it is not.

Off Linux (or without prctl) it does nothing but log at debug level. Called in the process that
*is* `parent_pid` (an engine core running in the server's own process) it does nothing, so the
server itself never inherits a death signal from whatever started it.

Linux sends the signal when the *thread* that started the child exits, so an engine must be
started from a thread that lives as long as it does (the main thread, as `inferscale serve`,
`MemoryLLM` and the tests do), not from a short-lived worker thread.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

log = logging.getLogger("inferscale.lifetime")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int | None) -> bool:
    """SIGKILL this process when its parent dies; `os._exit(1)` now if `parent_pid` is already
    dead. Returns whether the death signal is set (False: not Linux, prctl failed, or this process
    is `parent_pid` itself)."""
    if parent_pid is not None and int(parent_pid) == os.getpid():
        return False
    if not sys.platform.startswith("linux"):
        log.debug("die_with_parent: not Linux (%s), the engine may outlive a killed server", sys.platform)
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    except (OSError, AttributeError) as e:
        log.debug("die_with_parent: %s; the engine may outlive a killed server", e)
        return False
    if parent_pid is not None and not _alive(int(parent_pid)):
        log.error("the process that started this engine (pid %s) is gone; exiting", parent_pid)
        os._exit(1)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
