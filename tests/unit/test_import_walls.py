"""The walls between the parts: the torch-free services start fast and light."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "scheduler_svc.server",
        "scheduler_svc.transport",
        "kvcache_svc.server",
        "services.text",
        "wiring.launcher",
        "wiring.cli",
        "gateway.app",
        "gateway.server",
    ],
)
def test_does_not_import_torch(module):
    code = f"import sys, {module}; bad = [m for m in ('torch', 'transformers', 'worker_svc') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_worker_does_not_import_the_scheduler():
    code = (
        "import sys, worker_svc.server; sys.exit(1 if any(m.startswith('scheduler_svc') for m in sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# ----------------------------------------------------------------- the floors, read from the tree
# Every import statement of every product module (lazy ones inside functions included) is read
# from the source, not run: the library (services/) at the bottom, the four services above it,
# the wiring (wiring/) above them, tools and benchmarks (bench/, scripts/) on top.

import ast  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FLOORS = {
    "services": 0,
    "gateway": 1,
    "scheduler_svc": 1,
    "worker_svc": 1,
    "kvcache_svc": 1,
    "wiring": 2,
    "bench": 3,
    "scripts": 3,
}
SERVICES = ("gateway", "scheduler_svc", "worker_svc", "kvcache_svc")
# what one service may import of another: its published client and step types, nothing inside
PUBLIC: dict[str, set[str]] = {}  # no service imports another: contracts live in services/


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in FLOORS:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _import_graph() -> dict[str, set[str]]:
    """module -> the modules of this tree it imports (a `from pkg import mod` names the module)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(filter(None, (resolve(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    target = full if full in mods else resolve(node.module)
                    if target:
                        targets.add(target)
        targets.discard(module)
        graph[module] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_lazy_imports_included():
    assert _circles(_import_graph()) == []


def test_no_floor_imports_a_floor_above_it():
    graph = _import_graph()
    upward = [
        f"{m} -> {t}"
        for m, targets in graph.items()
        for t in targets
        if FLOORS[t.split(".")[0]] > FLOORS[m.split(".")[0]]
    ]
    assert upward == []


def test_services_import_no_other_service_internals_and_only_wiring_imports_several():
    graph = _import_graph()
    wrong = []
    for module, targets in graph.items():
        own = module.split(".")[0]
        others = {t.split(".")[0] for t in targets} & set(SERVICES) - {own}
        if own in SERVICES:
            wrong += [
                f"{module} -> {t}"
                for t in targets
                if t.split(".")[0] in others and t not in PUBLIC.get(t.split(".")[0], ())
            ]
            if len(others) > 1:  # putting services together is the wiring's work
                wrong.append(f"{module} imports several services: {sorted(others)}")
    assert wrong == []
    assert not any(
        t.startswith(("worker_svc", "kvcache_svc")) for m, ts in graph.items() if m.startswith("gateway") for t in ts
    )
    assert not any(t.startswith("scheduler_svc") for m, ts in graph.items() if m.startswith("worker_svc") for t in ts)


# ------------------------------------------------------------------- the stage worker's floors
# worker_svc/ shows its parts (docs/architecture.md "Floors"): the base modules, then kernels,
# weight formats, the layers, the models (architectures and the stage's model), checkpoints,
# the execution of steps, and the service on top; none imports a floor above its own.
WORKER_FLOORS = {
    "worker_svc.errors": 0,
    "worker_svc.config": 0,
    "worker_svc.model_config": 0,
    "worker_svc.kernels": 1,
    "worker_svc.weights": 2,
    "worker_svc.layers": 3,
    "worker_svc.models": 4,
    "worker_svc.checkpoints": 5,
    "worker_svc.execution": 6,
    "worker_svc.service": 7,
    "worker_svc.server": 7,
}


def _worker_floor(module: str) -> int:
    parts = module.split(".")
    name = ".".join(parts[:2])
    assert name in WORKER_FLOORS or module == "worker_svc", f"{module}: in no floor of worker_svc"
    return WORKER_FLOORS.get(name, 0)


def test_the_stage_worker_floors_import_only_downwards():
    graph = _import_graph()
    upward = [
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.startswith("worker_svc.")
        for t in targets
        if t.startswith("worker_svc.") and _worker_floor(t) > _worker_floor(m)
    ]
    assert upward == []


def test_the_stage_worker_keeps_no_flat_module_outside_its_floors():
    flat = sorted(p.stem for p in (ROOT / "worker_svc").glob("*.py") if p.stem != "__init__")
    assert flat == ["config", "errors", "model_config", "server"]
