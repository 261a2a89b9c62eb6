"""Mutual TLS for the peer port (`transport.tls`): the server asks every peer
for a certificate signed by the federation's CA, the client presents its own
and checks the server's; TLS 1.2 at least, never a fallback to plaintext.

The private key (`transport.tls.key`) is refused, as the identity keys are
(p2pfl/secure/identity.py `key_file_problem`), when other accounts may read
or write it: `ssl` loaded a 0666 key without a word (a key review)."""

from __future__ import annotations

import os
import ssl

from p2pfl.secure.identity import IdentityError, key_file_problem


def _check_key(key: str) -> None:
    """IdentityError (exit 2, one line) for a TLS key others may read or replace."""
    try:
        info = os.stat(key)  # followed: a Kubernetes Secret is links to 0440 files
    except OSError:
        return  # missing or unreadable: ssl says so itself
    problem = key_file_problem(info)
    if problem is not None:
        raise IdentityError(
            f"{key}: the TLS private key (transport.tls.key) {problem} — `chmod 600` it as the "
            "node's own user, and have your CA issue a new one if it may be known"
        )


def server_ssl_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """Mutual TLS: peers must present a certificate signed by the federation's CA."""
    _check_key(key)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    ctx.load_cert_chain(cert, key)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def client_ssl_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    _check_key(key)
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.load_cert_chain(cert, key)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
