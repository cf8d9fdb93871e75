"""The form of a setting (services/settings.py declares them all): what one setting is and
how a config field declares one.

A `Setting` is one value a user gives Pagoda: its flag, its variable, its default, its owner,
its kind (how its text is read) and its section of `--help`. Each service's config dataclass
carries its settings as field metadata: `declare` for a setting of its own, `uses` for one of
the shared settings of services/settings.py; `settings_of` lists a config's settings with the
process settings its subcommand takes besides (where it listens, its neighbours, its ready
file). services/settings.py, the public entry, re-exports these names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import NamedTuple

SERVICES = ("worker", "kvcache", "scheduler", "gateway")
# how a flag's text becomes its value: the parsers of wiring/flags.py
KINDS = (
    "int",
    "float",
    "str",
    "bool",
    "auto_bool",
    "switch",
    "weights",
    "size",
    "fraction",
    "limit",
    "int_list",
    "names",
    "port",
    "nonzero_port",
)
# the sections of a subcommand's `--help`, in order, as vLLM's `serve --help` has them: key ->
# (title, what its flags set); every flag is in one (`Setting.group`)
GROUPS = {
    "model": ("Model", "the checkpoint, the names it is served under and how its weights are held"),
    "device": ("Device", "where and how the stages compute"),
    "parallelism": ("Parallelism", "pipeline stages, tensor-parallel ranks and replicas"),
    "cache": ("Cache", "the KV blocks: their size, their number and the memory they take"),
    "scheduler": ("Scheduler", "what one step holds and the order requests run in"),
    "frontend": ("Frontend", "the OpenAI-compatible and gRPC API: keys, limits, chat templates, tool calls"),
    "lora": ("LoRA", "adapters served over the base model"),
    "speculative": ("Speculative decoding", "drafts the model verifies in one step"),
    "network": ("Network", "where each process listens and the services it calls"),
    "supervision": ("Supervision", "logs, metrics, restarts and the ready file"),
}
# what `pagoda serve` does with a setting: "pass" it has the flag and passes a value the user
# changed on to `Setting.passed_to`; "own" it has the flag and sets the services' flags from it
# itself (the launcher); "none" it has no such flag
SERVE_MODES = ("pass", "own", "none")


def variable(name: str) -> str:
    """The environment variable of a setting: `max_num_seqs` -> `PAGODA_MAX_NUM_SEQS`."""
    return "PAGODA_" + name.upper().replace("-", "_")


@dataclass(frozen=True)
class Setting:
    """One setting as users give it. `default` is the flag's default before its variable (None:
    not given, the service decides); a config field may default otherwise (`uses`).

    kind: how the text is read (KINDS): "bool" is --x / --no-x, "auto_bool" the same with
    unset meaning auto, "switch" --x alone, "names" one or more words, "weights" a=3,b=1,
    "size" 4GiB, "fraction" (0, 1], "limit" a positive int or none, "int_list" 3,5, "port"
    0..65535 (0: any free port), "nonzero_port" 1..65535.
    group: its section of `--help` (GROUPS).
    aliases: other spellings of the flag, kept working ("--num-blocks"; "--no-x" for a bool).
    required: a service refuses to start without it (its flag, or its variable).
    env: PAGODA_<NAME> gives the default. command_line: False for a secret, read from its
    variable only (never on a command line that `ps` shows).
    owner: the service whose value the others must agree with (None: each process its own).
    services: the subcommands taking it. serve, passed_to: SERVE_MODES; passed_to defaults
    to every one of `services`.
    """

    name: str
    help: str = ""
    kind: str = "str"
    default: object = None
    choices: tuple[object, ...] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    required: bool = False
    env: bool = True
    command_line: bool = True
    owner: str | None = None
    services: tuple[str, ...] = ()
    serve: str = "none"
    passed_to: tuple[str, ...] | None = None
    group: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"setting {self.name}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.group and self.group not in GROUPS:
            raise ValueError(f"setting {self.name}: group must be one of {', '.join(GROUPS)}, got {self.group!r}")
        if self.serve not in SERVE_MODES:
            raise ValueError(f"setting {self.name}: serve must be one of {', '.join(SERVE_MODES)}")
        if not set(self.services) <= set(SERVICES) or self.owner not in (None, "serve", *SERVICES):
            raise ValueError(f"setting {self.name}: unknown service in {self.services} / {self.owner!r}")
        if self.passed_to is not None and (self.serve != "pass" or not set(self.passed_to) <= set(self.services)):
            raise ValueError(f"setting {self.name}: passed_to names services it passes it to, among its own")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def variable(self) -> str:
        return variable(self.name)

    @property
    def serve_passes_to(self) -> tuple[str, ...]:
        """The services `pagoda serve` hands a changed value to."""
        if self.serve != "pass":
            return ()
        return self.services if self.passed_to is None else self.passed_to


class Bound(NamedTuple):
    """A setting as one subcommand takes it: the parsed value's attribute (`dest`) and the
    config field it fills (None: a process setting, not the config's)."""

    setting: Setting
    dest: str
    field: str | None


SAME = object()  # `uses(setting)`: the field defaults to the setting's own default


def declare(
    service: str,
    default: object = MISSING,
    help: str = "",
    kind: str = "str",
    *,
    name: str = "",
    flag_default: object = SAME,
    **kw,
) -> dataclasses.Field:
    """A config field that is a setting of `service` alone, named as the field unless `name`
    says otherwise (the field then takes the value of the flag of that name). MISSING: the
    field has no default. `flag_default`: the flag's default when it differs from the field's."""
    if flag_default is SAME:
        flag_default = None if default is MISSING else default
    setting = Setting(name, help, kind, flag_default, owner=service, services=(service,), **kw)
    return _field(default, {"setting": setting})


def uses(setting: Setting, default: object = SAME, *, dest: str = "") -> dataclasses.Field:
    """A config field that takes a shared setting, with the setting's default unless `default`
    says otherwise (MISSING: none); `dest`: the parsed attribute when the field keeps an older
    name than the setting's (`KVCacheConfig.num_blocks`)."""
    return _field(setting.default if default is SAME else default, {"setting": setting, "dest": dest})


def _field(default: object, metadata: dict) -> dataclasses.Field:
    if default is MISSING:
        return dataclasses.field(metadata=metadata)
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def settings_of(config: type, *process: Setting) -> tuple[Bound, ...]:
    """A subcommand's settings: `config`'s fields that carry one (in field order, named after
    the field where declared without a name), then `process`."""
    out = []
    for f in dataclasses.fields(config):
        setting = f.metadata.get("setting")
        if setting is None:
            continue
        if not setting.name:
            setting = dataclasses.replace(setting, name=f.name)
        out.append(Bound(setting, f.metadata.get("dest") or setting.name, f.name))
    return (*out, *(Bound(s, s.name, None) for s in process))
