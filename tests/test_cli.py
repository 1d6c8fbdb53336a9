"""The `inferscale` command line and the demo: parsing, config validation, errors, one tiny run."""

from __future__ import annotations

import dataclasses
import io
import re
import subprocess
import sys

import pytest

from inferscale.cli import build_parser, main
from inferscale.demo import DemoConfig
from inferscale.config import EngineSettings

# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


def test_python_m_inferscale_cli_is_the_command():
    """What the benchmarks start servers with (`benchmarks/throughput.py`, `benchmarks/local_judge.py`)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "inferscale.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "usage: inferscale serve" in out.stdout


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"]])
def test_help_exits_zero(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert "usage: inferscale" in capsys.readouterr().out


def test_missing_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_non_integer_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--w", "five"])
    assert exc.value.code == 2
    assert "--w" in capsys.readouterr().err


def test_demo_flags_map_to_config_fields():
    args = build_parser().parse_args(["demo", "--model", "m", "--w", "3", "--questions", "2",
                                      "--max-new-tokens", "7", "--kernels", "reference"])
    assert (args.model, args.w, args.questions, args.max_new_tokens, args.kernels) == ("m", 3, 2, 7, "reference")
    # flags not given are left out, so DemoConfig's defaults apply
    assert set(vars(build_parser().parse_args(["demo"]))) == {"command", "func"}


def test_help_states_the_config_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    defaults = DemoConfig()
    for flag, value in [("--w", defaults.settings.w), ("--questions", defaults.questions),
                        ("--max-new-tokens", defaults.max_new_tokens)]:
        assert re.search(rf"{flag} N .*?\(default: {value}\)", help_text), flag
    assert f"(default: {defaults.kernels}" in help_text


def test_help_works_without_jax_or_torch():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'jax', 'jaxlib', 'flax', 'torch', 'transformers', 'orbax'}:\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from inferscale.cli import main\n"
        "import inferscale.demo\n"
        "main(['demo', '--help'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--max-new-tokens" in out.stdout


# --------------------------------------------------------------------------------------------
# DemoConfig
# --------------------------------------------------------------------------------------------


def test_config_defaults():
    cfg = DemoConfig()
    assert (cfg.model, cfg.settings.w, cfg.questions, cfg.max_new_tokens, cfg.kernels, cfg.k) == (
        None, 5, 5, 40, "auto", 10)
    assert cfg.settings == EngineSettings()  # the memory and engine of a default server
    assert cfg.checkpoint_dir is not None and cfg.checkpoint_dir.endswith("orbax")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.k = 2


@pytest.mark.parametrize("field,value", [
    ("settings", {"w": 2}), ("questions", 0), ("max_new_tokens", 0), ("max_new_tokens", "8"),
    ("kernels", "cuda"), ("model", ""), ("model", 3), ("checkpoint_dir", " "),
])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):
        DemoConfig(**{field: value})


def test_config_accepts_edge_values():
    DemoConfig(settings=EngineSettings(w=0), questions=1, max_new_tokens=1, kernels="pallas", model="x",
               checkpoint_dir=None)


@pytest.mark.parametrize("flags,settings", [([], EngineSettings()), (["--w", "0"], EngineSettings(w=0))])
def test_the_demo_s_engine_flags_are_serve_s(flags, settings, monkeypatch):
    """`demo --w` is `serve --w`: it lands in the demo's EngineSettings, which a bad value refuses."""
    seen = []
    monkeypatch.setattr("inferscale.chat_demo.run_chat_demo", lambda cfg, console: seen.append(cfg))
    monkeypatch.setattr("inferscale.cli.engine_environment", lambda verbose: None)
    assert main(["demo", *flags]) == 0
    assert seen[0].settings == settings


# --------------------------------------------------------------------------------------------
# Errors from bad input: exit code 2, `error: ...` on stderr, no traceback
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["demo", "--w", "-1"], "error: w must be >= 0, got -1"),
    (["demo", "--kernels", "cuda"], "error: kernels must be one of"),
    (["demo", "--questions", "0"], "error: questions must be >= 1"),
])
def test_bad_demo_config_returns_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message)
    assert "Traceback" not in err


def test_missing_model_folder_returns_2(tmp_path, capsys):
    assert main(["demo", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model ") and "config.json" in err and "qwen2.5-coder-1.5b" in err


def test_models_list_and_short_names(tmp_path, capsys, monkeypatch):
    from inferscale import models

    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "qwen2.5-coder-1.5b" in out
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="inferscale models add qwen2.5-coder-1.5b"):
        models.resolve_model("qwen2.5-coder-1.5b")  # named, not installed: says how to install it
    target = tmp_path / "inferscale" / "models" / "Qwen2.5-Coder-1.5B-Instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"")
    assert models.resolve_model("qwen2.5-coder-1.5b") == target
    assert main(["models", "add", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_a_damaged_part_is_refused(tmp_path, monkeypatch):
    from inferscale import models

    parts = tmp_path / "site"
    for i in (1, 2):
        (parts / f"p{i}" / "data").mkdir(parents=True)
        (parts / f"p{i}" / "data" / "x.bin").write_bytes(b"GGUF" if i == 1 else b"rest")
    m = models.PackagedModel("t", "T", (("p1", "p1", "data/x.bin"), ("p2", "p2", "data/x.bin")), 9)
    monkeypatch.setattr(models, "_installed", lambda module: parts / module)
    with pytest.raises(ValueError, match="has 8 bytes, expected 9"):
        models._assemble(m, tmp_path / "t.gguf", log=lambda _: None)
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-made is left
    m = models.PackagedModel("t", "T", m.packages, 8)
    models._assemble(m, tmp_path / "t.gguf", log=lambda _: None)
    assert (tmp_path / "t.gguf").read_bytes() == b"GGUFrest"


# --------------------------------------------------------------------------------------------
# Quiet by default: vLLM's logs at WARNING unless --verbose or VLLM_LOGGING_LEVEL asks for more
# --------------------------------------------------------------------------------------------


def test_engine_environment_quiets_vllm_and_keeps_the_users_level():
    from inferscale.cli import engine_environment

    env: dict[str, str] = {}
    engine_environment(environ=env)
    assert env == {"VLLM_LOGGING_LEVEL": "WARNING"}
    env = {"VLLM_LOGGING_LEVEL": "DEBUG"}
    engine_environment(environ=env)
    assert env == {"VLLM_LOGGING_LEVEL": "DEBUG"}  # the user's value wins
    env = {}
    engine_environment(verbose=True, environ=env)
    assert env == {}  # vLLM's own default (INFO)
    env = {"VLLM_LOGGING_LEVEL": "ERROR"}
    engine_environment(verbose=True, environ=env)
    assert env == {"VLLM_LOGGING_LEVEL": "ERROR"}


def test_engine_environment_sets_the_process_environment(monkeypatch):
    """What the engine-core and worker processes inherit."""
    import os

    from inferscale.cli import engine_environment

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    engine_environment()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    engine_environment()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"


class _Stop(Exception):
    pass


@pytest.mark.parametrize("argv, verbose", [(["demo"], False), (["demo", "--verbose"], True),
                                           (["serve"], False), (["serve", "--verbose"], True),
                                           (["demo", "--engine", "jax", "--verbose"], True)])
def test_demo_and_serve_prepare_the_environment_before_anything_loads(argv, verbose, monkeypatch):
    """The command's first step (so before vLLM is imported) prepares the environment, and --verbose
    reaches it; --verbose is no DemoConfig / ServerConfig field."""
    import inferscale.cli as cli

    calls = []

    def record(verbose=False, environ=None):
        calls.append(verbose)
        raise _Stop

    monkeypatch.setattr(cli, "engine_environment", record)
    with pytest.raises(_Stop):
        main(argv)
    assert calls == [verbose]


def test_verbose_is_left_out_of_the_configs():
    from inferscale.cli.serve_command import config_from_args

    args = build_parser().parse_args(["serve", "--verbose"])
    assert args.verbose is True
    config_from_args(args)  # not a ServerConfig field
    assert "verbose" not in vars(build_parser().parse_args(["demo"]))


# --------------------------------------------------------------------------------------------
# One end-to-end demo on a tiny random model
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_runs_end_to_end_on_a_tiny_model(tmp_path):
    pytest.importorskip("jax")
    from tiny_models import make_tiny_model
    from rich.console import Console

    from inferscale.evaluation.datasets import load_demo
    from inferscale.demo import run_demo

    from inferscale.gate.calibration import Calibration, encoding_key
    from inferscale.common.model.spec import ModelSpec, model_fingerprint

    model_dir = tmp_path / "llama"
    make_tiny_model(model_dir, "llama", num_layers=1, max_position_embeddings=2048)
    fingerprint = model_fingerprint(model_dir, ModelSpec.from_pretrained(model_dir))
    # the model's gate for memory encoded after 2 turns: last:2 up to k=6
    served = dict(kv_dtype="bfloat16", encode_mode="one-pass", dtype="float32")  # as a default server keeps it
    Calibration(fingerprint, 0.05, {6: "last:2"}, encoding=encoding_key("turns", 2, **served)).save(tmp_path / "mem")
    out = io.StringIO()
    cfg = DemoConfig(model=str(model_dir), settings=EngineSettings(w=2), questions=2, max_new_tokens=4,
                     checkpoint_dir=None, k=6, memory_root=str(tmp_path / "mem"))
    results = run_demo(cfg, Console(file=out, width=140, force_terminal=False))
    text = out.getvalue()

    assert len(results) == 2
    for r in results:
        assert len(r.facts) == 6  # retrieved per question
        assert r.joint.num_injected == 0 and r.inject.num_injected > 0
        assert r.joint.num_prefilled == r.inject.num_injected + r.inject.num_prefilled
        assert 1 <= len(r.joint.token_ids) <= 4 and 1 <= len(r.inject.token_ids) <= 4
        assert (r.decision.mode, r.decision.policy) == ("inject", "last:2")
        assert r.joint.num_injected < r.served.num_injected < r.inject.num_injected  # the last 2 facts recomputed
    assert results[0].facts != results[1].facts
    assert f"Encoded {len(load_demo().conversation.facts)} facts" in text
    assert "its top 6 of" in text and "auto" in text and "inject, policy last:2" in text
    assert len(re.findall(r"TTFT +joint [\d,]+ ms \| inject [\d,]+ ms \| ratio joint/inject [\d.]+x", text)) == 2
    assert "Q2/2" in text
    for row in ("median TTFT", "median ratio joint/inject", "prompt tokens injected",
                "prompt tokens prefilled", "answers identical token for token"):
        assert row in text


@pytest.mark.slow
def test_the_demo_serves_a_chat_through_vllm_and_the_connector(tmp_path):
    """`inferscale demo` runs the product: a chat with a system prompt over vLLM with the
    connector, every turn injected and as text, the chat growing turn by turn, and auto following
    the model's calibration."""
    pytest.importorskip("vllm")
    from rich.console import Console
    from tiny_models import make_tiny_model

    from inferscale.chat_demo import run_chat_demo
    from inferscale.gate.calibration import Calibration, encoding_key
    from inferscale.common.model.spec import ModelSpec, model_fingerprint

    model_dir = tmp_path / "llama"
    make_tiny_model(model_dir, "llama", head_dim=32, max_position_embeddings=2048)
    fingerprint = model_fingerprint(model_dir, ModelSpec.from_pretrained(model_dir))
    served = dict(kv_dtype="bfloat16", encode_mode="one-pass", dtype="float32")  # the demo's MemoryLLM's defaults
    Calibration(fingerprint, 0.05, {6: "last:2"}, data="test",
                encoding=encoding_key("turns", 2, **served)).save(tmp_path / "mem")
    out = io.StringIO()
    cfg = DemoConfig(model=str(model_dir), settings=EngineSettings(w=2, max_model_len=2048), questions=2,
                     max_new_tokens=4, k=6, memory_root=str(tmp_path / "mem"))
    result = run_chat_demo(cfg, Console(file=out, width=160, force_terminal=False))
    text = out.getvalue()
    assert len(result.turns) == 2
    for t in result.turns:
        assert t.inject.num_injected > 0 and t.text.num_injected == 0
        assert t.inject_ttft_s > 0 and t.text_ttft_s > 0 and t.cold_ttft_s > 0 and len(t.facts) == 6
        assert t.auto[:2] == ("inject", "last:2") and "memory root calibration" in t.auto[2]
        assert 0 < t.served.num_injected < t.inject.num_injected  # the last 2 facts recomputed
    assert result.turns[1].inject.num_prompt > result.turns[0].inject.num_prompt  # the chat carries the turns
    # turn 2 finds turn 1's system prompt and question in the prefix cache (history-first)
    assert result.turns[1].cached_tokens > result.turns[0].cached_tokens
    assert "from the prefix cache" in text and "re-prefilled" in text
    assert "Turn 2/2" in text and "median TTFT" in text and "inject, policy last:2" in text
    w = result.whole  # the whole memory from the chain: the text's answer, every fact's link injected
    assert w.chain.token_ids == w.text.token_ids and w.auto[0] == "chain"
    assert w.chain.num_injected > len(w.chain.facts) and w.text.num_injected == 0
    assert w.chain.num_injected > w.chain.num_prompt // 2  # the links, not the header alone: most of the prompt
    assert "identical token for token" in text and "The whole memory" in text
