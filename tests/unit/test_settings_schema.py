"""The one settings schema (services/settings.py and the configs' field declarations) against
everything made from it or written beside it.

Generated, and checked here to say what the schema says: each subcommand's flags (names,
aliases, defaults, choices, required), their `PAGODA_*` variables, and what `pagoda serve`
passes on to each service. Written by hand, and checked to use only names the schema
declares: the compose file's variables and the Kubernetes manifests' variables and flags.
Read from the source: the KV-pool flag, the block size and max_model_len are declared once.
"""

from __future__ import annotations

import argparse
import io
import re
import tokenize
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import GatewayConfig
from kvcache_svc.config import KVCacheConfig
from scheduler_svc.config import SchedulerConfig
from services import settings as shared
from services.settings import SERVICES, Bound, Setting
from wiring import k8s, k8s_objects, k8s_options
from wiring.cli import build_parser
from wiring.flags import PARSERS, config_values, flag_args, service_settings
from wiring.serve import passed_flags, serve_settings
from worker_svc.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = (*SERVICES, "serve")
CONFIGS = {"worker": WorkerConfig, "kvcache": KVCacheConfig, "scheduler": SchedulerConfig, "gateway": GatewayConfig}


def schema(command: str) -> tuple[Bound, ...]:
    return serve_settings() if command == "serve" else service_settings(command)


def shared_settings() -> list[Setting]:
    return [v for v in vars(shared).values() if isinstance(v, Setting)]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """The flags' defaults read PAGODA_* when the parser is built: none but the test's."""
    import os

    for name in [n for n in os.environ if n.startswith("PAGODA_")]:
        monkeypatch.delenv(name)


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def spellings(s: Setting) -> set[str]:
    """Every option string a setting's flag answers to."""
    out = {s.flag, *s.aliases}
    if s.kind in ("bool", "auto_bool"):
        out.add("--no-" + s.flag[2:])
    return out


def sample(s: Setting) -> Any:
    """A value of the setting other than its default, as its flag's parser returns it (None:
    the setting has no other value)."""
    if s.choices:
        return next((c for c in s.choices if c != s.default), None)
    return {
        "int": lambda: (s.default or 0) + 3,
        "float": lambda: (s.default or 0.0) + 0.5,
        "fraction": lambda: 0.5,
        "size": lambda: 2**30,
        "limit": lambda: 7,
        "str": lambda: f"x-{s.name}",
        "bool": lambda: not s.default,
        "auto_bool": lambda: False,
        "switch": lambda: True,
        "weights": lambda: {"a": 2.0},
        "names": lambda: ["n1", "n2"],
        "int_list": lambda: (1, 2),
        "port": lambda: (s.default or 0) + 3,
        "nonzero_port": lambda: (s.default or 9000) + 3,
    }[s.kind]()


def as_text(s: Setting, value: Any) -> str:
    """`value` as its PAGODA_* variable holds it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if s.kind == "weights":
        return ",".join(f"{k}={v}" for k, v in value.items())
    if s.kind in ("names", "int_list"):
        return " ".join(map(str, value)) if s.kind == "names" else ",".join(map(str, value))
    return str(value)


def required_args(command: str, but: str = "") -> list[str]:
    """Values for the subcommand's required flags (all but `but`)."""
    out = []
    for b in schema(command):
        if command != "serve" and b.setting.required and b.setting.name != but:
            out += flag_args(b.setting, sample(b.setting))
    return out


def parse(command: str, *argv: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *required_args(command), *argv])


# --- the subcommands: generated from the schema -------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_each_setting_is_a_flag_of_its_subcommand_as_declared(command):
    actions = {o: a for a in subparser(command)._actions for o in a.option_strings}
    declared: set[str] = {"-h", "--help"}
    for b in schema(command):
        s = b.setting
        if command == "serve":
            assert s.serve != "none", s.name
        else:
            assert command in s.services, f"{command} takes {s.name}, which does not name it"
        if not s.command_line:  # a secret: its variable only
            assert not spellings(s) & set(actions), s.name
            continue
        declared |= spellings(s)
        action = actions[s.flag]
        assert {o for o in spellings(s) if actions[o].dest == b.dest} == spellings(s), s.name
        assert (action.dest, action.default, action.metavar) == (b.dest, s.default, s.metavar), s.name
        assert tuple(action.choices or ()) == tuple(s.choices or ()), s.name
        assert action.required == (s.required and command != "serve"), s.name
    # and nothing else: no flag written by hand beside the schema
    assert set(actions) == declared


def test_each_service_takes_every_setting_that_names_it():
    declarations = {id(b.setting): b.setting for c in SERVICES for b in service_settings(c)}
    for s in [*declarations.values(), *shared_settings()]:
        for service in s.services:
            assert any(b.setting == s for b in service_settings(service)), f"{service} lacks {s.name}"


def test_a_setting_of_several_services_is_one_shared_declaration():
    """One name, one declaration: a setting two services take is services/settings.py's (so
    it has one flag, one variable, one default everywhere), and names its owner."""
    by_name: dict[str, list[Setting]] = {}
    for command in SERVICES:
        for b in service_settings(command):
            by_name.setdefault(b.setting.name, []).append(b.setting)
    declared_shared = [id(s) for s in shared_settings()]
    for name, found in by_name.items():
        if name == "port":  # each service's own port; the gateway's defaults to 8000, the others' pick one
            assert {s.default for s in found} == {0, 8000}
            continue
        if len(found) > 1:
            assert all(s is found[0] for s in found) and id(found[0]) in declared_shared, name
    for s in shared_settings():
        assert s.owner in (None, *s.services), s.name
    # the settings the issue names: one owner each, one flag everywhere
    assert (
        shared.BLOCK_SIZE.owner,
        shared.NUM_KV_BLOCKS.owner,
        shared.MAX_MODEL_LEN.owner,
        shared.MAX_NUM_BATCHED_TOKENS.owner,
    ) == ("kvcache", "kvcache", "scheduler", "scheduler")
    assert shared.NUM_KV_BLOCKS.flag == "--num-kv-blocks"
    assert SchedulerConfig().max_num_batched_tokens == WorkerConfig(model="m").max_num_batched_tokens


@pytest.mark.parametrize("command", COMMANDS)
def test_each_variable_gives_its_flags_default(command, monkeypatch):
    for b in schema(command):
        s, value = b.setting, sample(b.setting)
        if not s.command_line or value is None:
            continue
        monkeypatch.setenv(s.variable, as_text(s, value))
        args = build_parser().parse_args([command, *required_args(command, but=s.name)])
        want = value if s.env else s.default  # (a ready file is never read from the environment)
        assert getattr(args, b.dest) == want, s.variable
        monkeypatch.delenv(s.variable)


@pytest.mark.parametrize("command", SERVICES)
def test_the_config_is_made_of_the_parsed_flags(command):
    """Every field that carries a setting gets the flag's value."""
    argv, want = [], {}
    for b in service_settings(command):
        value = sample(b.setting)
        if b.field is None or value is None or b.setting.required:
            continue
        argv += flag_args(b.setting, value)
        want[b.field] = tuple(value) if isinstance(value, list) else value
    values = config_values(
        service_settings(command), build_parser().parse_args([command, *required_args(command), *argv])
    )
    assert {k: values[k] for k in want} == want
    assert set(values) <= {f for f in CONFIGS[command].__dataclass_fields__}


# --- pagoda serve's pass-through ----------------------------------------------------------


def test_serve_passes_each_setting_to_exactly_its_services():
    passed = [b.setting for b in serve_settings() if b.setting.serve == "pass"]
    assert {s.name for s in passed} >= {
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_model_len",
        "dtype",
        "enable_prefix_caching",
        "grace_period",
        "scheduler_policy",
    }
    for s in passed:
        value = sample(s)
        if value is None:
            continue
        args = build_parser().parse_args(["serve", *flag_args(s, value)])
        assert getattr(args, s.name) == value, s.name
        for service in SERVICES:
            flags = passed_flags(args, service)
            if service in s.serve_passes_to:
                assert getattr(parse(service, *flags), s.name) == value, (s.name, service)
            else:
                assert not spellings(s) & set(flags), (s.name, service)
    defaults = build_parser().parse_args(["serve"])
    assert [passed_flags(defaults, service) for service in SERVICES] == [[]] * len(SERVICES)


def test_serve_passes_a_value_the_environment_would_not_give():
    """A service reads the same variables as serve (it inherits serve's environment): serve
    passes what differs from them, even a value that is the declared default."""
    import os

    os.environ["PAGODA_MAX_NUM_SEQS"] = "9"
    try:
        args = build_parser().parse_args(["serve", "--max-num-seqs", "256"])
        assert passed_flags(args, "scheduler") == passed_flags(args, "worker") == ["--max-num-seqs", "256"]
        assert passed_flags(build_parser().parse_args(["serve"]), "worker") == []  # (9: the stage reads it)
    finally:
        del os.environ["PAGODA_MAX_NUM_SEQS"]


# --- the compose file: its variables are declared settings of the services given them -----

_REFERENCE = re.compile(r"\$\{(PAGODA_[A-Z0-9_]+)(?::?[-?]([^}]*))?\}")
# compose's own: the host folder mounted as the model, the host file given as the keys secret
COMPOSE_ONLY = {"PAGODA_MODEL_DIR", "PAGODA_API_KEYS_FILE"}


def _strings(node: Any):
    if isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
    elif isinstance(node, str):
        yield node


def _config(command: str, env: dict[str, str], monkeypatch) -> object:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args([command, *required_args(command)])
    for name in env:
        monkeypatch.delenv(name)
    return CONFIGS[command](**config_values(service_settings(command), args))


def test_the_compose_files_variables_are_settings_of_the_services_given_them(monkeypatch):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    used = set()
    for name, service in compose["services"].items():
        if service.get("image") != "pagoda:local":
            continue
        command = service["command"][0]
        variables = {b.setting.variable: b.setting for b in service_settings(command) if b.setting.env}
        for key, value in (service.get("environment") or {}).items():
            assert key in variables, f"{name}: {key} is no setting of `pagoda {command}`"
            for ref, default in _REFERENCE.findall(str(value)):
                assert ref == key, f"{name}: {key} is given {ref}"
                used.add(ref)
                owner = variables[key].owner
                if default and owner in CONFIGS:  # a default written here is the owner's own
                    assert _config(owner, {key: default}, monkeypatch) == _config(owner, {}, monkeypatch), key
        for previous, arg in zip(service["command"], service["command"][1:], strict=False):
            for ref, _ in _REFERENCE.findall(str(arg)):
                assert ref in variables and previous in spellings(variables[ref]), f"{name}: {ref} given to {previous}"
                used.add(ref)
    everywhere = {ref for text in _strings(compose) for ref, _ in _REFERENCE.findall(text)}
    assert everywhere - used == COMPOSE_ONLY
    # the block size is the services' own default, not a copy
    assert compose["x-kv-layout"]["PAGODA_BLOCK_SIZE"] == "${PAGODA_BLOCK_SIZE:-}"


# --- the Kubernetes manifests: declared variables and flags --------------------------------


def _engine_settings() -> dict[str, str]:
    """A value for every setting a `--set` may carry (declared, read from a variable, not one
    the manifests set themselves)."""
    out = {}
    for command in SERVICES:
        for b in service_settings(command):
            s, value = b.setting, sample(b.setting)
            if s.env and s.command_line and value is not None and s.name not in k8s_options.RESERVED_SETTINGS:
                out[s.name] = as_text(s, value)
    return out


@pytest.mark.parametrize(
    "options",
    [
        k8s_options.K8sOptions(),
        k8s_options.K8sOptions(
            replicas=2,
            pipeline_parallel_size=3,
            tensor_parallel_size=2,
            gpus=True,
            gpu_memory_utilization=0.9,
            served_model_names=("a", "b"),
            engine=_engine_settings(),
        ),
    ],
    ids=["default", "every-setting"],
)
def test_the_manifests_use_only_declared_variables_and_flags(options):
    manifests = k8s.render(options)
    config_maps = {m["metadata"]["name"]: m["data"] for m in manifests if m["kind"] == "ConfigMap"}
    variables = {
        c: {b.setting.variable for b in service_settings(c) if b.setting.env or not b.setting.command_line}
        for c in SERVICES
    }
    for m in manifests:
        if m["kind"] not in ("Deployment", "StatefulSet") or m["metadata"]["name"] == k8s_options.REDIS:
            continue
        command = m["metadata"]["labels"][k8s_objects.COMPONENT_LABEL]
        container = m["spec"]["template"]["spec"]["containers"][0]
        for var in container["env"]:
            assert var["name"] in variables[command], f"{command}: {var['name']}"
        for source in container["envFrom"]:  # one ConfigMap for every component: some must read each
            for name in config_maps[source["configMapRef"]["name"]]:
                assert any(name in v for v in variables.values()), name
        flags = {o for b in service_settings(command) for o in spellings(b.setting)}
        replica = m["metadata"]["labels"].get(k8s_objects.REPLICA_LABEL)
        argvs = (
            [k8s.worker_args(options, replica, k) for k in range(options.pipeline_parallel_size)]
            if command == "worker"
            else [container["args"]]
        )
        for argv in argvs:
            assert argv[0] == command
            assert {a for a in argv if a.startswith("-")} <= flags, command
    # what the manifests set themselves are settings (num_blocks: the pool's old name)
    declared = {b.setting.name for c in SERVICES for b in service_settings(c)}
    assert k8s_options.RESERVED_SETTINGS - declared == {"num_blocks"}


# --- declared once --------------------------------------------------------------------------

PRODUCT = ("services", "wiring", "gateway", "scheduler_svc", "worker_svc", "kvcache_svc")  # (bench/: its own)


def _string_tokens(path: Path) -> list[str]:
    return [
        t.string for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline) if t.type == tokenize.STRING
    ]


def _setting_declarations(path: Path) -> list[str]:
    """The names of the `Setting(...)` calls in a module."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Setting":
            if node.args and isinstance(node.args[0], ast.Constant):
                out.append(node.args[0].value)
    return out


def test_the_kv_pool_flag_block_size_and_max_model_len_are_declared_once():
    flags = {'"--num-kv-blocks"', '"--num-blocks"', '"--block-size"', '"--max-model-len"'}
    written, declared = [], []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "services/pb" in path.as_posix():
                continue
            written += [f"{path.relative_to(ROOT)}: {t}" for t in _string_tokens(path) if t in flags]
            declared += [
                f"{path.relative_to(ROOT)}: {n}"
                for n in _setting_declarations(path)
                if n in ("num_kv_blocks", "block_size", "max_model_len")
            ]
    # each flag is its declaration's `.flag` (the pool's old spelling: an alias in its declaration)
    assert written == ['services/settings.py: "--num-blocks"']
    assert sorted(declared) == [
        "services/settings.py: block_size",
        "services/settings.py: max_model_len",
        "services/settings.py: num_kv_blocks",
    ]
    # a config field of a shared setting's name takes that declaration
    for config in CONFIGS.values():
        for f in config.__dataclass_fields__.values():
            same = [s for s in shared_settings() if s.name == f.name]
            # (the gateway's port: its own; the scheduler's trace file: PAGODA_TRACE_FILE's value
            # when PAGODA_TRACE_SCHEDULER is on, wiring/cli.py, else None)
            if same and f.name not in ("port", "trace_file"):
                assert f.metadata.get("setting") is same[0], f"{config.__name__}.{f.name}"
    assert KVCacheConfig.__dataclass_fields__["num_blocks"].metadata["setting"] is shared.NUM_KV_BLOCKS
    from services import defaults

    assert (shared.BLOCK_SIZE.default, shared.MAX_NUM_BATCHED_TOKENS.default) == (
        defaults.BLOCK_SIZE,
        defaults.MAX_NUM_BATCHED_TOKENS,
    )
    assert set(PARSERS) == set(shared.KINDS)


# --- read once: the environment -------------------------------------------------------------
# A PAGODA_* variable is read in one place, services/settings.py (`env_text`, `env_value`): a
# flag's default or a switch. Anywhere else the code may copy the environment for a child
# process, set a variable (for a library, a child) and read only these, which are not Pagoda's:

PROCESS_VARIABLES = {
    "CC": "the C compiler the native kernels are built with, as make takes it",
    "XDG_CACHE_HOME": "where the cache root lies when PAGODA_CACHE_DIR is unset (the XDG base directories)",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "OpenTelemetry's own variable: the span exporter's endpoint when "
    "PAGODA_OTLP_ENDPOINT is unset",
    "ONEDNN_MAX_CPU_ISA": "oneDNN's ISA cap: read to know which units its products will use",
    "ATEN_CPU_CAPABILITY": "torch's ISA cap, read for the same reason",
    "OUT": "the device machine's output folder (scripts/gpu_check.py)",
}
# set, never read: for libraries (tokenizers' fork warning, the hub's progress bars, gloo's
# interface, OpenMP's threads) and for child processes (the stack's secret)
SET_FOR_OTHERS = {
    "TOKENIZERS_PARALLELISM",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "GLOO_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
    "INTERNAL_TOKEN_ENV",
}
SCANNED = (*PRODUCT, "bench", "scripts")
SCHEMA_MODULE = "services/settings.py"  # the one reader


def _name(node) -> str | None:
    """A variable's name as the code writes it: a string, or the constant that holds it."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return getattr(node, "id", None)


def environment_uses(source: str) -> list[str]:
    """Each use of the process environment in `source` that is not allowed outside the schema,
    as "line: what": a read of a variable not in PROCESS_VARIABLES, a variable set that is not
    in SET_FOR_OTHERS, `os.environ` handed on (to be read elsewhere)."""
    import ast

    tree = ast.parse(source)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            out += [f"{node.lineno}: imports os.{a.name}" for a in node.names if a.name in ("environ", "getenv")]
        if not (
            isinstance(node, ast.Attribute)
            and getattr(node.value, "id", None) == "os"
            and node.attr in ("environ", "getenv")
        ):
            continue
        up = parent.get(node)
        if node.attr == "getenv":
            name = _name(up.args[0]) if isinstance(up, ast.Call) and up.args else None
            if name not in PROCESS_VARIABLES:
                out.append(f"{node.lineno}: reads {name}")
        elif isinstance(up, ast.Attribute) and up.attr in ("get", "setdefault", "pop"):
            call = parent.get(up)
            name = _name(call.args[0]) if isinstance(call, ast.Call) and call.args else None
            written = up.attr != "get" and isinstance(parent.get(call), ast.Expr)  # (its value unused)
            if not (name in SET_FOR_OTHERS if written else name in PROCESS_VARIABLES):
                out.append(f"{node.lineno}: {'sets' if written else 'reads'} {name}")
        elif isinstance(up, ast.Subscript):
            name = _name(up.slice)
            if not (name in SET_FOR_OTHERS if isinstance(up.ctx, ast.Store | ast.Del) else name in PROCESS_VARIABLES):
                out.append(f"{node.lineno}: reads {name}")
        elif isinstance(up, ast.Compare):
            out.append(f"{node.lineno}: reads {_name(up.left)}")
        elif not (
            isinstance(up, ast.Dict)
            and None in up.keys  # {**os.environ, ...}: a child's
            or isinstance(up, ast.Call)
            and getattr(up.func, "id", None) == "dict"
        ):  # dict(os.environ)
            out.append(f"{node.lineno}: hands os.environ on")
    return sorted(out, key=lambda use: int(use.split(":")[0]))


def test_the_environment_check_finds_each_read_outside_the_schema():
    source = "\n".join(
        [
            "import os",
            "a = os.environ.get('PAGODA_FUSED_DECODE', '1')",  # 2: a switch read where it is used
            "b = os.environ['PAGODA_CACHE_DIR']",  # 3
            "c = os.getenv('PAGODA_TRACE_FILE')",  # 4
            "d = 'PAGODA_X' in os.environ",  # 5
            "e = os.environ if a else {}",  # 6: handed on, read elsewhere
            "f = os.environ.get(SOME_ENV)",  # 7: through a name
            "os.environ['PAGODA_X'] = '1'",  # 8: set: read by this process later
            "g = os.environ.setdefault('PAGODA_Y', '1')",  # 9: set and read
            "from os import environ",  # 10
            "h = os.environ.get('CC') or os.environ.get('XDG_CACHE_HOME')",  # allowed: not Pagoda's
            "i = {**os.environ, 'OMP_NUM_THREADS': '1'}",  # a child's environment
            "j = dict(os.environ)",
            "os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')",  # set for a library
            "os.environ.setdefault(INTERNAL_TOKEN_ENV, 'x')",  # set for the children
        ]
    )
    assert environment_uses(source) == [
        "2: reads PAGODA_FUSED_DECODE",
        "3: reads PAGODA_CACHE_DIR",
        "4: reads PAGODA_TRACE_FILE",
        "5: reads PAGODA_X",
        "6: hands os.environ on",
        "7: reads SOME_ENV",
        "8: reads PAGODA_X",
        "9: reads PAGODA_Y",
        "10: imports os.environ",
    ]


def test_no_environment_read_outside_the_schema():
    """Every PAGODA_* variable is read through services/settings.py, so its schema lists each
    one (its default, its kind, its owner, the subcommands whose `--help` shows it)."""
    found = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative != SCHEMA_MODULE and "services/pb" not in relative:
                found += [f"{relative}:{use}" for use in environment_uses(path.read_text())]
    assert found == []


def _declared_variables() -> set[str]:
    out = {s.variable for s in shared_settings()}
    for command in COMMANDS:
        out |= {b.setting.variable for b in schema(command) if b.setting.env or not b.setting.command_line}
    return out


def test_every_pagoda_variable_the_code_names_is_a_declared_setting():
    """A PAGODA_* name in the code (a message, a docstring, a child's environment) is one the
    schema declares: no switch lives outside it, none is documented that is not there."""
    declared, named = _declared_variables(), set()
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            for text in _string_tokens(path):
                named |= {
                    f"{path.relative_to(ROOT)}: {v}"
                    for v in re.findall(r"\bPAGODA_[A-Z0-9_]+", text)
                    if v not in declared
                }
    assert sorted(named) == []


def test_each_switch_is_read_through_the_schema_and_listed_in_help(monkeypatch, capsys):
    assert [s.variable for s in shared.SWITCHES if s.command_line or not s.env] == []
    for s in shared.SWITCHES:
        monkeypatch.delenv(s.variable, raising=False)
        assert shared.env_value(s) == s.default, s.name
    monkeypatch.setenv("PAGODA_FUSED_DECODE", " Off ")
    assert shared.env_value(shared.FUSED_DECODE) is False
    monkeypatch.setenv("PAGODA_FUSED_DECODE", "")  # set empty: the default
    assert shared.env_value(shared.FUSED_DECODE) is True
    monkeypatch.setenv("PAGODA_FUSED_DECODE", "maybe")
    with pytest.raises(ValueError, match="PAGODA_FUSED_DECODE"):
        shared.env_value(shared.FUSED_DECODE)
    monkeypatch.setenv("PAGODA_TRACE_SCHEDULER", "1")
    assert shared.env_value(shared.TRACE_SCHEDULER) is True
    assert shared.env_value(shared.TRACE_FILE, {"PAGODA_TRACE_FILE": "t.jsonl"}) == "t.jsonl"
    with pytest.raises(ValueError, match="read from its flag"):
        shared.env_value(shared.MAX_NUM_SEQS)
    # each subcommand's help lists the switches its processes read; serve's, every service's
    for command in COMMANDS:
        text = subparser(command).format_help()
        services = SERVICES if command == "serve" else (command,)
        for s in shared.SWITCHES:
            assert (s.variable in text) == bool(set(s.services) & set(services)), (command, s.variable)


def test_one_boolean_parser():
    from wiring import flags

    assert flags.PARSERS["bool"] is flags.PARSERS["switch"] is shared.parse_bool
    assert [shared.parse_bool(v) for v in ("1", "TRUE", " yes", "on", "0", "False", "no", "off ")] == [True] * 4 + [
        False
    ] * 4
    with pytest.raises(ValueError):
        shared.parse_bool("2")
    copies = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            copies += [
                f"{path.relative_to(ROOT)}" for _ in re.finditer(r"[\"']no[\"'],\s*[\"']off[\"']", path.read_text())
            ]
    assert copies == ["services/settings.py"]


def test_the_planners_defaults_are_the_settings_not_copies():
    from scheduler_svc.core.planner import PlannerConfig
    from services import defaults
    from services.speculative import SpeculativeConfig

    planner, ngram = PlannerConfig(), SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert planner.max_num_seqs == shared.MAX_NUM_SEQS.default == defaults.MAX_NUM_SEQS
    assert (
        (planner.prompt_lookup_min, planner.prompt_lookup_max)
        == (ngram.prompt_lookup_min, ngram.prompt_lookup_max)
        == (defaults.PROMPT_LOOKUP_MIN, defaults.PROMPT_LOOKUP_MAX)
    )
