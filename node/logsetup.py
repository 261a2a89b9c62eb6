"""Logging for a node process: plain or one JSON object a line (`logging.format`),
to stderr and to `<state_dir>/node.log`, with aiohttp's noise turned down.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from aiohttp.http_exceptions import HttpProcessingError

from p2pfl.config import SiteConfig


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "t": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(cfg: SiteConfig) -> None:
    fmt: logging.Formatter = (
        JsonFormatter()
        if cfg.logging.format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.setLevel(cfg.logging.level)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    path = Path(cfg.node.state_dir) / "node.log"
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    path.chmod(0o600)  # peers' names, reasons and settings: this account's only
    for handler in (
        logging.StreamHandler(),
        logging.FileHandler(path, encoding="utf-8"),
    ):
        handler.setFormatter(fmt)
        root.addHandler(handler)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").addFilter(quiet_http_parser_refusals)


def quiet_http_parser_refusals(record: logging.LogRecord) -> bool:
    """aiohttp logs every request its HTTP parser refuses (already answered 400)
    at ERROR with a traceback: anyone who reaches the port could fill the log.
    Those become one DEBUG line; real handler errors keep their traceback."""
    exc = record.exc_info[1] if record.exc_info else None
    if not isinstance(exc, HttpProcessingError):
        return True
    if not logging.getLogger("aiohttp.server").isEnabledFor(logging.DEBUG):
        return False
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    record.msg, record.args = "refused malformed HTTP request: %s", (exc,)
    record.exc_info = record.exc_text = None
    return True
