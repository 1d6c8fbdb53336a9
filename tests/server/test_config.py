"""ServerConfig (validation, YAML, API keys, CLI flags), tenancy and admission: no engine needed."""

from __future__ import annotations

import asyncio

import pytest

from inferscale.cli import build_parser, main
from inferscale.server.admission import Admission, Overloaded
from inferscale.server.auth import Tenancy
from inferscale.cli.serve_command import config_from_args
from inferscale.server.settings import ServerConfig
from inferscale.server.errors import APIError


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


@pytest.mark.parametrize("field,value", [
    ("port", 70000), ("port", "80"), ("w", -1), ("max_concurrent", 0), ("max_queued", -1),
    ("request_timeout_s", 0), ("request_timeout_s", float("nan")), ("default_k", -1), ("max_k", 0),
    ("default_mode", "joint"), ("default_policy", "keys:80"), ("default_policy", "fast"), ("default_policy", 3),
    ("dtype", "int8"), ("enable_prefix_caching", "yes"), ("host", ""),
    ("memory_root", ""), ("log_level", "loud"), ("max_model_len", 8), ("default_max_tokens", 0),
    ("api_keys", {"short": "a"}), ("api_keys", {"long-enough-key": "bad:tenant"}), ("model", "/no/such/dir"),
    ("max_concurrent", True), ("max_body_bytes", 100), ("max_add_items", 0), ("max_query_chars", 0),
    ("max_text_chars", "big"), ("catalog", "mysql://db"), ("catalog", 5), ("kv_store", "memcached://x"),
    ("kv_load", "async"), ("query_weights", "int4"), ("engine_url", "vllm:8000"),
])
def test_invalid_settings_name_the_field(field, value, tmp_path):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{"memory_root": str(tmp_path), field: value})


def test_a_remote_engine_cannot_be_probed(tmp_path):
    with pytest.raises(ValueError, match="engine_probe"):
        ServerConfig(memory_root=str(tmp_path), engine_url="http://vllm:8000", engine_probe=True)


def test_default_k_above_max_k():
    with pytest.raises(ValueError, match="default_k"):
        ServerConfig(memory_root="m", default_k=20, max_k=10)


def test_the_default_scope_may_be_the_whole_memory():
    assert ServerConfig(memory_root="m", default_k="all", max_k=10).default_k == "all"
    args = build_parser().parse_args(["serve", "--default-k", "all", "--chat-layout", "memory-first"])
    cfg = config_from_args(args)
    assert (cfg.default_k, cfg.chat_layout) == ("all", "memory-first")
    for bad in ("every", True):
        with pytest.raises(ValueError, match="default_k"):
            ServerConfig(memory_root="m", default_k=bad)
    with pytest.raises(ValueError, match="chat_layout"):
        ServerConfig(memory_root="m", chat_layout="sideways")


def test_yaml_then_flags(tmp_path, model_dir):
    cfg_file = tmp_path / "server.yaml"
    keys = tmp_path / "keys.yaml"
    keys.write_text("key-for-team-a-1: team-a\nkey-for-team-b-2: team-b\n")
    cfg_file.write_text(f"model: {model_dir}\nport: 9001\nmax_concurrent: 3\napi_keys_file: {keys}\n")
    cfg = ServerConfig.from_sources(cfg_file, port=9002, memory_root=str(tmp_path / "mem"))
    assert (cfg.model, cfg.port, cfg.max_concurrent) == (model_dir, 9002, 3)
    assert dict(cfg.api_keys) == {"key-for-team-a-1": "team-a", "key-for-team-b-2": "team-b"}
    assert not cfg.open_mode and cfg.model_name(model_dir) == "m"
    assert ServerConfig(memory_root="x").open_mode

    cfg_file.write_text("prot: 9001\n")
    with pytest.raises(ValueError, match="prot"):
        ServerConfig.from_sources(cfg_file)
    cfg_file.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        ServerConfig.from_sources(cfg_file)
    cfg_file.write_text("port: [\n")
    with pytest.raises(ValueError, match="YAML"):
        ServerConfig.from_sources(cfg_file)
    with pytest.raises(FileNotFoundError):
        ServerConfig.from_sources(tmp_path / "missing.yaml")
    keys.write_text("")
    with pytest.raises(ValueError, match="no keys"):
        ServerConfig.from_sources(None, api_keys_file=str(keys))
    keys.write_text("key-for-team-a-1: 'team a'\n")
    with pytest.raises(ValueError, match="tenant"):
        ServerConfig.from_sources(None, api_keys_file=str(keys))


def test_cli_flags_map_to_config(tmp_path, model_dir):
    args = build_parser().parse_args(["serve", "--model", model_dir, "--memory-root", str(tmp_path), "--port", "0",
                                      "--max-concurrent", "2", "--max-queued", "5", "--timeout", "2.5",
                                      "--no-prefix-caching"])
    cfg = config_from_args(args)
    assert (cfg.memory_root, cfg.port, cfg.max_concurrent, cfg.max_queued, cfg.request_timeout_s) == \
        (str(tmp_path), 0, 2, 5, 2.5)
    assert cfg.enable_prefix_caching is False and cfg.host == "127.0.0.1"
    # flags not given are left to the YAML file and the defaults
    assert set(vars(build_parser().parse_args(["serve"]))) == {"command", "func"}


def test_request_limits_default_and_come_from_yaml_and_flags(tmp_path):
    cfg = ServerConfig(memory_root="m")
    assert (cfg.max_body_bytes, cfg.max_add_items, cfg.max_query_chars, cfg.max_text_chars) == \
        (8 * 1024 * 1024, 1000, 16384, 32768)
    cfg_file = tmp_path / "server.yaml"
    cfg_file.write_text("max_body_bytes: 65536\nmax_add_items: 50\nmax_query_chars: 1000\nmax_text_chars: 2000\n")
    args = build_parser().parse_args(["serve", "--config", str(cfg_file), "--store", str(tmp_path),
                                      "--max-add-items", "7", "--max-text-chars", "300"])
    cfg = config_from_args(args)
    assert (cfg.max_body_bytes, cfg.max_add_items, cfg.max_query_chars, cfg.max_text_chars) == (65536, 7, 1000, 300)
    args = build_parser().parse_args(["serve", "--store", str(tmp_path), "--max-body-bytes", "4096",
                                      "--max-query-chars", "99"])
    assert (config_from_args(args).max_body_bytes, config_from_args(args).max_query_chars) == (4096, 99)


def test_bad_settings_fail_before_anything_loads(capsys, tmp_path):
    assert main(["serve", "--store", str(tmp_path), "--max-concurrent", "0"]) == 2
    assert "max_concurrent" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--port", "eighty"])


def test_tenancy():
    t = Tenancy({"key-for-team-a-1": "team-a"})
    assert t.tenant_for("Bearer key-for-team-a-1") == "team-a"
    for header in (None, "", "Bearer", "Basic key-for-team-a-1", "Bearer key-for-team-a-2"):
        with pytest.raises(APIError) as e:
            t.tenant_for(header)
        assert e.value.status == 401
    assert Tenancy().tenant_for(None) == "default"
    assert Tenancy.internal_user("team-a", "alice") == "team-a:alice"
    assert Tenancy.public_user("team-a", "team-a:alice") == "alice"
    assert Tenancy.public_user("team-b", "team-a:alice") is None
    with pytest.raises(APIError) as e:
        Tenancy.internal_user("team-a", "../etc")
    assert e.value.status == 400
    with pytest.raises(APIError, match="too long"):
        Tenancy.internal_user("team-a", "u" * 125)


def test_admission_bounds_queues_and_cancels():
    async def scenario():
        adm = Admission(max_concurrent=2, max_queued=1)
        s1, s2 = await adm.acquire(), await adm.acquire()
        waiter = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        assert adm.queued == 1 and adm.in_flight == 2
        with pytest.raises(Overloaded):
            await adm.acquire()
        s1.release()
        s1.release()  # idempotent
        s3 = await waiter  # handed over: still 2 in flight
        assert adm.in_flight == 2 and adm.queued == 0
        cancelled = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert adm.queued == 0
        s2.release()
        s3.release()
        assert adm.in_flight == 0
        # a slot handed to a waiter that is cancelled at the same moment is passed on, not lost
        a = await adm.acquire()
        b = await adm.acquire()
        w = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        a.release()  # resolves w's future...
        w.cancel()  # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await w
        assert adm.in_flight == 1
        b.release()
        assert adm.in_flight == 0 and adm.rejected == 1

    asyncio.run(scenario())


def test_every_engine_setting_is_a_serve_flag_and_reaches_memory_llm(tmp_path, model_dir):
    """One tree: each `EngineSettings` knob is settable from `inferscale serve` under its own name
    (`kv_write` is `--kv-write`), and the server's `MemoryLLMConfig` carries it unchanged."""
    from dataclasses import fields

    import argparse

    from inferscale.config import EngineSettings

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {a.dest: a.option_strings[0] for a in sub.choices["serve"]._actions if a.option_strings}
    for f in fields(EngineSettings):
        assert "flag" in f.metadata, f"EngineSettings.{f.name} has no knob (its flag, help and default)"
        assert f.name in flags, f"EngineSettings.{f.name} has no inferscale serve flag"
        if f.name != "enable_prefix_caching":  # the switch that turns it off: --no-prefix-caching
            assert flags[f.name] == "--" + f.name.replace("_", "-"), (f.name, flags[f.name])
    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--store", str(tmp_path), "--kv-write",
                                      "plain", "--kv-load-cpus", "0,1", "--device-cache-bytes", "0",
                                      "--encode-mode", "per-fact", "--index", "exact", "--block-size", "16",
                                      "--memory-boundary"])
    cfg = config_from_args(args)
    llm_cfg = cfg.memory_llm_config(model_dir)
    assert llm_cfg.engine_settings() == cfg.engine_settings()
    assert (llm_cfg.kv_write, llm_cfg.kv_load_cpus, llm_cfg.device_cache_bytes, llm_cfg.encode_mode, llm_cfg.index,
            llm_cfg.block_size, llm_cfg.memory_boundary) == ("plain", [0, 1], 0, "per-fact", "exact", 16, True)


def test_the_connector_config_round_trips_and_refuses_unknown_keys():
    from inferscale.config import ConnectorConfig

    cfg = ConnectorConfig(memory_root="/m", kv_load="background", kv_load_cpus=[2, 3], kv_write="plain",
                          kv_write_threads=2, device_cache_bytes=0, parent_pid=7)
    assert ConnectorConfig.from_extra(cfg.to_extra()) == cfg
    legacy = ConnectorConfig.from_extra({"memory_root": "/m", "load": "layerwise", "paged_write": "backend",
                                         "write_threads": 3, "load_cpus": "auto"})
    assert (legacy.kv_load, legacy.kv_write, legacy.kv_write_threads) == ("layerwise", "backend", 3)
    with pytest.raises(ValueError, match="unknown key 'kv_lod'"):
        ConnectorConfig.from_extra({"memory_root": "/m", "kv_lod": "sync"})
    with pytest.raises(ValueError, match="name the same setting"):
        ConnectorConfig.from_extra({"memory_root": "/m", "load": "sync", "kv_load": "sync"})
    with pytest.raises(ValueError, match="kv_write must be one of"):
        ConnectorConfig.from_extra({"memory_root": "/m", "kv_write": "fast"})
    with pytest.raises(ValueError, match="memory_root"):
        ConnectorConfig.from_extra({})


def test_lower_layers_take_their_sections_of_the_tree_by_name(tmp_path):
    """The memory service's and the connector's configs are sections of the tree: every field
    they share with `EngineSettings` by name is passed on (a field added to both travels by itself),
    and the rest is named by the caller."""
    from dataclasses import fields

    from inferscale.config import ConnectorConfig, EngineSettings, section
    from inferscale.memory.service_types import MemoryConfig

    settings = EngineSettings(w=2, context="facts", kv_dtype="int8", index="exact", kv_load="background",
                              kv_load_cpus=[1], kv_write="plain", kv_write_threads=3, device_cache_bytes=0,
                              host_cache_bytes=1 << 20)
    for cls, named in ((MemoryConfig, {"root": str(tmp_path)}), (ConnectorConfig, {"memory_root": str(tmp_path)})):
        cfg = section(cls, settings, **named)
        shared = {f.name for f in fields(cls)} & {f.name for f in fields(EngineSettings)}
        assert shared and all(getattr(cfg, n) == getattr(settings, n) for n in shared), cls
        assert all(getattr(cfg, n) == v for n, v in named.items())
    assert section(MemoryConfig, settings, root=str(tmp_path), w=7).w == 7  # the caller's value wins


def test_each_engine_flag_is_defined_once():
    """serve, calibrate and demo take the shared engine settings' flags from their knobs
    (`config.add_flags`): the same name, help and default everywhere, written in one place."""
    import argparse
    from dataclasses import fields
    from pathlib import Path

    import inferscale.cli as cli
    from inferscale.config import EngineSettings

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {cmd: {a.dest: a.help for a in sub.choices[cmd]._actions if a.option_strings}
             for cmd in ("serve", "calibrate", "demo")}
    helps["memory"] = {a.dest: a.help for a in sub.choices["memory"]._actions if a.option_strings}
    for cmd in ("calibrate", "demo", "memory"):
        # (calibrate's --tolerance is the calibration's own: the one it decides with and writes)
        shared = {d for d in helps[cmd] if d in {f.name for f in fields(EngineSettings)}} - {"tolerance"}
        assert shared and all(helps[cmd][d] == helps["serve"][d] for d in shared), cmd
    source = "".join(f.read_text() for f in Path(cli.__file__).parent.glob("*.py"))
    for f in fields(EngineSettings):
        if f.name != "tolerance":  # calibrate's own (above)
            assert f'"--{f.name.replace("_", "-")}"' not in source, f"--{f.name} is written out in the CLI"
