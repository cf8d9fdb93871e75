"""The gateway's configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ApiKey:
    """What a key grants: the tenant and priority class its requests run under."""

    tenant: str = ""
    priority: int = 0


@dataclass(frozen=True)
class GatewayConfig:
    model: str  # checkpoint directory (tokenizer, chat template, max length)
    scheduler_address: str
    served_model_name: str = ""  # default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    api_keys: Mapping[str, ApiKey] = field(default_factory=dict)  # empty: no keys (loopback only)
    max_body_bytes: int = 4 * 1024 * 1024
    max_model_len: int = 4096
    max_n: int = 16
    max_logprobs: int = 20
    max_num_prompts: int = 256  # prompts in one completions request
    grace_period_s: float = 30.0  # in-flight requests' time to finish on SIGTERM

    def __post_init__(self) -> None:
        for name in ("port", "grpc_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name}: must be in [0, 65536), got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be at least 1024, got {self.max_body_bytes}")
        for name in ("max_model_len", "max_n", "max_num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.max_logprobs < 0 or self.grace_period_s < 0:
            raise ValueError("max_logprobs and grace_period_s: must not be negative")
        for key, grant in self.api_keys.items():
            if not isinstance(key, str) or not key or not isinstance(grant, ApiKey):
                raise ValueError("api_keys: must map non-empty key strings to ApiKey")
        if not self.api_keys and not _is_loopback(self.host):
            raise ValueError(
                f"api_keys: binding {self.host} beyond loopback without API keys would open the "
                "server to anyone; configure keys (--api-keys-file) or bind 127.0.0.1"
            )

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @property
    def model_name(self) -> str:
        """The name clients use in `model`: --served-model-name, else the directory's name."""
        return self.served_model_name or Path(self.model).name


def load_api_keys(path: str | Path) -> dict[str, ApiKey]:
    """`{"<key>": {"tenant": "team-a", "priority": 0}, ...}` from a JSON file; ValueError
    naming the file and the entry when it is malformed."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"api keys file {path}: cannot read it as JSON: {exc}") from exc
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"api keys file {path}: must hold a non-empty JSON object "
                         '{"<key>": {"tenant": ..., "priority": ...}}')
    keys = {}
    for n, (key, grant) in enumerate(raw.items()):
        where = f"api keys file {path}: entry {n}"
        if not key or key != key.strip():
            raise ValueError(f"{where}: a key must be a non-empty string without spaces")
        if grant is None:
            grant = {}
        if not isinstance(grant, dict) or set(grant) - {"tenant", "priority"}:
            raise ValueError(f"{where}: must be an object with only 'tenant' and 'priority'")
        tenant, priority = grant.get("tenant", ""), grant.get("priority", 0)
        if not isinstance(tenant, str) or isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"{where}: tenant must be a string and priority an integer")
        keys[key] = ApiKey(tenant=tenant, priority=priority)
    return keys


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
