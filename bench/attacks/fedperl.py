"""Hole 1 on real daemons: four FedPerl daemons with secure aggregation, and a
curious roster member m that asks for one contributor's model outright and
then for sums over contributor sets it chooses (bench/attacks/requester.py),
subtracting them and lying about a dropout."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bench.attacks.federations import checkpoints, farewell, fresh, provisioned, wait_done
from bench.attacks.kit import (
    FEDERATION,
    Counters,
    Options,
    combine,
    guarded,
    inconclusive,
    say,
    verdict,
)
from bench.attacks.requester import collect_sum, combination, own_reference
from bench.localfed import LocalFederation
from bench.peer import RawPeer, Reply
from node.provision import SitePlan
from p2pfl.learning.state import averaged_keys
from protocols.masking import FIXED_POINT_BITS
from protocols.secagg_messages import SECAGG_KIND


def attack_subset_difference(
    attacker: RawPeer,
    names: list[str],
    rounds: int,
    reference: dict[str, Tensor],
    wait_s: float,
) -> dict[str, Any]:
    """A curious requester's attempts to isolate one contributor's model, one
    model round each (a contributor keeps its last 3):

    - `retry_after_dropout` (round `rounds`): a sum over all of `names`, then
      one over all but the last, as a retry after it dropped out:
      S_all - S_rest = w_last x_last.
    - `different_subsets` (round `rounds - 1`): sums over {a, b}, {b, c},
      {a, c}: a = (S_ab + S_ac - S_bc) / (W_ab + W_ac - W_bc).
    - `claimed_dropout` (round `rounds - 2`): one session over all of `names`
      in which the requester, holding every masked input, tells the others the
      last one dropped; it peels that one's pair masks off its input with the
      mask key the others reveal.
    `reference`: the model's entries (the requester's own model, as a node's
    requester has). Each attempt: the target, the answers, and the recovered
    model or None."""
    a, b, c, last = names[0], names[1], names[2], names[-1]
    attempts: dict[str, Any] = {}
    full, full_answers = collect_sum(attacker, names, rounds, reference, wait_s=wait_s)
    rest, rest_answers = collect_sum(
        attacker, names[:-1], rounds, reference, dropped=[last], wait_s=wait_s
    )
    attempts["retry_after_dropout"] = {
        "target": last,
        "round": rounds,
        "answers": {"all": full_answers, "survivors": rest_answers},
        "recovered": combination([(1, full), (-1, rest)]) if full and rest else None,
    }
    sums, answers = {}, {}
    for pair in ((a, b), (b, c), (a, c)):
        label = "+".join(pair)
        sums[label], answers[label] = collect_sum(
            attacker, list(pair), rounds - 1, reference, wait_s=wait_s
        )
    ab, bc, ac = sums[f"{a}+{b}"], sums[f"{b}+{c}"], sums[f"{a}+{c}"]
    attempts["different_subsets"] = {
        "target": a,
        "round": rounds - 1,
        "answers": answers,
        "recovered": combination([(1, ab), (1, ac), (-1, bc)]) if ab and bc and ac else None,
    }
    lie, lie_answers = collect_sum(
        attacker, names, rounds - 2, reference, dropped=[last], wait_s=wait_s
    )
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
    daemon, is the curious requester. The daemons run with
    `protocol.secure_aggregation` on, and so with `wire.encryption` (config
    refuses the one without the other); m encrypts what it sends, as a
    member's daemon would."""
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
        "secure_aggregation": True,
    }
    plans, ports = provisioned(
        folder,
        names,
        protocol,
        opts.seed,
        label_fraction=0.5,
        training={"epochs": 3},
        wire={"encryption": True},
    )
    by_name = {p.name: p for p in plans}
    fed = LocalFederation([by_name[n] for n in daemons], folder / "logs")
    m = RawPeer(folder / "fed", "m", ports, federation=FEDERATION, encrypt=True)
    target = daemons[-1]
    results: dict[str, dict[str, Any]] = {}
    say(f"fedperl: {', '.join(daemons)}, {rounds} rounds, secure_aggregation=True; raw requester m")
    with fed:
        farewell([m], fed, encrypt=True, timeout=opts.timeout_s)
        wait_done(fed, rounds, opts.timeout_s)
        say("fedperl: federation done; m asks for models")
        before = Counters.of(fed[target])
        pull_reply, payload = m.request(
            target, "model", {"round": rounds, "max_round": rounds}, round_no=rounds
        )
        pulled = payload.get("state") if isinstance(payload, dict) else None
        pulled = pulled if isinstance(pulled, dict) else None
        after = {n: Counters.of(fed[n]) for n in daemons}
        if "fedperl_model_pull" in selected:
            results["fedperl_model_pull"] = judge_model_pull(
                pull_reply, pulled, before, after[target]
            )
        if "fedperl_subset_difference" in selected:
            results["fedperl_subset_difference"] = guarded(
                "fedperl_subset_difference",
                lambda: subset_difference(m, fed, by_name, daemons, rounds, pulled, after),
            )
    return results


def judge_model_pull(
    reply: Reply,
    state: dict[str, Tensor] | None,
    before: Counters,
    after: Counters,
) -> dict[str, Any]:
    """m asks a daemon for its model of the last round with a plain FedAVGP2P
    `model` request: an individual model handed to a roster member is the
    leak. Any refusal the daemon counted (a kind it no longer serves included)
    is a refusal here: the request itself is well formed."""
    evidence = {"reply": reply.brief(), "secure_aggregation": True, "counted": before.rise(after)}
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
) -> dict[str, Any]:
    """Hole 1: a curious requester (roster member m) collects sums over
    contributor sets it chooses, subtracts them, lies about dropouts. A
    recovered model is compared with the target's own (from the plain pull,
    when the target gave it) or, without that ground truth, judged by whether
    it is a plausible trained model (judge_recovered). Per attempt: succeeded
    if a model came out; refused if a contributor refused and counted it;
    neutralised if contributors refused without counting, or only noise came out."""
    reference = own_reference(by_name[m.name])
    attempts = attack_subset_difference(m, daemons, rounds, reference, wait_s=10.0)
    after = {n: Counters.of(fed[n]) for n in daemons}
    counted = {n: before[n].rise(after[n]) for n in daemons}
    evidence: dict[str, Any] = {
        "protocol": SECAGG_KIND,
        "secure_aggregation": True,
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
            f"the daemons do not serve {SECAGG_KIND}: adapt collect_sum",
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
