"""Memory plans only the gateway can write: an HMAC over the plan and the prompt's token ids.

Whoever can reach the vLLM engine's port can send a request with any `kv_transfer_params`. The
connector checks that the prompt's tokens equal the stored tokens of every fact the plan names, but
a fact's KV carries more than its text (it was encoded after a window of its user's conversation),
so a plan naming another user's store must be refused by who wrote it, not by what it says. The
composer signs every plan it writes with a secret shared by it and the connector:

    sig = HMAC-SHA256(secret, canonical JSON of the plan (without "sig") + the prompt's token ids)

and the connector injects nothing for a plan that is unsigned, forged, or signed for another
prompt (a replay). The secret is a file of 64 hex digits: `plan_secret_file` in the config, or
`<memory_root>/plan-secret`, created with mode 0600 at the first start (one machine: the server
and its in-process engine share the memory root). A gateway and stock `vllm serve` pods on other
machines are given the same file (docs/deployment.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Sequence

from inferscale.common.prompt.plan import PLAN_KEY, PlanError

SECRET_NAME = "plan-secret"
SIG_KEY = "sig"


def secret_path(memory_root: str, plan_secret_file: str = "") -> Path:
    """The secret's file: `plan_secret_file` when given, else `<memory_root>/plan-secret`."""
    return Path(plan_secret_file) if plan_secret_file else Path(memory_root) / SECRET_NAME


def load_secret(path: Path, create: bool = True) -> bytes:
    """The secret in `path`; a new random one is written there first when it does not exist and
    `create` (atomically: two processes starting together end up with the same secret)."""
    if not path.exists():
        if not create:
            raise FileNotFoundError(f"no plan secret at {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".plan-secret-")
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (secrets.token_hex(32) + "\n").encode())
            os.fsync(fd)
            os.close(fd)
            try:
                os.link(tmp, path)  # fails if another process made it first: theirs is kept
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"plan secret {path} must hold hex digits") from None
    if len(key) < 16:
        raise ValueError(f"plan secret {path} is too short ({len(key)} bytes; at least 16)")
    return key


def signature(plan: dict, prompt_ids: Sequence[int], secret: bytes) -> str:
    """The HMAC of one plan (its inner dict, "sig" left out) for one prompt."""
    body = {k: v for k, v in plan.items() if k != SIG_KEY}
    msg = json.dumps(body, sort_keys=True, separators=(",", ":")) + "|" + ",".join(str(int(t)) for t in prompt_ids)
    return hmac.new(secret, msg.encode(), hashlib.sha256).hexdigest()


def sign(params: dict, prompt_ids: Sequence[int], secret: bytes) -> dict:
    """`kv_transfer_params` with the plan signed for this prompt."""
    plan = dict(params[PLAN_KEY])
    plan[SIG_KEY] = signature(plan, prompt_ids, secret)
    return {**params, PLAN_KEY: plan}


def verify(params: dict, prompt_ids: Sequence[int], secret: bytes) -> None:
    """PlanError unless the plan in `params` carries this prompt's signature."""
    plan = (params or {}).get(PLAN_KEY) or {}
    sig = plan.get(SIG_KEY)
    if not isinstance(sig, str) or not sig:
        raise PlanError("the memory plan is not signed (only the gateway's plans are injected)")
    if not hmac.compare_digest(sig, signature(plan, prompt_ids, secret)):
        raise PlanError("the memory plan's signature does not match it and this prompt (forged, or signed for "
                        "another prompt)")
