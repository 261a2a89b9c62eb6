"""What `p2pfl-node check` loads as the node would at start, so that a site
check passed is not refused after its peer port is up: the TLS files (node/tls.py)
and the status token (node/status.py)."""

from __future__ import annotations

from pathlib import Path

from p2pfl.config import ConfigError, SiteConfig


def check_status_token(cfg: SiteConfig, path: Path) -> None:
    """Read the status token as the node does (node/status.py `status_token`:
    an inline token's text, a token file's mode and owner): `check` passed a
    token with spaces and a 0644 status.token_file that the node refused at
    start, after its peer port was up (a third key review). The node's own
    STATE/status.token is left to the first start to make."""
    from node.status import STATUS_TOKEN_FILE, inside, status_token

    if not cfg.status.enabled:
        return
    state = Path(cfg.node.state_dir)
    named = cfg.status.token_file
    own = Path(named) if named else state / STATUS_TOKEN_FILE
    if (
        cfg.status.token
        or (named and not inside(Path(named), state))
        or own.is_symlink()
        or own.exists()
    ):
        status_token(cfg, path)  # creates no file: the own one exists, or is not used


def check_tls(cfg: SiteConfig, path: Path) -> None:
    """Load transport.tls as the node does (node/tls.py: the key files' checks,
    then ssl): `check` passed a 0644 TLS key the node then refused (a key review)."""
    import ssl

    from node.tls import client_ssl_context, server_ssl_context

    tls = cfg.transport.tls
    if not tls:
        return
    for make in (server_ssl_context, client_ssl_context):
        try:
            make(str(tls.cert), str(tls.key), str(tls.ca))
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                path,
                "transport.tls",
                f"cannot load the TLS files: {exc}",
                "give the PEM certificate, its private key and the federation CA",
            ) from None
