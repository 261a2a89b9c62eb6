"""Logging for a node process: plain or one JSON object a line (`logging.format`),
to stderr and to `<state_dir>/node.log`, with aiohttp's and asyncio's noise
turned down: what anyone who reaches a port can make them log, one line each.

A record about a data file that cannot be used (a `DataError`, whose message
names the file, and so often a patient: `DOE_JANE_MRN4471920.png`) goes whole
to node.log (0600) only; stderr, which under systemd, docker or Kubernetes is
a journal or a log collector that others read, gets the line with the error's
kind and reason in place of the message, and no traceback.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp.http_exceptions import HttpProcessingError

from p2pfl.config import SiteConfig

if TYPE_CHECKING:
    from p2pfl.learning.data.errors import DataError


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
        StderrHandler(),
        logging.FileHandler(path, encoding="utf-8"),
    ):
        handler.setFormatter(fmt)
        root.addHandler(handler)
    quiet_network_noise()


def _data_error(value: object) -> DataError | None:
    """`value`, or the exception it was raised from, if it is a DataError.
    The class is looked up where it was loaded, never imported here: the
    relay logs through this module and imports neither torch nor numpy
    (tests/test_relay_imports.py), which p2pfl.learning.data's package does.
    A DataError exists only once that module was imported."""
    errors = sys.modules.get("p2pfl.learning.data.errors")
    if errors is None:
        return None
    for _ in range(16):  # a chain of causes, never a cycle
        if isinstance(value, errors.DataError):
            return value
        if not isinstance(value, BaseException):
            return None
        value = value.__cause__ or value.__context__
    return None


def _withheld(error: DataError) -> str:
    return f"<{type(error).__name__} {error.reason}: the file it names is in node.log>"


def stderr_error(exc: BaseException) -> str:
    """`Kind: message` of an error, for stderr: a DataError's message withheld."""
    found = _data_error(exc)
    return f"{type(exc).__name__}: {exc if found is None else _withheld(found)}"


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, without the data file a DataError names (module doc). The record
    is copied, never changed: node.log's handler formats the same one."""

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        raised = _data_error(record.exc_info[1]) if record.exc_info else None
        if raised is not None or any(_data_error(a) for a in args):
            fields = dict(record.__dict__, exc_info=None, exc_text=None)
            if isinstance(record.args, tuple):
                fields["args"] = tuple(
                    _withheld(e) if (e := _data_error(a)) is not None else a for a in args
                )
            if raised is not None:
                fields["msg"] = f"{record.msg} ({_withheld(raised)})"
            record = logging.makeLogRecord(fields)
        super().emit(record)


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
