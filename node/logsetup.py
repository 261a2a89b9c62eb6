"""Logging for a node process: plain or one JSON object a line (`logging.format`),
to stderr and to `<state_dir>/node.log`, with aiohttp's and asyncio's noise
turned down: what anyone who reaches a port can make them log, one line each.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
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
    quiet_network_noise()


def quiet_network_noise() -> None:
    """The filters below, on the loggers they quiet (a node's and a relay's)."""
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").addFilter(quiet_http_parser_refusals)
    logging.getLogger("asyncio").addFilter(ACCEPT_FAILURES)


class AcceptFailures(logging.Filter):
    """asyncio logs "socket.accept() out of system resource" with a traceback
    each time a listening socket's accept() fails for want of file
    descriptors, up to its backlog (512) times per turn of the event loop:
    57,026 lines in 20 s in the review, while connections held the node's
    descriptors. One WARNING line, without the traceback, every `every_s`
    at most, saying how many it left out; `total` counts them all."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, every_s: float = 60.0) -> None:
        super().__init__()
        self.every_s = every_s
        self.total = 0
        self.left_out = 0
        self.last = -math.inf

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.MESSAGE):
            return True
        self.total += 1
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.left_out += 1
            return False
        exc = record.exc_info[1] if record.exc_info else None
        why = getattr(exc, "strerror", None) or exc or "no resource"
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg = (
            "cannot accept connections: %s (%d more such failures left out of the log since "
            "the last line); each open connection or file holds a file descriptor"
        )
        record.args = (why, self.left_out)
        record.exc_info = record.exc_text = None
        self.last, self.left_out = now, 0
        return True


ACCEPT_FAILURES = AcceptFailures()  # one per process: its count and its pace


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
