"""`pagoda eval-quality`'s two sources of a window's logits: Pagoda's stage, one prefill of
the whole window into a fresh paged KV pool, and llama.cpp (llama-cpp-python in its own
environment) in a subprocess that writes raw float32 rows. torch is imported where used.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

LLAMA_PYTHON = Path("~/.cache/pagoda-anchor/llama/venv/bin/python").expanduser()  # its environment


def window_logits(model, ids: Sequence[int], first: int, backend=None) -> torch.Tensor:
    """float32 logits [len(ids) - 1 - first, vocab] of positions first .. len(ids)-2, from one
    prefill of the whole window into a fresh one-block paged KV pool."""
    import torch

    from worker_svc.execution.kv_cache import PagedKVCache
    from worker_svc.kernels.attention import AttentionMetadata, TorchAttentionBackend

    n, config = len(ids), model.config
    device = next(model.buffers()).device
    # the KV pool's dtype as a served stage's (StageRunner): its float weights'
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    kv = PagedKVCache(model.num_local_layers, 1, n, config.num_kv_heads, config.head_dim, dtype, device)
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], device=device),
        context_lens=torch.tensor([n], device=device),
        block_tables=torch.zeros((1, 1), dtype=torch.long, device=device),
        query_start_loc_list=(0, n),
        context_lens_list=(n,),
    )
    tokens = torch.tensor(list(ids), dtype=torch.long, device=device)
    rows = torch.arange(first, n - 1, device=device)
    logits = model(tokens, torch.arange(n, device=device), kv.pools, metadata, backend or TorchAttentionBackend(), rows)
    return logits.float().cpu()


# ---------------------------------------------------------------- llama.cpp

_LLAMA_SCRIPT = r"""
import json, sys, time
import llama_cpp
import numpy as np
from llama_cpp import Llama

model, ids_file, first, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with open(ids_file) as f:
    windows = np.asarray(json.load(f), dtype=np.int32)
n_ctx = windows.shape[1]
llm = Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, n_threads=1, n_threads_batch=1,
            logits_all=True, verbose=False)
# raw float32 rows (no pickle, no header): [windows, n_ctx - 1 - first, vocab]
logits = np.memmap(out, mode="w+", dtype=np.float32, shape=(len(windows), n_ctx - 1 - first, llm.n_vocab()))
started = time.perf_counter()
for w, ids in enumerate(windows):
    llm.reset()
    llm.eval(ids.tolist())
    logits[w] = llm.scores[first:n_ctx - 1]
logits.flush()
print(json.dumps({"eval_s": time.perf_counter() - started, "version": llama_cpp.__version__}))
"""


def llama_logits(
    python: Path, gguf_file: Path, windows: list[list[int]], first: int, out: Path
) -> tuple[np.ndarray, dict]:
    """llama.cpp's logits [windows, n_ctx - 1 - first, vocab] (memory-mapped from `out`) and
    {"eval_s", "version"}, from a subprocess in the llama-cpp-python environment."""
    script = out.with_suffix(".py")
    from bench.vs_llama_cpp_anchor import llama_script

    script.write_text(llama_script(_LLAMA_SCRIPT))
    ids_file = out.with_suffix(".ids.json")
    ids_file.write_text(json.dumps([list(map(int, w)) for w in windows]))
    done = subprocess.run(
        [str(python), str(script), str(gguf_file), str(ids_file), str(first), str(out)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp on {gguf_file.name} failed: {done.stderr.strip()[-800:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    rows = len(windows[0]) - 1 - first
    vocab = out.stat().st_size // 4 // (len(windows) * rows)
    return np.memmap(out, mode="r", dtype=np.float32, shape=(len(windows), rows, vocab)), info
