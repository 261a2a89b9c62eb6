"""Text another machine chose, made safe to store, show and log.

A peer, a relay or anything on a link without TLS can put any string where a
node expects a short code: a refusal's `reason`, a heartbeat's `phase` or
`error`, a field of a reply. Logged as it came, a newline in it starts a line
the node never wrote (a forged "roster reloaded" in node.log), and a string of
megabytes is copied into every log line and every /status answer. Each such
value goes through one of these where it enters, cut before it is scanned, so
a huge one costs no more than a short one.
"""

from __future__ import annotations

import re
from typing import Any

# Anything but printable ASCII: control characters (newlines, escapes), DEL,
# and every non-ASCII character (look-alikes, right-to-left overrides).
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")
# A refusal's reason as another machine gave it (a code such as `queue_full`;
# a relay's or a stranger's could be anything).
MAX_REASON_CHARS = 120


def one_line(text: str, limit: int) -> str:
    """`text` as at most `limit` printable ASCII characters, each other one
    (newlines included) replaced by "?"."""
    return _UNPRINTABLE.sub("?", text[:limit])


def shown(value: Any, limit: int = 40) -> str:
    """A value a peer sent, for a log line that names it (in place of %r):
    text and bytes cut to `limit` before repr, numbers as they are, anything
    else (lists, maps, whose repr could be megabytes) by its type only."""
    if isinstance(value, str | bytes | bytearray):
        cut = "..." if len(value) > limit else ""
        return one_line(repr(value[:limit]), 4 * limit + 8) + cut
    if value is None or isinstance(value, bool | float):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else "<int too large>"
    return f"<{type(value).__name__}>"
