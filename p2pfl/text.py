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

# Anything but printable ASCII: control characters (newlines, escapes), DEL,
# and every non-ASCII character (look-alikes, right-to-left overrides).
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def one_line(text: str, limit: int) -> str:
    """`text` as at most `limit` printable ASCII characters, each other one
    (newlines included) replaced by "?"."""
    return _UNPRINTABLE.sub("?", text[:limit])
