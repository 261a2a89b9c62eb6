"""Federation operations across institutions: key rotation with a grace period,
roster edits, SIGHUP reload, and the container health check.

The fast tests drive the real CLI and the real wire codec; the slow one runs a
real `p2pfl-node` process and plays its peer with that peer's real keys.
"""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from bench.localfed import LocalFederation
from node.cli import main
from node.provision import free_ports, provision
from node.transport import MESSAGE_PATH
from p2pfl.secure.identity import LocalIdentity, Roster, load_card
from p2pfl.secure.wire import WireCodec, WireError


def keygen(tmp_path: Path, name: str, address: str) -> Path:
    keys = tmp_path / name / "keys"
    assert main(["keygen", "--name", name, "--out", str(keys), "--address", address]) == 0
    return keys


def load_identity(keys: Path, name: str) -> LocalIdentity:
    return LocalIdentity.load(name, keys / f"{name}.sign.pem", keys / f"{name}.kex.pem")


def test_rotate_writes_a_new_signing_key_and_keeps_the_old_one_aside(tmp_path, capsys):
    keys = keygen(tmp_path, "x", "x.example.org:7000")
    old = load_identity(keys, "x")
    old_pem = (keys / "x.sign.pem").read_bytes()
    capsys.readouterr()
    before = time.time()
    assert (
        main(["keygen", "--rotate", "--name", "x", "--out", str(keys), "--grace-hours", "6"]) == 0
    )
    printed = yaml.safe_load(capsys.readouterr().out)
    new = load_identity(keys, "x")
    card = load_card(keys / "x.card.yaml")
    assert printed == card.to_dict()
    assert card.address == "x.example.org:7000"  # kept from the old card
    assert card.signing_key == new.card().signing_key != old.card().signing_key
    assert card.previous_signing_key == old.card().signing_key
    assert card.agreement_key == old.card().agreement_key  # agreement key is not rotated
    assert before + 6 * 3600 - 1 <= card.previous_valid_until <= time.time() + 6 * 3600 + 1
    retired = list((keys / "retired").glob("x.sign.*.pem"))
    assert len(retired) == 1 and retired[0].read_bytes() == old_pem
    for private in (keys / "x.sign.pem", keys / "x.kex.pem", retired[0]):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600


def test_rotate_without_a_key_is_a_one_line_error(tmp_path, capsys):
    assert main(["keygen", "--rotate", "--name", "x", "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "keygen" in err[0] and "not found" in err[0]


def test_peers_accept_old_and_new_key_during_the_grace_period_only(tmp_path, capsys):
    x_keys = keygen(tmp_path, "x", "127.0.0.1:7100")
    y_keys = keygen(tmp_path, "y", "127.0.0.1:7101")
    roster_path = tmp_path / "y" / "roster.yaml"
    for keys, name in ((x_keys, "x"), (y_keys, "y")):
        assert (
            main(["roster", "add", str(keys / f"{name}.card.yaml"), "--roster", str(roster_path)])
            == 0
        )
    x_old = load_identity(x_keys, "x")

    def receive(sender: LocalIdentity) -> str:
        """y's verdict on a message `sender` signs, with y's roster as on disk."""
        y = WireCodec(load_identity(y_keys, "y"), Roster.load(roster_path), "fed")
        sender_roster = Roster([sender.card("127.0.0.1:7100"), load_identity(y_keys, "y").card()])
        frame = WireCodec(sender, sender_roster, "fed").encode("probe", "y", {"n": 1}).to_bytes()
        try:
            y.decode(frame)
        except WireError as err:
            return err.reason
        return "accepted"

    # x rotates with a 24 h grace period and sends the new card; y adds it.
    assert main(["keygen", "--rotate", "--name", "x", "--out", str(x_keys)]) == 0
    x_new = load_identity(x_keys, "x")
    assert receive(x_new) == "bad_signature"  # y has not loaded the new card yet
    assert main(["roster", "add", str(x_keys / "x.card.yaml"), "--roster", str(roster_path)]) == 0
    assert receive(x_old) == "accepted"  # messages x signed before it restarted
    assert receive(x_new) == "accepted"

    # A second rotation with no grace: the key it replaces stops working at once.
    assert (
        main(["keygen", "--rotate", "--name", "x", "--out", str(x_keys), "--grace-hours", "0"]) == 0
    )
    x_newest = load_identity(x_keys, "x")
    assert main(["roster", "add", str(x_keys / "x.card.yaml"), "--roster", str(roster_path)]) == 0
    assert receive(x_newest) == "accepted"
    assert receive(x_new) == "bad_signature"
    assert receive(x_old) == "bad_signature"  # only one previous key is carried


def test_a_rotated_site_passes_check_once_its_own_roster_has_the_new_card(tmp_path, capsys):
    fed = tmp_path / "fed"
    assert main(["provision", "--sites", "a,b", "--out", str(fed)]) == 0
    keys = fed / "a" / "state" / "keys"
    (keys / "a.card.yaml").write_text(
        yaml.safe_dump(Roster.load(fed / "roster.yaml")["a"].card.to_dict(), sort_keys=False)
    )
    assert main(["keygen", "--rotate", "--name", "a", "--out", str(keys)]) == 0
    capsys.readouterr()
    # The roster still has the old key: the node refuses to start with the new one.
    assert main(["check", "--config", str(fed / "a" / "site.yaml")]) == 2
    assert "does not match the roster" in capsys.readouterr().err
    assert (
        main(["roster", "add", str(keys / "a.card.yaml"), "--roster", str(fed / "roster.yaml")])
        == 0
    )
    assert main(["check", "--config", str(fed / "a" / "site.yaml")]) == 0


# ----------------------------------------------------------------------------- real process


def post(port: int, frame: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{MESSAGE_PATH}", data=frame, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - loopback
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def heartbeat(codec: WireCodec) -> bytes:
    beat = {
        "round": 0,
        "phase": "test",
        "done": False,
        "bye": False,
        "meta": {},
        "edges": [],
        "choices": [],
    }
    return codec.encode("heartbeat", "a", beat).to_bytes()


def healthcheck(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node.deploy", "healthcheck", "--url", url, "--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_sighup_reloads_rotated_cards_and_refuses_a_removed_site_at_once(tmp_path):
    fed_dir = tmp_path / "fed"
    plans = provision(
        fed_dir,
        ["a", "b"],
        protocol={"name": "probe", "rounds": 1, "payload_kb": 1},
        overrides={
            "node": {"startup_wait_s": 120},
            "transport": {"heartbeat_s": 0.5, "retries": 0},
        },
    )
    roster_path = fed_dir / "roster.yaml"
    b_keys = fed_dir / "b" / "state" / "keys"
    b_old = load_identity(b_keys, "b")
    (b_keys / "b.card.yaml").write_text(
        yaml.safe_dump(Roster.load(roster_path)["b"].card.to_dict(), sort_keys=False)
    )
    port = plans[0].port
    with LocalFederation([plans[0]], tmp_path / "logs") as fed:  # only a runs; the test is b
        node = fed["a"]
        node.wait_for(lambda s: True, 90, "status endpoint up")
        log_path = tmp_path / "logs" / "a.log"

        def reload_and_wait() -> None:
            before = log_path.read_text().count("roster reloaded")
            node.signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while log_path.read_text().count("roster reloaded") == before:
                assert time.monotonic() < deadline, node.log_tail()
                time.sleep(0.05)

        def from_b(identity: LocalIdentity) -> tuple[int, dict]:
            return post(port, heartbeat(WireCodec(identity, Roster.load(roster_path), "local")))

        # The image's HEALTHCHECK command against the live node, and against nothing.
        assert healthcheck(f"http://127.0.0.1:{plans[0].status_port}/healthz").returncode == 0
        closed = healthcheck(f"http://127.0.0.1:{free_ports(1)[0]}/healthz")
        assert closed.returncode == 1 and "unhealthy" in closed.stderr

        assert from_b(b_old)[0] == 200

        # b rotates its key; a adds the new card and reloads: both keys work.
        assert main(["keygen", "--rotate", "--name", "b", "--out", str(b_keys)]) == 0
        b_new = load_identity(b_keys, "b")
        assert from_b(b_new) == (401, {"reason": "bad_signature", "detail": "from 'b'"})
        assert (
            main(["roster", "add", str(b_keys / "b.card.yaml"), "--roster", str(roster_path)]) == 0
        )
        reload_and_wait()
        assert from_b(b_new)[0] == 200
        assert from_b(b_old)[0] == 200

        # The federation removes b. Until a reloads, b still gets in ...
        assert main(["roster", "remove", "b", "--roster", str(roster_path)]) == 0
        assert from_b(b_new)[0] == 200
        # ... and from the reload on, not a single message more.
        reload_and_wait()
        for identity in (b_new, b_old):
            status, body = from_b(identity)
            assert (status, body["reason"]) == (403, "unknown_sender")
        st = node.status()
        assert st is not None
        assert st["rejected"]["unknown_sender"] == 2
        assert st["rejected_by_stranger"]["b"] >= 2  # b is on no roster now
        assert "b" not in st["rejected_by_peer"]
        assert node.running
