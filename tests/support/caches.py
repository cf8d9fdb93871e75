"""A private cache folder (`PAGODA_CACHE_DIR`) for a process a test starts, as a new user's
first run has it (the default model fetched, GGUF folders prepared, chat templates read
again), but for the machine's native kernels and their calibration: those are the shared
cache's (worker_svc/cpu_kernels.cache_dir), keyed by source, flags (the -march an ISA cap
leaves) and CPU, so a capped process builds and calibrates its own beside the others. Built
again in every private folder they cost a test ~15-25 s of compiling and timing."""

from __future__ import annotations

from pathlib import Path


def private_cache_with_shared_kernels(folder: Path) -> Path:
    """`folder` made a cache root whose `kernels` is the shared cache's; returns it."""
    from worker_svc.kernels.cpu_kernels import cache_dir

    shared = cache_dir()
    shared.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernels").symlink_to(shared, target_is_directory=True)
    return folder
