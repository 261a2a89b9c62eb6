"""The third key lifecycle review: holes in the second one's fixes.

Real keys, card and TLS files and the real CLI; nothing attacked is mocked.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from node.cli import main
from p2pfl.secure.identity import load_card

sys.path.insert(0, str(Path(__file__).parent))
from test_tls import make_pki  # noqa: E402


@pytest.mark.parametrize("hours", ["nan", "inf", "1e308"])
def test_rotate_refuses_a_grace_period_no_card_can_hold(tmp_path, capsys, hours):
    # Before: `keygen --rotate --grace-hours nan` replaced the signing key,
    # wrote a card with previous_valid_until .nan that every roster (and the
    # rerun of --rotate itself) refuses, then died in a ValueError traceback:
    # the site was left with a new key and no card peers would load.
    assert main(["keygen", "--name", "a", "--out", str(tmp_path), "--address", "h:1"]) == 0
    before = (tmp_path / "a.sign.pem").read_bytes()
    card = (tmp_path / "a.card.yaml").read_text()
    capsys.readouterr()
    rotate = ["keygen", "--rotate", "--name", "a", "--out", str(tmp_path)]
    assert main([*rotate, "--grace-hours", hours]) == 2
    assert "--grace-hours" in capsys.readouterr().err
    assert (tmp_path / "a.sign.pem").read_bytes() == before  # nothing rotated
    assert (tmp_path / "a.card.yaml").read_text() == card
    assert main(rotate) == 0  # and an honest rotation still works
    assert load_card(tmp_path / "a.card.yaml").grace_signed()


def _site_with_tls(tmp_path: Path) -> tuple[Path, Path]:
    assert main(["provision", "--out", str(tmp_path / "fed"), "--sites", "a,b"]) == 0
    pki = tmp_path / "pki"
    pki.mkdir()
    make_pki(pki, ["a"])
    site = tmp_path / "fed" / "a" / "site.yaml"
    cfg = yaml.safe_load(site.read_text())
    files = {"cert": pki / "a.crt", "key": pki / "a.key", "ca": pki / "ca.pem"}
    cfg.setdefault("transport", {})["tls"] = {k: str(v) for k, v in files.items()}
    site.write_text(yaml.safe_dump(cfg))
    return site, pki


@pytest.mark.parametrize("broken", ["cert", "key_missing", "ca"])
def test_run_with_broken_tls_files_is_one_line_not_a_traceback(tmp_path, capsys, broken):
    # Before: `check` said "transport.tls: cannot load the TLS files" in one
    # line, but `run` (and a relay) let ssl.SSLError or FileNotFoundError out
    # of node/tls.py as a traceback at start.
    site, pki = _site_with_tls(tmp_path)
    if broken == "cert":
        (pki / "a.crt").write_text("not a certificate\n")
    elif broken == "key_missing":
        (pki / "a.key").unlink()
    else:
        (pki / "ca.pem").write_text("not a CA\n")
    capsys.readouterr()
    assert main(["run", "--config", str(site)]) == 2
    err = capsys.readouterr().err
    assert "transport.tls" in err
    assert "PRIVATE KEY" not in err


def test_a_rotated_card_from_an_older_version_says_what_to_do(tmp_path, capsys):
    # Before: a rotated card without grace_signature (an older keygen --rotate
    # wrote none) was refused as "altered in transit, or made by hand — ask the
    # site to send the card `keygen --rotate` wrote": the very card refused.
    roster = ["--roster", str(tmp_path / "r.yaml")]
    assert main(["keygen", "--name", "a", "--out", str(tmp_path), "--address", "h:1"]) == 0
    assert main(["roster", "add", str(tmp_path / "a.card.yaml"), *roster]) == 0
    assert main(["keygen", "--rotate", "--name", "a", "--out", str(tmp_path)]) == 0
    old = yaml.safe_load((tmp_path / "a.card.yaml").read_text())
    del old["grace_signature"]
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    capsys.readouterr()
    assert main(["roster", "add", str(tmp_path / "old.yaml"), *roster]) == 2
    err = capsys.readouterr().err
    assert "no grace_signature" in err and "roster remove a" in err
    assert main(["roster", "remove", "a", *roster]) == 0
    assert main(["roster", "add", str(tmp_path / "old.yaml"), *roster]) == 0


@pytest.mark.parametrize("how", ["inline_spaces", "file_0644"])
def test_check_refuses_the_status_token_the_node_would_refuse(tmp_path, capsys, how):
    # Before: `check` never read the status token: it passed an inline token
    # with spaces and a 0644 status.token_file that `run` then refused at
    # start, after the peer port was already up.
    assert main(["provision", "--out", str(tmp_path / "fed"), "--sites", "a,b"]) == 0
    site = tmp_path / "fed" / "a" / "site.yaml"
    cfg = yaml.safe_load(site.read_text())
    status = cfg.setdefault("status", {})
    status.pop("token_file", None)
    secret = "SECRETSECRET with spaces 1234"
    if how == "inline_spaces":
        status["token"] = secret
    else:
        token = tmp_path / "token"
        token.write_text(secret.replace(" ", "") + "\n")
        os.chmod(token, 0o644)
        status["token_file"] = str(token)
    site.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main(["check", "--config", str(site)]) == 2
    out = capsys.readouterr()
    assert "status.token" in out.err
    assert "SECRET" not in out.err + out.out
    if how == "file_0644":
        os.chmod(token, 0o600)
        assert main(["check", "--config", str(site)]) == 0
