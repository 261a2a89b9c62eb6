"""The key lifecycle review (trust bootstrap): what a roster may say about a
rotated key's grace period, and which private key files a node refuses to load.

Real keys, real roster files, the real wire codec; nothing attacked is mocked.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

import pytest
import yaml

from node.cli import main
from p2pfl.secure.identity import IdentityError, LocalIdentity, Roster, b64, load_card
from p2pfl.secure.wire import WireCodec, WireError


def rotated_roster(tmp_path: Path, until: object) -> tuple[Path, LocalIdentity, LocalIdentity]:
    """A roster whose site `a` names `old`'s key as its previous one, valid `until`."""
    old, new = LocalIdentity.generate("a"), LocalIdentity.generate("a")
    new.agreement = old.agreement
    card = new.card("127.0.0.1:7100").to_dict()
    card.update(previous_signing_key=b64(old.signing_public), previous_valid_until=until)
    path = tmp_path / "roster.yaml"
    path.write_text(yaml.safe_dump({"sites": [card]}))
    return path, old, new


@pytest.mark.parametrize(
    "until", ["2026-12-01", "tomorrow", True, [1.0], {"s": 1}, math.nan, math.inf, -math.inf]
)
def test_a_grace_deadline_that_is_not_finite_unix_seconds_is_refused_when_the_roster_loads(
    tmp_path, until
):
    # Before: a string (an ISO date) loaded, then every signature check of the
    # site raised TypeError out of the codec; .nan and .inf kept the previous
    # key valid for ever; True was taken as 1 second after 1970.
    path, _, _ = rotated_roster(tmp_path, until)
    with pytest.raises(IdentityError, match="previous_valid_until must be unix seconds"):
        Roster.load(path)


def test_a_finite_grace_deadline_still_admits_the_previous_key_until_then(tmp_path):
    now = time.time()
    path, old, new = rotated_roster(tmp_path, int(now) + 3600)  # an int, as a hand edit gives
    site = Roster.load(path)["a"]
    assert site.verify(old.sign(b"m"), b"m", now) and site.verify(new.sign(b"m"), b"m", now)
    assert not site.verify(old.sign(b"m"), b"m", now + 7200)
    assert site.verify(new.sign(b"m"), b"m", now + 7200)


def test_a_malformed_grace_deadline_is_refused_whole_and_the_loaded_roster_still_answers(tmp_path):
    """The codec never sees such a roster: a reload (SIGHUP) that raises keeps the old one."""
    path, old, _ = rotated_roster(tmp_path, time.time() + 3600)
    me = LocalIdentity.generate("me")
    doc = yaml.safe_load(path.read_text())
    doc["sites"].append(me.card("127.0.0.1:7101").to_dict())
    path.write_text(yaml.safe_dump(doc))
    codec = WireCodec(me, Roster.load(path), "fed")
    frame = WireCodec(old, Roster([old.card(), me.card()]), "fed").encode("probe", "me", {})
    doc["sites"][0]["previous_valid_until"] = "2026-12-01"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(IdentityError):
        Roster.load(path)
    assert codec.decode(frame.to_bytes()).header.sender == "a"  # the old roster still answers


# ----------------------------------------------------------------------------- key files


def saved(tmp_path: Path) -> tuple[LocalIdentity, Path, Path]:
    identity = LocalIdentity.generate("a")
    sign, kex = identity.save(tmp_path / "keys")
    return identity, sign, kex


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o666, 0o620, 0o602])
def test_a_private_key_other_accounts_may_read_or_replace_is_refused(tmp_path, mode):
    # Before: LocalIdentity.load read a 0666 signing key without a word.
    _, sign, kex = saved(tmp_path)
    for victim in (sign, kex):
        os.chmod(victim, mode)
        with pytest.raises(IdentityError, match=f"mode {mode:04o}"):
            LocalIdentity.load("a", sign, kex)
        os.chmod(victim, 0o600)


def test_a_key_of_another_account_is_refused(tmp_path):
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    _, sign, kex = saved(tmp_path)
    os.chown(sign, 4321, 4321)  # an account that could rewrite it
    with pytest.raises(IdentityError, match="belongs to uid 4321"):
        LocalIdentity.load("a", sign, kex)


def test_a_fifo_at_the_key_path_is_refused_not_waited_on(tmp_path):
    _, sign, kex = saved(tmp_path)
    sign.unlink()
    os.mkfifo(sign, 0o600)
    with pytest.raises(IdentityError, match="not a plain file"):
        LocalIdentity.load("a", sign, kex)


def test_what_the_shipped_deployments_make_still_loads(tmp_path):
    """keygen's 0600 files, and a Kubernetes Secret volume: links to root's
    0440 files, readable by the pod's fsGroup (deploy/k8s/base)."""
    identity, sign, kex = saved(tmp_path)
    assert LocalIdentity.load("a", sign, kex).signing_public == identity.signing_public
    secret = tmp_path / "secret"
    data = secret / "..2026_11_28_00_00_00.1"
    data.mkdir(parents=True)
    for src, name in ((sign, "sign.pem"), (kex, "kex.pem")):
        (data / name).write_bytes(src.read_bytes())
        os.chmod(data / name, 0o440)
        (secret / name).symlink_to(Path(data.name) / name)
    loaded = LocalIdentity.load("a", secret / "sign.pem", secret / "kex.pem")
    assert loaded.agreement_public == identity.agreement_public


def test_check_names_the_key_and_its_mode_in_one_line(tmp_path, capsys):
    out = tmp_path / "fed"
    assert main(["provision", "--out", str(out), "--sites", "a,b"]) == 0
    os.chmod(out / "a" / "state" / "keys" / "a.sign.pem", 0o644)
    capsys.readouterr()
    assert main(["check", "--config", str(out / "a" / "site.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a.sign.pem" in err[0] and "0644" in err[0]


def test_decode_with_the_roster_it_loaded_never_raises_past_the_codec(tmp_path):
    """The check that used to escape as TypeError: a previous key with a
    deadline, past and future, gives a verdict (accepted or bad_signature)."""
    me = LocalIdentity.generate("me")
    for until, expected in ((time.time() - 10, "bad_signature"), (time.time() + 600, "ok")):
        path, old, _ = rotated_roster(tmp_path, until)
        doc = yaml.safe_load(path.read_text())
        doc["sites"].append(me.card("127.0.0.1:7101").to_dict())
        path.write_text(yaml.safe_dump(doc))
        codec = WireCodec(me, Roster.load(path), "fed")
        frame = WireCodec(old, Roster([old.card(), me.card()]), "fed").encode("probe", "me", {})
        try:
            codec.decode(frame.to_bytes())
            verdict = "ok"
        except WireError as err:
            verdict = err.reason
        assert verdict == expected


# ----------------------------------------------------------------------------- cards in transit


def two_sites(tmp_path: Path) -> Path:
    """a and b made by keygen; b's roster holds both cards; returns that roster."""
    for n, port in (("a", 7100), ("b", 7101)):
        assert (
            main(
                [
                    "keygen",
                    "--name",
                    n,
                    "--out",
                    str(tmp_path / n),
                    "--address",
                    f"127.0.0.1:{port}",
                ]
            )
            == 0
        )
    roster = tmp_path / "b" / "roster.yaml"
    for n in ("a", "b"):
        assert (
            main(["roster", "add", str(tmp_path / n / f"{n}.card.yaml"), "--roster", str(roster)])
            == 0
        )
    return roster


def test_a_rotated_card_naming_a_stranger_as_its_previous_key_is_refused(tmp_path, capsys):
    # Before: `roster add` took the swapped previous key, and b accepted a
    # message mallory signed as `a` for the whole grace period.
    roster = two_sites(tmp_path)
    assert main(["keygen", "--rotate", "--name", "a", "--out", str(tmp_path / "a")]) == 0
    mallory = LocalIdentity.generate("a")
    card = yaml.safe_load((tmp_path / "a" / "a.card.yaml").read_text())
    card["previous_signing_key"] = b64(mallory.signing_public)
    (tmp_path / "evil.card.yaml").write_text(yaml.safe_dump(card))
    before = roster.read_bytes()
    capsys.readouterr()
    assert main(["roster", "add", str(tmp_path / "evil.card.yaml"), "--roster", str(roster)]) == 2
    assert "previous_signing_key is not a key the roster lists" in capsys.readouterr().err
    assert roster.read_bytes() == before
    b = LocalIdentity.load("b", tmp_path / "b" / "b.sign.pem", tmp_path / "b" / "b.kex.pem")
    frame = WireCodec(mallory, Roster([mallory.card(), b.card()]), "fed").encode("probe", "b", {})
    with pytest.raises(WireError, match="bad_signature"):
        WireCodec(b, Roster.load(roster), "fed").decode(frame.to_bytes())
    # the honest rotated card still goes in, with its grace key
    assert (
        main(["roster", "add", str(tmp_path / "a" / "a.card.yaml"), "--roster", str(roster)]) == 0
    )
    honest = load_card(tmp_path / "a" / "a.card.yaml").previous_signing_key
    assert Roster.load(roster)["a"].card.previous_signing_key == honest


def test_a_first_added_card_gets_no_grace_key(tmp_path):
    """A site the roster never listed has no previous key anyone vouched for."""
    roster = tmp_path / "roster.yaml"
    keys = tmp_path / "a"
    assert main(["keygen", "--name", "a", "--out", str(keys), "--address", "127.0.0.1:7100"]) == 0
    assert main(["keygen", "--rotate", "--name", "a", "--out", str(keys)]) == 0
    assert load_card_previous(keys / "a.card.yaml")
    assert main(["roster", "add", str(keys / "a.card.yaml"), "--roster", str(roster)]) == 0
    card = Roster.load(roster)["a"].card
    assert card.previous_signing_key is None and card.previous_valid_until is None


def load_card_previous(path: Path) -> str | None:
    return yaml.safe_load(path.read_text()).get("previous_signing_key")


def test_the_fingerprint_covers_the_agreement_key_and_every_cli_step_prints_it(tmp_path, capsys):
    # Before: the docs had sites confirm the signing key alone by phone; a card
    # with the real signing key and mallory's agreement key passed, and b's
    # payloads encrypted to `a` opened with mallory's key.
    a, mallory = LocalIdentity.generate("a"), LocalIdentity.generate("a")
    real = a.card("127.0.0.1:7100")
    swapped = dataclasses.replace(real, agreement_key=b64(mallory.agreement_public))
    assert swapped.signing_key == real.signing_key
    assert swapped.fingerprint() != real.fingerprint()
    assert dataclasses.replace(real, name="b").fingerprint() != real.fingerprint()
    assert dataclasses.replace(real, address="10.0.0.1:1").fingerprint() == real.fingerprint()
    capsys.readouterr()
    roster = two_sites(tmp_path)
    printed = capsys.readouterr()
    fp = Roster.load(roster)["a"].card.fingerprint()
    assert f"fingerprint (read it to each peer by phone): {fp}" in printed.err  # keygen
    assert f"fingerprint {fp}: confirm it with a" in printed.out  # roster add
    assert main(["roster", "list", "--roster", str(roster)]) == 0
    assert fp in capsys.readouterr().out
    assert main(["keygen", "--rotate", "--name", "a", "--out", str(tmp_path / "a")]) == 0
    rotated = load_card(tmp_path / "a" / "a.card.yaml").fingerprint()
    assert rotated != fp and rotated in capsys.readouterr().err


def test_the_provisioning_docs_say_to_confirm_the_fingerprint():
    ops = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    step = ops[ops.index("3. **Exchange cards**") : ops.index("4. **Each site builds")]
    assert "fingerprint" in step and "agreement" in step


# ----------------------------------------------------------------------------- the roster file


def test_a_roster_any_account_may_rewrite_is_refused(tmp_path):
    # Before: a 0666 roster loaded at start and at every SIGHUP, node and
    # relay alike: any account on the host could add a key or swap one.
    path = tmp_path / "roster.yaml"
    Roster([LocalIdentity.generate("a").card("127.0.0.1:7100")]).save(path)
    os.chmod(path, 0o666)
    with pytest.raises(IdentityError, match="mode 0666: any account on this host may rewrite"):
        Roster.load(path)
    os.chmod(path, 0o664)  # a group-shared admin folder under umask 002 stays usable
    assert Roster.load(path).names() == ["a"]


def test_a_roster_that_is_not_utf8_is_one_line_not_a_traceback(tmp_path):
    path = tmp_path / "roster.yaml"
    path.write_bytes(b"sites: [\xff\xfe]\n")
    with pytest.raises(IdentityError, match="not UTF-8"):
        Roster.load(path)


# ----------------------------------------------------------------------------- rotation


def test_a_rotation_rerun_after_a_crash_keeps_the_published_key_as_the_grace_key(
    tmp_path, monkeypatch
):
    # Before: a crash after the new key was written and before the new card
    # was (here: the card's YAML dump raises) left the old card; the rerun
    # rotated from the never-published key and named it the previous one, so
    # the key peers trusted lost its grace period.
    import node.deploy as deploy

    keys = tmp_path / "a"
    assert main(["keygen", "--name", "a", "--out", str(keys), "--address", "127.0.0.1:7100"]) == 0
    published = load_card(keys / "a.card.yaml").signing_key

    def power_cut(*args, **kwargs):
        raise OSError("power cut")

    with monkeypatch.context() as patched:
        patched.setattr(deploy.yaml, "safe_dump", power_cut)
        with pytest.raises(OSError, match="power cut"):
            deploy.rotate_signing_key("a", keys, grace_hours=24)
    assert load_card(keys / "a.card.yaml").signing_key == published  # the old card, whole
    assert main(["keygen", "--rotate", "--name", "a", "--out", str(keys)]) == 0
    card = load_card(keys / "a.card.yaml")
    assert card.previous_signing_key == published
    on_disk = LocalIdentity.load("a", keys / "a.sign.pem", keys / "a.kex.pem")
    assert card.signing_key == b64(on_disk.signing_public)
    for retired in (keys / "retired").iterdir():
        assert retired.stat().st_mode & 0o077 == 0


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    "name",
    [
        "x by phone\r  fingerprint 0000 1111: confirm it with x",
        "a\nb",
        "\x1b[2Ka",
        "",
        "-a",
        "a" * 65,
        7,
    ],
)
def test_a_card_whose_name_no_site_may_have_is_refused_before_anything_prints_it(
    tmp_path, capsys, name
):
    # Before: `roster add` took a name with a carriage return and printed it
    # raw; on a terminal the line read for the phone check showed a made-up
    # fingerprint instead of the card's.
    card = LocalIdentity.generate("x").card("127.0.0.1:7100").to_dict()
    card["name"] = name
    (tmp_path / "x.card.yaml").write_text(yaml.safe_dump(card))
    roster = tmp_path / "roster.yaml"
    capsys.readouterr()
    assert main(["roster", "add", str(tmp_path / "x.card.yaml"), "--roster", str(roster)]) == 2
    printed = capsys.readouterr()
    assert "is not a site name" in printed.err and printed.out == "" and not roster.exists()
    assert "\r" not in printed.err and "\n" not in printed.err.rstrip("\n")


def test_roster_names_follow_the_config_name_rule():
    from p2pfl.config.sections import NodeSection
    from p2pfl.secure.identity import NAME_PATTERN

    assert NodeSection.model_fields["name"].metadata[0].pattern == NAME_PATTERN


# ----------------------------------------------------------------------------- the TLS key


def test_a_tls_private_key_others_may_read_or_replace_is_refused(tmp_path):
    # Before: node/tls.py handed a 0666 key to ssl without a word.
    from test_tls import make_pki

    from node.tls import client_ssl_context, server_ssl_context

    make_pki(tmp_path, ["a"])
    cert, key, ca = (str(tmp_path / n) for n in ("a.crt", "a.key", "ca.pem"))
    for context in (server_ssl_context, client_ssl_context):
        context(cert, key, ca)  # 0600, as make_pki writes it
        os.chmod(key, 0o644)
        with pytest.raises(IdentityError, match="TLS private key .* mode 0644"):
            context(cert, key, ca)
        os.chmod(key, 0o600)


def test_a_card_with_a_low_order_agreement_key_is_refused_when_the_roster_loads(tmp_path):
    # Before: the roster loaded, and every encrypted frame from that member,
    # and every encryption to it, raised ValueError out of the codec (whose
    # contract is WireError only).
    m = LocalIdentity.generate("m")
    card = m.card("127.0.0.1:7100").to_dict()
    card["agreement_key"] = b64(bytes(32))
    path = tmp_path / "roster.yaml"
    path.write_text(yaml.safe_dump({"sites": [card]}))
    with pytest.raises(IdentityError, match="no key exchange works with"):
        Roster.load(path)


# ----------------------------------------------------------------------------- named token files


def named_token(tmp_path: Path, mode: int) -> Path:
    token = tmp_path / "etc" / "status.token"
    token.parent.mkdir(exist_ok=True)
    token.write_text("s" * 43 + "\n")
    os.chmod(token, mode)
    return token


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620])
def test_a_status_token_file_the_operator_names_that_others_may_read_is_refused(tmp_path, mode):
    # Before: a token file outside the state dir (the docs' choice when the
    # status port is not on loopback) was read whatever its mode: a 0644 one,
    # readable by any account on the host, was served as the bearer token.
    from node.provision import provision
    from node.status import status_token
    from p2pfl.config import ConfigError, load_config

    token = named_token(tmp_path, mode)
    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={"name": "fedavgp2p", "rounds": 1},
        per_site={"a": {"status": {"token_file": str(token)}}},
    )
    cfg = load_config(plans[0].config_path)
    with pytest.raises(ConfigError, match=f"mode {mode:04o}") as caught:
        status_token(cfg, plans[0].config_path)
    assert "s" * 43 not in str(caught.value)
    os.chmod(token, 0o600)
    assert status_token(cfg, plans[0].config_path) == "s" * 43
    # a Kubernetes Secret: a link to a 0440 file the pod's group reads
    os.chmod(token, 0o440)
    link = tmp_path / "etc" / "link.token"
    link.symlink_to(token.name)
    cfg.status.token_file = link
    assert status_token(cfg, plans[0].config_path) == "s" * 43


def test_a_relay_refuses_a_named_status_token_file_others_may_read(tmp_path):
    from test_relay import write_relay_yaml

    from node.relay_status import relay_status_token
    from p2pfl.config import ConfigError
    from p2pfl.config.relay import load_relay_config

    token = named_token(tmp_path, 0o644)
    Roster([LocalIdentity.generate("a").card("127.0.0.1:7100")]).save(tmp_path / "roster.yaml")
    path = write_relay_yaml(tmp_path / "r1", {"name": "r1"}, status={"token_file": str(token)})
    with pytest.raises(ConfigError, match="mode 0644"):
        relay_status_token(load_relay_config(path), path)
    os.chmod(token, 0o600)
    assert relay_status_token(load_relay_config(path), path) == ("s" * 43, token)


def test_a_card_cannot_extend_the_deadline_of_a_key_already_rotated_out(tmp_path):
    # Before (with the check above): a card naming the roster's previous key
    # again with a later deadline was taken, reviving a rotated-out key for
    # whoever held it; the fingerprint does not cover the previous key.
    roster = two_sites(tmp_path)
    assert (
        main(
            [
                "keygen",
                "--rotate",
                "--name",
                "a",
                "--out",
                str(tmp_path / "a"),
                "--grace-hours",
                "0",
            ]
        )
        == 0
    )
    assert (
        main(["roster", "add", str(tmp_path / "a" / "a.card.yaml"), "--roster", str(roster)]) == 0
    )
    listed = Roster.load(roster)["a"].card
    card = listed.to_dict()
    card["previous_valid_until"] = time.time() + 10 * 365 * 86400
    (tmp_path / "evil.card.yaml").write_text(yaml.safe_dump(card))
    assert main(["roster", "add", str(tmp_path / "evil.card.yaml"), "--roster", str(roster)]) == 0
    kept = Roster.load(roster)["a"]
    assert kept.card.previous_valid_until == listed.previous_valid_until < time.time()
    old = LocalIdentity.load(
        "a", next((tmp_path / "a" / "retired").iterdir()), tmp_path / "a" / "a.kex.pem"
    )
    assert not kept.verify(old.sign(b"m"), b"m")


def test_a_rotated_cards_deadline_altered_in_transit_is_refused(tmp_path, capsys):
    # Before: the deadline was covered by nothing the sites confirm. A site
    # rotated a stolen key with --grace-hours 0; the thief set the deadline
    # ten years out on the card's way, the phoned fingerprint still matched,
    # and the stolen key went on signing as the site.
    roster = two_sites(tmp_path)
    stolen = LocalIdentity.load("a", tmp_path / "a" / "a.sign.pem", tmp_path / "a" / "a.kex.pem")
    rotate = ["keygen", "--rotate", "--name", "a", "--out", str(tmp_path / "a")]
    assert main([*rotate, "--grace-hours", "0"]) == 0
    sent = load_card(tmp_path / "a" / "a.card.yaml")
    assert sent.grace_signed()
    card = yaml.safe_load((tmp_path / "a" / "a.card.yaml").read_text())
    card["previous_valid_until"] = time.time() + 10 * 365 * 86400
    (tmp_path / "evil.card.yaml").write_text(yaml.safe_dump(card))
    before = roster.read_bytes()
    capsys.readouterr()
    assert main(["roster", "add", str(tmp_path / "evil.card.yaml"), "--roster", str(roster)]) == 2
    assert "not signed by the card's signing key" in capsys.readouterr().err
    assert roster.read_bytes() == before
    # the card as sent goes in, and the stolen key is refused at once
    assert (
        main(["roster", "add", str(tmp_path / "a" / "a.card.yaml"), "--roster", str(roster)]) == 0
    )
    assert not Roster.load(roster)["a"].verify(stolen.sign(b"m"), b"m")


def test_an_inline_status_token_in_a_site_yaml_others_may_read_is_named_loudly(tmp_path, caplog):
    """The systemd unit's configuration folder is 0755, so a site.yaml there is
    0644 under the usual umask: an inline status.token in it is every local
    account's (a review, 2026-11-28). The node says so, naming the file and
    the fix, and says nothing once the file is the service's alone."""
    from node.provision import provision
    from node.status import status_token
    from p2pfl.config import load_config

    token = "t" * 43
    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={"name": "fedavgp2p", "rounds": 1},
        per_site={"a": {"status": {"token": token}}},
    )
    path = plans[0].config_path
    cfg = load_config(path, check_files=False)  # provision's token file is made at start
    os.chmod(path, 0o644)
    with caplog.at_level("WARNING", logger="node.status"):
        assert status_token(cfg, path) == token
    warned = [r.getMessage() for r in caplog.records if "status.token inline" in r.getMessage()]
    assert len(warned) == 1 and "0644" in warned[0] and str(path) in warned[0]
    assert token not in warned[0]
    caplog.clear()
    os.chmod(path, 0o600)
    with caplog.at_level("WARNING", logger="node.status"):
        assert status_token(cfg, path) == token
    assert not [r for r in caplog.records if "status.token inline" in r.getMessage()]
