"""One structured log format across services; the level comes from PAGODA_LOG_LEVEL."""

from __future__ import annotations

import logging
import os
import sys


def configure_logging(service: str, level: str | None = None) -> None:
    level = (level or os.environ.get("PAGODA_LOG_LEVEL") or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s service={service} logger=%(name)s msg=%(message)s"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
