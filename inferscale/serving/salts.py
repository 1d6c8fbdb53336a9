"""vLLM prefix-cache salts: which requests may share cached KV blocks (per user, per injected
memory, per tenant scope). Plain Python."""

from __future__ import annotations

import hashlib

from inferscale.common.prompt.plan import MemoryPlan
from inferscale.common.prompt.recovery import RecoveryPolicy, connector_policy


def memory_salt(plan: MemoryPlan, mode: str = "inject", policy: "str | RecoveryPolicy | None" = None) -> str:
    """Prefix-cache salt of a memory request. Prompts whose KV vLLM computes itself ("text",
    "none", or an injection plan with nothing to inject) are exact and get a salt per user and
    incarnation, so a chat's turns share their conversation's blocks. Injected KV is only ever
    shared with requests of the same user, incarnation and memory version that inject the same
    stored facts in the same order with the same recovery policy: vLLM keys a cached block by
    its tokens (the salt counts once, for the first block), and two facts can hold the same
    tokens with different KV (each was encoded after its own window), so the identity of what
    is injected has to be in the salt. A user deleted and created again shares nothing with its
    former self, and injected blocks are never shared with exact ones. The chain's links are
    exact and named by their tokens (`common.prompt.chain_links`), so chain requests share one salt per user
    and incarnation, apart from the prefills'."""
    kind = "inject" if mode == "inject" and plan.segments else "chain" if mode == "chain" else "exact"
    key = f"inferscale:{kind}:{plan.user}:{plan.incarnation}"
    if kind == "inject":
        facts = ",".join(f"{s.store}/{s.key}" for s in plan.segments)
        key += f":{plan.version}:{connector_policy(policy)}:{hashlib.sha256(facts.encode()).hexdigest()}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]

def scope_salt(scope: str) -> str:
    """Prefix-cache salt of a request without memory, for a scope (a tenant, or a tenant's
    user): such prompts share cached blocks only inside their scope, never across tenants."""
    return hashlib.sha256(f"inferscale:scope:{scope}".encode()).hexdigest()[:32]

