"""How a configuration mistake is told: one `ConfigError` line naming the file,
the field path and the fix, also for pydantic's validation errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from p2pfl.config.protocols import protocol_names
from p2pfl.errors import UserError


class ConfigError(UserError):
    """A configuration mistake a person can fix; `str()` is the one-line message."""

    def __init__(self, file: str | Path, field: str, problem: str, fix: str = "") -> None:
        self.file = str(file)
        self.field = field
        self.problem = problem
        self.fix = fix
        where = f"{self.file}: {field}" if field else self.file
        super().__init__(f"{where}: {problem}" + (f" — {fix}" if fix else ""))


class FieldValueError(ValueError):
    """A check across sections (a model validator) that still names the field and
    the fix: `config_error` reports `field`, not the whole file."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.field = field
        self.problem = problem
        self.fix = fix


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in protocol_names() and parts and parts[-1] == "protocol":
            continue  # discriminated-union tag: the user wrote protocol.<field>, not protocol.<name>.<field>
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def _describe(err: dict[str, Any]) -> tuple[str, str]:
    kind = err["type"]
    if kind == "extra_forbidden":
        return (
            "unknown key",
            "remove it or check its spelling (`p2pfl-node schema` lists every key)",
        )
    if kind == "missing":
        return "required key is missing", "add it (`p2pfl-node schema` shows its type)"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return (
            f"unknown protocol {err.get('input', {}).get('name') if isinstance(err.get('input'), dict) else ''!r}".replace(
                "''", "(none)"
            ),
            "set protocol.name to one of: " + ", ".join(protocol_names()),
        )
    if kind == "literal_error":
        return err["msg"], "use one of the listed values"
    if kind == "value_error":
        return err["msg"].removeprefix("Value error, "), ""
    return err["msg"], "fix the value (`p2pfl-node schema` shows the expected type)"


def config_error(path: str | Path, exc: ValidationError) -> ConfigError:
    """The first pydantic error as the one-line FILE: FIELD: problem — fix message."""
    err = exc.errors()[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldValueError):
        return ConfigError(path, cause.field, cause.problem, cause.fix)
    problem, fix = _describe(err)
    loc = tuple(err["loc"])
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        loc = ("protocol", "name")
    return ConfigError(path, _field_path(loc), problem, fix)
