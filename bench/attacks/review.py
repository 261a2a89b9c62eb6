"""Attack bench, issue #28 (a hostile review): one scenario per hole it found.

Listed in the registry (bench/attacks/kit.py) by bench/attacks/runner.py, so it runs as

    python -m bench.attacks --scenarios nan_wait,response_bomb,...

and is judged as every other scenario there (refused / neutralised /
succeeded, `inconclusive` where the attack could not be carried out). Holes
1, 2 and 4 (secure aggregation) are attacked elsewhere. Three small
federations, each started only when one of its scenarios is selected:

- `review_wire`: one probe daemon v1 (`wire.max_message_bytes` 4 MiB,
  `transport.inbox_size` 4); `m` is a roster member played raw (RawPeer),
  `f` a roster slot whose port the attacker holds (a fake aiohttp peer).
- `review_held`: one FedAVGP2P daemon h1 after its single round; it holds a
  request for a model it has not trained (`NotReady`) until the wait asked.
- `review_feder`: one FedER daemon f0; `m` heartbeats, so it is its ring
  predecessor, and a sink at m's port acknowledges f0's pushes.

The victims are watched while attacked (`Monitor`): /healthz latency (a
frozen node does not answer), RSS and open descriptors (psutil). The status
token, where the node has one (site.yaml `status.token` or `token_file`, or
STATE/status.token), is sent with every status read; without one the bench
reads without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.attacks.federations import fresh, ledger, poisoned_relay, provisioned
from bench.attacks.kit import (
    NOT_A_DEFENCE,
    TINY_GAN,
    TRANSPORT,
    Options,
    guarded,
    inconclusive,
    judge_input,
    say,
    verdict,
)
from bench.attacks.review_load import (
    concurrent_replay,
    decode_bomb,
    held_request_flood,
    nan_wait,
    response_bomb,
    unbounded_kinds,
)
from bench.attacks.victim import MAX_MESSAGE, Victim, raw_frame, status_token
from bench.localfed import LocalFederation
from bench.peer import Heartbeats, RawPeer, heartbeat_payload
from node.membership import HEARTBEAT
from node.provision import SitePlan
from p2pfl.secure import tensors

FEDERATION = "bench-review"
REBIND_HOST = "rebind.attacker.example"


# ---------------------------------------------------------------------- federations


def federation(
    opts: Options, folder: Path, names: list[str], protocol: dict[str, Any], **extra: Any
) -> tuple[list[SitePlan], dict[str, int]]:
    return provisioned(fresh(folder), names, protocol, opts.seed, federation=FEDERATION, **extra)


def say_goodbye(member: RawPeer, victim: Victim, timeout: float) -> None:
    """A roster member without a daemon says it is done, so the victim starts at once."""
    victim.wait_status(lambda s: True, timeout, "status endpoint up")
    member.post(victim.name, member.frame(HEARTBEAT, victim.name, heartbeat_payload()))


def run_steps(
    steps: list[tuple[str, Callable[[], dict[str, Any]]]],
    selected: set[str],
    victim: Victim,
    timeout: float,
) -> dict[str, dict[str, Any]]:
    """The selected steps in order; a victim left frozen or dead is restarted for the next."""
    results = {}
    for name, step in steps:
        if name not in selected:
            continue
        if not victim.healthy():
            say(f"  {victim.name} not answering: restarting it for {name}")
            victim.restart(timeout)
        say(f"review: {name}")
        results[name] = guarded(name, step)
    return results


def run_review_wire(opts: Options, selected: set[str]) -> dict[str, dict[str, Any]]:
    folder = opts.out / "review_wire"
    probe = {"name": "probe", "rounds": 1_000_000, "payload_kb": 1, "round_timeout_s": 2.0,
             "interval_s": 0.5}  # fmt: skip
    plans, ports = federation(
        opts, folder, ["v1", "m", "f"], probe,
        node={"startup_wait_s": 0.5}, transport={**TRANSPORT, "inbox_size": 4},
        wire={"max_message_bytes": MAX_MESSAGE},
    )  # fmt: skip
    by_name = {p.name: p for p in plans}
    m = RawPeer(folder / "fed", "m", ports, federation=FEDERATION)
    fed = LocalFederation([by_name["v1"]], folder / "logs")
    with fed:
        v1 = Victim(fed["v1"])
        v1.wait_status(lambda s: (s.get("round") or 0) >= 1, opts.timeout_s, "v1 running")
        steps = [
            ("status_rebinding", lambda: status_rebinding(v1)),
            ("huge_round_header", lambda: huge_round_header(m, v1)),
            ("concurrent_replay", lambda: concurrent_replay(m, v1, by_name["v1"])),
            ("response_bomb", lambda: response_bomb(v1, ports["f"])),
            ("decode_bomb", lambda: decode_bomb(m, v1)),
            # last: it restarts v1
            ("unbounded_kinds", lambda: unbounded_kinds(m, v1, by_name["v1"], opts.timeout_s)),
        ]
        return run_steps(steps, selected, v1, opts.timeout_s)


def run_review_held(opts: Options, selected: set[str]) -> dict[str, dict[str, Any]]:
    folder = opts.out / "review_held"
    protocol = {"name": "fedavgp2p", "rounds": 1, "fraction": 1.0, "round_timeout_s": 5.0}
    plans, ports = federation(opts, folder, ["h1", "m"], protocol, transport=TRANSPORT)
    m = RawPeer(folder / "fed", "m", ports, federation=FEDERATION)
    fed = LocalFederation([plans[0]], folder / "logs")
    with fed:
        h1 = Victim(fed["h1"])
        say_goodbye(m, h1, opts.timeout_s)
        h1.wait_status(lambda s: s.get("phase") in ("done", "failed"), opts.timeout_s, "h1 done")
        steps = [
            ("held_request_flood", lambda: held_request_flood(m, h1)),
            ("nan_wait", lambda: nan_wait(m, h1)),  # last: it may freeze h1
        ]
        return run_steps(steps, selected, h1, opts.timeout_s)


def run_review_feder(opts: Options, selected: set[str]) -> dict[str, dict[str, Any]]:
    folder = opts.out / "review_feder"
    protocol = {"name": "feder", "rounds": 1, "buffer_size": 32, "initial_epochs": 1,
                "round_timeout_s": 20.0, "genbuffer": TINY_GAN}  # fmt: skip
    plans, ports = federation(opts, folder, ["f0", "m"], protocol, transport=TRANSPORT)
    m = RawPeer(folder / "fed", "m", ports, federation=FEDERATION)
    fed = LocalFederation([plans[0]], folder / "logs")
    with fed, m.listen():
        f0 = Victim(fed["f0"])
        return {
            "stale_feder_relay": guarded(
                "stale_feder_relay", lambda: stale_relay(m, f0, plans, opts)
            )
        }


# ---------------------------------------------------------------------- scenarios


def status_rebinding(victim: Victim) -> dict[str, Any]:
    """Hole 9: /status, /peers and /metrics as a DNS-rebound page asks for them
    (Host: rebind.attacker.example), without and with the node's token."""
    port = victim.node.plan.status_port
    control = victim.get("/status")[0]
    host = f"{REBIND_HOST}:{port}"
    rows = {}
    for path in ("/status", "/peers", "/metrics"):
        rows[f"{path} no token"] = victim.get(path, host=host, token=False)[0]
        if status_token(victim.node.plan):
            rows[f"{path} token"] = victim.get(path, host=host)[0]
    evidence = {"control_status": control, "rebound": rows}
    if control != 200:
        return inconclusive("28.9", f"/status with the node's own host: {control}", **evidence)
    open_ = [k for k, code in rows.items() if code not in (400, 401, 403, 421)]
    if open_:
        return verdict("succeeded", "28.9", f"answered: {', '.join(open_)}", **evidence)
    return verdict("refused", "28.9", "every rebound request refused", **evidence)


def huge_round_header(m: RawPeer, victim: Victim) -> dict[str, Any]:
    """Hole 10: an encrypted push whose signed header says round 2**63."""
    payload = tensors.dumps({"round": 1, "from": "m"})
    frame, _ = raw_frame(m, "probe", victim.name, payload, round_no=2**63, encrypt=True)
    before = victim.counters()
    reply = m.post(victim.name, frame)
    time.sleep(0.1)
    row = judge_input(reply, before, victim.counters())
    outcome = "refused" if row["outcome"] == "refused" and reply.status < 500 else "succeeded"
    return verdict(outcome, "28.10", f"answered {reply.status} {reply.reason}", input=row)


def stale_relay(m: RawPeer, victim: Victim, plans: list[SitePlan], opts: Options) -> dict[str, Any]:
    """FedER: ring member m sends f0 a relay of round 0 (an honest-looking model:
    the federation's initial one) for f0 to take in round 1."""
    relay = poisoned_relay(plans[1], 1.0)
    relay["round"] = 0
    victim.wait_status(lambda s: True, opts.timeout_s, "status endpoint up")
    with Heartbeats(m, [victim.name], 0, max_s=opts.timeout_s):
        time.sleep(1.5)  # f0 hears m before it derives round 1's ring
        reply = m.post(victim.name, m.frame("feder", victim.name, relay, round_no=0))
        status = victim.wait_status(
            lambda s: s.get("phase") in ("done", "failed"), opts.timeout_s, "f0 done"
        )
    merged = {r: sorted(p) for r, p in ledger(plans[0]).items()}
    counted = int((status.get("rejected_by_peer") or {}).get("m", 0))
    evidence = {
        "push": reply.brief(),
        "merged_by_round": merged,
        "counted_from_m": counted,
        "rejected": status.get("rejected"),
    }
    if not reply.accepted:
        ok = reply.reason not in NOT_A_DEFENCE and counted
        return verdict(
            "refused" if ok else "neutralised", "28.feder", f"{reply.reason}", **evidence
        )
    if "m" in merged.get(1, []):
        return verdict("succeeded", "28.feder", "f0 took round 0's relay in round 1", **evidence)
    if counted:
        return verdict("refused", "28.feder", "f0 refused and counted the relay", **evidence)
    if status.get("phase") != "done":
        return inconclusive("28.feder", "f0 did not finish round 1", **evidence)
    return verdict("neutralised", "28.feder", "not merged, not counted", **evidence)


# ---------------------------------------------------------------------- registration


SCENARIOS: dict[str, tuple[str, str]] = {  # name -> (hole of issue #28, group)
    "nan_wait": ("28.3", "review_held"),
    "response_bomb": ("28.5", "review_wire"),
    "unbounded_kinds": ("28.6", "review_wire"),
    "decode_bomb": ("28.7", "review_wire"),
    "concurrent_replay": ("28.8", "review_wire"),
    "status_rebinding": ("28.9", "review_wire"),
    "huge_round_header": ("28.10", "review_wire"),
    "held_request_flood": ("28.held", "review_held"),
    "stale_feder_relay": ("28.feder", "review_feder"),
}
GROUPS: dict[str, Callable[[Options, set[str]], dict[str, dict[str, Any]]]] = {
    "review_wire": run_review_wire,
    "review_held": run_review_held,
    "review_feder": run_review_feder,
}
