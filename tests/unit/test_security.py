"""Security rules as tests: nothing in the tree unpickles, loads a torch pickle, evaluates
strings, loads YAML unsafely or runs a shell; internal services bind to loopback unless an
address is given. (Issue 16; the API-key checks before any work are in the gateway tests.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "wiring", "scheduler_svc", "worker_svc", "kvcache_svc", "gateway", "bench", "scripts", "tests")
UNSAFE_MODULES = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "pb" not in path.relative_to(ROOT).parts[:2]:  # generated protobuf code
                yield path


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            out.append(f"{where}: from {node.module} import")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in (
                "eval",
                "exec",
                "compile",
                "__import__",
                "os.system",
                "os.popen",
                "torch.load",
                "pickle.loads",
                "numpy.load",
                "np.load",
            ):
                out.append(f"{where}: {name}(...)")
            if name in ("yaml.load", "yaml.load_all") and not any(
                k.arg == "Loader" and "Safe" in _dotted(k.value) for k in node.keywords
            ):
                out.append(f"{where}: {name} without a safe loader")
            for k in node.keywords:
                if k.arg == "shell" and not (isinstance(k.value, ast.Constant) and k.value.value is False):
                    out.append(f"{where}: {name}(..., shell=...)")
    return out


def test_no_pickle_eval_unsafe_yaml_or_shell_anywhere():
    sources = list(_sources())
    assert len(sources) > 100
    found = [f for path in sources for f in findings(path)]
    assert found == [], "\n".join(found)


def test_the_scan_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nimport yaml, subprocess, torch\nx = eval('1')\ntorch.load('m.pt')\n"
        "yaml.load(s)\nsubprocess.run('ls', shell=True)\nmodel.eval()\n"
        "yaml.load(s, Loader=yaml.SafeLoader)\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        got = findings(bad)
    finally:
        ROOT = saved
    assert [g.split(": ", 1)[1] for g in got] == [
        "import pickle",
        "eval(...)",
        "torch.load(...)",
        "yaml.load without a safe loader",
        "subprocess.run(..., shell=...)",
    ]


@pytest.mark.parametrize(
    ("command", "required"),
    [
        ("worker", ["--model", "m"]),
        ("kvcache", []),
        ("scheduler", ["--model", "m", "--kvcache", "127.0.0.1:1", "--stages", "127.0.0.1:2"]),
        ("gateway", ["--model", "m", "--scheduler", "127.0.0.1:1"]),
    ],
)
def test_services_bind_loopback_unless_told(command, required, monkeypatch):
    """Each service's listening address defaults to 127.0.0.1; a flag (or PAGODA_HOST) must
    ask for more."""
    from wiring.cli import build_parser

    for name in ("PAGODA_HOST", "PAGODA_MODEL", "PAGODA_KVCACHE", "PAGODA_STAGES", "PAGODA_SCHEDULER"):
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args([command, *required])
    assert args.host == "127.0.0.1"
