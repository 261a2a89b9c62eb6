"""Attacks on claims of docs/threat-model.md, docs/export.md and
docs/configuration.md that no test attacked before (a claims review,
2026-11-28): each test tries to break the sentence it names."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
from PIL import Image

from node.cli import main


def test_predicts_csv_is_this_accounts_only_whatever_the_umask(tmp_path, capsys):
    """docs/export.md: predict's CSV "is created 0600, as it says what each of
    the site's images shows". Under the usual umask 022, and over a 0644 file
    already at the name (a previous run's, or one made by hand), the CSV comes
    out 0600."""
    import torch

    from p2pfl.learning.export import Architecture, write_package

    torch.manual_seed(0)
    arch = Architecture("small_cnn", 1, 2, 16)
    package = tmp_path / "pkg"
    write_package(
        package,
        arch.build().state_dict(),
        arch,
        ["normal", "pneumonia"],
        ["safetensors"],
        torch.rand(4, 1, 16, 16),
    )
    scans = tmp_path / "scans"
    scans.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(
            scans / f"DOE_JANE_{i}.png"
        )
    out = tmp_path / "shared"
    out.mkdir(mode=0o755)
    fresh, existing = out / "fresh.csv", out / "existing.csv"
    existing.write_text("old\n")
    os.chmod(existing, 0o644)
    previous = os.umask(0o022)
    try:
        for target in (fresh, existing):
            assert main(["predict", "--model", str(package), str(scans), "--csv", str(target)]) == 0
    finally:
        os.umask(previous)
    capsys.readouterr()
    for target in (fresh, existing):
        assert stat.S_IMODE(target.stat().st_mode) == 0o600, (target, oct(target.stat().st_mode))
        assert target.read_text().count("DOE_JANE_") == 3  # what it protects: a name per image


def test_the_gossiped_f1_is_the_federated_models_never_the_personal_ones(tmp_path):
    """docs/threat-model.md, Personalization: "The personal model's figures are
    not gossiped (only the federated model's per-class F1 is ...)". Two
    in-memory sites under the f1 heuristic with Ditto (whose personal model is
    evaluated in the same module, swapped in): the per-class F1 each site sends
    every roster member is that of its federated model on its validation split,
    and not that of its personal model, which a strong personal pull (lambda
    0) makes differ."""
    import asyncio

    import torch

    from p2pfl.learning.data.partition import partition_dataset
    from p2pfl.learning.evaluate import evaluate_site
    from p2pfl.learning.train import LocalSite
    from protocols.memory import InMemoryNetwork, simulate, simulation_configs
    from protocols.selection import F1_KEY

    partition_dataset("digits", 2, "dirichlet:0.5", tmp_path / "parts", seed=0)
    configs = simulation_configs(
        [str(tmp_path / "parts" / f"site_{i}.npz") for i in range(2)],
        protocol={"name": "fedavgp2p", "rounds": 2, "fraction": 1.0, "round_timeout_s": 5.0},
        state_root=tmp_path / "state",
        data={"image_size": 8, "augment": "none"},
        training={
            "epochs": 1,
            "batch_size": 32,
            "max_steps_per_epoch": 4,
            "personalization": {"method": "ditto", "ditto_lambda": 0.0},
        },
        selection={"name": "f1"},
    )
    network = InMemoryNetwork(inline_train=True)
    result = asyncio.run(simulate(configs, network=network))
    assert result.errors == {}, result.errors
    seen = {p.name: p.meta for p in network.join("observer").peers()}
    for config in configs:
        name = config.node.name
        gossiped = seen[name][F1_KEY]
        saved = network.saved_state(name)
        assert saved is not None and saved["personal"]["state"] is not None
        torch.manual_seed(0)
        site = LocalSite.from_config(config)
        figures = {}
        for which, state in (
            ("federated", saved["model"]),
            ("personal", saved["personal"]["state"]),
        ):
            site.load_state_dict(state)
            figures[which] = [float(x) for x in evaluate_site(site)["per_class_f1"]]
        assert figures["personal"] != figures["federated"], (name, figures)  # the test can tell
        assert gossiped == figures["federated"], (name, gossiped, figures)


def test_a_relays_own_status_token_file_is_refused_if_a_link_or_others_may_read_it(tmp_path):
    """docs/threat-model.md, Through a relay: the relay's own `status.token`
    beside its relay.yaml is "refused if it is a link or others may read it"
    (the cited test only made one). Planted as a link to a 0600 file holding a
    good token, left 0644 by hand, or another account's: the relay's start
    refuses it, naming the file, never its token."""
    import pytest
    from test_relay import write_relay_yaml

    from node.relay_status import relay_status_token
    from p2pfl.config import ConfigError
    from p2pfl.config.relay import load_relay_config
    from p2pfl.secure.identity import LocalIdentity, Roster

    Roster([LocalIdentity.generate("a").card("127.0.0.1:7100")]).save(tmp_path / "roster.yaml")
    path = write_relay_yaml(tmp_path / "r1", {"name": "r1"}, status={"port": 0})
    own = tmp_path / "r1" / "status.token"
    secret = "s" * 43
    elsewhere = tmp_path / "elsewhere.token"
    elsewhere.write_text(secret + "\n")
    os.chmod(elsewhere, 0o600)

    def refused(match: str) -> None:
        with pytest.raises(ConfigError, match=match) as caught:
            relay_status_token(load_relay_config(path), path)
        assert secret not in str(caught.value) and str(own) in str(caught.value)

    own.symlink_to(elsewhere)
    refused("symbolic link")
    own.unlink()
    own.write_text(secret + "\n")
    os.chmod(own, 0o644)
    refused("others may read it")
    os.chmod(own, 0o600)
    if os.getuid() == 0:  # planted by another account (only root can give a file away)
        os.chown(own, 4321, 4321)
        refused("belongs to uid 4321")
        os.chown(own, 0, 0)
    assert relay_status_token(load_relay_config(path), path) == (secret, own)


def test_a_peer_learns_the_kind_of_a_sites_data_error_never_its_file_name(tmp_path):
    """docs/threat-model.md, Other accounts on the node's host: a DataError names
    a file, and a file name often names a patient; "heartbeats carry the kind
    alone" (the cited test read only the failing node's own /status). Two real
    daemons in this process: c's data folder holds DOE_JANE_MRN....png, which
    cannot be read; what a shows of c (its /status and /peers, filled from c's
    heartbeats) says DataError, and nowhere the patient's name."""
    import json

    from inproc_util import InProcessFederation
    from test_log_privacy import PATIENT, _folder_with_a_patients_broken_file

    from node.provision import provision
    from p2pfl.learning.data.partition import partition_dataset

    partition_dataset("digits", 1, "iid", tmp_path / "parts", seed=0)
    source = _folder_with_a_patients_broken_file(tmp_path / "images")
    plans = provision(
        tmp_path / "fed",
        ["a", "c"],
        protocol={"name": "fedavgp2p", "rounds": 1, "fraction": 1.0, "round_timeout_s": 5},
        data_sources=[str(tmp_path / "parts" / "site_0.npz"), str(source)],
        overrides={
            "transport": {"heartbeat_s": 0.3, "suspect_after_s": 3.0, "dead_after_s": 6.0},
            "node": {"startup_wait_s": 2},
            "data": {"image_size": 8, "augment": "none"},
            "training": {"max_steps_per_epoch": 1, "batch_size": 16, "threads": 1},
        },
    )

    def c_failed_as_a_sees_it(status: dict) -> bool:
        return "DataError" in json.dumps(status.get("peers"))

    with InProcessFederation(plans) as fed:
        fed["c"].wait_for(lambda s: bool(s.get("error")), 60, "c's failure")
        seen = fed["a"].wait_for(c_failed_as_a_sees_it, 30, "c's failure heard by a")
        graph = fed["a"].get("/peers")
        fed.stop_all()
    (c,) = [p for p in seen["peers"] if p["name"] == "c"]
    assert c["error"] == "DataError", c  # the kind alone (a message would be cut at 80)
    shown = json.dumps(seen) + json.dumps(graph)
    assert PATIENT not in shown and "MRN" not in shown and ".png" not in shown, shown


GOOD_TOKEN = "Zq3" * 15  # 45 printable characters: a plausible token


def test_check_never_prints_an_inline_status_token_good_or_refused(tmp_path, capsys):
    """docs/configuration.md: `check` prints "the resolved config (status.token
    masked)"; docs/threat-model.md: "No refusal prints key bytes or the status
    token (`check` masks an inline token)". Neither was attacked. An inline
    token is written into a provisioned site.yaml: a good one, and ones the node
    refuses (too short, too long, with spaces, with a newline, not ASCII, not
    a string); whatever `check` says, on stdout or stderr, holds no token."""
    import yaml

    from node.provision import provision

    (plan,) = provision(tmp_path / "fed", ["solo"], protocol={"name": "fedavgp2p", "rounds": 1})
    config = Path(plan.config_path)
    raw = yaml.safe_load(config.read_text())
    cases = [
        (GOOD_TOKEN, 0),
        ("S3cr" * 3, 2),  # 12 characters
        ("L0ng" * 200, 2),  # 800 characters
        ("Spaced out " * 5, 2),
        ("Two\nLines" + "x" * 30, 2),
        ("Gr\u00fc\u00dfe" + "y" * 30, 2),
    ]
    for token, expected in cases:
        raw["status"] = {**raw.get("status", {}), "token": token}
        raw["status"].pop("token_file", None)
        config.write_text(yaml.safe_dump(raw))
        os.chmod(config, 0o600)
        code = main(["check", "--config", str(config)])
        out, err = capsys.readouterr()
        assert code == expected, (token[:20], code, err[-500:])
        if expected == 0:  # docs/operations.md: shown as `<set: not shown>`
            assert "token: '<set: not shown>'" in out or "token: <set: not shown>" in out, out
        for part in {token, token.strip(), *token.split()} - {""}:
            if len(part) >= 8:
                assert part not in out + err, (token[:20], part, (out + err)[-800:])
    raw["status"]["token"] = ["L1st", GOOD_TOKEN]  # not a string at all
    config.write_text(yaml.safe_dump(raw))
    code = main(["check", "--config", str(config)])
    out, err = capsys.readouterr()
    assert code == 2 and GOOD_TOKEN not in out + err, (out + err)[-800:]


def test_with_encryption_a_nodes_answer_to_a_request_is_sealed_to_the_requester(
    tmp_path, identities, roster
):
    """docs/operations.md: with `wire.encryption: true` "a node encrypts
    everything it sends to each recipient: pushes, requests, answers and
    heartbeats"; tests/test_encryption.py reads only the heartbeats a node
    sends. A roster member asks the node's real Inbound for its model: the
    answer frame is sealed to that member (no tensor byte and no key name in
    the clear), opens with its key only, and a third member cannot open it."""
    import asyncio
    from types import SimpleNamespace

    import torch
    from test_hostile_wire import FED, incoming, make_inbound

    from p2pfl.secure.wire import WireCodec, WireError

    alice = WireCodec(identities["alice"], roster, FED, require_encryption=True)
    bob = WireCodec(identities["bob"], roster, FED, require_encryption=True)
    carol = WireCodec(identities["carol"], roster, FED)
    weights = torch.arange(4096, dtype=torch.float32) + 0.5  # bytes one can look for
    served = {"conv_secret_weight": weights}

    async def scenario() -> bytes:
        inbound = make_inbound(tmp_path, alice)
        inbound.cfg = SimpleNamespace(
            transport=inbound.cfg.transport, wire=SimpleNamespace(encryption=True)
        )

        async def model(sender: str, query: dict) -> dict:
            return {"model": served, "round": 1}

        inbound.handlers["model"] = model
        ask = bob.encode("req:model", "alice", {"round": 1}, encrypt=True).to_bytes()
        status, chunks = await inbound.on_frame(incoming(alice, ask))
        assert status == 200
        return b"".join(bytes(c) for c in chunks)

    frame = asyncio.run(scenario())
    assert weights.numpy().tobytes()[:64] not in frame
    assert b"conv_secret_weight" not in frame
    got = bob.decode(bytearray(frame))
    assert got.header.encrypted and got.header.kind == "resp:model"
    assert torch.equal(got.payload["model"]["conv_secret_weight"], weights)
    try:
        carol.decode(bytearray(frame))
    except WireError as exc:
        assert exc.reason in {"wrong_recipient", "decrypt_failed", "bad_ciphertext"}, exc.reason
    else:  # pragma: no cover - the hole this test is about
        raise AssertionError("a third roster member opened an answer sealed to bob")


WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
WRITE_EVENTS = {
    "os.rename",
    "os.replace",
    "os.remove",
    "os.rmdir",
    "os.mkdir",
    "os.link",
    "os.symlink",
    "os.truncate",
    "os.chmod",
    "os.chown",
    "shutil.copyfile",
    "shutil.move",
    "shutil.rmtree",
}
_WRITES: list[tuple[str, str]] | None = None  # recording while a list


def _record_writes(event: str, args: tuple) -> None:
    """An audit hook (PEP 578): every file this process opens for writing, and
    every path it renames, links, removes or changes, while recording."""
    if _WRITES is None:
        return
    if event == "open":
        path, _mode, flags = (tuple(args) + (None, None))[:3]
        named = isinstance(path, (str, bytes, os.PathLike))
        if named and isinstance(flags, int) and flags & WRITE_FLAGS:
            _WRITES.append((event, os.fsdecode(path)))
    elif event in WRITE_EVENTS and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _WRITES.append((event, os.fsdecode(args[0])))


def test_a_relay_writes_nothing_to_disk_but_its_status_token(tmp_path, monkeypatch):
    """docs/operations.md: the relay "holds no data, no keys but its TLS
    certificate, trains nothing and writes nothing to disk but its status
    token". A relay process in this process, watched by an audit hook for every
    write, rename, link, removal or mode change of a file: it starts, admits
    an outbound-only site, forwards a frame to it and back, refuses a plaintext
    one, answers /status, reloads its roster and stops; the one file it wrote is
    its status.token."""
    import asyncio
    import sys

    import aiohttp
    from test_relay import (
        RelaySite,
        codec,
        frame,
        make_roster,
        post,
        reason,
        until,
        write_relay_yaml,
    )

    from node.provision import free_ports
    from node.relay_status import RelayProcess
    from p2pfl.config.relay import load_relay_config
    from p2pfl.secure.identity import LocalIdentity, Roster

    global _WRITES
    ids = {n: LocalIdentity.generate(n) for n in ("a", "b", "c", "d", "f", "x")}
    make_roster(ids).save(tmp_path / "roster.yaml")
    (port,) = free_ports(1)
    path = write_relay_yaml(
        tmp_path / "r1", {"name": "r1", "listen": f"127.0.0.1:{port}"}, status={"port": 0}
    )
    cfg = load_relay_config(path)
    roster = Roster.load(tmp_path / "roster.yaml")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # imports' .pyc are not the relay's
    sys.addaudithook(_record_writes)

    async def scenario() -> None:
        process = RelayProcess(cfg, roster, path)
        await process.start()
        url = f"http://127.0.0.1:{process.port}"
        b = RelaySite(ids["b"], roster)
        try:
            assert await b.connect(url) == {"type": "ok"}
            await until(lambda: "b" in process.server.links)
            a = codec(ids, roster, "a")
            status, _ = await post(url, frame(a, "b", {"round": 1, "x": "y" * 4096}))
            assert status == 200 and len(b.received) == 1
            status, body = await post(url, frame(a, "b", encrypt=False))
            assert (status, reason(body)) == (403, "encryption_required")
            base = f"http://127.0.0.1:{process.status_port}"
            headers = {"Authorization": f"Bearer {process.token}"}
            async with aiohttp.ClientSession() as s, s.get(base + "/status", headers=headers) as r:
                assert r.status == 200
            process.reload_roster()
        finally:
            await b.close()
            await process.stop()

    _WRITES = []
    try:
        asyncio.run(scenario())
        written = list(_WRITES)
    finally:
        _WRITES = None
    token = tmp_path / "r1" / "status.token"
    assert token.is_file()
    others = [(e, p) for e, p in written if Path(p).name not in {token.name}]
    # create_exclusive's temporary names sit beside it, start with its name's dot form
    others = [(e, p) for e, p in others if not Path(p).name.startswith(".status.token.")]
    # (its folder, which exists, made sure of before the token is created in it)
    others = [(e, p) for e, p in others if (e, Path(p)) != ("os.mkdir", token.parent)]
    assert others == [], others
    assert any("status.token" in Path(p).name for _, p in written), written  # the hook sees


def test_the_gates_grids_of_real_images_are_never_served(tmp_path, codecs):
    """docs/configuration.md and docs/threat-model.md: the gate's evidence in
    STATE/genbuffer (grids of real images) is "never served". /status names the
    grid's path (the dashboard shows it to the operator): asked for at that
    path, under the state directory, or by any route the dashboard or a peer
    could reach, with the status token, nothing answers with it. The status
    and peer apps hold only fixed routes (no static folder, no path parameter),
    so no future file under the state directory can be served by a name."""
    import asyncio

    from test_status import TOKEN, fetch, populated_telemetry

    from node.relay import RelayServer
    from node.status import create_status_app, start_status_server
    from node.transport import MESSAGE_PATH, MessageServer
    from p2pfl.config import RelaySettings, TransportSection

    state = tmp_path / "state"
    grid = state / "genbuffer" / "privacy_gate.png"
    grid.parent.mkdir(parents=True)
    png = b"\x89PNG\r\n\x1a\n" + b"PATIENT-PIXELS" * 64
    grid.write_bytes(png)
    (state / "genbuffer" / "membership_audit_grid.png").write_bytes(png)
    telemetry = populated_telemetry()
    telemetry.set_privacy_gate({"enabled": True, "released": False, "files": {"grid": str(grid)}})
    status_app = create_status_app(telemetry, node_name="a", protocol_name="feder", token=TOKEN)
    peer = MessageServer(codecs["alice"], TransportSection(), None, lambda r, w: None)
    relaying = MessageServer(codecs["alice"], TransportSection(), None, lambda r, w: None)
    relay = RelayServer(
        "alice",
        "fed-test",
        codecs["alice"].roster,
        RelaySettings(),
        max_message_bytes=8 << 20,
        clock_skew_s=60,
    )
    relaying.extra_routes.append(relay.add_routes)
    for app in (status_app, peer.app(), relaying.app()):
        for resource in app.router.resources():
            info = resource.get_info()
            assert set(info) == {"path"}, info  # a fixed path: no prefix, no {name}
    paths = {r.get_info()["path"] for r in status_app.router.resources()}
    assert paths == {"/healthz", "/status", "/peers", "/metrics", "/history", "/"}
    assert [r.get_info()["path"] for r in peer.app().router.resources()] == [MESSAGE_PATH]

    asks = [
        str(grid),
        "/genbuffer/privacy_gate.png",
        "/state/genbuffer/privacy_gate.png",
        "/privacy_gate.png",
        "/membership_audit_grid.png",
        "/static/../genbuffer/privacy_gate.png",
        "/%2e%2e/genbuffer/privacy_gate.png",
        "/?file=genbuffer/privacy_gate.png",
        "/status?file=" + str(grid),
    ]

    async def scenario() -> list[tuple[str, int, str]]:
        runner, port = await start_status_server(status_app, "127.0.0.1", 0)
        try:
            answers = []
            for ask in asks:
                status, _, body = await fetch(
                    f"http://127.0.0.1:{port}{ask}", {"Authorization": f"Bearer {TOKEN}"}
                )
                answers.append((ask, status, body))
            return answers
        finally:
            await runner.cleanup()

    for ask, status, body in asyncio.run(scenario()):
        assert "PATIENT-PIXELS" not in body and "PNG" not in body, (ask, status)
        assert status in (200, 404), (ask, status)  # 200: /status or the dashboard, by their name


def _modes_below(root: Path, leaf: Path) -> dict[str, str]:
    """The mode of each folder from `root` (excluded) down to `leaf` (included)."""
    modes = {}
    for folder in [leaf, *leaf.parents]:
        if folder == root:
            break
        modes[str(folder.relative_to(root))] = oct(stat.S_IMODE(folder.stat().st_mode))
    return modes


def test_a_nested_artifact_folder_in_the_state_dir_is_0700_whatever_the_umask(tmp_path):
    """docs/configuration.md: in the state directory "every folder [is created]
    0700, whatever the umask". A protocol's artifact (Fed-MAE's `encoder_out`,
    Fed-BEiT's `tokenizer_out`, FedER's relative `genbuffer.out_dir`) may name a
    nested path: `encoder_out: models/fedmae/encoder.pt` made STATE/models and
    STATE/models/fedmae 0755 under umask 022 (a claims review, 2026-11-28), open
    to every local account until the next start narrowed them."""
    from protocols.memory import InMemoryNetwork, simulation_configs

    (config,) = simulation_configs(
        ["digits"], protocol={"name": "fedavgp2p"}, state_root=tmp_path / "state"
    )
    state = Path(config.node.state_dir)
    state.mkdir(parents=True, mode=0o700)
    ctx = InMemoryNetwork().join(config.node.name, config)
    previous = os.umask(0o022)
    try:
        path = ctx.artifact("models/fedmae/encoder.pt")
    finally:
        os.umask(previous)
    assert path == state / "models" / "fedmae" / "encoder.pt"
    modes = _modes_below(state, path.parent)
    assert modes == {"models": "0o700", "models/fedmae": "0o700"}, modes


def test_every_folder_partition_creates_is_0700_whatever_the_umask(tmp_path, capsys):
    """docs/threat-model.md: `p2pfl-node partition` copies a source's images, and
    "a folder it creates is 0700 (one that exists keeps its mode)". Asked for
    `--out new/deeper/parts` under umask 022, it made `parts` 0700 but `new` and
    `new/deeper` 0755 (a claims review, 2026-11-28); `tmp_path`, which exists,
    keeps its mode."""
    out = tmp_path / "new" / "deeper" / "parts"
    before = stat.S_IMODE(tmp_path.stat().st_mode)
    previous = os.umask(0o022)
    try:
        code = main(
            ["partition", "--data", "digits", "--sites", "2", "--scheme", "iid", "--out", str(out)]
        )
    finally:
        os.umask(previous)
    capsys.readouterr()
    assert code == 0
    modes = _modes_below(tmp_path, out)
    assert modes == {k: "0o700" for k in ("new", "new/deeper", "new/deeper/parts")}, modes
    assert stat.S_IMODE(tmp_path.stat().st_mode) == before


def test_every_folder_the_dev_split_copy_makes_is_0700_whatever_the_umask(tmp_path):
    """docs/threat-model.md: `python -m bench.dev_split` writes its copy of a
    source's images 0600 "and a folder it makes for it 0700". Its own test made
    `dev/a` and read `a` alone: `dev` came out 0755 under umask 022."""
    from test_bench_dev_split import source

    from bench import dev_split

    source(tmp_path / "src.npz")
    out = tmp_path / "dev" / "a" / "dev.npz"
    previous = os.umask(0o022)
    try:
        dev_split.main([str(tmp_path / "src.npz"), "--out", str(out)])
    finally:
        os.umask(previous)
    assert _modes_below(tmp_path, out.parent) == {"dev": "0o700", "dev/a": "0o700"}
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_a_hard_link_to_another_accounts_key_in_the_keys_folder_is_refused(tmp_path):
    """docs/threat-model.md (third key review): "A hard link to another
    account's key file in the keys folder is refused (`st_uid` is the inode's)".
    Another account's 0600 key, hard-linked at the site's key names (a name in
    a folder this account owns, a plain file of mode 0600), is refused for
    either key, naming the owner."""
    import pytest

    from p2pfl.secure.identity import IdentityError, LocalIdentity

    if os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    identity = LocalIdentity.generate("a")
    sign, kex = identity.save(tmp_path / "keys")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for mine in (sign, kex):
        planted = theirs / mine.name
        planted.write_bytes(mine.read_bytes())
        os.chmod(planted, 0o600)
        os.chown(planted, 4321, 4321)
        kept = mine.with_suffix(".kept")
        os.replace(mine, kept)
        os.link(planted, mine)
        assert stat.S_ISREG(os.lstat(mine).st_mode) and os.lstat(mine).st_nlink == 2
        with pytest.raises(IdentityError, match="belongs to uid 4321"):
            LocalIdentity.load("a", sign, kex)
        os.replace(kept, mine)
    assert LocalIdentity.load("a", sign, kex).card().signing_key == identity.card().signing_key


async def test_a_stranger_signing_in_a_peers_name_cannot_spend_its_rate(identities, roster):
    """docs/configuration.md: the receiver "rate-limits each peer (...; a peer
    over its rate is refused before the signature check)". The bucket is keyed
    by the claimed name, so the check that keeps a stranger from spending a
    roster peer's rate is that only verified frames take tokens. A stranger
    (carol's key) floods frames claiming to be bob, at 5 x bob's burst: each is
    refused `bad_signature`, none `rate_limited`, and bob's own frames right
    after are all taken."""
    import aiohttp

    from node.transport import MESSAGE_PATH, MessageServer
    from p2pfl.config import TransportSection
    from p2pfl.secure.identity import LocalIdentity
    from p2pfl.secure.wire import WireCodec

    fed = "fed-test"
    alice = WireCodec(identities["alice"], roster, fed)
    bob = WireCodec(identities["bob"], roster, fed)
    carol = identities["carol"]
    forger = WireCodec(LocalIdentity("bob", carol.signing, carol.agreement), roster, fed)
    refused: list[str] = []
    taken: list[str] = []

    async def on_frame(incoming):
        taken.append(incoming.header.sender)
        return 200, None

    cfg = TransportSection(rate_limit_per_s=0.5)  # burst max(10, rate): 10 frames, then 1 per 2 s
    server = MessageServer(alice, cfg, on_frame, lambda reason, who: refused.append(reason))
    port = await server.start("127.0.0.1", 0, None)
    url = f"http://127.0.0.1:{port}{MESSAGE_PATH}"

    async def send(session: aiohttp.ClientSession, codec: WireCodec, i: int) -> int:
        body = codec.encode("probe", "alice", {"i": i}).to_bytes()
        async with session.post(url, data=body) as response:
            await response.read()
            return response.status

    try:
        async with aiohttp.ClientSession() as session:
            assert await send(session, bob, 0) == 200  # bob's bucket exists, 9 tokens left
            forged = [await send(session, forger, i) for i in range(1, 51)]
            honest = [await send(session, bob, i) for i in range(51, 60)]
    finally:
        await server.stop()
    assert set(forged) == {401} and refused.count("bad_signature") == 50, refused
    assert "rate_limited" not in refused, refused
    assert honest == [200] * 9 and taken == ["bob"] * 10


def test_a_secure_ssfl_node_serves_no_plain_model(tmp_path):
    """docs/threat-model.md: `protocol.secure_aggregation` covers SSFL ("A node
    serves no plain model" was attacked for FedAVGP2P and FedPerl only). Three
    in-memory SSFL sites under secure aggregation train and merge by secure
    sums: no "model" message travels, and a roster member that asks a node for
    its model gets none."""
    import asyncio

    import pytest

    from p2pfl.learning.data.partition import partition_dataset
    from protocols.base import PeerUnavailable
    from protocols.memory import InMemoryNetwork, simulate, simulation_configs

    partition_dataset("digits", 3, "iid", tmp_path / "parts", label_fraction=0.3, seed=0)
    configs = simulation_configs(
        [str(tmp_path / "parts" / f"site_{i}.npz") for i in range(3)],
        protocol={
            "name": "ssfl",
            "rounds": 1,
            "fraction": 1.0,
            "secure_aggregation": True,
            "round_timeout_s": 10.0,
        },
        state_root=tmp_path / "state",
        data={"image_size": 8, "augment": "weak"},
        training={"batch_size": 32, "device": "cpu", "max_steps_per_epoch": 2},
    )
    network = InMemoryNetwork(inline_train=True)
    result = asyncio.run(simulate(configs, network=network))
    assert result.errors == {}, result.errors
    assert result.messages_sent("model") == 0
    assert result.messages_sent("secagg") > 0  # the merge was a secure sum
    spy = network.join("spy")

    async def ask(round_no: int) -> None:
        await spy.request("site0", "model", {"round": round_no}, timeout=0.5)

    with pytest.raises(PeerUnavailable):
        asyncio.run(ask(1))


def test_provision_keeps_an_outbound_only_site_on_its_own_loopback(tmp_path):
    """docs/operations.md: an outbound-only site "listens on its own loopback
    only". The node binds what `node.listen` says; what makes it loopback is
    provision: a site provisioned `--behind` a relay has no address on its card
    and listens on 127.0.0.1, even where the other sites are given a host."""
    import yaml

    from node.provision import provision
    from p2pfl.secure.identity import Roster

    plans = provision(
        tmp_path / "fed",
        ["a", "b", "c"],
        protocol={"name": "probe", "rounds": 1},
        relays=["r1"],
        behind=["c"],
        hosts={"a": "10.1.2.3", "b": "10.1.2.4", "c": "10.1.2.5"},
    )
    roster = Roster.load(tmp_path / "fed" / "roster.yaml")
    listen = {
        p.name: yaml.safe_load(Path(p.config_path).read_text())["node"]["listen"] for p in plans
    }
    (c,) = [card for card in roster.cards() if card.name == "c"]
    assert c.address is None and tuple(c.via) == ("r1",)
    assert listen["c"].startswith("127.0.0.1:"), listen
    assert listen["a"].startswith("10.1.2.3:"), listen  # (the others as asked)
