"""The gateway's configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from functools import partial
from pathlib import Path

from gateway.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from gateway.ratelimit import RateLimit, redacted_url
from services import settings as shared
from services.defaults import MAX_MODEL_LEN, ROUTING_POLICIES
from services.generation_config import check_mode, parse_override
from services.pooling import POOLING_TYPES
from services.settings import Setting, uses

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_GRANT_FIELDS = {"tenant", "priority", "requests_per_minute", "tokens_per_minute", "admin"}
TASKS = ("generate", "embed")  # vLLM's --task values Pagoda takes (both serve everything)


@dataclass(frozen=True)
class ApiKey:
    """What a key grants: the tenant and priority class its requests run under, and its own
    rate limits (None: the gateway's default, --rate-limit-rpm / --rate-limit-tpm)."""

    tenant: str = ""
    priority: int = 0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    admin: bool = False  # may load and unload LoRA adapters at run time

    def __post_init__(self) -> None:
        self.rate_limit  # noqa: B018 - ValueError when a limit is not a positive integer

    @property
    def rate_limit(self) -> RateLimit:
        return RateLimit(self.requests_per_minute, self.tokens_per_minute)


_setting = partial(shared.declare, "gateway", group="frontend")  # (--help's section, unless said)
_passed = partial(_setting, serve="pass")  # `pagoda serve` takes it and passes it to its gateway

_STALL_HELP = (
    "a streaming client that reads nothing for this long, while the gateway holds all it "
    'buffers for it, has its request aborted (finish reason "abort"); 0: never (default 30)'
)


@dataclass(frozen=True)
class GatewayConfig:
    """What `pagoda gateway` was started with. Each field that is a setting carries its
    declaration (services/settings.py): the flags are made from it."""

    model: str = uses(shared.MODEL, MISSING)  # checkpoint directory (tokenizer, chat template, max length)
    scheduler_address: str = _setting(
        MISSING,
        "HOST:PORT of the scheduler; or several replicas' schedulers, NAME=HOST:PORT,NAME=HOST:PORT,... "
        "(the names their KV services publish as --replica-id), and this gateway routes among them",
        name="scheduler",
        required=True,
        group="network",
    )
    prefill_scheduler: str = _setting(
        "",
        "P/D disaggregation (gateway/disaggregation.py): the prefill replicas' schedulers, "
        "NAME=HOST:PORT,...; prompts are computed there and the --scheduler replicas decode, "
        "pulling the prompts' KV blocks (their KV services and stages need --kv-import-blocks)",
        name="prefill_scheduler",
        group="network",
    )
    # (vLLM's --served-model-name)
    served_model_names: tuple[str, ...] = _passed(
        (),
        "the names clients may send as `model`, the first reported in responses (default: the --model "
        "string, and the directory's name)",
        "names",
        name="served_model_name",
        metavar="NAME",
        flag_default=None,
        group="model",
    )
    host: str = uses(shared.HOST)
    port: int = _passed(
        8000, "the REST port: the OpenAI-compatible API under /v1, /health, /metrics, /docs", "port", group="network"
    )
    grpc_port: int = _passed(
        50051, "the public gRPC port: pagoda.v1.Generation, health, reflection", "port", group="network"
    )
    api_keys: Mapping[str, ApiKey] = field(default_factory=dict)  # empty: no keys (loopback only)
    max_body_bytes: int = _passed(
        4 * 1024 * 1024,
        "the largest request body (REST) and request message (gRPC) taken, in bytes; a larger one is refused",
        "int",
        metavar="BYTES",
    )
    max_model_len: int = uses(shared.MAX_MODEL_LEN, MAX_MODEL_LEN)
    # multi-LoRA: a request's `model` may name an adapter (the stages hold them)
    enable_lora: bool = uses(shared.ENABLE_LORA)
    lora_modules: tuple[str, ...] = uses(shared.LORA_MODULES, ())
    max_loras: int = uses(shared.MAX_LORAS)  # (reported to an endpoint picker: vllm:lora_requests_info)
    allow_runtime_lora_updating: bool = uses(shared.ALLOW_RUNTIME_LORA_UPDATING)
    max_n: int = 16
    max_logprobs: int = 20
    max_num_prompts: int = 256  # prompts in one completions request
    grace_period_s: float = _passed(
        30.0,
        "on SIGTERM or Ctrl-C, the seconds in-flight requests get to finish while no new ones are taken",
        "float",
        name="grace_period",
        metavar="SECONDS",
    )
    stream_stall_timeout_s: float = _passed(30.0, _STALL_HELP, "float", name="stream_stall_timeout", metavar="SECONDS")
    metrics_require_key: bool = _setting(
        False, "with API keys, /metrics needs one too (default: open to scrapers, as /health)", "switch"
    )
    # Rate limits: the defaults for keys without their own (or for the one anonymous
    # bucket without keys); None: not limited. redis_url: buckets shared across replicas.
    rate_limit_rpm: int | None = _passed(
        None,
        "requests per minute per API key without its own requests_per_minute (without keys: for "
        "all anonymous use); default: unlimited",
        "limit",
        metavar="N",
    )
    rate_limit_tpm: int | None = _passed(
        None,
        "tokens (prompt + max_tokens) per minute per API key without its own tokens_per_minute; default: unlimited",
        "limit",
        metavar="N",
    )
    redis_url: str = uses(shared.REDIS_URL, "")  # "": buckets in this process (and no prefix index: routing by load)
    # several schedulers (scheduler_address "r0=HOST:PORT,r1=..."): how a request's replica is
    # chosen (gateway/routing.py)
    routing: str = _passed(
        "prefix",
        "with several replicas: prefix (the replica holding most of the prompt's prefix, weighed "
        "against load; needs --redis-url, else by load), least-loaded or round-robin (default "
        "prefix); with --prefill-scheduler it routes the prefill replicas, and the decode ones go by load",
        choices=ROUTING_POLICIES,
        group="parallelism",
    )
    # /v1/embeddings (gateway/embeddings.py), served beside generation by every gateway: how a
    # prompt's final hidden states become its vector (vLLM: --override-pooler-config), and
    # vLLM's --task, taken so that its command lines work (either task serves both)
    pooling_type: str = _passed(
        "LAST",
        "how /v1/embeddings pools a prompt's final hidden states (after the final norm; then "
        "L2-normalized): LAST, the last token's (vLLM's default for decoder models), or MEAN, the "
        "mean over every token (those prompts then skip the prefix cache; default LAST)",
        choices=POOLING_TYPES,
        metavar="TYPE",
        group="model",
    )
    task: str = _passed(
        "generate",
        "vLLM's --task, accepted for its command lines: generate or embed; either way the "
        "server generates and serves /v1/embeddings (default generate)",
        choices=TASKS,
        group="model",
    )
    # vLLM's --tokenizer, --chat-template and --seed: the text side of a request and the seed of
    # those that send none (`pagoda gateway` reads a --chat-template file into `chat_template`
    # and makes `tokenizer` a folder with that template: wiring/model_source.py)
    tokenizer: str | None = _passed(
        None,
        "a tokenizer folder other than the model's (tokenizer.json, tokenizer_config.json), as vLLM's "
        "--tokenizer: the gateway tokenizes and renders chats with it (default: the model's)",
        metavar="DIR",
        group="model",
    )
    chat_template: str | None = _passed(
        None,
        "a chat template in place of the model's, as vLLM's --chat-template: a Jinja file, or the "
        "template itself (default: the model's)",
        metavar="TEMPLATE",
    )
    seed: int | None = _passed(
        None,
        "the seed of every request that sends none, as vLLM's --seed: a request then samples the same "
        "tokens each time it is sent (default: none, each such request draws its own)",
        "int",
        metavar="N",
        group="model",
    )
    # vLLM's --generation-config and --override-generation-config: the sampling of the fields a
    # request leaves out (services/generation_config.py)
    generation_config: str = _passed(
        "auto",
        "where the sampling a request leaves out comes from, as vLLM's: auto (the model's "
        "generation_config.json; for a GGUF file, which has none, llama.cpp's defaults: temperature 0.8, "
        "top_k 40, top_p 0.95, min_p 0.05), vllm (none: temperature 1, no truncation), or a folder "
        "holding a generation_config.json (default auto); a request's own fields win",
        metavar="auto|vllm|DIR",
    )
    override_generation_config: str | None = _passed(
        None,
        "sampling defaults set over --generation-config's, as vLLM's: a JSON object of temperature, "
        "top_p, top_k, min_p, repetition_penalty, e.g. '{\"temperature\": 0.7}'",
        metavar="JSON",
    )
    # vLLM's --enable-auto-tool-choice, --tool-call-parser and --reasoning-parser: how chat
    # replies are read into tool calls and reasoning (gateway/chat_parsing.py)
    enable_auto_tool_choice: bool = _passed(
        False,
        'serve tool_choice "auto" (the default when a chat request has tools): the model answers '
        'freely and its reply is read for tool calls with --tool-call-parser; without it "auto" is '
        "refused (400)",
        "switch",
    )
    tool_call_parser: str | None = _passed(
        None,
        "the model's tool-call syntax, as vLLM's parser of that name reads it: hermes (Qwen2.5, Qwen3, "
        "Hermes: <tool_call>{...}</tool_call>), llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]), "
        "pythonic (Llama 3.2/4: [f(x=1)]), openai (gpt-oss: Harmony's to=functions.NAME messages)",
        choices=tuple(TOOL_CALL_PARSERS),
        metavar="NAME",
    )
    reasoning_parser: str | None = _passed(
        None,
        "return a reasoning model's <think>...</think> part as reasoning_content, apart from the content: "
        "deepseek_r1 (DeepSeek R1 and its distills, QwQ, templates that open <think> in the prompt), qwen3 "
        "(the reply opens <think> itself), openai_gptoss (gpt-oss: Harmony's analysis channel as reasoning, "
        "final as content)",
        choices=tuple(REASONING_PARSERS),
        metavar="NAME",
    )

    def __post_init__(self) -> None:
        from gateway.replicas import parse_targets
        from gateway.routing import POLICIES

        parse_targets(self.scheduler_address)  # ValueError naming what is wrong
        if self.prefill_scheduler:
            parse_targets(self.prefill_scheduler)
        if self.routing not in POLICIES:
            raise ValueError(f"routing: must be one of {', '.join(POLICIES)}, got {self.routing!r}")
        for name in ("port", "grpc_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name}: must be in [0, 65536), got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be at least 1024, got {self.max_body_bytes}")
        for name in ("max_model_len", "max_n", "max_num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        for name in ("max_logprobs", "grace_period_s", "stream_stall_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must not be negative, got {getattr(self, name)}")
        self._check_embeddings()
        if not all(isinstance(n, str) and n.strip() for n in self.served_model_names):
            raise ValueError(f"served_model_names: each must be a non-empty string, got {self.served_model_names!r}")
        for key, grant in self.api_keys.items():
            if not isinstance(key, str) or not key or not isinstance(grant, ApiKey):
                raise ValueError("api_keys: must map non-empty key strings to ApiKey")
        RateLimit(self.rate_limit_rpm, self.rate_limit_tpm)  # ValueError when not positive
        if self.redis_url and not self.redis_url.startswith(_REDIS_SCHEMES):
            raise ValueError(
                f"redis_url: must start with one of {', '.join(_REDIS_SCHEMES)}, got {redacted_url(self.redis_url)!r}"
            )
        self._check_parsers()
        check_mode(self.generation_config)
        parse_override(self.override_generation_config)  # ValueError naming what is wrong
        if not self.api_keys and not _is_loopback(self.host):
            raise ValueError(
                f"api_keys: binding {self.host} beyond loopback without API keys would open the "
                "server to anyone; configure keys (--api-keys-file) or bind 127.0.0.1"
            )

    def _check_parsers(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser: must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser: must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            # as vLLM refuses it: "auto" needs to know the model's tool-call syntax
            raise ValueError(
                "enable_auto_tool_choice: needs --tool-call-parser NAME, the model's tool-call "
                f"syntax ({', '.join(TOOL_CALL_PARSERS)})"
            )

    def _check_embeddings(self) -> None:
        for name, allowed in (("pooling_type", POOLING_TYPES), ("task", TASKS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    @property
    def default_rate_limit(self) -> RateLimit:
        return RateLimit(self.rate_limit_rpm, self.rate_limit_tpm)

    @property
    def rate_limits_enabled(self) -> bool:
        """Whether any limit applies; when none does the gateway builds no limiter at all."""
        return self.default_rate_limit.enabled or any(grant.rate_limit.enabled for grant in self.api_keys.values())

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names clients may send as `model`; the first is the one responses report."""
        return self.served_model_names or default_model_names(self.model)

    @property
    def model_name(self) -> str:
        return self.model_names[0]


# what `pagoda gateway` takes besides its config's settings: the API keys, which become
# `GatewayConfig.api_keys` (wiring/cli.py reads the file)
API_KEYS_FILE = Setting(
    "api_keys_file",
    'a JSON file of API keys and what each grants: {"<key>": {"tenant": "a", "priority": 0, '
    '"requests_per_minute": 60, "tokens_per_minute": 100000}} (each field optional); clients send a key as '
    "`Authorization: Bearer KEY`; with neither this nor --api-key no key is asked for, and the gateway binds "
    "loopback only",
    metavar="FILE",
    owner="gateway",
    services=("gateway",),
    serve="pass",
    group="frontend",
)
# (`pagoda serve` hands its keys to its gateway by environment, never on a command line)
API_KEY = Setting(
    "api_key",
    "keys clients send as `Authorization: Bearer KEY`, as vLLM's --api-key (default "
    "tenant and priority; beside --api-keys-file)",
    "names",
    metavar="KEY",
    owner="gateway",
    services=("gateway",),
    serve="own",
    group="frontend",
)
SETTINGS = shared.settings_of(GatewayConfig, API_KEYS_FILE, API_KEY, shared.INTERNAL_TOKEN)


def default_model_names(model: str) -> tuple[str, ...]:
    """As vLLM: a model is served under the exact `--model` string; Pagoda also accepts the
    folder's name (`/models/qwen` -> ("/models/qwen", "qwen"))."""
    folder = Path(model).name
    return (model,) if not folder or folder == model else (model, folder)


def load_api_keys(path: str | Path) -> dict[str, ApiKey]:
    """`{"<key>": {"tenant": "team-a", "priority": 0, "requests_per_minute": 60,
    "tokens_per_minute": 100000}, ...}` from a JSON file (every field optional); ValueError
    naming the file and the entry when it is malformed."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"api keys file {path}: cannot read it as JSON: {exc}") from exc
    if not isinstance(raw, dict) or not raw:
        raise ValueError(
            f'api keys file {path}: must hold a non-empty JSON object {{"<key>": {{"tenant": ..., "priority": ...}}}}'
        )
    keys = {}
    for n, (key, grant) in enumerate(raw.items()):
        where = f"api keys file {path}: entry {n}"
        if not key or key != key.strip():
            raise ValueError(f"{where}: a key must be a non-empty string without spaces")
        if grant is None:
            grant = {}
        if not isinstance(grant, dict) or set(grant) - _GRANT_FIELDS:
            raise ValueError(
                f"{where}: must be an object with only {', '.join(repr(f) for f in sorted(_GRANT_FIELDS))}"
            )
        tenant, priority = grant.get("tenant", ""), grant.get("priority", 0)
        if not isinstance(tenant, str) or isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"{where}: tenant must be a string and priority an integer")
        rpm, tpm = grant.get("requests_per_minute"), grant.get("tokens_per_minute")
        try:
            RateLimit(rpm, tpm)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        admin = grant.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{where}: admin must be true or false")
        keys[key] = ApiKey(
            tenant=tenant, priority=priority, requests_per_minute=rpm, tokens_per_minute=tpm, admin=admin
        )
    return keys


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
