"""The command line, generated from the settings' declarations (services/settings.py).

Each service's subcommand gets a flag per setting its config declares (`add_settings`), with
the setting's `PAGODA_*` variable as its default (`flag_default`); the parsed flags become
the config (`config_values`); `flag_args` writes a value back as flags (what `pagoda serve`
and the launcher pass on). The value parsers are here, one per `Setting.kind`.
"""

from __future__ import annotations

import argparse
import shutil
import textwrap
from collections.abc import Iterable

from services.settings import GROUPS, SERVICES, Bound, Setting, env_text, parse_bool, switches_of


def names(raw: str) -> list[str]:
    """A list of names from one setting: separated by commas or whitespace."""
    return [n for n in raw.replace(",", " ").split() if n]


def _setting(text: str, convert, ok, expected: str):
    """One optional setting's value: "" (an unset PAGODA_* variable in compose) means none;
    otherwise `convert(text)`, which `ok` must accept."""
    if not text.strip():
        return None
    try:
        value = convert(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from exc
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def optional_limit(text: str) -> int | None:
    """A positive limit, or none."""
    return _setting(text, int, lambda v: v >= 1, "a positive integer")


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def _bytes(text: str) -> int:
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    if raw[len(number) :] not in _BYTE_UNITS:
        raise ValueError(f"unknown unit in {text!r}")
    return int(float(number) * _BYTE_UNITS[raw[len(number) :]])


def byte_size(text: str) -> int | None:
    """A size in bytes: 4294967296, 4GiB, 512MiB, 1.5GB; or none."""
    return _setting(text, _bytes, lambda v: 1 <= v < 2**63, "a size such as 4GiB or 512MiB")


def fraction(text: str) -> float | None:
    """A fraction in (0, 1], or none."""
    return _setting(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def check_tensor_parallel(model_dir: str, size: int) -> None:
    """ValueError when `size` ranks cannot split the checkpoint's heads and MLP evenly (a
    missing or unreadable checkpoint is left to the loader to report)."""
    if size == 1:
        return
    from worker_svc.errors import CheckpointError
    from worker_svc.models.registry import load_config

    try:
        config = load_config(model_dir)
    except CheckpointError:
        return
    config.shard(size)


def _bool_or_auto(text: str) -> bool | None:
    """`PAGODA_ASYNC_SCHEDULING`: "" or "auto" -> None (decided by the stage count)."""
    value = text.strip().lower()
    if value in ("", "auto"):
        return None
    try:
        return parse_bool(value)
    except ValueError:
        raise SystemExit(f"error: expected true, false or auto, got {text!r}") from None


def _tenant_weights(text: str) -> dict[str, float]:
    """`a=3,b=1` -> {"a": 3.0, "b": 1.0}"""
    out = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        name, _, weight = part.partition("=")
        try:
            out[name] = float(weight)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected tenant=weight pairs, got {part!r}") from exc
    return out


def int_list(text: str) -> tuple[int, ...]:
    """`3,5` -> (3, 5)"""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _port(text: str, least: int) -> int:
    """A TCP port, least..65535 (an int past it ended in OverflowError where it was bound)."""
    expected = "a port in 0..65535 (0: any free one)" if least == 0 else f"a port in {least}..65535"
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not least <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def port(text: str) -> int:
    """A port to listen on; 0: any free one (the ready file says which)."""
    return _port(text, 0)


def nonzero_port(text: str) -> int:
    """A port to listen on that others must know in advance (a metrics port): 1..65535."""
    return _port(text, 1)


# Setting.kind -> how its text (a flag's value, a variable) is read
PARSERS = {
    "int": int,
    "float": float,
    "str": str,
    "bool": parse_bool,
    "switch": parse_bool,
    "auto_bool": _bool_or_auto,
    "weights": _tenant_weights,
    "size": byte_size,
    "fraction": fraction,
    "limit": optional_limit,
    "int_list": int_list,
    "names": names,
    "port": port,
    "nonzero_port": nonzero_port,
}


# vLLM's other names of a dtype (`--dtype half`), taken by a setting whose choices are dtypes
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _choice_aliases(setting: Setting) -> dict[str, str]:
    """The other spellings a setting's choices answer to (a dtype's vLLM names)."""
    if setting.choices and set(DTYPE_ALIASES.values()) <= set(setting.choices):
        return DTYPE_ALIASES
    return {}


def parser_of(setting: Setting):
    """How the setting's text (a flag's value, a variable) is read: its kind's parser, an
    alias of a choice read as that choice."""
    parse, aliases = PARSERS[setting.kind], _choice_aliases(setting)
    if not aliases:
        return parse
    return lambda text: aliases.get(text.strip().lower(), None) or parse(text)


def flag_default(setting: Setting):
    """The flag's default: its variable's value when set, else the declared default (set empty,
    as compose's ${X:-}: unset, but for a plain string)."""
    if not setting.env:
        return setting.default
    raw, parse = env_text(setting), parser_of(setting)
    if raw is None or (raw == "" and parse is not str):
        return setting.default
    try:
        return parse(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise SystemExit(f"error: {setting.variable}={raw!r}: {exc}") from None


def _shown(value) -> str | None:
    """A default as `--help` shows it; None: nothing worth showing (unset, off, empty)."""
    if value is None or value is False or value in ("", (), [], {}):
        return None
    if value is True:
        return "on"
    if isinstance(value, dict):
        value = ",".join(f"{k}={v}" for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        value = " ".join(map(str, value))
    return str(value).replace("%", "%%")  # (argparse formats help with %)


def help_text(setting: Setting, default) -> str | None:
    """The flag's help: the declaration's, with the default the flag has (its variable's when
    set) where the text does not already say it, and the other spellings of its choices."""
    text, more = setting.help or "", []
    aliases = _choice_aliases(setting)
    if aliases:
        more.append(f"{' and '.join(aliases)}: vLLM's names of {' and '.join(aliases.values())}")
    shown = _shown(default)
    if shown is not None and "default" not in text:
        more.append(f"default: {shown}")
    if more:
        text += f" ({'; '.join(more)})"
    return text.strip() or None


def add_settings(p: argparse.ArgumentParser, settings: Iterable[Bound], *, optional: bool = False) -> None:
    """A flag per setting (its aliases too), its default from `PAGODA_<NAME>`, shown in its
    help, in its section of the help (`Setting.group`; the sections in GROUPS' order).
    `optional`: none is required (`pagoda serve` supplies the services' required ones itself)."""
    flags = [b for b in settings if b.setting.command_line]
    used = {b.setting.group for b in flags}
    sections = {
        key: p.add_argument_group(title, description) for key, (title, description) in GROUPS.items() if key in used
    }
    for bound in flags:
        _add_flag(sections.get(bound.setting.group, p), bound, optional)
    add_environment_help(p, [b.setting for b in settings])


def add_environment_help(p: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    """The settings read from their variable only (a switch, a secret), listed after the flags."""
    only = [s for s in settings if s.env and not s.command_line]
    if not only:
        return
    width = min(shutil.get_terminal_size().columns, 100) - 2
    lines = ["environment (no flag: each process reads the variable it inherits):"]
    for s in only:
        shown = ("1" if s.default else None) if isinstance(s.default, bool) else _shown(s.default)
        default = f" (default: {shown})" if shown is not None and "default" not in s.help else ""
        lines += textwrap.wrap(
            f"{s.variable}: {s.help}{default}",
            width,
            initial_indent="  ",
            subsequent_indent="      ",
            break_on_hyphens=False,
        )
    p.epilog = "\n".join(lines)
    p.formatter_class = argparse.RawDescriptionHelpFormatter


def _add_flag(p: argparse._ActionsContainer, bound: Bound, optional: bool) -> None:
    s = bound.setting
    default = flag_default(s)
    common = {"dest": bound.dest, "default": default, "help": help_text(s, default)}
    spellings = [s.flag, *(a for a in s.aliases if not a.startswith("--no-"))]
    if s.kind in ("bool", "auto_bool"):
        action = p.add_argument(*spellings, action=argparse.BooleanOptionalAction, **common)
        if action.help and action.help.count("(default") > 1:  # (Python 3.10's adds its own)
            action.help = action.help.rsplit(" (default", 1)[0]
        for alias in (a for a in s.aliases if a.startswith("--no-")):  # an old spelling of --no-<flag>
            p.add_argument(
                alias, dest=bound.dest, action="store_false", default=argparse.SUPPRESS, help=f"as --no-{s.flag[2:]}"
            )
    elif s.kind == "switch":
        p.add_argument(*spellings, action="store_true", **common)
    else:
        p.add_argument(
            *spellings,
            type=str if s.kind == "names" else parser_of(s),
            choices=s.choices,
            metavar=s.metavar,
            nargs="+" if s.kind == "names" else None,
            required=s.required and not optional and default is None,
            **common,
        )


def flag_args(setting: Setting, value) -> list[str]:
    """`value` as the flags that give it (what `add_settings`' parser reads back as `value`)."""
    if value is None:
        return []
    if setting.kind == "switch":
        return [setting.flag] if value else []
    if setting.kind in ("bool", "auto_bool"):
        return [setting.flag if value else "--no-" + setting.flag[2:]]
    if setting.kind == "names":
        return [setting.flag, *value]
    if setting.kind == "weights":
        return [setting.flag, ",".join(f"{k}={v}" for k, v in value.items())]
    if setting.kind == "int_list":
        return [setting.flag, ",".join(str(v) for v in value)]
    return [setting.flag, str(value)]


def config_values(settings: Iterable[Bound], args: argparse.Namespace) -> dict:
    """A config's fields from the parsed flags: those given (None: the config's default)."""
    out = {}
    for bound in settings:
        value = getattr(args, bound.dest, None)
        if bound.field is not None and value is not None:
            out[bound.field] = tuple(value) if isinstance(value, list) else value
    return out


def service_settings(service: str) -> tuple[Bound, ...]:
    """What `pagoda <service>` takes: its config's settings and its process settings."""
    if service == "worker":
        from worker_svc.config import SETTINGS  # (no torch: the settings only)
    elif service == "kvcache":
        from kvcache_svc.config import SETTINGS
    elif service == "scheduler":
        from scheduler_svc.config import SETTINGS
    elif service == "gateway":
        from gateway.config import SETTINGS
    else:
        raise ValueError(f"unknown service {service!r}; expected one of {', '.join(SERVICES)}")
    return (*SETTINGS, *(Bound(s, s.name, None) for s in switches_of(service)))
