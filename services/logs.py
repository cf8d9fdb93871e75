"""One structured log format across services; the level comes from PAGODA_LOG_LEVEL."""

from __future__ import annotations

import logging
import sys

from services.settings import LOG_LEVEL, env_value


def configure_logging(service: str, level: str | None = None) -> None:
    level = (level or env_value(LOG_LEVEL)).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s service={service} logger=%(name)s msg=%(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
