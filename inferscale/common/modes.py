"""Every mode, policy family and dtype name of InferScale, in one place (plain tuples, no imports).

Config fields, CLI flags, the server's YAML and the connector's extra config all validate against
these; the modules that act on a value import its tuple from here.
"""

from __future__ import annotations

# How a request is answered with memory. "inject": the facts' stored KV injected into the paged
# cache; "text": the same facts prefilled as prompt text; "chain": the whole memory from the user's
# memory chain (`memory.chain`: exact, the same tokens as "text" with k "all"); "auto": the whole
# memory from the chain, top k as the model's calibrated gate (`gate.calibration`) picks (text where it
# has no calibration); "none": no memory at all.
SERVE_MODES = ("auto", "inject", "text", "chain", "none")
# What a server request may ask for in `memory.mode` ("none" is `memory.enabled: false` there).
SERVER_MODES = ("auto", "inject", "text", "chain")
# The JAX reference engine's names for the same two paths: "joint" is joint prefill (the facts'
# text in the prompt, the oracle every injection is checked against), "inject" is injection.
JAX_MODES = ("inject", "joint")

# Where a chat's memory goes (`common.prompt.layout`): "history-first" puts it inside the new user turn, after
# the system prompt and the earlier turns, which stay a prefix the engine's prefix cache reuses from
# turn to turn; "memory-first" opens the system turn with it, before the whole conversation; "auto"
# lays out chats served as text history-first and injected ones memory-first, what measures fastest
# for each (injected, the conversation before the memory is computed by the connector, every turn
# the memory changes: docs/results.md, "Chats").
CHAT_LAYOUTS = ("auto", "history-first", "memory-first")

# `memory.k: "all"`: the user's whole memory (every live fact, in the order they were added, as the
# text layout renders it, up to the chain's token budget; the most relevant of the rest after it)
# instead of the top k retrieved; laid out memory-first, so the memory and the conversation after it
# are the same prefix on every turn until the memory changes. Mode "chain" always serves it.
WHOLE_MEMORY = "all"

# How stores keep KV (codes + per-channel scales for int8 and float8_e4m3: `common.storage.kvquant`).
KV_DTYPES = ("float32", "float16", "bfloat16", "int8", "float8_e4m3")
# What each fact was encoded after (besides the prompt header): its `w` preceding conversation
# turns (Context-Window Encoding), the `w` facts before it in the memory rendered as the memory
# block renders them (list-context encoding), or its `w` preceding turns read from one pass over
# the conversation (the conversation encoding, `common.prompt.conversation_pass`).
ENCODING_CONTEXTS = ("turns", "facts", "conversation")
# Where `inferscale calibrate` takes its conversations from: the checkout's LoCoMo, the packaged
# user-and-assistant conversations (`evaluation/data/assistant_conversations.json`), the packaged
# demo; besides these, any LoCoMo-format file by its path.
CALIBRATION_DATA = ("locomo", "assistant", "demo")
# How encoders run a batch of items: packed as prefix trees, or one sequence per fact (the reference).
ENCODE_MODES = ("one-pass", "per-fact")
# The vLLM engine's compute dtypes.
ENGINE_DTYPES = ("float32", "bfloat16", "float16")

# The default embedder's search-query network: int8 or float32 weights; "auto": int8 where it runs
# in ONNX Runtime (CPU), else float32. Facts are always embedded with the float32 network.
QUERY_WEIGHTS = ("auto", "float32", "int8")
# The per-user vector index: "exact" (numpy), "faiss", "auto" (faiss where it is installed).
INDEX_KINDS = ("auto", "faiss", "exact")

# How the connector loads memory KV: every layer before the forward pass, each layer right before
# its attention, or (CPU caches) on a writer thread beside the forward pass.
LOAD_MODES = ("sync", "layerwise", "background")
# How the connector writes into the cache: "auto" straight into the paged cache where its layout
# allows (vLLM's CPU float32 and bfloat16 caches), full blocks in streaming stores; "plain" the same
# with plain stores; "backend" through the attention backend's own cache write (also what "auto"
# and "plain" fall back to). All three write the same bits.
WRITE_WAYS = ("auto", "plain", "backend")
