"""Transport TLS: nodes talk over mutual TLS when configured, never plaintext."""

from __future__ import annotations

import datetime as dt
import json
import ssl
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bench.localfed import LocalFederation
from node.provision import provision
from node.transport import MESSAGE_PATH
from p2pfl.files import atomic_write_bytes

pytestmark = pytest.mark.slow


def _write_key(key, path: Path) -> None:
    """0600, as a node requires of a TLS private key (node/tls.py)."""
    atomic_write_bytes(
        path,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def make_pki(out: Path, names: list[str]) -> None:
    """A federation CA and one certificate per site (SAN 127.0.0.1 and localhost)."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "p2pfl test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    import ipaddress

    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        (out / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, out / f"{name}.key")


def test_nodes_exchange_over_mutual_tls_and_refuse_plaintext(tmp_path):
    pki = tmp_path / "pki"
    pki.mkdir()
    make_pki(pki, ["a", "b", "intruder"])
    probe = {"name": "probe", "rounds": 3, "payload_kb": 8, "round_timeout_s": 20}
    per_site = {
        n: {
            "transport": {
                "tls": {
                    "cert": str(pki / f"{n}.crt"),
                    "key": str(pki / f"{n}.key"),
                    "ca": str(pki / "ca.pem"),
                }
            }
        }
        for n in "ab"
    }
    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol=probe,
        overrides={"transport": {"heartbeat_s": 0.3}},
        per_site=per_site,
    )
    with LocalFederation(plans, tmp_path / "logs") as fed:
        for n in "ab":
            fed[n].wait_for(lambda s: s["phase"] == "done", 90, "probe over TLS")
        lines = [
            json.loads(x)
            for x in (tmp_path / "fed" / "a" / "state" / "metrics.jsonl").read_text().splitlines()
        ]
        assert [x["received"] for x in lines] == [1, 1, 1]
        assert "https://127.0.0.1" in fed["a"].log_path.read_text()
        url = f"127.0.0.1:{plans[0].port}{MESSAGE_PATH}"
        # Plain HTTP to the TLS port: no answer in plaintext.
        with pytest.raises((OSError, urllib.error.URLError)):
            urllib.request.urlopen(urllib.request.Request(f"http://{url}", data=b"x"), timeout=5)  # noqa: S310
        # TLS without a client certificate from the federation CA: handshake refused.
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with pytest.raises((ssl.SSLError, OSError, urllib.error.URLError)):
            urllib.request.urlopen(
                urllib.request.Request(f"https://{url}", data=b"x"), timeout=5, context=ctx
            )  # noqa: S310
