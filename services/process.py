"""A service process's tie to the process that started it (the launcher, `pagoda serve`).

The launcher sets `PARENT_ENV` to its pid in a service's environment when the service must not
outlive it; the service calls `die_with_parent()` first thing. Here, not in the launcher, because
services (a tensor-parallel stage's ranks too) call it and the library floor imports no wiring.
"""

from __future__ import annotations

import os
import signal
import sys

from services.settings import DIE_WITH_PARENT, env_value

PARENT_ENV = DIE_WITH_PARENT.variable
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a service process started with `die_with_parent`: ask the kernel for SIGKILL when
    the starter dies, and exit at once if it already has (it died before this ran)."""
    parent = env_value(DIE_WITH_PARENT)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):
        os._exit(1)
