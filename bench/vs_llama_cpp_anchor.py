"""bench.vs_llama_cpp's anchor: llama-cpp-python from its own virtualenv (shared/anchors/llama-cpp.md).

Run two ways, each with one thread and outside this checkout's environment (`llama_env`):
as a subprocess printing JSON (`run_llama`: the single stream, `Llama.eval` token by token)
and as its OpenAI-compatible server (`llama_server`, for the concurrent streams), which has
no /health (`health_wait_llama` polls /v1/models).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.machine import run_json
from bench.server_process import Server
from wiring.launcher import free_port

LLAMA_SCRIPT = r"""
import json, sys, time, statistics
import llama_cpp
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
t0 = time.perf_counter()
llm = Llama(model_path=cfg["model"], n_ctx=1024, n_threads=1, n_threads_batch=1, verbose=False)
load_s = time.perf_counter() - t0
runs = []
for i, prompt in enumerate(cfg["prompts"]):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    out = [llm.sample(temp=0.0)]
    t2 = time.perf_counter()
    for _ in range(cfg["n_out"] - 1):
        llm.eval([out[-1]])
        out.append(llm.sample(temp=0.0))
    t3 = time.perf_counter()
    runs.append({"warmup": i == 0, "prefill_s": t1 - t0, "first_token_s": t2 - t0,
                 "decode_s": t3 - t2, "tokens": len(out),
                 "prefill_tok_s": len(prompt) / (t1 - t0),
                 "decode_tok_s": (len(out) - 1) / (t3 - t2), "head": out[:8]})
meas = [r for r in runs if not r["warmup"]]
print(json.dumps({
    "llama_cpp_version": llama_cpp.__version__, "load_s": load_s,
    "model_size_bytes": int(llama_cpp.llama_model_size(llm.model)),
    "model_n_params": int(llama_cpp.llama_model_n_params(llm.model)),
    "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
    "runs": runs,
    "decode_tok_s": statistics.median(r["decode_tok_s"] for r in meas),
    "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in meas),
}))
"""


def llama_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    return env


def cpu_has_amx() -> bool:
    """An Intel CPU with AMX: llama.cpp 0.3.36's AMX buffer types segfault on the first eval
    there (SmolLM2 Q4_1 and a tiny Q8_0, Xeon family 6 model 167), so the anchor runs without
    extra buffer types (`use_extra_bufts` off: its AVX-512 kernels), as
    shared/anchors/llama-cpp.md says."""
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


_NO_EXTRA_BUFTS = r"""
import llama_cpp as _llama_cpp
_defaults = _llama_cpp.llama_cpp.llama_model_default_params
def _params():
    p = _defaults(); p.use_extra_bufts = False; return p
_llama_cpp.llama_cpp.llama_model_default_params = _params
"""


def llama_script(body: str) -> str:
    """A llama-cpp-python script as this CPU runs it: without extra buffer types on an AMX CPU."""
    return (_NO_EXTRA_BUFTS if cpu_has_amx() else "") + body


def run_llama(python: Path, model: Path, prompts: list[list[int]], n_out: int) -> dict[str, Any]:
    cfg = json.dumps({"model": str(model), "prompts": prompts, "n_out": n_out})
    out = run_json([str(python), "-c", llama_script(LLAMA_SCRIPT), cfg], 900, env=llama_env(), cwd=Path("/tmp"))
    out["extra_bufts"] = not cpu_has_amx()
    return out


def llama_server(python: Path, model: Path, run_dir: Path, served: str) -> Server:
    """llama-cpp-python's server on `model` at one thread, serving it as `served`."""
    port = free_port()
    cmd = [
        str(python),
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--model_alias",
        served,
        "--n_threads",
        "1",
        "--n_threads_batch",
        "1",
        "--n_ctx",
        "4096",
        "--interrupt_requests",
        "False",  # its default: a new request cuts the streaming one
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log = run_dir / f"llama-server-{model.stem}.log"
    srv = Server(f"llama-server-{model.stem}", cmd, llama_env(), log, f"http://127.0.0.1:{port}", cwd=Path("/tmp"))
    return srv


def llama_has_server(python: Path) -> bool:
    out = subprocess.run(
        [str(python), "-c", "import llama_cpp.server.app, uvicorn, sse_starlette"],
        capture_output=True,
        env=llama_env(),
        cwd="/tmp",
    )
    return out.returncode == 0


def health_wait_llama(server: Server, timeout_s: float) -> float:
    """llama_cpp.server has no /health: poll /v1/models."""
    import httpx2

    assert server.proc is not None
    t0 = time.perf_counter()
    with httpx2.Client(timeout=5.0) as http:
        while time.perf_counter() - t0 < timeout_s:
            server.track()
            if server.proc.poll() is not None:
                raise RuntimeError(f"exited {server.proc.returncode}:\n{server.log_tail()}")
            try:
                if http.get(f"{server.base_url}/v1/models").status_code == 200:
                    return time.perf_counter() - t0
            except httpx2.HTTPError:
                pass
            time.sleep(1.0)
    raise RuntimeError(f"not up after {timeout_s:.0f}s:\n{server.log_tail()}")
