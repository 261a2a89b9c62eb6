"""Sites behind a relay across real network namespaces (issue 31; bench/netns.py).

Four sites and a relay, each a real process in its own namespace on a private
bridge: a and b reachable at their namespace address, c and d outbound-only
(their cards say `address: null, via: [r1]`, they listen on their own
namespace's 127.0.0.1). The probe protocol pushes an encrypted tensor from
every site to every other each round, so every ordered pair goes through the
relay where either end is behind it (c -> d through it both ways).

Skipped with one loud line where namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any

import pytest
import yaml

from bench.netns import Netns, processes, skip_unless_netns
from node.cli import main
from node.provision import provision
from p2pfl.config import load_config
from p2pfl.config.relay import load_relay_config
from p2pfl.secure.identity import Roster

pytestmark = pytest.mark.slow

SITES = ["a", "b", "c", "d"]
BEHIND = {"c", "d"}
ROUNDS = 3


def overrides() -> dict[str, Any]:
    return {
        "node": {"startup_wait_s": 60},
        "transport": {"heartbeat_s": 0.5, "backoff_base_s": 0.1, "backoff_max_s": 2.0},
        "training": {"threads": 1, "personalization": {"method": "none"}},
    }


def wait_done(nodes: dict[str, Any], names: list[str], rounds: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    states: dict[str, Any] = {}
    while time.monotonic() < deadline:
        for name in names:
            node = nodes[name]
            assert node.running, f"{name} exited: {node.log_tail()}"
            states[name] = node.status()
        if all(
            s and s.get("phase") == "done" and s.get("round") == rounds for s in states.values()
        ):
            return
        time.sleep(0.5)
    raise TimeoutError(
        "not every site finished: "
        + json.dumps({n: (s or {}).get("round") for n, s in states.items()})
        + "\n"
        + "\n".join(f"--- {n}\n{nodes[n].log_tail(15)}" for n in nodes)
    )


def test_behind_sites_complete_every_round_through_the_relay_and_are_unreachable(tmp_path):
    skip_unless_netns()
    probe = {"name": "probe", "rounds": ROUNDS, "payload_kb": 16, "round_timeout_s": 20.0}
    with Netns([*SITES, "r1"], rate_mbit=200) as net:
        plans = provision(
            tmp_path / "fed",
            SITES,
            protocol=probe,
            overrides=overrides(),
            relays=["r1"],
            behind=BEHIND,
            hosts={name: net.address(name) for name in [*SITES, "r1"]},
        )
        nodes = processes(net, [*plans.relays, *plans], tmp_path / "logs")
        try:
            for node in nodes.values():
                node.start()
            nodes["r1"].wait_for(lambda s: True, 120, "relay status")
            wait_done(nodes, SITES, ROUNDS, timeout=180)  # startup on a loaded machine
            # every process (all still running) lives in its own namespace, however
            # it was launched: exec'd under `ip netns exec`, or forked and entering
            # it before its first socket (so checked once it answered, not at start)
            for name, node in nodes.items():
                assert node.proc is not None and node.running, name
                ns = os.stat(f"/proc/{node.proc.pid}/ns/net").st_ino
                assert ns == os.stat(net.path(name)).st_ino, name

            # A behind site's peer port: open in its own namespace on 127.0.0.1,
            # closed to every other namespace (at its address and their own loopback).
            for plan in plans:
                if plan.name not in BEHIND:
                    continue
                assert net.can_connect(plan.name, "127.0.0.1", plan.port)
                for other in [*SITES, "r1"]:
                    if other == plan.name:
                        continue
                    assert not net.can_connect(other, net.address(plan.name), plan.port, 1.0)
                    assert not net.can_connect(other, "127.0.0.1", plan.port, 1.0)
            # a reachable site is reached from a peer namespace. (Not probed from the
            # root namespace: it has no leg on the bridge, so such a probe would leave
            # through its default route, to an address this test did not make.)
            a = next(p for p in plans if p.name == "a")
            assert net.can_connect("c", net.address("a"), a.port)

            relay = nodes["r1"].get("/status")
            sites = relay["sites"]
            for name in BEHIND:  # each got probes from three peers, all through r1
                assert sites[name]["connected"], relay
                moved = sites[name]["messages_in"] + sites[name]["messages_out"]
                assert moved >= (len(SITES) - 1) * ROUNDS, relay
                assert sites[name]["bytes_in"] + sites[name]["bytes_out"] > 0, relay
        finally:
            codes = {n: node.stop(10) for n, node in nodes.items()}
        for plan in plans:
            rows = [
                json.loads(x)
                for x in (plan.config_path.parent / "state" / "metrics.jsonl")
                .read_text()
                .splitlines()
            ]
            assert rows[-1]["round"] == ROUNDS, (plan.name, rows[-1])
            assert rows[-1]["received_total"] == (len(SITES) - 1) * ROUNDS, (plan.name, rows[-1])
        print(json.dumps({"scenario": "netns_relay", "exit_codes": codes, "relay": relay}))
        made = net.created()
        assert made, "the namespaces exist until the context ends"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in made if n in listed.split()], listed


def test_every_namespace_goes_even_when_the_block_fails():
    skip_unless_netns()
    with pytest.raises(RuntimeError, match="planned"), Netns(["x", "y"]) as net:
        made = net.created()
        assert len(made) == 3  # x, y and the switch
        # nothing of the run is in the root namespace: no bridge, no veth
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert net.bridge not in links
        # a process started inside is killed by pid, so the namespace really goes
        sleeper = subprocess.Popen([*net.exec_prefix("x"), "sleep", "60"])
        raise RuntimeError("planned")
    assert sleeper.wait(10) is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not set(made) & set(listed.split()), listed


def test_provision_writes_relays_and_outbound_only_sites(tmp_path, capsys):
    """No namespace needed: `provision --relay --behind` writes a federation
    every site's `check` accepts, and a relay.yaml the relay reads."""
    fed = tmp_path / "fed"
    args = ["provision", "--sites", "a,b,c,d,e", "--relay", "r1", "--behind", "c,d"]
    assert main([*args, "--out", str(fed), "--base-port", "7400"]) == 0
    roster = Roster.load(fed / "roster.yaml")
    assert roster.relays == {"r1": "127.0.0.1:7405"}  # the relay's port follows the sites'
    raw = yaml.safe_load((fed / "roster.yaml").read_text())
    assert raw["relays"] == [{"name": "r1", "address": "127.0.0.1:7405"}]
    for card in roster.cards():
        behind = card.name in ("c", "d")
        assert (card.address is None) == behind and card.via == (("r1",) if behind else ())
    for name in "abcde":
        cfg = load_config(fed / name / "site.yaml", check_files=False)
        assert cfg.wire.encryption  # a relay never carries plaintext
        assert cfg.node.listen.startswith("127.0.0.1:")
        assert main(["check", "--config", str(fed / name / "site.yaml")]) == 0
    relay = load_relay_config(fed / "r1" / "relay.yaml")
    assert relay.relay.name == "r1" and relay.relay.listen == "127.0.0.1:7405"
    assert relay.federation.roster.resolve() == (fed / "roster.yaml").resolve()
    assert relay.status.token_file is not None and relay.status.token_file.exists()
    printed = capsys.readouterr().out
    assert "p2pfl-node relay --config" in printed and "outbound-only" in printed
    # a name both a site and a relay, or a behind site without a relay: one line, exit 2
    assert main(["provision", "--sites", "a,b", "--relay", "a", "--out", str(tmp_path / "x")]) == 2
    assert main(["provision", "--sites", "a,b", "--behind", "b", "--out", str(tmp_path / "y")]) == 2
    assert "at least one relay" in capsys.readouterr().err


def test_provision_places_sites_and_relays_on_their_hosts(tmp_path):
    plans = provision(
        tmp_path,
        ["a", "b", "c"],
        protocol={"name": "probe", "rounds": 1},
        relays=["r1", "r2"],
        behind={"c"},
        hosts={"a": "10.231.7.1", "b": "10.231.7.2", "c": "10.231.7.3", "r1": "10.231.7.9"},
    )
    assert [p.name for p in plans] == ["a", "b", "c"]
    assert [r.name for r in plans.relays] == ["r1", "r2"]
    roster = Roster.load(tmp_path / "roster.yaml")
    assert roster["a"].address == f"10.231.7.1:{plans[0].port}"
    assert roster["c"].address is None and roster["c"].card.via == ("r1", "r2")
    assert roster.relays["r1"] == f"10.231.7.9:{plans.relays[0].port}"
    listen = {p.name: load_config(p.config_path, check_files=False).node.listen for p in plans}
    assert listen["a"].startswith("10.231.7.1:")
    assert listen["c"] == f"127.0.0.1:{plans[2].port}"  # behind: its own loopback only
