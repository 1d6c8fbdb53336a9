"""`ServerConfig`: every setting of `inferscale serve`, typed and validated.

Built once at the entry point from (lowest to highest precedence) the defaults below, an optional
YAML file whose keys are the field names (`--config server.yaml`), and the command-line flags.
API keys come from a separate YAML file (`--api-keys keys.yaml`, or `api_keys_file:` in the
config) mapping each key to its tenant, or to its tenant and that tenant's quotas:

    sk-team-a-0123456789: team-a
    sk-team-b-abcdefghij: {tenant: team-b, max_facts: 100000, max_kv_bytes: 8589934592, max_in_flight: 8}

Quotas (`QUOTA_FIELDS`) can also be set per tenant under `quotas:` in the config (the way to bound
the single tenant "default" of open mode). A tenant without a limit is unlimited in it.

No keys at all is *open mode*: every request belongs to the single tenant "default".
Every invalid value raises `ValueError` naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from inferscale.common.modes import SERVER_MODES, WHOLE_MEMORY
from inferscale.common.prompt.recovery import connector_policy
from inferscale.config import (
    EngineSettings,
    check_bool,
    check_float,
    check_int,
    check_str,
)
from inferscale.default_model import default_memory_root
from inferscale.models import MODELS

OPEN_TENANT = "default"
QUOTA_FIELDS = ("max_facts", "max_kv_bytes", "max_in_flight")  # per tenant: facts, bytes of KV, requests at once
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")  # fullmatch: "$" would admit a final newline


def validate_tenant(tenant: object, where: str = "tenant") -> str:
    """Tenant names: 1-64 letters, digits or '_.-' (no ':', which separates tenant and user)."""
    if not isinstance(tenant, str) or not _TENANT_RE.fullmatch(tenant):
        raise ValueError(f"{where}: invalid tenant {tenant!r}: use 1-64 letters, digits or '_.-', "
                         "starting with a letter or digit")
    return tenant


@dataclass(frozen=True)
class ServerConfig(EngineSettings):
    """Every setting of `inferscale serve`: the shared `EngineSettings` and the server's own."""

    # the model and its memory
    model: str | None = None  # Hugging Face folder; None = the packaged SmolLM2-135M-Instruct
    memory_root: str = field(default_factory=default_memory_root)
    served_model_name: str | None = None  # the `model` name clients send; default: the folder's name
    engine_url: str = ""  # http(s):// URL of a `vllm serve` with the InferScale connector ("" = vLLM in process)
    engine_model: str = ""  # the name that server serves the model under ("" = the model folder, as given)
    # network
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    # tenancy
    api_keys_file: str | None = None
    api_keys: Mapping[str, str] = field(default_factory=dict)  # key -> tenant; empty = open mode
    quotas: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # tenant -> {QUOTA_FIELDS: limit}
    sweep_interval_s: float = 60.0  # how often expired facts are forgotten completely (0: never; reads skip them)
    # load behaviour
    max_concurrent: int = 16  # chat requests inside the engine at once
    max_queued: int = 64  # chat requests waiting for a slot; beyond: 429
    request_timeout_s: float = 120.0  # whole request (queue + retrieval + generation); beyond: 504
    # request defaults and limits
    default_k: int | str = 10  # facts a chat retrieves when it does not say, or "all" (the whole memory)
    max_k: int = 100
    default_mode: str = "auto"
    default_policy: str = "none"  # recovery policy of injected memory: none, last:N or all
    default_max_tokens: int = 256
    remember: bool = False  # chats store their exchange and extract facts from it (memory.remember overrides)
    # who extracts facts from added messages: "" the served model through the engine (no second model
    # in memory), or an OpenAI-compatible endpoint's /v1 root with its model (key: extraction_api_key_env)
    extraction_url: str = ""
    extraction_model: str = ""
    extraction_api_key_env: str = "OPENAI_API_KEY"
    # request size limits, checked before the work they would cost (body: 413 before it is read;
    # items: 413; characters: 400 naming the field)
    max_body_bytes: int = 8 * 1024 * 1024  # any request body (Content-Length, or counted as it streams)
    max_add_items: int = 1000  # facts + turns in one POST /v1/memories/{user}
    max_query_chars: int = 16384  # the chat question (last user message) and a search query
    max_text_chars: int = 32768  # a fact's or a turn's text (add and update)
    # debugging: lets /health read the connector's pending state inside the engine process (needs
    # vLLM's pickle-based IPC, VLLM_ALLOW_INSECURE_SERIALIZATION=1, set by the entry point)
    engine_probe: bool = False
    log_level: str = "info"

    def __post_init__(self) -> None:
        check_str("model", self.model, optional=True)
        if self.model is not None and not Path(self.model, "config.json").is_file():
            if self.model not in MODELS:
                raise ValueError(f"model must be a Hugging Face folder with config.json or one of "
                                 f"{', '.join(MODELS)}, got {self.model!r}")
        check_str("memory_root", self.memory_root)
        check_str("served_model_name", self.served_model_name, optional=True)
        super().__post_init__()
        for name in ("engine_url", "engine_model"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string (a URL, or empty), got {getattr(self, name)!r}")
        if self.engine_url and not self.engine_url.startswith(("http://", "https://")):
            raise ValueError(f"engine_url must be an http(s):// URL of a vllm serve, got {self.engine_url!r}")
        if self.engine_url and self.engine_probe:
            raise ValueError("engine_probe needs vLLM in this process; it cannot probe a remote engine_url")
        check_str("host", self.host)
        check_int("port", self.port, 0, 65535)
        check_str("api_keys_file", self.api_keys_file, optional=True)
        if not isinstance(self.api_keys, Mapping):
            raise ValueError(f"api_keys must map API keys to tenants, got {type(self.api_keys).__name__}")
        for key, tenant in self.api_keys.items():
            if not isinstance(key, str) or len(key.strip()) < 8 or key != key.strip():
                raise ValueError("api_keys: every key must be a string of at least 8 characters without "
                                 "surrounding spaces")
            validate_tenant(tenant, "api_keys")
        if not isinstance(self.quotas, Mapping):
            raise ValueError(f"quotas must map tenants to their limits, got {type(self.quotas).__name__}")
        for tenant, limits in self.quotas.items():
            validate_tenant(tenant, "quotas")
            if not isinstance(limits, Mapping):
                raise ValueError(f"quotas.{tenant} must map limits ({', '.join(QUOTA_FIELDS)}) to integers")
            for name, value in limits.items():
                if name not in QUOTA_FIELDS:
                    raise ValueError(f"quotas.{tenant}: unknown limit {name!r}; known: {', '.join(QUOTA_FIELDS)}")
                check_int(f"quotas.{tenant}.{name}", value, 1)
        check_float("sweep_interval_s", self.sweep_interval_s, 0.0)
        check_int("max_concurrent", self.max_concurrent, 1)
        check_int("max_queued", self.max_queued, 0)
        check_float("request_timeout_s", self.request_timeout_s, 0.0)
        if self.default_k != WHOLE_MEMORY:
            check_int("default_k", self.default_k, 0)
        check_int("max_k", self.max_k, 1)
        if self.default_k != WHOLE_MEMORY and self.default_k > self.max_k:
            raise ValueError(f"default_k ({self.default_k}) must be <= max_k ({self.max_k})")
        if self.default_mode not in SERVER_MODES:
            raise ValueError(f"default_mode must be one of {SERVER_MODES}, got {self.default_mode!r}")
        if not isinstance(self.default_policy, str):
            raise ValueError(f"default_policy must be a string, got {self.default_policy!r}")
        try:
            connector_policy(self.default_policy)
        except ValueError as e:
            raise ValueError(f"default_policy: {e}") from None
        check_int("default_max_tokens", self.default_max_tokens, 1)
        check_int("max_body_bytes", self.max_body_bytes, 1024)
        check_int("max_add_items", self.max_add_items, 1)
        check_int("max_query_chars", self.max_query_chars, 1)
        check_int("max_text_chars", self.max_text_chars, 1)
        check_bool("engine_probe", self.engine_probe)
        check_bool("remember", self.remember)
        for name in ("extraction_url", "extraction_model"):  # "" : the served model extracts
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        check_str("extraction_api_key_env", self.extraction_api_key_env)
        if self.extraction_url and not self.extraction_url.startswith(("http://", "https://")):
            raise ValueError(f"extraction_url must be an http(s) URL (the /v1 root), got {self.extraction_url!r}")
        if bool(self.extraction_url) != bool(self.extraction_model):
            raise ValueError("extraction_url and extraction_model go together: name the endpoint's model")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"log_level must be critical, error, warning, info, debug or trace, "
                             f"got {self.log_level!r}")

    @property
    def open_mode(self) -> bool:
        return not self.api_keys

    def model_name(self, model_dir: str | Path) -> str:
        return self.served_model_name or Path(model_dir).name

    def memory_llm_config(self, model_dir: str | Path):
        """The `MemoryLLMConfig` of the composer and engine this server runs."""
        from inferscale.serving.memory_llm import MemoryLLMConfig

        return MemoryLLMConfig(model=str(model_dir), memory_root=self.memory_root, **self.engine_settings())

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def from_sources(cls, config_file: str | Path | None = None, **overrides: Any) -> "ServerConfig":
        """Defaults < YAML `config_file` < `overrides` (flags given on the command line); then the
        API keys file (if any) is read into `api_keys`."""
        values: dict[str, Any] = {}
        if config_file is not None:
            values.update(load_yaml_mapping(config_file, "config"))
        unknown = set(values) - cls.field_names()
        if unknown:
            raise ValueError(f"config file {str(config_file)!r}: unknown setting(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted(cls.field_names()))}")
        bad = set(overrides) - cls.field_names()
        if bad:
            raise ValueError(f"unknown setting(s) {', '.join(sorted(bad))}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        keys_file = values.get("api_keys_file")
        if keys_file is not None:
            check_str("api_keys_file", keys_file)
            if values.get("api_keys"):
                raise ValueError("api_keys and api_keys_file are both set; use one")
            values["api_keys"], file_quotas = load_api_keys(keys_file)
            quotas = dict(values.get("quotas") or {})
            for tenant, limits in file_quotas.items():
                if tenant in quotas and dict(quotas[tenant]) != limits:
                    raise ValueError(f"quotas of tenant {tenant!r} are set both in the config and in api_keys_file; "
                                     "set them in one place")
                quotas[tenant] = limits
            values["quotas"] = quotas
        return cls(**values)


def load_yaml_mapping(path: str | Path, what: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} file not found: {str(path)!r}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"{what} file {str(path)!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    return data


def load_api_keys(path: str | Path) -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    """(key -> tenant, tenant -> quotas) from a YAML file of `key: tenant` or `key: {tenant: ...,
    <quota>: N}` entries (each validated by `ServerConfig`); two keys of one tenant may not give
    it different quotas."""
    data = load_yaml_mapping(path, "api_keys_file")
    if not data:
        raise ValueError(f"api_keys_file {str(path)!r} holds no keys (remove it to serve in open mode)")
    keys: dict[str, str] = {}
    quotas: dict[str, dict[str, int]] = {}
    where = f"api_keys_file {str(path)!r}"
    for key, entry in data.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: keys must be strings, got {key!r}")
        limits: dict[str, int] = {}
        if isinstance(entry, Mapping):
            limits = {k: v for k, v in entry.items() if k != "tenant"}
            entry = entry.get("tenant")
        tenant = keys[key] = validate_tenant(entry, where)
        if limits:
            if quotas.get(tenant, limits) != limits:
                raise ValueError(f"{where}: two keys of tenant {tenant!r} give it different quotas")
            quotas[tenant] = limits
    return keys, quotas
