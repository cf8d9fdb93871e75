"""The shape of the product code: no function a reader cannot hold at once.

Past a screen (80 lines) a function is split into its phases (docs/STYLE: `KVCacheManager.step`
-> `_add` / `_append` / `_write`). Branching is held by ruff's McCabe check (C901 at 15 in
pyproject.toml, run by `make test`); length is held here. Read from the source, nothing run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("services", "wiring", "gateway", "scheduler_svc", "worker_svc", "kvcache_svc", "bench", "scripts")
GENERATED = ("services/pb",)
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600  # past this a module is split into parts (as formatted by `ruff format`)


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for relative, path in product_files(root):
        for node in ast.walk(ast.parse(path.read_text(), relative)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - start + 1
                if lines > limit:
                    found.append(f"{relative}:{node.lineno} {node.name}: {lines} lines")
    return found


def product_files(root: Path = ROOT):
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if not relative.startswith(GENERATED):
                yield relative, path


def long_files(root: Path = ROOT, limit: int = MAX_FILE_LINES) -> list[str]:
    found = []
    for relative, path in product_files(root):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{relative}: {lines} lines")
    return found


def test_the_check_counts_a_long_file(tmp_path):
    package = tmp_path / "wiring"
    package.mkdir()
    (package / "long.py").write_text("x = 1\n" * 601)
    (package / "short.py").write_text("x = 1\n" * 600)
    (tmp_path / "services" / "pb").mkdir(parents=True)
    (tmp_path / "services" / "pb" / "generated_pb2.py").write_text("x = 1\n" * 900)
    assert long_files(tmp_path) == ["wiring/long.py: 601 lines"]


def test_no_product_file_is_longer_than_600_lines():
    """Generated code (services/pb) is the one exception (docs/architecture.md)."""
    assert long_files() == []


def test_ruff_format_is_enforced():
    """`make lint` and `make test` fail on a formatting drift: the check has no `|| true`."""
    makefile = (ROOT / "Makefile").read_text()
    assert "ruff format --check ." in makefile and "--check . ||" not in makefile


def test_the_check_counts_a_long_function(tmp_path):
    package = tmp_path / "services"
    package.mkdir()
    (package / "long.py").write_text("def f():\n" + "    x = 1\n" * 81)
    (package / "short.py").write_text("def g():\n" + "    x = 1\n" * 79)
    assert long_functions(tmp_path) == ["services/long.py:1 f: 82 lines"]


def test_no_product_function_is_longer_than_a_screen():
    assert long_functions() == []


def test_ruff_checks_complexity_at_15():
    import tomllib

    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "C901" in lint["select"]
    assert lint["mccabe"]["max-complexity"] == 15


def test_test_modules_have_distinct_names():
    """pytest imports test modules by their base name (no packages under tests/): two files
    of one name in two folders stop the whole collection."""
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a name"
        seen[path.name] = path
