"""The second key lifecycle review: holes in the first one's fixes.

Real keys, real roster and card files, the real CLI and the real ssl loader;
nothing attacked is mocked (the TLS test runs the attacker's swap at the
worst moment, right after the check, instead of racing for it).
"""

from __future__ import annotations

import base64
import os
import sys
import threading
from pathlib import Path

import pytest
import yaml
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from node import tls
from node.cli import main
from p2pfl.secure.identity import IdentityError, LocalIdentity, Roster, b64

sys.path.insert(0, str(Path(__file__).parent))
from test_tls import make_pki  # noqa: E402

# ----------------------------------------------------------------------------- roster file


def test_a_fifo_at_the_roster_path_is_refused_not_waited_on(tmp_path):
    # Before: Roster.load opened it blocking and waited for a writer for ever:
    # at a SIGHUP, in the running node's event loop.
    fifo = tmp_path / "roster.yaml"
    os.mkfifo(fifo)
    outcome: list[BaseException | Roster] = []

    def load() -> None:
        try:
            outcome.append(Roster.load(fifo))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(5)
    if thread.is_alive():  # unblock the old code's open before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("Roster.load waited on a FIFO")
    assert isinstance(outcome[0], IdentityError) and "not a plain file" in str(outcome[0])


# ----------------------------------------------------------------------------- roster add


def card_file(tmp_path: Path, name: str = "b", **extra: object) -> Path:
    card = LocalIdentity.generate(name).card("10.0.0.2:7000").to_dict()
    card.update(extra)
    path = tmp_path / f"{name}.card.yaml"
    path.write_text(yaml.safe_dump(card))
    return path


def test_a_card_that_is_not_utf8_or_not_a_file_is_one_line_not_a_traceback(tmp_path, capsys):
    # Before: UnicodeDecodeError and IsADirectoryError out of `roster add`.
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"name: site\xff\n")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    roster = tmp_path / "roster.yaml"
    assert main(["roster", "add", str(bad), "--roster", str(roster)]) == 2
    assert main(["roster", "add", str(folder), "--roster", str(roster)]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8" in err and "cannot read the card" in err


def test_a_cards_own_max_samples_is_not_the_admins_cap(tmp_path):
    # max_samples lies outside the fingerprint: a cap of 1 written into the card
    # in transit used to become the roster's cap (the site's model then weighed
    # next to nothing) on a first add and on a re-add of an uncapped site.
    roster = tmp_path / "roster.yaml"
    path = card_file(tmp_path, max_samples=1)
    assert main(["roster", "add", str(path), "--roster", str(roster)]) == 0
    assert Roster.load(roster)["b"].card.max_samples is None
    assert main(["roster", "add", str(path), "--roster", str(roster)]) == 0  # re-added
    assert Roster.load(roster)["b"].card.max_samples is None
    cap = ["--max-samples", "500"]
    assert main(["roster", "add", str(path), "--roster", str(roster), *cap]) == 0
    assert main(["roster", "add", str(path), "--roster", str(roster)]) == 0
    assert Roster.load(roster)["b"].card.max_samples == 500  # the admin's word stays


# ----------------------------------------------------------------------------- key values

# Ed25519 points of order 1, 4 and 8 (the neutral point, y = 0, and one of order 8)
SMALL_ORDER = [
    bytes([1]) + bytes(31),
    bytes(32),
    bytes.fromhex("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a"),
    bytes.fromhex("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05"),
]
BASE_POINT = bytes.fromhex("5866666666666666666666666666666666666666666666666666666666666666")


def forged(key: bytes) -> bool:
    """Whether a signature made with no private key (R = B, S = 1) verifies under
    `key` for one of 64 messages: it does for a small-order key."""
    public = Ed25519PublicKey.from_public_bytes(key)
    for i in range(64):
        try:
            public.verify(BASE_POINT + (1).to_bytes(32, "little"), b"msg %d" % i)
            return True
        except InvalidSignature:
            continue
    return False


@pytest.mark.parametrize("raw", SMALL_ORDER, ids=["order1", "order4", "order8", "order8b"])
@pytest.mark.parametrize("field", ["signing_key", "previous_signing_key"])
def test_a_signing_key_anyone_can_forge_for_is_refused(tmp_path, raw, field):
    # Before: such a card loaded, and every stranger could sign as the site.
    assert forged(raw)
    card = LocalIdentity.generate("b").card("10.0.0.2:7000").to_dict()
    card[field] = b64(raw)
    card["previous_valid_until"] = 4e9
    path = tmp_path / "roster.yaml"
    path.write_text(yaml.safe_dump({"sites": [card]}))
    with pytest.raises(IdentityError, match="forge signatures"):
        Roster.load(path)


def test_real_signing_keys_still_load_and_resist_the_forgery(tmp_path):
    ids = [LocalIdentity.generate(n) for n in "abc"]
    roster = Roster([i.card("127.0.0.1:1") for i in ids])
    for identity in ids:
        assert not forged(base64.b64decode(roster[identity.name].card.signing_key))


# ----------------------------------------------------------------------------- TLS key


def test_a_tls_key_swapped_right_after_its_check_is_not_what_ssl_loads(tmp_path, monkeypatch):
    # Before: node/tls.py checked os.stat(name) and ssl opened the name again,
    # so a link swapped in between loaded a 0644 key (a racing loop did it).
    make_pki(tmp_path, ["a"])
    exposed = tmp_path / "a.key"
    os.chmod(exposed, 0o644)
    decoy = tmp_path / "decoy.key"
    decoy.write_text("not a key\n")
    os.chmod(decoy, 0o600)
    link = tmp_path / "key.pem"
    link.symlink_to(decoy)
    checked = tls.key_file_problem

    def check_then_swap(info: os.stat_result) -> str | None:
        problem = checked(info)
        swap = tmp_path / "swap"
        swap.symlink_to(exposed)
        os.replace(swap, link)  # the attacker, right after the check
        return problem

    monkeypatch.setattr(tls, "key_file_problem", check_then_swap)
    for make in (tls.server_ssl_context, tls.client_ssl_context):
        link.unlink()
        link.symlink_to(decoy)
        with pytest.raises(IdentityError) as caught:  # the decoy's ssl error, in one line
            make(str(tmp_path / "a.crt"), str(link), str(tmp_path / "ca.pem"))
        assert "cannot load" in str(caught.value)  # the decoy was checked and read
        assert "mode" not in str(caught.value)


def test_check_refuses_the_tls_key_the_node_would_refuse(tmp_path, capsys):
    # Before: `p2pfl-node check` never loaded transport.tls and passed a 0644
    # TLS key that the node then refused at start.
    assert main(["provision", "--out", str(tmp_path / "fed"), "--sites", "a,b"]) == 0
    pki = tmp_path / "pki"
    pki.mkdir()
    make_pki(pki, ["a"])
    site = tmp_path / "fed" / "a" / "site.yaml"
    cfg = yaml.safe_load(site.read_text())
    files = {"cert": pki / "a.crt", "key": pki / "a.key", "ca": pki / "ca.pem"}
    cfg.setdefault("transport", {})["tls"] = {k: str(v) for k, v in files.items()}
    site.write_text(yaml.safe_dump(cfg))
    assert main(["check", "--config", str(site)]) == 0
    os.chmod(pki / "a.key", 0o644)
    capsys.readouterr()
    assert main(["check", "--config", str(site)]) == 2
    assert "mode 0644" in capsys.readouterr().err
    os.chmod(pki / "a.key", 0o600)
    (pki / "a.crt").write_text("not a certificate\n")
    assert main(["check", "--config", str(site)]) == 2
    assert "transport.tls" in capsys.readouterr().err


def test_a_roster_or_card_nested_too_deep_is_one_line(tmp_path):
    # Before: RecursionError out of Roster.load (the relay's SIGHUP reload
    # catches IdentityError only) and a traceback out of `roster add`.
    deep = tmp_path / "deep.yaml"
    deep.write_text("sites: " + "[" * 5000 + "]" * 5000)
    with pytest.raises(IdentityError, match="nests too deep"):
        Roster.load(deep)
    assert main(["roster", "add", str(deep), "--roster", str(tmp_path / "r.yaml")]) == 2


@pytest.mark.parametrize("mode", [0o666, 0o646])
def test_a_tls_ca_file_any_account_may_rewrite_is_refused(tmp_path, mode):
    # Before: loaded as is; whoever rewrote it added a CA of their own, and
    # their certificate then passed the peer port's handshake.
    make_pki(tmp_path, ["a"])
    files = [str(tmp_path / "a.crt"), str(tmp_path / "a.key"), str(tmp_path / "ca.pem")]
    for make in (tls.server_ssl_context, tls.client_ssl_context):
        make(*files)  # 0644: loads
    os.chmod(tmp_path / "ca.pem", mode)
    for make in (tls.server_ssl_context, tls.client_ssl_context):
        with pytest.raises(IdentityError, match=f"CA .* has mode {mode:04o}"):
            make(*files)


@pytest.mark.parametrize("where", ["site", "relay"])
def test_an_address_with_control_characters_is_refused(tmp_path, capsys, where):
    # Before: a card's address (not in the fingerprint) loaded with a tab and
    # ESC[8m, and `roster list` printed a made-up fingerprint and concealed
    # the real one after it.
    fake = "10.0.0.2:7000\t1111 2222 3333 4444 5555 6666 7777 8888\x1b[8m"
    card = LocalIdentity.generate("b").card("10.0.0.2:7000").to_dict()
    doc: dict[str, object] = {"sites": [card]}
    if where == "site":
        card["address"] = fake
    else:
        doc["relays"] = [{"name": "r1", "address": fake}]
    path = tmp_path / "roster.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(IdentityError, match="address"):
        Roster.load(path)
    assert main(["roster", "list", "--roster", str(path)]) == 2
    assert "\x1b" not in capsys.readouterr().out
