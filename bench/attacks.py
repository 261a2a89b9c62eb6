"""Attack bench for issue #16 (trust): real daemons on 127.0.0.1, one attack per hole.

    python -m bench.attacks [--scenarios NAME,NAME,...] [--out DIR] [--list]

Every scenario starts real `p2pfl-node` processes (bench/localfed.py) on
loopback, attacks them as a compromised roster member or a network observer
would, and judges the outcome from what the victims did, never from what the
attacker hoped:

- `refused`: the victim refused the input with a reason and counted it (the
  HTTP status and `reason` of its answer, the rise of its `/status` rejection
  counter, or a protocol refusal it counted through `ctx.reject`);
- `neutralised`: the input was taken (or refused without being counted) but
  had no effect beyond a stated bound: a duplicate dropped without being
  processed again, or the honest nodes' macro-F1 within `--bound` of the same
  federation without the attack, measured in the same bench run;
- `succeeded`: anything else. A scenario that could not carry its attack out
  (a harness failure, a victim that did not take even the legitimate input
  the attack starts from, a protocol kind that no longer exists) also reports
  `succeeded`, with `inconclusive: true` and why: the bench claims a defence
  only where it watched one.

The scenarios (hole numbers are the issue's):

| scenario | hole | federation | attack |
|---|---|---|---|
| fedperl_subset_difference | 1 | 4 FedPerl daemons + a raw requester | sums over nested and overlapping contributor sets, subtracted; with secure aggregation also a lie about a dropout |
| fedperl_model_pull | 1 | the same | a plain FedAVGP2P `model` request for one contributor's model |
| unencrypted_injection | 2 | FedAVGP2P, `wire.encryption: true` | a signed but unencrypted push, request and heartbeat |
| replay_after_restart | 3 | the same | a captured push, request and heartbeat resent after the victim's SIGKILL and restart |
| poisoned_sgd_gradients | 5 | 3 FedSGDP2P daemons, one compromised | `scaled_random` gradients (x `--sgd-scale` the norm) |
| poisoned_feder_relay | 5 | 3 FedER daemons + a raw ring member | a signed relay whose model is x `--feder-scale` a real one |
| inflated_sample_count | 6 | 5 FedAVGP2P daemons, one compromised | a site with 0.6 % of the images claims `--inflation-factor` x its count |
| inflated_sample_count_capped | 6 | the same, every roster card's `max_samples` its site's true count | the same claim (inconclusive where the roster has no `max_samples`) |
| forged_signature | earlier | wire federation | a push signed with a key not the sender's; a stranger's push; forged answers |
| wrong_federation | earlier | wire federation | a correctly signed push for another federation id |
| nan_model | earlier | wire federation + a compromised node | NaN and Inf models served |
| replayed_answer | earlier | the same | an earlier answer replayed byte for byte |
| huge_norm_model | earlier | the same | a model x 1e6 served (FedAVGP2P's max_norm_ratio) |
| nan_wait | 28.3 | 1 FedAVGP2P daemon after its round (bench/attacks_review.py) | a signed request with `_wait_s: NaN`; /healthz must answer within 1 s |
| held_request_flood | 28.held | the same | 300 held requests from one member (100/s); a per-peer cap, /healthz, descriptors |
| response_bomb | 28.5 | 1 probe daemon, max_message_bytes 4 MiB, + a fake peer at a roster address | 64 MiB answers to its heartbeats; RSS growth < 2 x max_message_bytes |
| unbounded_kinds | 28.6 | the same, inbox_size 4 | 50 pushes of 50 unregistered kinds; none spooled, none re-queued after a restart |
| decode_bomb | 28.7 | the same | a 1 MiB heartbeat of ~1M empty arrays; RSS < 2 x max_message_bytes, /healthz p99 < 100 ms |
| concurrent_replay | 28.8 | the same | 3 copies of one push, every header before any payload; processed once |
| status_rebinding | 28.9 | the same | /status, /peers, /metrics with `Host: rebind.attacker.example` |
| huge_round_header | 28.10 | the same | an encrypted push whose header says round 2**63 |
| stale_feder_relay | 28.feder | 1 FedER daemon + a raw ring member | a relay of round 0 taken in round 1 |
| secagg_u2_split | 28.1 | real Contributors in one process (bench/attacks_secagg.py) | the victim told U2 = {a, b}, the others the full U2, then that b dropped |
| secagg_session_reuse | 28.2 | the same | one session id and range twice, the victim said to have dropped the second time |
| secagg_story_search | 28.1/2 | the same | hypothesis: any U1..U4 per contributor, thresholds, ids, ranges (bench/secagg_adversary.py) |
| secagg_bad_share_index | 28.4 | 9 Contributors + a requester in memory | one reveals a negative index, then junk under index 1 |

Attackers: a compromised roster member is either a raw client (`RawPeer`: a
`WireCodec` with that member's own keys from the harness's state dir, plain
HTTP POSTs to the victim's peer port) or a real daemon with a fault plan
(node/faults.py `poison`), as bench/robustness.py does. A network observer's
capture is simulated by building the frame exactly as the legitimate peer's
daemon would (its keys, the victim's encryption setting) and recording the
bytes before delivering them.

Data: the embedded scikit-learn digits at 16 x 16, small CNN, a few rounds;
every federation is bounded by `--timeout` and stopped (SIGTERM, then SIGKILL)
whatever happens. Progress goes to stderr; DIR/results.json keeps every
scenario's evidence; the last stdout line is one JSON object
`{"attacks": {NAME: {"outcome": ..., ...}}, "all_defended": BOOL}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bench import attacks_review, attacks_secagg
from bench.attack_kit import (
    FEDERATION,
    FIXED_POINT_BITS,
    GROUPS,
    MASKED_WEIGHT_KEY,
    NOT_A_DEFENCE,
    REPLAY_REASONS,
    SCENARIOS,
    TINY_GAN,
    Counters,
    Heartbeats,
    Options,
    RawPeer,
    Reply,
    checkpoints,
    combine,
    farewell,
    fresh,
    guarded,
    heartbeat_payload,
    honest_macro_f1,
    inconclusive,
    judge_damage,
    judge_input,
    ledger,
    overrides,
    poison_events,
    poisoned_relay,
    probe_payload,
    provisioned,
    reason_rise,
    run_federation,
    say,
    send_and_watch,
    site_data,
    state_dir,
    verdict,
    wait_done,
    wait_up,
    write_plan,
)
from bench.attack_kit import (
    OUTCOMES as OUTCOMES,  # re-exported: the outcomes a verdict may have
)
from bench.federation import read_metrics
from bench.localfed import LocalFederation, NodeProcess
from node.faults import ENV
from node.membership import HEARTBEAT
from node.outbound import REQUEST_PREFIX
from node.provision import SitePlan, provision
from p2pfl.config import FedPerlParams
from p2pfl.learning.state import averaged_keys
from p2pfl.secure.identity import Card, LocalIdentity, Roster
from protocols.checks import float_norm

# ---------------------------------------------------------------------- wire group (holes 2, 3, earlier)

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
    m = RawPeer(fed_dir, "m", ports)
    absent = [RawPeer(fed_dir, n, ports) for n in names if n not in daemons]
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
    impostor = RawPeer(fed_dir, "m", ports, identity=LocalIdentity.generate("m"))
    stranger = RawPeer(fed_dir, "mallory", ports, identity=LocalIdentity.generate("mallory"))
    rows = {}
    for label, attacker in (("impostor_push", impostor), ("stranger_push", stranger)):
        frame = attacker.frame("probe", victim.name, probe_payload(attacker.name, 1), round=1)
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
    frame = other.frame("probe", victim.name, probe_payload("m", 1), round=1)
    row = judge_input(*send_and_watch(other, victim, frame))
    return verdict(
        row["outcome"], "earlier", f"answered {row['status']} {row['reason']}", input=row
    )


def unencrypted_injection(m: RawPeer, victim: NodeProcess, rounds: int) -> dict[str, Any]:
    """Victim runs with `wire.encryption: true`; roster member m sends a correctly
    signed but unencrypted push, request and heartbeat (expect each refused,
    e.g. `encryption_required`). The same three encrypted are the control: the
    victim must take those, or the refusals say nothing about encryption."""
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
        frame = m.frame(kind, victim.name, payload, round=rounds, encrypt=False)
        rows[label] = judge_input(*send_and_watch(m, victim, frame))
        ok = m.post(victim.name, m.frame(kind, victim.name, payload, round=rounds, encrypt=True))
        control[label] = ok.brief()
    parts = {k: v["outcome"] for k, v in rows.items()}
    evidence = {"unencrypted": rows, "encrypted_control": control}
    if not all(c["status"] == 200 for c in control.values()):
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
    legit = RawPeer(fed_dir, "v2", ports)
    captured = {
        "push": legit.frame(  # a kind the FedAVGP2P victim declares
            "model", victim.name, probe_payload("v2", rounds), round=rounds, encrypt=True
        ),
        "request": legit.frame(
            REQUEST_PREFIX + "model",
            victim.name,
            {"round": rounds, "max_round": rounds, "_wait_s": 1.0},
            round=rounds,
            encrypt=True,
        ),
        "heartbeat": legit.frame(
            HEARTBEAT,
            victim.name,
            heartbeat_payload(rounds, "done", done=True, bye=False),
            round=rounds,
            encrypt=True,
        ),
    }
    kinds = {"push": "model", "request": REQUEST_PREFIX + "model", "heartbeat": HEARTBEAT}
    first = {k: legit.post(victim.name, f).brief() for k, f in captured.items()}
    resend = {k: legit.post(victim.name, f).brief() for k, f in captured.items()}
    evidence: dict[str, Any] = {"first_delivery": first, "resent_before_restart": resend}
    if not all(r["status"] == 200 for r in first.values()):
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


# ---------------------------------------------------------------------- FedPerl group (hole 1)

# The requester's side, and only here: `collect_sum` speaks whichever protocol
# the daemons serve (the masked anonymized peer of `anon_model` requests, or
# secure aggregation's `secagg` sessions once protocols/secagg.py exists); the
# attacks below only choose contributor sets, rounds and lies.
ANON_KIND = "anon_model"
SECAGG_KIND = "secagg"


@dataclass
class Sum:
    """What a requester obtained: sum_u w_u x_u per float entry (float64) and sum_u w_u."""

    entries: dict[str, np.ndarray]
    weight: float
    extra: dict[str, Any] = field(default_factory=dict)


def secure_aggregation_code() -> bool:
    """Do these daemons speak secure aggregation (protocols/secagg.py beside the
    `protocols` package the daemons import; an editable install's finder may
    resolve the module name to another checkout, so the file is what counts)?"""
    import protocols

    return (Path(protocols.__file__).parent / "secagg.py").exists()


def collect_sum(
    attacker: RawPeer,
    contributors: list[str],
    round: int,
    *,
    dropped: list[str] | None = None,
    wait_s: float = 10.0,
) -> tuple[Sum | None, dict[str, Any]]:
    """One sum over `contributors`' models of `round`, asked for by `attacker`.
    `dropped`: contributors to claim dropped out after masking (secure
    aggregation's Unmasking), though they answered. Returns (the sum, or None
    when the contributors did not all go along; what each answered)."""
    if secure_aggregation_code():
        return collect_secure_sum(attacker, contributors, round, dropped=dropped, wait_s=wait_s)
    return collect_masked_sum(attacker, contributors, round, wait_s=wait_s)


def collect_masked_sum(
    attacker: RawPeer, contributors: list[str], round: int, *, wait_s: float
) -> tuple[Sum | None, dict[str, Any]]:
    """The old protocol (protocols/fedperl.py AnonymizedPeerRequest): every
    contributor answers one request with its masked model; the masks cancel in
    the sum mod 2^64. It has no dropout phase: a retry is a fresh request over
    the survivors, which is how the caller claims a dropout."""
    request = {
        "request_id": secrets.token_hex(16),
        "contributors": sorted(contributors),
        "round": round,
        "max_round": round,
    }
    answers: dict[str, Any] = {}
    total: dict[str, np.ndarray] = {}
    complete = True
    for peer in request["contributors"]:
        reply, payload = attacker.request(peer, ANON_KIND, request, round=round, wait_s=wait_s)
        masked = payload.get("masked") if isinstance(payload, dict) else None
        if not reply.accepted or not isinstance(masked, dict):
            complete = False
            answers[peer] = reply.brief() | {
                "refused": payload.get("refused") if isinstance(payload, dict) else None
            }
            continue
        answers[peer] = {"status": 200, "masked_entries": len(masked)}
        add_masked(total, masked)
    if not complete or MASKED_WEIGHT_KEY not in total:
        return None, answers
    return masked_total(total), answers


def masked_total(total: dict[str, np.ndarray]) -> Sum:
    """The summed masked contributions (fixed point, mod 2^64) as floats."""
    rest = dict(total)
    weight = float(fixed_to_float(rest.pop(MASKED_WEIGHT_KEY))[0])
    return Sum({k: fixed_to_float(v) for k, v in rest.items()}, weight)


def collect_secure_sum(
    attacker: RawPeer,
    contributors: list[str],
    round: int,
    *,
    dropped: list[str] | None,
    wait_s: float,
) -> tuple[Sum | None, dict[str, Any]]:
    """Secure aggregation (protocols/secagg.py, Bonawitz et al.'s five rounds),
    played by a raw requester. With `dropped`, the requester lies after every
    masked input arrived: it tells the others that those dropped out (U3
    without them), collects the survivors' shares of the dropped ones' mask
    keys, and tries to peel their pair masks off the masked inputs it holds.
    Returns the sum over the contributors the others unmasked."""
    from protocols import secagg, secagg_primitives

    u = sorted(contributors)
    base = {
        "session": secrets.token_hex(16),
        "contributors": u,
        "round": round,
        "max_round": round,
        "purpose": "model",
    }
    answers: dict[str, dict[str, Any]] = {p: {} for p in u}

    def ask(peer: str, phase: str, body: dict[str, Any]) -> dict[str, Any] | None:
        query = {**base, "phase": phase, "body": body}
        reply, payload = attacker.request(peer, SECAGG_KIND, query, round=round, wait_s=wait_s)
        if not reply.accepted or not isinstance(payload, dict) or "refused" in payload:
            answers[peer][phase] = reply.brief() | {
                "refused": payload.get("refused") if isinstance(payload, dict) else None
            }
            return None
        answers[peer][phase] = {"status": 200}
        return payload

    keys = {p: r for p in u if (r := ask(p, "advertise", {})) is not None}
    u1 = sorted(keys)
    t = secagg.threshold_for(len(u) - 1, None)
    if len(u1) < max(secagg.MIN_SUM, t + 1):
        return None, answers

    dealt = {
        p: r for p in u1 if (r := ask(p, "share", share_keys_body(keys, u1, t, p))) is not None
    }
    shares = {p: r["shares"] for p, r in dealt.items()}
    u2 = sorted(shares)

    def mask_body(p: str) -> dict[str, Any]:
        others = [v for v in u2 if v != p]
        return {
            "u2": u2,
            "shares": {v: shares[v][p] for v in others},
            "commitments": {v: dealt[v].get("commitments", {}).get(p) for v in others},
        }

    masked = {p: r for p in u2 if (r := ask(p, "mask", mask_body(p))) is not None}
    inputs = {p: r["masked"] for p, r in masked.items()}
    claimed_dropped = [v for v in u2 if v not in inputs or v in (dropped or [])]
    u3 = sorted(v for v in inputs if v not in claimed_dropped)
    vouched = {
        p: r["tags"]
        for p in u3
        if (r := ask(p, "consistency", consistency_body(masked, u3, p))) is not None
    }
    u4 = sorted(vouched)
    revealed = {
        p: r
        for p in u4
        if (r := ask(p, "unmask", {"u4": u4, "tags": {v: vouched[v][p] for v in u4 if v != p}}))
        is not None
    }
    self_shares: dict[str, list[tuple[int, bytes]]] = {v: [] for v in u3}
    key_shares: dict[str, list[tuple[int, bytes]]] = {v: [] for v in claimed_dropped}
    for reply in revealed.values():
        for name, bucket in (("self_shares", self_shares), ("key_shares", key_shares)):
            for v, item in (reply.get(name) or {}).items():
                if v in bucket and isinstance(item, dict):
                    bucket[v].append((item["idx"], item["share"]))
    if not u3 or any(len(s) < t for s in (*self_shares.values(), *key_shares.values())):
        return None, answers
    reference = {
        k: torch.zeros(tuple(v.shape), dtype=torch.float64)
        for k, v in inputs[u3[0]].items()
        if k != MASKED_WEIGHT_KEY
    }
    context = secagg.session_context(attacker.name, secagg.SessionRequest(**base, phase="unmask"))
    dropped_keys = {v: secagg_primitives.combine_shares(s[:t]) for v, s in key_shares.items()}
    public_keys = {v: mask_public(keys[v]) for v in u1}
    mean, total = secagg_primitives.unmask_sum(
        {v: inputs[v] for v in u3},
        {v: secagg_primitives.combine_shares(s[:t]) for v, s in self_shares.items()},
        dropped_keys,
        public_keys,
        context,
        reference,
    )
    result = Sum({k: (v.double() * total).numpy().reshape(-1) for k, v in mean.items()}, total)
    # The lie's prize: a masked input whose owner's mask key the others revealed.
    for v in claimed_dropped:
        if v in inputs:
            result.extra[v] = peel_pair_masks(
                inputs[v], v, dropped_keys[v], public_keys, u2, context
            )
    return result, answers


def share_keys_body(
    adverts: dict[str, dict[str, Any]], u1: list[str], threshold: int, peer: str
) -> dict[str, Any]:
    """Round 1's query to `peer`, built from the Round 0 answers whatever fields
    they carry: each advert as its owner gave it, less its `tags`, plus the tag
    its owner made for `peer` (as protocols/secagg_requester.py share_keys_body)."""
    return {
        "threshold": threshold,
        "keys": {
            v: {
                **{f: x for f, x in adverts[v].items() if f != "tags"},
                **(
                    {"tag": b"" if v == peer else adverts[v]["tags"].get(peer, b"")}
                    if isinstance(adverts[v].get("tags"), dict)
                    else {}
                ),
            }
            for v in u1
        },
    }


def consistency_body(masked: dict[str, dict[str, Any]], u3: list[str], peer: str) -> dict[str, Any]:
    """Round 3's query to `peer`: U3, and the view tags the others made for it
    with their masked inputs (where the protocol has them)."""
    views = {
        v: masked[v]["view_tags"].get(peer, b"")
        for v in u3
        if v != peer and isinstance(masked[v].get("view_tags"), dict)
    }
    return {"u3": u3, "view_tags": views} if views else {"u3": u3}


def mask_public(advert: dict[str, Any]) -> bytes:
    """The public key a contributor's pair masks are agreed with (`s_pk`; `pk` before)."""
    return advert["s_pk"] if "s_pk" in advert else advert["pk"]


def peel_pair_masks(
    masked: dict[str, Tensor],
    owner: str,
    private_key: bytes,
    public_keys: dict[str, bytes],
    u2: list[str],
    context: bytes,
) -> dict[str, np.ndarray]:
    """owner's masked input less its pair masks with every other member of U2
    (rebuilt from its revealed mask key): what is left is its weighted model
    plus its self-mask, which only the shares of its self-mask seed remove."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from protocols import masking, secagg_primitives

    private = X25519PrivateKey.from_private_bytes(private_key)
    out = {}
    for entry, value in masked.items():
        if entry == MASKED_WEIGHT_KEY:
            continue
        flat = value.detach().cpu().numpy().reshape(-1).view(np.uint64).copy()
        for u in u2:
            if u == owner:
                continue
            seed = secagg_primitives.mask_seed(private, public_keys[u], context, owner, u)
            mask = masking.mask_stream(seed, entry, flat.size)
            if owner < u:
                flat -= mask
            else:
                flat += mask
        out[entry] = fixed_to_float(flat)
    return out


def add_masked(total: dict[str, np.ndarray], masked: dict[str, Any]) -> None:
    """total += one masked contribution (int64 tensors read as uint64, mod 2^64),
    as protocols/masking.py's requester sums them."""
    for key, value in masked.items():
        if not isinstance(value, Tensor):
            continue
        flat = value.detach().cpu().numpy().reshape(-1).view(np.uint64)
        total[key] = total[key] + flat if key in total else flat.copy()


def fixed_to_float(values: np.ndarray) -> np.ndarray:
    return values.view(np.int64).astype(np.float64) / 2.0**FIXED_POINT_BITS


def combination(sums: list[tuple[int, Sum]]) -> dict[str, np.ndarray]:
    """sum_i c_i S_i / sum_i c_i W_i: one model out of signed combinations of
    weighted sums (e.g. S_abc - S_ab = w_c x_c, over W_abc - W_ab = w_c)."""
    weight = sum(c * s.weight for c, s in sums)
    keys = set.intersection(*(set(s.entries) for _, s in sums))
    return {
        k: sum(c * s.entries[k] for c, s in sums) / (weight if abs(weight) > 1e-9 else 1.0)
        for k in keys
    }


def attack_subset_difference(
    attacker: RawPeer, names: list[str], rounds: int, wait_s: float
) -> dict[str, Any]:
    """A curious requester's attempts to isolate one contributor's model, one
    model round each (a contributor keeps its last 3):

    - `retry_after_dropout` (round `rounds`): a sum over all of `names`, then
      one over all but the last, as a retry after it dropped out:
      S_all - S_rest = w_last x_last.
    - `different_subsets` (round `rounds - 1`): sums over {a, b}, {b, c},
      {a, c}: a = (S_ab + S_ac - S_bc) / (W_ab + W_ac - W_bc).
    - `claimed_dropout` (round `rounds - 2`, secure aggregation only; the old
      protocol's dropout claim is `retry_after_dropout`): one session over all
      of `names` in which the requester, holding every masked input, tells the
      others the last one dropped; it peels that one's pair masks off its
      input with the mask key the others reveal.
    Each attempt: the target, the answers, and the recovered model or None."""
    a, b, c, last = names[0], names[1], names[2], names[-1]
    attempts: dict[str, Any] = {}
    full, full_answers = collect_sum(attacker, names, rounds, wait_s=wait_s)
    rest, rest_answers = collect_sum(attacker, names[:-1], rounds, dropped=[last], wait_s=wait_s)
    attempts["retry_after_dropout"] = {
        "target": last,
        "round": rounds,
        "answers": {"all": full_answers, "survivors": rest_answers},
        "recovered": combination([(1, full), (-1, rest)]) if full and rest else None,
    }
    sums, answers = {}, {}
    for pair in ((a, b), (b, c), (a, c)):
        label = "+".join(pair)
        sums[label], answers[label] = collect_sum(attacker, list(pair), rounds - 1, wait_s=wait_s)
    ab, bc, ac = sums[f"{a}+{b}"], sums[f"{b}+{c}"], sums[f"{a}+{c}"]
    attempts["different_subsets"] = {
        "target": a,
        "round": rounds - 1,
        "answers": answers,
        "recovered": combination([(1, ab), (1, ac), (-1, bc)]) if ab and bc and ac else None,
    }
    if secure_aggregation_code():
        lie, lie_answers = collect_sum(attacker, names, rounds - 2, dropped=[last], wait_s=wait_s)
        attempts["claimed_dropout"] = {
            "target": last,
            "round": rounds - 2,
            "answers": {"session": lie_answers},
            "sum_over": sorted(set(names) - {last}) if lie else None,
            "recovered": lie.extra.get(last) if lie else None,
        }
    return attempts


def run_fedperl(opts: Options, selected: set[str]) -> dict[str, dict[str, Any]]:
    """Four FedPerl daemons (pa, pb, pc, pd); `m`, a roster member without a
    daemon, is the curious requester. With `protocol.secure_aggregation` in the
    schema (the planned fix) the daemons run with it on, and so with
    `wire.encryption` (config refuses the one without the other); m then
    encrypts what it sends, as a member's daemon would."""
    folder = fresh(opts.out / "fedperl")
    daemons = ["pa", "pb", "pc", "pd"]
    names = [*daemons, "m"]
    rounds = 3
    protocol: dict[str, Any] = {
        "name": "fedperl",
        "rounds": rounds,
        "fraction": 1.0,
        "top_t": 2,
        "warmup_rounds": 10,  # the daemons need no anonymized peer among themselves
        "round_timeout_s": 20.0,
        "max_staleness": 1,
    }
    secure = "secure_aggregation" in FedPerlParams.model_fields
    if secure:
        protocol["secure_aggregation"] = True
    plans, ports = provisioned(
        folder,
        names,
        protocol,
        opts.seed,
        label_fraction=0.5,
        training={"epochs": 3},
        wire={"encryption": secure},
    )
    by_name = {p.name: p for p in plans}
    fed = LocalFederation([by_name[n] for n in daemons], folder / "logs")
    m = RawPeer(folder / "fed", "m", ports, encrypt=secure)
    target = daemons[-1]
    results: dict[str, dict[str, Any]] = {}
    say(
        f"fedperl: {', '.join(daemons)}, {rounds} rounds, secure_aggregation={secure}; "
        "raw requester m"
    )
    with fed:
        farewell([m], fed, encrypt=secure, timeout=opts.timeout_s)
        wait_done(fed, rounds, opts.timeout_s)
        say("fedperl: federation done; m asks for models")
        before = Counters.of(fed[target])
        pull_reply, payload = m.request(
            target, "model", {"round": rounds, "max_round": rounds}, round=rounds
        )
        pulled = payload.get("state") if isinstance(payload, dict) else None
        pulled = pulled if isinstance(pulled, dict) else None
        after = {n: Counters.of(fed[n]) for n in daemons}
        if "fedperl_model_pull" in selected:
            results["fedperl_model_pull"] = judge_model_pull(
                pull_reply, pulled, before, after[target], secure
            )
        if "fedperl_subset_difference" in selected:
            results["fedperl_subset_difference"] = guarded(
                "fedperl_subset_difference",
                lambda: subset_difference(m, fed, by_name, daemons, rounds, pulled, after, secure),
            )
    return results


def judge_model_pull(
    reply: Reply,
    state: dict[str, Tensor] | None,
    before: Counters,
    after: Counters,
    secure: bool,
) -> dict[str, Any]:
    """m asks a daemon for its model of the last round with a plain FedAVGP2P
    `model` request: an individual model handed to a roster member is the
    leak. Any refusal the daemon counted (a kind it no longer serves included)
    is a refusal here: the request itself is well formed."""
    evidence = {"reply": reply.brief(), "secure_aggregation": secure, "counted": before.rise(after)}
    if state is not None:
        return verdict("succeeded", "1", "the daemon answered with its own model", **evidence)
    if (
        not reply.accepted
        and reply.reason
        and after.rejected.get(reply.reason, 0) > before.rejected.get(reply.reason, 0)
    ):
        return verdict("refused", "1", f"refused: {reply.reason}", **evidence)
    return verdict("neutralised", "1", "no model given, no refusal counted", **evidence)


def subset_difference(
    m: RawPeer,
    fed: LocalFederation,
    by_name: dict[str, SitePlan],
    daemons: list[str],
    rounds: int,
    truth: dict[str, Tensor] | None,
    before: dict[str, Counters],
    secure: bool,
) -> dict[str, Any]:
    """Hole 1: a curious requester (roster member m) collects sums over
    contributor sets it chooses, subtracts them, lies about dropouts. A
    recovered model is compared with the target's own (from the plain pull,
    when the target gave it) or, without that ground truth, judged by whether
    it is a plausible trained model (judge_recovered). Per attempt: succeeded
    if a model came out; refused if a contributor refused and counted it;
    neutralised if contributors refused without counting, or only noise came out."""
    attempts = attack_subset_difference(m, daemons, rounds, wait_s=10.0)
    after = {n: Counters.of(fed[n]) for n in daemons}
    counted = {n: before[n].rise(after[n]) for n in daemons}
    evidence: dict[str, Any] = {
        "protocol": "secagg" if secure_aggregation_code() else ANON_KIND,
        "secure_aggregation": secure,
        "counted_by_contributors": counted,
    }
    parts: dict[str, str] = {}
    replies: list[dict[str, Any]] = []
    for label, attempt in attempts.items():
        recovered = attempt.pop("recovered")
        replies += list(_answers(attempt["answers"]))
        if recovered is None:
            refused = [
                x
                for x in _answers(attempt["answers"])
                if x.get("status") != 200 or x.get("refused")
            ]
            parts[label] = "refused" if refused and any(counted.values()) else "neutralised"
            attempt["result"] = "the contributors did not all go along"
        else:
            target = attempt["target"]
            exact = truth if label == "retry_after_dropout" and target == daemons[-1] else None
            attempt |= judge_recovered(recovered, exact, by_name[target])
            parts[label] = "succeeded" if attempt["leaked"] else "neutralised"
        attempt["outcome"] = parts[label]
        evidence[label] = attempt
    if replies and all(x.get("reason") == "no_handler" for x in replies):
        return inconclusive(
            "1",
            "the daemons serve neither anon_model nor secagg: adapt collect_sum",
            **evidence,
        )
    return verdict(combine(parts), "1", f"{parts}", **evidence)


def _answers(tree: Any) -> Iterable[dict[str, Any]]:
    """Every contributor's answer record in an attempt's nested answers."""
    if isinstance(tree, dict):
        if "status" in tree:
            yield tree
            return
        for value in tree.values():
            yield from _answers(value)


PLAUSIBLE_DISTANCE = 0.5  # relative L2 distance to the target's own latest model


def judge_recovered(
    recovered: dict[str, np.ndarray], truth: dict[str, Tensor] | None, target: SitePlan
) -> dict[str, Any]:
    """Is `recovered` the target's model? Exact (to the fixed-point step) against
    the ground truth when there is one. Without one: finite, and either within
    PLAUSIBLE_DISTANCE (relative L2) of the model in the target's latest
    checkpoint (its round's aggregate, which its own model lies near; masks
    that did not cancel are ~2^43 away) or scoring well above chance on the
    target's test split."""
    finite = all(np.isfinite(v).all() for v in recovered.values())
    largest = max((float(np.abs(v).max()) for v in recovered.values() if v.size), default=0.0)
    out: dict[str, Any] = {"finite": finite, "largest_abs_value": float(f"{largest:.6g}")}
    saved = checkpoints(target)
    if saved and isinstance(saved[-1].get("protocol"), dict) and "model" in saved[-1]["protocol"]:
        out["relative_distance_to_target_checkpoint"] = relative_distance(
            recovered, saved[-1]["protocol"]["model"]
        )
    if truth is not None:
        keys = averaged_keys(truth)
        diff = (
            max(
                float(np.abs(recovered[k] - truth[k].double().numpy().reshape(-1)).max())
                for k in keys
            )
            if all(k in recovered for k in keys)
            else float("inf")
        )
        out["max_abs_diff_vs_target_model"] = diff
        out["leaked"] = diff <= 2.0 ** -(FIXED_POINT_BITS - 1)
        return out
    if not finite or largest > 1e3:
        out["leaked"] = False
        return out
    f1 = evaluate_state(recovered, target)
    out["recovered_macro_f1"] = f1
    distance = out.get("relative_distance_to_target_checkpoint")
    out["leaked"] = (f1 is not None and f1 > 0.3) or (
        distance is not None and distance < PLAUSIBLE_DISTANCE
    )
    return out


def relative_distance(entries: dict[str, np.ndarray], state: dict[str, Tensor]) -> float | None:
    """||entries - state|| / ||state|| over the entries both hold (float64)."""
    keys = [k for k in entries if k in state and state[k].is_floating_point()]
    if not keys:
        return None
    ref = np.concatenate([state[k].double().numpy().reshape(-1) for k in keys])
    got = np.concatenate([entries[k].reshape(-1) for k in keys])
    norm = float(np.linalg.norm(ref))
    return float(f"{float(np.linalg.norm(got - ref)) / max(norm, 1e-12):.4g}")


def evaluate_state(entries: dict[str, np.ndarray], plan: SitePlan) -> float | None:
    """Test macro-F1 of a recovered model, built like the target site builds its own."""
    from p2pfl.config import load_config
    from p2pfl.learning.evaluate import evaluate_site
    from protocols.site import build_site

    site = build_site(load_config(plan.config_path))
    state = site.state_dict()
    for key, value in entries.items():
        if key in state:
            state[key] = torch.from_numpy(value).reshape(state[key].shape).to(state[key].dtype)
    site.load_state_dict(state)
    f1 = evaluate_site(site).get("macro_f1")
    return None if f1 is None else round(float(f1), 4)


# ---------------------------------------------------------------------- inflation group (hole 6)


def shrink_and_flip(path: Path, keep: int) -> int:
    """The compromised site's data: its first `keep` training images, labels
    shifted by one class (what it wants its neighbours to learn)."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = dict(npz)
    classes = len(arrays["class_names"])
    arrays["train_images"] = arrays["train_images"][:keep]
    arrays["train_labels"] = (arrays["train_labels"][:keep] + 1) % classes
    np.savez_compressed(path, **arrays)
    return int(len(arrays["train_labels"]))


def run_inflation(opts: Options, selected: set[str]) -> dict[str, dict[str, Any]]:
    """Hole 6: `big`, one of N FedAVGP2P sites, holds ~0.6 % of the training
    images (labels shifted, so its weight shows in the others' scores) and
    claims `inflation_factor` x its count with every model it serves
    (fault plan mode `inflated_count`). The reference is the same federation,
    the same `big`, but an honest count. Every node averages with all others
    (c = 1), so every honest node weighs `big` by its claim every round."""
    folder = fresh(opts.out / "inflation")
    n = opts.inflation_nodes
    names = [f"s{i}" for i in range(n - 1)] + ["big"]
    sources = site_data(folder / "data", n, opts.seed)
    with np.load(sources[0], allow_pickle=False) as npz:
        per_site = len(npz["train_labels"])
    total = sum(len(np.load(s, allow_pickle=False)["train_labels"]) for s in sources)
    keep = max(2, round(opts.inflation_share * total))
    kept = shrink_and_flip(sources[-1], keep)
    honest_counts = [len(np.load(s, allow_pickle=False)["train_labels"]) for s in sources[:-1]]
    rounds = 4
    protocol = {
        "name": "fedavgp2p",
        "rounds": rounds,
        "fraction": 1.0,
        "round_timeout_s": 20.0,
        "max_staleness": 1,
    }
    claimed = max(1, round(kept * opts.inflation_factor))
    evidence: dict[str, Any] = {
        "attacker": "big",
        "true_count": kept,
        "true_share_of_all_training_images": round(kept / total, 4),
        "claimed_count": claimed,
        "honest_counts": honest_counts,
        "claimed_weight_in_a_victims_mean": round(claimed / (claimed + sum(honest_counts)), 4),
        "honest_weight_in_a_victims_mean": round(kept / (kept + sum(honest_counts)), 4),
        "per_site_before_shrinking": per_site,
    }
    counts = {**dict(zip(names[:-1], honest_counts, strict=True)), "big": kept}
    plan = [("reference", False, False)]
    if "inflated_sample_count" in selected:
        plan.append(("attacked", True, False))
    capped_possible = "max_samples" in {f.name for f in dataclasses.fields(Card)}
    if "inflated_sample_count_capped" in selected and capped_possible:
        plan.append(("attacked_capped", True, True))
    runs: dict[str, dict[str, Any]] = {}
    rejected: dict[str, int] = {}
    seen: dict[str, dict[str, dict[str, Any]]] = {}
    for label, attack, capped in plan:
        run_dir = fresh(folder / label)
        plans = provision(
            run_dir / "fed",
            names,
            protocol=protocol,
            data_sources=[str(s) for s in sources],
            federation=FEDERATION,
            seed=opts.seed,
            overrides=overrides(),
            # a compromised site trains as it likes: long and fast on its few images
            per_site={"big": {"training": {"epochs": 10, "lr": 1e-2}}},
        )
        if capped:  # the admin's cap: every card's max_samples is its site's true count
            roster_path = run_dir / "fed" / "roster.yaml"
            roster = Roster.load(roster_path)
            Roster(
                [dataclasses.replace(c, max_samples=counts[c.name]) for c in roster.cards()]
            ).save(roster_path)
        env = {}
        if attack:
            plan_path = write_plan(
                run_dir / "big-faults.json",
                {
                    "poison": {
                        "kind": "model",
                        "mode": "inflated_count",
                        "scale": opts.inflation_factor,
                        "from_round": 1,
                    }
                },
            )
            env["big"] = {ENV: str(plan_path)}
        statuses = run_federation(
            f"inflation/{label}", plans, run_dir, rounds=rounds, timeout=opts.timeout_s, env=env
        )
        runs[label] = honest_macro_f1(plans, names[:-1])
        seen[label] = statuses
        rejected[label] = sum(
            int((s.get("rejected_by_peer") or {}).get("big", 0))
            for name, s in statuses.items()
            if name != "big"
        )
        evidence[f"rejected_reasons_{label}"] = {
            name: s.get("rejected") for name, s in statuses.items() if name != "big"
        }
    results = {}
    for name, label in (
        ("inflated_sample_count", "attacked"),
        ("inflated_sample_count_capped", "attacked_capped"),
    ):
        if name not in selected:
            continue
        if label not in runs:
            results[name] = inconclusive(
                "6", "the roster has no max_samples: there is no cap to set", **evidence
            )
            continue
        results[name] = judge_damage(
            "6",
            runs["reference"],
            runs[label],
            opts.bound,
            rejected[label] - rejected["reference"],
            reason_rise(seen["reference"], seen[label], "big"),
            roster_max_samples=counts if label == "attacked_capped" else None,
            **evidence,
        )
    return results


# ---------------------------------------------------------------------- FedSGDP2P group (hole 5)


def run_sgd(opts: Options, selected: set[str]) -> dict[str, dict[str, Any]]:
    """Hole 5, gradients: three FedSGDP2P daemons, `g2` compromised from round 1
    on, serving `scaled_random` gradients (random directions, `sgd_scale` x its
    gradient's norm). The reference is the same federation with g2 honest."""
    folder = fresh(opts.out / "sgd")
    names = ["g0", "g1", "g2"]
    sources = site_data(folder / "data", len(names), opts.seed)
    rounds = 3
    protocol = {
        "name": "fedsgdp2p",
        "rounds": rounds,
        "fraction": 1.0,
        "step_timeout_s": 10.0,
        "round_timeout_s": 20.0,
    }
    runs: dict[str, dict[str, Any]] = {}
    rejected: dict[str, int] = {}
    seen: dict[str, dict[str, dict[str, Any]]] = {}
    evidence: dict[str, Any] = {"attacker": "g2", "mode": "scaled_random", "scale": opts.sgd_scale}
    for label, attack in (("reference", False), ("attacked", True)):
        run_dir = fresh(folder / label)
        plans = provision(
            run_dir / "fed",
            names,
            protocol=protocol,
            data_sources=[str(s) for s in sources],
            federation=FEDERATION,
            seed=opts.seed,
            overrides=overrides(training={"steps_per_round": 12}),
        )
        env = {}
        plan_path = None
        if attack:
            plan_path = write_plan(
                run_dir / "g2-faults.json",
                {
                    "poison": {
                        "kind": "grad",
                        "mode": "scaled_random",
                        "scale": opts.sgd_scale,
                        "from_round": 1,
                    }
                },
            )
            env["g2"] = {ENV: str(plan_path)}
        statuses = run_federation(
            f"sgd/{label}", plans, run_dir, rounds=rounds, timeout=opts.timeout_s, env=env
        )
        runs[label] = honest_macro_f1(plans, names[:-1])
        seen[label] = statuses
        rejected[label] = sum(
            int((s.get("rejected_by_peer") or {}).get("g2", 0))
            for name, s in statuses.items()
            if name != "g2"
        )
        evidence[f"rejected_reasons_{label}"] = {
            name: s.get("rejected") for name, s in statuses.items() if name != "g2"
        }
        if attack:
            evidence["poisoned_gradients_served"] = sum(
                1 for e in poison_events(plan_path) if e.get("event") == "poison"
            )
    return {
        "poisoned_sgd_gradients": judge_damage(
            "5",
            runs["reference"],
            runs["attacked"],
            opts.bound,
            rejected["attacked"] - rejected["reference"],
            reason_rise(seen["reference"], seen["attacked"], "g2"),
            **evidence,
        )
    }


# ---------------------------------------------------------------------- FedER group (hole 5)


def run_feder(opts: Options, selected: set[str]) -> dict[str, dict[str, Any]]:
    """Hole 5, FedER's relay: three FedER daemons (f0, f1, f2) and `m`, a roster
    member played raw that heartbeats like a live node, so it is a ring member;
    before round 1 it pushes its ring successor a correctly signed relay whose
    model is a real initial model x `feder_scale` (plus a small valid buffer).
    The relayed model replaces the receiver's own (Alg. 1)."""
    from protocols.feder import derive_ring, ring_successor

    folder = fresh(opts.out / "feder")
    names = ["f0", "f1", "f2", "m"]
    daemons = names[:3]
    rounds = 2
    protocol = {
        "name": "feder",
        "rounds": rounds,
        "buffer_size": 32,
        "initial_epochs": 1,
        "round_timeout_s": 30.0,
        "genbuffer": TINY_GAN,
    }
    plans, ports = provisioned(folder, names, protocol, opts.seed)
    by_name = {p.name: p for p in plans}
    m = RawPeer(folder / "fed", "m", ports)
    ring = derive_ring(sorted(names), opts.seed, 1)
    victim = ring_successor(ring, "m", set(daemons))[0]
    relay = poisoned_relay(by_name["m"], opts.feder_scale)
    evidence: dict[str, Any] = {
        "attacker": "m",
        "victim": victim,
        "ring_round_1": ring,
        "scale": opts.feder_scale,
        "relay_model_norm": round(float_norm(relay["model"]), 2),
    }
    fed = LocalFederation([by_name[n] for n in daemons], folder / "logs")
    say(f"feder: {', '.join(daemons)}, {rounds} rounds; m relays to {victim}")
    with fed:
        wait_up(fed.nodes.values(), opts.timeout_s)
        with Heartbeats(m, daemons, 1, max_s=opts.timeout_s):
            time.sleep(1.5)  # the daemons hear m before they derive round 1's ring
            reply = m.post(victim, m.frame("feder", victim, relay, round=1))
            evidence["push"] = reply.brief()
            fed[victim].wait_for(
                lambda s: (
                    (s.get("metrics_round") or 0) >= 1 or s.get("phase") in ("done", "failed")
                ),
                opts.timeout_s,
                "the victim's round 1",
            )
        statuses = wait_done(fed, rounds, opts.timeout_s)
    if not reply.accepted:
        counted = int((statuses[victim].get("rejected_by_peer") or {}).get("m", 0))
        outcome = "refused" if reply.reason not in NOT_A_DEFENCE and counted else "neutralised"
        return {
            "poisoned_feder_relay": verdict(
                outcome, "5", f"push answered {reply.status} {reply.reason}", **evidence
            )
        }
    merged = 1 in {r for r, peers in ledger(by_name[victim]).items() if "m" in peers}
    f1 = {
        name: {
            int(r["round"]): r.get("macro_f1")
            for r in read_metrics(state_dir(by_name[name]) / "metrics.jsonl")
        }
        for name in daemons
    }
    norms = {
        int(s["round"]): round(float_norm(s["protocol"]["model"]), 2)
        for s in checkpoints(by_name[victim])
        if isinstance(s.get("protocol"), dict) and "model" in s["protocol"]
    }
    rejected = int((statuses[victim].get("rejected_by_peer") or {}).get("m", 0))
    evidence |= {
        "victim_merged_m_in_round_1": merged,
        "macro_f1_round_1": {n: f1[n].get(1) for n in daemons},
        "victim_model_norm_by_round": norms,
        "victim_rejected_from_m": rejected,
        "victim_rejected": statuses[victim].get("rejected"),
    }
    return {"poisoned_feder_relay": judge_feder(merged, rejected, norms, evidence)}


FEDER_NORM_BOUND = 10.0  # the default protocol.max_norm_ratio


def judge_feder(
    merged: bool, rejected: int, norms: dict[int, float], evidence: dict[str, Any]
) -> dict[str, Any]:
    """Did the victim take m's relay (its ledger says so), and did its model
    blow up? Effect bound: the victim's model norm after round 1 at most
    FEDER_NORM_BOUND x its own round-0 model (macro-F1 is evidence only:
    FedER's round-1 scores vary too much between nodes to judge by)."""
    evidence["norm_bound"] = FEDER_NORM_BOUND
    if not merged:
        if rejected:
            return verdict("refused", "5", "the victim refused and counted m's relay", **evidence)
        return inconclusive(
            "5", "the victim did not merge m's relay, nor count it refused", **evidence
        )
    if 0 not in norms or 1 not in norms or norms[0] <= 0:
        return inconclusive("5", "no round-0 and round-1 checkpoints to compare", **evidence)
    ratio = norms[1] / norms[0]
    evidence["victim_norm_ratio_round_1_to_0"] = float(f"{ratio:.4g}")
    if ratio > FEDER_NORM_BOUND:
        return verdict(
            "succeeded",
            "5",
            f"the victim took m's model in place of its own: norm x{ratio:.3g}",
            **evidence,
        )
    return verdict(
        "neutralised",
        "5",
        f"merged, but the victim's norm stayed within x{FEDER_NORM_BOUND:g}",
        **evidence,
    )


# ---------------------------------------------------------------------- the bench

# The registry (bench/attack_kit.py): these scenarios, then issue #28's
# (bench/attacks_review.py, bench/attacks_secagg.py). name -> (hole, group); group -> its runner.
SCENARIOS.update(
    {
        "fedperl_subset_difference": ("1", "fedperl"),
        "fedperl_model_pull": ("1", "fedperl"),
        "unencrypted_injection": ("2", "wire"),
        "replay_after_restart": ("3", "wire"),
        "poisoned_sgd_gradients": ("5", "sgd"),
        "poisoned_feder_relay": ("5", "feder"),
        "inflated_sample_count": ("6", "inflation"),
        "inflated_sample_count_capped": ("6", "inflation"),
        "forged_signature": ("earlier", "wire"),
        "wrong_federation": ("earlier", "wire"),
        "nan_model": ("earlier", "wire"),
        "replayed_answer": ("earlier", "wire"),
        "huge_norm_model": ("earlier", "wire"),
    }
)
SCENARIOS.update(attacks_review.SCENARIOS)
SCENARIOS.update(attacks_secagg.SCENARIOS)
GROUPS.update(
    {
        "wire": run_wire,
        "fedperl": run_fedperl,
        "sgd": run_sgd,
        "inflation": run_inflation,
        "feder": run_feder,
    }
)
GROUPS.update(attacks_review.GROUPS)
GROUPS.update(attacks_secagg.GROUPS)


def run_bench(opts: Options, names: list[str]) -> dict[str, Any]:
    """Run the named scenarios (group by group); the result object."""
    opts.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    attacks: dict[str, dict[str, Any]] = {}
    for group, runner in GROUPS.items():
        selected = {n for n in names if SCENARIOS[n][1] == group}
        if not selected:
            continue
        group_start = time.monotonic()
        try:
            found = runner(opts, selected)
        except Exception as exc:  # noqa: BLE001 - every scenario of the group reports it
            say(f"{group}: failed: {exc!r}")
            found = {
                n: inconclusive(
                    SCENARIOS[n][0], f"{group} federation failed: {type(exc).__name__}: {exc}"[:600]
                )
                for n in selected
            }
        for name in sorted(selected):
            entry = found.get(name) or inconclusive(SCENARIOS[name][0], "not run")
            attacks[name] = entry
            say(
                f"{name}: {entry['outcome']}{' (inconclusive)' if entry.get('inconclusive') else ''} - {entry['why']}"
            )
        say(f"{group}: {time.monotonic() - group_start:.0f} s")
    ordered = {n: attacks[n] for n in SCENARIOS if n in attacks}
    return {
        "attacks": ordered,
        "all_defended": all(e["outcome"] != "succeeded" for e in ordered.values()),
        "wall_s": round(time.monotonic() - started, 1),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.attacks",
        description="Attack real daemons on 127.0.0.1, one scenario per trust hole (issue #16).",
    )
    p.add_argument(
        "--scenarios",
        default="all",
        help="comma-separated scenario names (see --list), or 'all' (default)",
    )
    p.add_argument("--list", action="store_true", help="print the scenarios and exit")
    p.add_argument("--out", type=Path, default=Path("runs/attacks"), help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bound",
        type=float,
        default=0.05,
        help="macro-F1 (0-1) an accepted attack may cost the honest nodes and still be neutralised",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per federation, seconds")
    p.add_argument("--inflation-factor", type=float, default=100.0)
    p.add_argument("--inflation-nodes", type=int, default=5)
    p.add_argument("--sgd-scale", type=float, default=1000.0)
    p.add_argument("--feder-scale", type=float, default=1000.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        for name, (hole, group) in SCENARIOS.items():
            print(f"{name:28s} hole {hole:8s} federation {group}")
        return 0
    names = (
        list(SCENARIOS)
        if args.scenarios == "all"
        else [s.strip() for s in args.scenarios.split(",") if s.strip()]
    )
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(
            f"--scenarios: unknown {', '.join(unknown)}; known: {', '.join(SCENARIOS)}"
        )
    if args.inflation_nodes < 3:
        raise SystemExit("--inflation-nodes: at least 3")
    opts = Options(
        out=args.out.resolve(),  # site.yaml files name their data by absolute path
        seed=args.seed,
        bound=args.bound,
        timeout_s=args.timeout,
        inflation_factor=args.inflation_factor,
        inflation_nodes=args.inflation_nodes,
        sgd_scale=args.sgd_scale,
        feder_scale=args.feder_scale,
    )
    result = run_bench(opts, names)
    (opts.out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    line = {"attacks": result["attacks"], "all_defended": result["all_defended"]}
    sys.stdout.write(json.dumps(line, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
