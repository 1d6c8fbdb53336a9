"""Truncating an over-long chat (`layout.fit_turns`): the bisection keeps exactly what
dropping the oldest turn one at a time keeps (the reference below), with O(log n) renderings."""

import random

from inferscale.common.prompt.layout import fit_turns


def reference(messages, budget, render):
    """Drop the oldest turn (and the replies it leaves leading) until the rendering fits or only the new
    message is left."""
    messages, dropped = list(messages), 0
    ids = render(messages)
    while len(ids) > budget:
        turns = [i for i, m in enumerate(messages[:-1]) if m["role"] not in ("system", "developer")]
        if not turns:
            break
        del messages[turns[0]]
        dropped += 1
        nxt = [i for i, m in enumerate(messages[:-1]) if m["role"] not in ("system", "developer")]
        while nxt and messages[nxt[0]]["role"] == "assistant":
            del messages[nxt[0]]
            dropped += 1
            nxt = [i for i, m in enumerate(messages[:-1]) if m["role"] not in ("system", "developer")]
        ids = render(messages)
    return messages, dropped, ids


def test_bisection_keeps_what_dropping_one_turn_at_a_time_keeps():
    rng = random.Random(0)
    calls = []

    def render(msgs):  # 3 tokens of template per message, a token per word
        calls.append(1)
        return [0] * sum(3 + len(m["content"].split()) for m in msgs)

    for _ in range(400):
        n = rng.randrange(0, 40)
        msgs = [{"role": "system", "content": "be brief " * rng.randrange(1, 5)}] if rng.random() < 0.5 else []
        for i in range(n):  # mostly alternating, sometimes two of a kind, a developer note now and then
            role = rng.choice(["user", "assistant"]) if rng.random() < 0.2 else ("user", "assistant")[i % 2]
            msgs.append({"role": "developer" if rng.random() < 0.05 else role,
                         "content": "word " * rng.randrange(1, 60)})
        msgs.append({"role": "user", "content": "and now? " * rng.randrange(1, 30)})
        budget = rng.randrange(10, 1500)
        calls.clear()
        got = fit_turns(msgs, budget, render)
        fast_calls = len(calls)
        assert got == reference(msgs, budget, render)
        assert fast_calls <= 2 + len(msgs).bit_length()
