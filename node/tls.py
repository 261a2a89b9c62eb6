"""Mutual TLS for the peer port (`transport.tls`): the server asks every peer
for a certificate signed by the federation's CA, the client presents its own
and checks the server's; TLS 1.2 at least, never a fallback to plaintext.

The private key (`transport.tls.key`) is refused, as the identity keys are
(p2pfl/secure/identity.py `key_file_problem`), when other accounts may read
or write it: `ssl` loaded a 0666 key without a word (a key review)."""

from __future__ import annotations

import os
import ssl
import stat
from collections.abc import Callable
from typing import TypeVar

from p2pfl.secure.identity import IdentityError, key_file_problem

T = TypeVar("T")


def _ssl_loads(load: Callable[[], T], what: str) -> T:
    """`load()`, with what ssl raises (a file missing, no PEM in it) turned
    into one IdentityError line: `check` said so in a line, but `run` and a
    relay let ssl.SSLError out of here as a traceback at start (a third key
    review). ssl's messages name the file, never what it holds."""
    try:
        return load()
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise IdentityError(
            f"transport.tls: cannot load {what} ({exc}) — give the PEM certificate, "
            "its private key and the federation CA"
        ) from None


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    """Load `cert` and the key: IdentityError (exit 2, one line) for a key
    others may read or replace. The checks run on the opened file, and ssl
    reads that same file (/proc/self/fd/N): a stat of the name, then ssl
    opening the name again, let a link swapped in between load a 0644 key
    past the check (a key review). Links are followed: a Kubernetes Secret
    is links to 0440 files."""
    try:
        fd = os.open(key, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # missing or unreadable: ssl says so itself
        _ssl_loads(lambda: ctx.load_cert_chain(cert, key), f"{cert} and {key}")
        return
    try:
        problem = key_file_problem(os.fstat(fd))
        if problem is not None:
            raise IdentityError(
                f"{key}: the TLS private key (transport.tls.key) {problem} — `chmod 600` it as "
                "the node's own user, and have your CA issue a new one if it may be known"
            )
        opened = f"/proc/self/fd/{fd}"  # Linux; elsewhere the name, as before
        chosen = opened if os.path.exists(opened) else key
        _ssl_loads(lambda: ctx.load_cert_chain(cert, chosen), f"{cert} and {key}")
    finally:
        os.close(fd)


def _context(purpose: ssl.Purpose, ca: str) -> ssl.SSLContext:
    """A context trusting the CA file `ca`, refused (IdentityError) if any
    account on the host may rewrite it, as a roster is: whoever may adds a CA
    of their own, and their certificate passes the handshake (a key review:
    a 0666 CA file loaded). Checked on the opened file, which ssl reads."""
    try:
        fd = os.open(ca, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return _ssl_loads(lambda: ssl.create_default_context(purpose, cafile=ca), ca)
    try:
        info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISREG(info.st_mode) or mode & 0o002:
            what = (
                "is not a plain file" if not stat.S_ISREG(info.st_mode) else f"has mode {mode:04o}"
            )
            raise IdentityError(
                f"{ca}: the federation CA (transport.tls.ca) {what}: any account on this host "
                "may replace it and add a CA of its own — `chmod o-w` it, and check what it holds"
            )
        opened = f"/proc/self/fd/{fd}"
        chosen = opened if os.path.exists(opened) else ca
        return _ssl_loads(lambda: ssl.create_default_context(purpose, cafile=chosen), ca)
    finally:
        os.close(fd)


def server_ssl_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """Mutual TLS: peers must present a certificate signed by the federation's CA."""
    ctx = _context(ssl.Purpose.CLIENT_AUTH, ca)
    _load_chain(ctx, cert, key)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def client_ssl_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx = _context(ssl.Purpose.SERVER_AUTH, ca)
    _load_chain(ctx, cert, key)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
