"""The scheduler's registry of LoRA adapters: which adapters the stages serve, under which
identity, and what a stage that reconnects must load or unload to serve them too.

    LoraRegistry.admit(name) -> LoraAdapter     the adapter a new request runs under
    LoraRegistry.sync(held) -> list[StageSync]  per stage: what to unload, what to load

An adapter's identity is its load id: drawn at random at each load through the scheduler,
0 for one a stage loaded itself at start (--lora-modules). The prefix cache keys an
adapter's blocks by name and load id (`lora_namespace`), so an adapter reloaded
under its old name with other weights never meets the old one's KV: the old blocks are
fenced off and age out of the cache like any unused prefix.

The stages report what they hold (name, folder, load id). A stage that restarted holds
only the adapters of --lora-modules: `sync` says what it lacks (or holds under another
identity), and the scheduler loads those again. The first sync of a scheduler adopts what
the stages hold (a scheduler that restarted learns the adapters loaded before it).

An adapter being unloaded drains: it stays registered (its running requests go on, and a
stage that restarts meanwhile gets it back) but admits no new request.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler_svc.core.request import Request


class AdapterNotServed(LookupError):
    """A request names an adapter that is not served, or is being unloaded (NOT_FOUND)."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter: the name requests use, the folder it was loaded from, its identity."""

    name: str
    path: str
    load_id: int = 0  # 0: loaded by the stages at start (--lora-modules)


def lora_namespace(model: str | None, name: str, load_id: int) -> str:
    """The prefix cache's namespace of an adapter's blocks under `model`'s: by its name and
    identity, so that blocks of an adapter reloaded under the same name are never shared."""
    return f"{model or ''}/lora:{name}#{load_id:x}"


def request_namespace(model: str | None, request: Request) -> str | None:
    """The prefix cache's namespace of a request's blocks: the model's, and its LoRA adapter's
    (the same prompt under two adapters, or under one name reloaded with other weights, has
    other KV: it never shares blocks)."""
    if not request.lora_name:
        return model
    return lora_namespace(model, request.lora_name, request.lora_load_id)


@dataclass(frozen=True)
class StageSync:
    """What one stage must do to hold exactly the registry's adapters: unload `unload`
    (names it holds that are not registered, or under another identity), then load `load`."""

    unload: tuple[str, ...] = ()
    load: tuple[LoraAdapter, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.unload and not self.load


def new_load_id() -> int:
    """A fresh identity: random, never 0, so that one drawn by a scheduler that restarted
    never repeats one a stage still holds."""
    return secrets.randbits(63) | 1


class LoraRegistry:
    """The adapters the scheduler serves, by name.

    Invariants: every registered adapter is held by every stage under its load id once a
    sync completed (the scheduler loads what a stage lacks, or drops the adapter from all);
    a draining name is registered; a name is registered once."""

    def __init__(self) -> None:
        self._adapters: dict[str, LoraAdapter] = {}
        self._draining: set[str] = set()
        self._adopted = False  # the first sync takes what the stages hold

    @property
    def adapters(self) -> tuple[LoraAdapter, ...]:
        """Every registered adapter, draining ones included."""
        return tuple(self._adapters.values())

    @property
    def served(self) -> tuple[LoraAdapter, ...]:
        """The adapters a new request may run under (not draining)."""
        return tuple(a for a in self._adapters.values() if a.name not in self._draining)

    def get(self, name: str) -> LoraAdapter | None:
        return self._adapters.get(name)

    def is_draining(self, name: str) -> bool:
        return name in self._draining

    def admit(self, name: str) -> LoraAdapter:
        """The adapter a new request under `name` runs under; AdapterNotServed when there is
        none, or it is being unloaded."""
        adapter = self._adapters.get(name)
        if adapter is None:
            served = ", ".join(repr(a.name) for a in self.served) or "none"
            raise AdapterNotServed(f"model: no LoRA adapter {name!r} is loaded (loaded: {served})")
        if name in self._draining:
            raise AdapterNotServed(f"model: the LoRA adapter {name!r} is being unloaded")
        return adapter

    def add(self, adapter: LoraAdapter) -> None:
        if adapter.name in self._adapters:
            raise ValueError(f"lora_name: an adapter {adapter.name!r} is loaded already")
        self._adapters[adapter.name] = adapter

    def drain(self, name: str) -> LoraAdapter:
        """Admit no new request under `name` (KeyError when it is not registered, or
        draining already: one unload at a time)."""
        adapter = self._adapters.get(name)
        if adapter is None or name in self._draining:
            raise KeyError(name)
        self._draining.add(name)
        return adapter

    def resume(self, name: str) -> None:
        """Admit requests under a draining adapter again (its unload was given up)."""
        self._draining.discard(name)

    def remove(self, name: str) -> LoraAdapter | None:
        self._draining.discard(name)
        return self._adapters.pop(name, None)

    def sync(self, held: Sequence[Iterable[LoraAdapter]]) -> list[StageSync]:
        """What each stage (holding `held[i]`) must unload and load to hold exactly the
        registered adapters. The first sync adopts the stages' adapters first: by name, a
        runtime load (load id not 0) before one of --lora-modules, then the first stage's."""
        held = [tuple(h) for h in held]
        if not self._adopted:
            self._adopt(held)
        plans = []
        for adapters in held:
            have = {a.name: a for a in adapters}
            unload = tuple(name for name, a in have.items() if self._adapters.get(name) != a)
            load = tuple(a for a in self._adapters.values() if have.get(a.name) != a)
            plans.append(StageSync(unload, load))
        return plans

    def _adopt(self, held: list[tuple[LoraAdapter, ...]]) -> None:
        for adapters in held:
            for a in adapters:
                mine = self._adapters.get(a.name)
                if mine is None or (mine.load_id == 0 and a.load_id != 0):
                    self._adapters[a.name] = a
        self._adopted = True
