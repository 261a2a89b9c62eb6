"""The wire group (issue #16's holes 2 and 3, and the earlier forged,
wrong-federation, NaN, replayed and huge-norm inputs): FedAVGP2P daemons with
`wire.encryption: true`, a raw roster member, and a compromised daemon that
serves poisoned answers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.attacks.federations import (
    farewell,
    fresh,
    ledger,
    poison_events,
    provisioned,
    wait_done,
    write_plan,
)
from bench.attacks.kit import (
    FEDERATION,
    REPLAY_REASONS,
    Options,
    combine,
    guarded,
    inconclusive,
    judge_input,
    probe_payload,
    say,
    send_and_watch,
    verdict,
)
from bench.localfed import LocalFederation, NodeProcess
from bench.peer import RawPeer, heartbeat_payload
from node.faults import ENV
from node.membership import HEARTBEAT
from node.outbound import REQUEST_PREFIX
from p2pfl.secure.identity import LocalIdentity

POISON_SCENARIOS = {"nan_model", "replayed_answer", "huge_norm_model", "forged_signature"}


def run_wire(opts: Options, selected: set[str]) -> dict[str, dict[str, Any]]:
    """FedAVGP2P with `wire.encryption: true`: daemons v1 and v2 (and `evil`, a
    compromised node cycling through poisoned answers from round 2, when a
    scenario needs it); `m` is a roster member without a daemon, played raw."""
    folder = fresh(opts.out / "wire")
    with_evil = bool(selected & POISON_SCENARIOS)
    rounds = 7 if with_evil else 2
    names = ["v1", "v2", "evil", "m"]
    daemons = ["v1", "v2", "evil"] if with_evil else ["v1", "v2"]
    protocol = {
        "name": "fedavgp2p",
        "rounds": rounds,
        "fraction": 1.0,
        "round_timeout_s": 10.0,
        "max_staleness": 1,
    }
    plans, ports = provisioned(folder, names, protocol, opts.seed, wire={"encryption": True})
    by_name = {p.name: p for p in plans}
    fed_dir = folder / "fed"
    fed = LocalFederation([by_name[n] for n in daemons], folder / "logs")
    plan_path = None
    if with_evil:
        plan_path = write_plan(
            folder / "evil-faults.json",
            {"poison": {"kind": "model", "mode": "cycle", "scale": 5.0, "from_round": 2}},
        )
        fed["evil"].env = {ENV: str(plan_path)}
    m = RawPeer(fed_dir, "m", ports, federation=FEDERATION)
    absent = [RawPeer(fed_dir, n, ports, federation=FEDERATION) for n in names if n not in daemons]
    results: dict[str, dict[str, Any]] = {}
    say(f"wire: {', '.join(daemons)} (encryption on), {rounds} rounds; raw member m")
    with fed:
        farewell(absent, fed, encrypt=True, timeout=opts.timeout_s)
        statuses = wait_done(fed, rounds, opts.timeout_s)
        say("wire: federation done; attacking v1")
        v1 = fed["v1"]
        victims = ["v1", "v2"]
        if with_evil:
            events = poison_events(plan_path)
            ledgers = {n: ledger(by_name[n]) for n in victims}
            live = {n: fed[n].status() or statuses[n] for n in victims}
            answer_checks = {
                "nan_model": (("nan", "inf"), ("payload_schema",)),
                "replayed_answer": (("replayed",), REPLAY_REASONS),
                "huge_norm_model": (("huge_norm",), ("model_huge_norm",)),
            }
            for name, (modes, reasons) in answer_checks.items():
                if name in selected:
                    results[name] = guarded(
                        name,
                        lambda modes=modes, reasons=reasons: judge_poisoned_answers(
                            modes, reasons, events, live, ledgers
                        ),
                    )
            forged_answers = judge_poisoned_answers(
                ("forged",), ("bad_signature",), events, live, ledgers
            )
        else:
            forged_answers = None
        steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("forged_signature", lambda: forged_signature(fed_dir, ports, v1, forged_answers)),
            ("wrong_federation", lambda: wrong_federation(fed_dir, ports, v1)),
            ("unencrypted_injection", lambda: unencrypted_injection(m, v1, rounds)),
            # last: it restarts v1
            ("replay_after_restart", lambda: replay_after_restart(fed_dir, ports, v1, rounds)),
        ]
        for name, step in steps:
            if name in selected:
                say(f"wire: {name}")
                results[name] = guarded(name, step)
    return results


def judge_poisoned_answers(
    modes: tuple[str, ...],
    reasons: tuple[str, ...],
    events: list[dict[str, Any]],
    statuses: dict[str, dict[str, Any]],
    ledgers: dict[str, dict[int, set[str]]],
) -> dict[str, Any]:
    """Answers of `modes` served by the compromised node: merged by a victim in
    that round (succeeded), or refused and counted under one of `reasons`."""
    served = [e for e in events if e.get("event") == "poison" and e.get("mode") in modes]
    counted = {
        r: sum(int((s.get("rejected") or {}).get(r, 0)) for s in statuses.values()) for r in reasons
    }
    evidence = {
        "served": [{"to": e["to"], "round": e["round"], "mode": e["mode"]} for e in served],
        "counted_by_victims": counted,
    }
    if not served:
        return inconclusive(
            "earlier", f"the compromised node served no {'/'.join(modes)} answer", **evidence
        )
    merged = [
        (e["to"], e["round"])
        for e in served
        if e["to"] in ledgers and "evil" in ledgers[e["to"]].get(int(e["round"]), set())
    ]
    evidence["merged_in_those_rounds"] = merged
    if merged:
        return verdict("succeeded", "earlier", "a victim merged the poisoned answer", **evidence)
    if sum(counted.values()) > 0:
        return verdict(
            "refused", "earlier", f"refused and counted as {'/'.join(reasons)}", **evidence
        )
    return verdict("neutralised", "earlier", "not merged, but no refusal counted", **evidence)


def forged_signature(
    fed_dir: Path, ports: dict[str, int], victim: NodeProcess, forged_answers: dict[str, Any] | None
) -> dict[str, Any]:
    """A push claiming to come from roster member m but signed with another key
    (expect bad_signature); a push from a name not in the roster (expect
    unknown_sender); with the compromised node running, its forged answers."""
    impostor = RawPeer(
        fed_dir, "m", ports, federation=FEDERATION, identity=LocalIdentity.generate("m")
    )
    stranger = RawPeer(
        fed_dir, "mallory", ports, federation=FEDERATION, identity=LocalIdentity.generate("mallory")
    )
    rows = {}
    for label, attacker in (("impostor_push", impostor), ("stranger_push", stranger)):
        frame = attacker.frame("probe", victim.name, probe_payload(attacker.name, 1), round_no=1)
        rows[label] = judge_input(*send_and_watch(attacker, victim, frame))
    parts = {k: v["outcome"] for k, v in rows.items()}
    evidence: dict[str, Any] = {"inputs": rows}
    if forged_answers is not None:
        parts["forged_answers"] = forged_answers["outcome"]
        evidence["forged_answers"] = forged_answers
    outcome = combine(parts)
    return verdict(outcome, "earlier", f"{parts}", **evidence)


def wrong_federation(fed_dir: Path, ports: dict[str, int], victim: NodeProcess) -> dict[str, Any]:
    """m's real key, another federation id in the header: expect wrong_federation."""
    other = RawPeer(fed_dir, "m", ports, federation="not-" + FEDERATION)
    frame = other.frame("probe", victim.name, probe_payload("m", 1), round_no=1)
    row = judge_input(*send_and_watch(other, victim, frame))
    return verdict(
        row["outcome"], "earlier", f"answered {row['status']} {row['reason']}", input=row
    )


def unencrypted_injection(m: RawPeer, victim: NodeProcess, rounds: int) -> dict[str, Any]:
    """Victim runs with `wire.encryption: true`; roster member m sends a correctly
    signed but unencrypted push, request and heartbeat (expect each refused,
    e.g. `encryption_required`). The same three encrypted are the control: the
    victim must take those, or the refusals say nothing about encryption. (A
    FedAVGP2P victim takes no push of any kind: its encrypted push control is
    refused `push_not_accepted`, a check made after the one for encryption.)"""
    inputs = {
        # a kind the FedAVGP2P victim declares (it refuses others, unknown_kind)
        "push": ("model", probe_payload("m", rounds)),
        "request": (
            REQUEST_PREFIX + "model",
            {"round": rounds, "max_round": rounds, "_wait_s": 1.0},
        ),
        # done and goodbye: m stays out of the victim's neighbour choices
        "heartbeat": (HEARTBEAT, heartbeat_payload(rounds)),
    }
    rows, control = {}, {}
    for label, (kind, payload) in inputs.items():
        frame = m.frame(kind, victim.name, payload, round_no=rounds, encrypt=False)
        rows[label] = judge_input(*send_and_watch(m, victim, frame))
        ok = m.post(victim.name, m.frame(kind, victim.name, payload, round_no=rounds, encrypt=True))
        control[label] = ok.brief()
    parts = {k: v["outcome"] for k, v in rows.items()}
    evidence = {"unencrypted": rows, "encrypted_control": control}
    if not all(c["status"] == 200 or c["reason"] == "push_not_accepted" for c in control.values()):
        return inconclusive("2", "the victim refused the encrypted control too", **evidence)
    return verdict(combine(parts), "2", f"{parts}", **evidence)


def replay_after_restart(
    fed_dir: Path, ports: dict[str, int], victim: NodeProcess, rounds: int
) -> dict[str, Any]:
    """A network observer's capture: a push, a request and a heartbeat from v2
    to v1, built exactly as v2's daemon builds them (v2's keys, encrypted as
    v1's federation requires) and recorded before delivery; v1 takes each
    (200), refuses an immediate resend (the control), is SIGKILLed and started
    again on the same state dir, and gets the same bytes again. Expected:
    refused (`replayed` or another replay/stale reason) for all three. A push
    answered 200 but not processed again (the spool/journal deduplicates it:
    its kind's received count does not rise) is neutralised."""
    legit = RawPeer(fed_dir, "v2", ports, federation=FEDERATION)
    captured = {
        "push": legit.frame(  # a kind the FedAVGP2P victim declares
            "model", victim.name, probe_payload("v2", rounds), round_no=rounds, encrypt=True
        ),
        "request": legit.frame(
            REQUEST_PREFIX + "model",
            victim.name,
            {"round": rounds, "max_round": rounds, "_wait_s": 1.0},
            round_no=rounds,
            encrypt=True,
        ),
        "heartbeat": legit.frame(
            HEARTBEAT,
            victim.name,
            heartbeat_payload(rounds, "done", done=True, bye=False),
            round_no=rounds,
            encrypt=True,
        ),
    }
    kinds = {"push": "model", "request": REQUEST_PREFIX + "model", "heartbeat": HEARTBEAT}
    first = {k: legit.post(victim.name, f).brief() for k, f in captured.items()}
    resend = {k: legit.post(victim.name, f).brief() for k, f in captured.items()}
    evidence: dict[str, Any] = {"first_delivery": first, "resent_before_restart": resend}
    # Since 091d02c a FedAVGP2P node takes no pushes of the kind it serves
    # ("model"): refused push_not_accepted before anything is spooled. That
    # push must then stay refused after the restart too; the request and the
    # heartbeat must have been taken.
    push_refused = first["push"]["status"] == 404 and first["push"]["reason"] == "push_not_accepted"
    evidence["push_not_read_by_victim"] = push_refused
    if not all(r["status"] == 200 for k, r in first.items() if not (k == "push" and push_refused)):
        return inconclusive("3", "the victim did not take the legitimate frames", **evidence)
    victim.kill()
    victim.start()
    victim.wait_for(lambda s: True, 120, "restart")
    evidence["restarted"] = True
    rows, parts = {}, {}
    for label, frame in captured.items():
        reply, before, after = send_and_watch(legit, victim, frame)
        row = judge_input(reply, before, after)
        kind = kinds[label]
        row["processed_again"] = after.received.get(kind, 0) > before.received.get(kind, 0)
        if row["outcome"] == "succeeded" and reply.accepted and not row["processed_again"]:
            row["outcome"] = "neutralised"  # a duplicate acknowledged and dropped
        rows[label] = row
        parts[label] = row["outcome"]
    evidence["resent_after_restart"] = rows
    return verdict(combine(parts), "3", f"{parts}", **evidence)
