"""keygen, provision, check, schema, roster: good configs exit 0, bad ones exit 2
with one line naming the file and the field."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from genbuffer.config import load_genbuffer_config
from node.cli import main
from p2pfl.config import ConfigError, load_config


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def federation(tmp_path: Path) -> Path:
    assert (
        main(
            ["provision", "--sites", "a,b,c", "--out", str(tmp_path / "fed"), "--base-port", "7100"]
        )
        == 0
    )
    return tmp_path / "fed"


def test_keygen_writes_private_keys_0600_and_prints_card(tmp_path, capsys):
    assert (
        main(
            [
                "keygen",
                "--name",
                "site1",
                "--out",
                str(tmp_path / "keys"),
                "--address",
                "10.0.0.5:7000",
            ]
        )
        == 0
    )
    card = yaml.safe_load(capsys.readouterr().out)
    assert card["name"] == "site1" and card["address"] == "10.0.0.5:7000"
    assert len(card["signing_key"]) == 44 and len(card["agreement_key"]) == 44
    for suffix in ("sign.pem", "kex.pem"):
        path = tmp_path / "keys" / f"site1.{suffix}"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    # Refuses to overwrite without --force.
    assert main(["keygen", "--name", "site1", "--out", str(tmp_path / "keys")]) == 2


def test_provision_makes_a_ready_federation(federation, capsys):
    roster = yaml.safe_load((federation / "roster.yaml").read_text())
    assert [s["name"] for s in roster["sites"]] == ["a", "b", "c"]
    ports, status_ports, states = set(), set(), set()
    for name in "abc":
        cfg = load_config(federation / name / "site.yaml")
        ports.add(cfg.node.listen)
        status_ports.add(cfg.status.port)
        states.add(cfg.node.state_dir)
        assert cfg.node.listen.startswith("127.0.0.1:")
        assert main(["check", "--config", str(federation / name / "site.yaml")]) == 0
    assert len(ports) == len(status_ports) == len(states) == 3
    assert "# ok: c in federation 'local' with 3 sites" in capsys.readouterr().out


def test_provision_writes_a_status_token_per_site_that_site_yaml_names(tmp_path, capsys):
    federation = tmp_path / "fed"
    assert main(["provision", "--sites", "a,b,c", "--out", str(federation)]) == 0
    tokens = set()
    for name in "abc":
        token_file = federation / name / "state" / "status.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        tokens.add(token)
        raw = yaml.safe_load((federation / name / "site.yaml").read_text())
        assert raw["status"]["token_file"] == "state/status.token"
        assert load_config(federation / name / "site.yaml").status.token_file == token_file
    assert len(tokens) == 3
    # provision printed each dashboard and where its token is kept.
    printed = capsys.readouterr().out
    # not a terminal here: the URLs name no token, only where it is (a second review:
    # provisioning from a script writes its stdout to logs others read)
    assert not any(token in printed for token in tokens), printed
    assert printed.count("status.token)") == 3, printed


def test_secure_aggregation_without_encryption_is_refused_by_check_and_run(federation, capsys):
    path = edit(
        federation / "a" / "site.yaml", lambda d: d["protocol"].update(secure_aggregation=True)
    )
    expected = (
        f"p2pfl-node: {path}: protocol.secure_aggregation: secure aggregation needs "
        "wire.encryption: true"
    )
    for command in ("check", "run"):
        assert main([command, "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(expected) and err.count("\n") == 1, err
        assert "— set wire.encryption: true in every site.yaml" in err
    edit(path, lambda d: d.update(wire={"encryption": True}))
    assert main(["check", "--config", str(path)]) == 0


def test_console_script_check_and_schema(federation):
    out = run_cli("check", "--config", str(federation / "a" / "site.yaml"))
    assert out.returncode == 0, out.stderr
    assert "name: fedavgp2p" in out.stdout
    schema = json.loads(run_cli("schema").stdout)
    assert "protocol" in schema["properties"] and "node" in schema["required"]
    genbuffer = schema["$defs"][schema["properties"]["genbuffer"]["$ref"].rsplit("/", 1)[-1]]
    assert {"resolution", "lpips_weights", "out_dir"} <= genbuffer["properties"].keys()


def edit(path: Path, fn) -> Path:
    data = yaml.safe_load(path.read_text())
    fn(data)
    path.write_text(yaml.safe_dump(data))
    return path


def test_check_does_not_print_an_inline_status_token(federation, capsys):
    """`p2pfl-node check` printed the whole config, an inline status.token in
    clear: its output goes to terminals, CI logs and support tickets."""
    token = "inline-status-token-0123456789abcdef"
    path = edit(federation / "a" / "site.yaml", lambda d: d["status"].update(token=token))
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert token not in out
    assert yaml.safe_load(out.split("# ")[0])["status"]["token"] == "<set: not shown>"


BAD = {
    "unknown_key": (lambda d: d["node"].update(colour="red"), "node.colour", "unknown key"),
    "wrong_type": (lambda d: d["training"].update(epochs="many"), "training.epochs", "integer"),
    "unknown_protocol": (
        lambda d: d["protocol"].update(name="fedmagic"),
        "protocol.name",
        "fedavgp2p",
    ),
    "protocol_param": (
        lambda d: d["protocol"].update(fraction=2.5),
        "protocol.fraction",
        "less than or equal to 1",
    ),
    "missing_roster": (
        lambda d: d["federation"].update(roster="nowhere.yaml"),
        "federation.roster",
        "file not found",
    ),
    "missing_section": (lambda d: d.pop("federation"), "federation", "missing"),
    "unknown_model": (
        lambda d: d.setdefault("model", {}).update(name="resnet81"),
        "model.name",
        "resnet18",
    ),
    "public_status_without_token": (
        lambda d: d.update(status={"host": "0.0.0.0", "port": 8000}),
        "status",
        "bearer token",
    ),
    "bad_listen": (lambda d: d["node"].update(listen="localhost"), "node.listen", "HOST:PORT"),
    "genbuffer_unknown_key": (
        lambda d: d.update(genbuffer={"resolutoin": 32}),
        "genbuffer.resolutoin",
        "unknown key",
    ),
    "genbuffer_wrong_type": (
        lambda d: d.update(genbuffer={"batch_size": "big"}),
        "genbuffer.batch_size",
        "integer",
    ),
    "genbuffer_resolution": (
        lambda d: d.update(genbuffer={"resolution": 48}),
        "genbuffer.resolution",
        "power of two",
    ),
    "genbuffer_weights_with_random_backbone": (
        lambda d: d.update(genbuffer={"lpips_backbone": "random", "lpips_weights": "a.pth"}),
        "genbuffer.lpips_weights",
        "remove one of the two keys",
    ),
    "fedbeit_missing_tokenizer": (
        lambda d: (
            d["protocol"].update(name="fedbeit"),
            d.setdefault("model", {}).update(
                name="vit_tiny_patch16_224", tokenizer_from="nowhere.pt"
            ),
        ),
        "model.tokenizer_from",
        "file not found",
    ),
    "secure_aggregation_without_encryption": (
        lambda d: d["protocol"].update(secure_aggregation=True),
        "protocol.secure_aggregation",
        "needs wire.encryption: true",
    ),
    "fedmae_finetune_secure_aggregation_without_encryption": (
        lambda d: d.update(
            protocol={
                "name": "fedmae",
                "finetune": {"name": "fedavgp2p", "secure_aggregation": True},
            }
        ),
        "protocol.finetune.secure_aggregation",
        "set wire.encryption: true",
    ),
    "fedbeit_needs_a_vit": (
        lambda d: d["protocol"].update(name="fedbeit"),
        "model.name",
        "need a timm ViT",
    ),
    "genbuffer_missing_weights": (
        lambda d: d.update(genbuffer={"lpips_weights": "nowhere.pth"}),
        "genbuffer.lpips_weights",
        "file not found",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_configs_exit_2_with_one_line(federation, case, capsys):
    change, field, words = BAD[case]
    path = edit(federation / "a" / "site.yaml", change)
    assert main(["check", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert str(path) in err and f": {field}:" in err and words in err, err


def test_genbuffer_section_passes_check_with_paths_resolved(federation, capsys):
    site = federation / "a"
    (site / "weights").mkdir()
    (site / "weights" / "alexnet.pth").write_bytes(b"")
    path = edit(
        site / "site.yaml",
        lambda d: d.update(genbuffer={"resolution": 64, "lpips_weights": "weights/alexnet.pth"}),
    )
    assert main(["check", "--config", str(path)]) == 0
    checked = yaml.safe_load(capsys.readouterr().out)["genbuffer"]
    assert checked["resolution"] == 64
    assert checked["lpips_weights"] == str(site / "weights" / "alexnet.pth")
    # Unset, out_dir is the node's state folder's genbuffer/, like the genbuffer CLI's default.
    assert checked["out_dir"] == str(site / "state" / "genbuffer")
    assert load_genbuffer_config(path).genbuffer == load_config(path).genbuffer
    # Set, it is relative to the site.yaml's folder, as every other path.
    edit(path, lambda d: d["genbuffer"].update(out_dir="gan"))
    cfg = load_config(path)
    assert cfg.genbuffer.out_dir == site / "gan" and cfg.genbuffer.resolution == 64
    assert load_genbuffer_config(path).genbuffer == cfg.genbuffer


def test_bad_genbuffer_field_is_one_line_with_the_fix(federation, capsys):
    path = edit(federation / "a" / "site.yaml", lambda d: d.update(genbuffer={"resolution": 48}))
    assert main(["check", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"p2pfl-node: {path}: genbuffer.resolution: 48 is not a power of two between 16 and 256"
        " — use 16, 32, 64, 128 or 256\n"
    )
    assert main(["run", "--config", str(path)]) == 2
    assert ": genbuffer.resolution: " in capsys.readouterr().err


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text("node:\n  name: a\n  listen: [oops\n")
    out = run_cli("check", "--config", str(path))
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "site.yaml: line" in out.stderr and "YAML syntax error" in out.stderr


def test_missing_config_and_wrong_key(federation, tmp_path):
    out = run_cli("--config", str(tmp_path / "absent.yaml"))
    assert out.returncode == 2 and "file not found" in out.stderr
    # b's config pointing at a's signing key: the roster says otherwise.
    path = edit(
        federation / "b" / "site.yaml",
        lambda d: d.update(
            identity={"signing_key": str(federation / "a" / "state" / "keys" / "a.sign.pem")}
        ),
    )
    out = run_cli("check", "--config", str(path))
    assert (
        out.returncode == 2
        and "identity.signing_key" in out.stderr
        and "does not match" in out.stderr
    )


def test_unknown_site_is_refused(federation, capsys):
    path = edit(federation / "a" / "site.yaml", lambda d: d["node"].update(name="zed"))
    assert main(["check", "--config", str(path)]) == 2
    assert "node.name" in capsys.readouterr().err


def test_roster_add_and_remove(tmp_path, federation, capsys):
    roster = federation / "roster.yaml"
    assert (
        main(["keygen", "--name", "d", "--out", str(tmp_path / "d"), "--address", "127.0.0.1:7200"])
        == 0
    )
    assert (
        main(["roster", "add", str(tmp_path / "d" / "d.card.yaml"), "--roster", str(roster)]) == 0
    )
    assert [s["name"] for s in yaml.safe_load(roster.read_text())["sites"]] == ["a", "b", "c", "d"]
    assert main(["roster", "remove", "b", "--roster", str(roster)]) == 0
    assert [s["name"] for s in yaml.safe_load(roster.read_text())["sites"]] == ["a", "c", "d"]
    assert main(["roster", "remove", "nobody", "--roster", str(roster)]) == 2


def test_config_error_type(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "mapping" in str(err.value)
    os.chmod(path, 0o644)


LIGHT_COMMANDS = [
    ["--help"],
    ["keygen", "--help"],
    ["provision", "--help"],
    ["roster", "--help"],
    ["relay", "--help"],
]
IMPORT_PROBE = """
import contextlib, io, json, sys
from node.cli import main
seen = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    seen.append({"argv": argv, "torch": "torch" in sys.modules, "help": out.getvalue()})
print(json.dumps(seen))
"""


def test_only_the_command_being_run_imports_its_feature():
    """The optional sub-commands (partition, genbuffer, evaluate, export,
    predict) import torch when they register their arguments, ~3 CPU-seconds:
    `p2pfl-node keygen` and the others load none of them, yet `--help` still
    lists every command, and an optional command gets its full arguments."""
    argvs = [*LIGHT_COMMANDS, ["partition", "--help"]]
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert [s["torch"] for s in seen] == [False] * len(LIGHT_COMMANDS) + [True]
    listing = seen[0]["help"]
    for command in ("run", "keygen", "relay", "partition", "genbuffer", "evaluate", "export"):
        assert f"    {command} " in listing, command
    assert "predict" in listing
    assert "--min-per-site" in seen[-1]["help"]  # partition's own arguments


def test_the_demo_prints_no_token_to_a_stdout_that_is_not_a_terminal(tmp_path, capsys) -> None:
    """`make demo`'s dashboard lines, as provision's: the URL with its token
    only for a terminal (a CI log or a redirected file is read by others)."""
    from bench.demo import show_dashboards
    from node.provision import provision

    plans = provision(tmp_path / "fed", ["a", "b"], protocol={"name": "probe"})
    show_dashboards(list(plans))
    printed = capsys.readouterr().out
    tokens = [plan.status_token() for plan in plans]
    assert all(token and token not in printed for token in tokens), printed
    assert printed.count("http://127.0.0.1:") == 2
