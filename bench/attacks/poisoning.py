"""Learning attacks (issue #16's holes 5 and 6): poisoned FedSGDP2P gradients,
a poisoned FedER relay, and an inflated sample count, each judged against
the same federation without the attack."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.attacks.federations import (
    checkpoints,
    fresh,
    honest_macro_f1,
    ledger,
    overrides,
    poison_events,
    poisoned_relay,
    provisioned,
    run_federation,
    site_data,
    state_dir,
    wait_done,
    wait_up,
    write_plan,
)
from bench.attacks.kit import (
    FEDERATION,
    NOT_A_DEFENCE,
    TINY_GAN,
    Options,
    inconclusive,
    say,
    verdict,
)
from bench.federation import read_metrics
from bench.localfed import LocalFederation
from bench.peer import Heartbeats, RawPeer
from node.faults import ENV
from node.provision import provision
from p2pfl.secure.identity import Card, Roster
from protocols.checks import float_norm

# ---------------------------------------------------------------------- verdicts of learning attacks


def judge_damage(
    hole: str,
    reference: dict[str, Any],
    attacked: dict[str, Any],
    bound: float,
    rejected_from_attacker: int,
    reasons: dict[str, int],
    **evidence: Any,
) -> dict[str, Any]:
    """Learning attacks: the honest nodes' final macro-F1 against the same
    federation without the attack. Beyond `bound`: succeeded. Within it:
    refused if the victims counted the attacker's inputs as refused (a reason
    that rose against the reference run, other than a cap); neutralised if
    they took them, capped (`*_capped`) or not."""
    clean, hit = reference["final"], attacked["final"]
    evidence |= {
        "honest_macro_f1_reference": reference,
        "honest_macro_f1_attacked": attacked,
        "bound": bound,
        "rejected_from_attacker": rejected_from_attacker,
        "reasons_counted_by_victims": reasons,
    }
    if clean is None or hit is None:
        return inconclusive(hole, "no final macro-F1 to compare", **evidence)
    drop = round(clean - hit, 4)
    evidence["macro_f1_drop"] = drop
    if drop > bound:
        return verdict(
            "succeeded", hole, f"honest macro-F1 {drop:+.3f} below the clean run", **evidence
        )
    refusals = {r: n for r, n in reasons.items() if not r.endswith("_capped")}
    if rejected_from_attacker > 0 and refusals:
        return verdict(
            "refused",
            hole,
            f"the victims refused and counted the attacker's inputs: {refusals}",
            **evidence,
        )
    capped = {r: n for r, n in reasons.items() if r.endswith("_capped")}
    return verdict(
        "neutralised",
        hole,
        f"honest macro-F1 within {bound} of the clean run"
        + (f"; counted caps {capped}" if capped else ""),
        **evidence,
    )


def reason_rise(
    reference: dict[str, dict[str, Any]], attacked: dict[str, dict[str, Any]], attacker: str
) -> dict[str, int]:
    """Rejection reasons the honest nodes counted in the attacked run beyond the reference run."""
    totals: dict[str, int] = {}
    for statuses, sign in ((attacked, 1), (reference, -1)):
        for name, status in statuses.items():
            if name == attacker:
                continue
            for reason, n in (status.get("rejected") or {}).items():
                totals[reason] = totals.get(reason, 0) + sign * int(n)
    return {r: n for r, n in sorted(totals.items()) if n > 0}


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
    from protocols.feder_relays import derive_ring, ring_successor

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
    m = RawPeer(folder / "fed", "m", ports, federation=FEDERATION)
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
            reply = m.post(victim, m.frame("feder", victim, relay, round_no=1))
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
