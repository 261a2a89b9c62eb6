"""Mutual TLS for the peer port (`transport.tls`): the server asks every peer
for a certificate signed by the federation's CA, the client presents its own
and checks the server's; TLS 1.2 at least, never a fallback to plaintext."""

from __future__ import annotations

import ssl


def server_ssl_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """Mutual TLS: peers must present a certificate signed by the federation's CA."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    ctx.load_cert_chain(cert, key)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def client_ssl_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.load_cert_chain(cert, key)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
