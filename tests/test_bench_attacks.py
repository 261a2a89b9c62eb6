"""The attack bench (bench/attacks.py): its attacker's arithmetic against the real
masking, the `inflated_count` fault, and one cheap run against real daemons
whose verdicts must agree with the evidence they report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import attacks
from node.faults import CYCLE_MODES, FaultPlan
from protocols import masking

ROOT = Path(__file__).resolve().parents[1]


def test_inflated_count_multiplies_the_claimed_count_and_leaves_the_tensors(tmp_path):
    plan_path = tmp_path / "faults.json"
    plan_path.write_text(
        json.dumps({"poison": {"kind": "model", "mode": "inflated_count", "scale": 100}})
    )
    plan = FaultPlan(plan_path)
    assert plan.poison_mode("model", 1) == "inflated_count"
    assert plan.poison_mode("grad", 1) is None  # only the configured kind
    state = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    served = {"round": 1, "state": state, "num_train": 8}
    out = plan.poison_payload(served, "inflated_count")
    assert out["num_train"] == 800 and served["num_train"] == 8  # the served copy is not touched
    assert all(torch.equal(out["state"][k], state[k]) for k in state)
    grad = plan.poison_payload(
        {"round": 1, "step": 2, "grad": state, "batch_size": 32}, "inflated_count"
    )
    assert grad["batch_size"] == 3200 and grad["step"] == 2


def test_cycle_never_serves_inflated_count(tmp_path):
    """cycle's attacks must all be refused by a receiver; an inflated count is not one of them."""
    plan_path = tmp_path / "faults.json"
    plan_path.write_text(json.dumps({"poison": {"kind": "model", "mode": "cycle"}}))
    plan = FaultPlan(plan_path)
    modes = [plan.poison_mode("model", 1) for _ in range(3 * len(CYCLE_MODES))]
    assert set(modes) == set(CYCLE_MODES) and "inflated_count" not in modes


def _masked(
    models: dict[str, dict[str, torch.Tensor]], secrets: dict[frozenset[str], bytes]
) -> dict[str, dict[str, torch.Tensor]]:
    """Pairwise additive masking as the old anonymized peer did it, with
    protocols/masking.py's keystreams: x_i in fixed point (2^20, mod 2^64),
    plus m_ij for j > i, minus m_ij for j < i; the weight (1) travels masked too."""
    names = sorted(models)
    out = {}
    for me in names:
        entries = {**models[me], attacks.MASKED_WEIGHT_KEY: torch.ones(1, dtype=torch.float64)}
        masked = {}
        for key, value in entries.items():
            fixed = (
                np.rint(value.double().numpy().reshape(-1) * 2.0**attacks.FIXED_POINT_BITS)
                .astype(np.int64)
                .view(np.uint64)
            )
            for peer in names:
                if peer != me:
                    mask = masking.mask_stream(secrets[frozenset((me, peer))], key, fixed.size)
                    fixed = fixed + mask if me < peer else fixed - mask
            masked[key] = torch.from_numpy(fixed.view(np.int64)).reshape(value.shape)
        out[me] = masked
    return out


def test_the_attackers_subset_difference_recovers_a_model_from_masked_sums():
    """What fedperl_subset_difference does with the old protocol's answers:
    the sum over {a, b, c} less the sum over {a, b} (fresh masks) is c's model,
    to the fixed-point step; a single masked contribution is nowhere near it."""
    torch.manual_seed(0)
    models = {n: {"w": torch.randn(5, 3), "b": torch.randn(3)} for n in ("a", "b", "c")}
    pairs = [frozenset(p) for p in (("a", "b"), ("a", "c"), ("b", "c"))]
    full = _masked(models, {p: os.urandom(32) for p in pairs})
    rest = _masked({n: models[n] for n in ("a", "b")}, {p: os.urandom(32) for p in pairs})
    total_full: dict = {}
    total_rest: dict = {}
    for masked in full.values():
        attacks.add_masked(total_full, masked)
    for masked in rest.values():
        attacks.add_masked(total_rest, masked)
    s_full, s_rest = attacks.masked_total(total_full), attacks.masked_total(total_rest)
    assert (s_full.weight, s_rest.weight) == (3.0, 2.0)
    recovered = attacks.combination([(1, s_full), (-1, s_rest)])
    assert set(recovered) == {"w", "b"}
    for key, value in models["c"].items():
        gap = abs(recovered[key] - value.double().numpy().reshape(-1)).max()
        assert gap <= 2.0 ** -(attacks.FIXED_POINT_BITS - 1), (key, gap)
    alone = attacks.fixed_to_float(full["c"]["w"].numpy().reshape(-1).view(np.uint64))
    assert abs(alone - models["c"]["w"].double().numpy().reshape(-1)).max() > 1e3


def test_list_names_every_scenario(capsys):
    assert attacks.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(attacks.SCENARIOS)
    assert set(group for _, group in attacks.SCENARIOS.values()) == set(attacks.GROUPS)


@pytest.mark.slow
def test_two_cheap_scenarios_against_real_daemons_report_verdicts_their_evidence_supports(
    tmp_path,
):
    """Two daemons with wire.encryption on; a raw roster member sends a frame of
    another federation and unencrypted inputs. Whatever the code under test
    does, each verdict must follow from the evidence it records, and the last
    stdout line is the result object."""
    out = tmp_path / "attacks"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.attacks",
            "--scenarios",
            "wrong_federation,unencrypted_injection",
            "--out",
            str(out),
            "--timeout",
            "240",
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"attacks", "all_defended"}
    found = result["attacks"]
    assert set(found) == {"wrong_federation", "unencrypted_injection"}
    assert all(
        e["outcome"] in attacks.OUTCOMES and not e.get("inconclusive") for e in found.values()
    )
    assert result["all_defended"] == all(e["outcome"] != "succeeded" for e in found.values())
    assert json.loads((out / "results.json").read_text())["attacks"] == found

    # An earlier defence: refused, with the 403 and the victim's counter to show for it.
    wrong = found["wrong_federation"]
    assert wrong["outcome"] == "refused", wrong
    assert wrong["input"]["status"] == 403 and wrong["input"]["counted"] == {"wrong_federation": 1}

    # Hole 2: the victim took every encrypted control input; each unencrypted one
    # is either refused with a reason it counted, or it got through.
    inj = found["unencrypted_injection"]
    assert {r["status"] for r in inj["encrypted_control"].values()} == {200}
    rows = inj["unencrypted"]
    assert set(rows) == {"push", "request", "heartbeat"}
    for label, row in rows.items():
        if row["outcome"] == "refused":
            assert row["status"] >= 400 and row["counted"].get(row["reason"], 0) >= 1, (label, row)
        else:
            assert row["status"] == 200 or row["reason"] in attacks.NOT_A_DEFENCE, (label, row)
    expected = "refused" if all(r["outcome"] == "refused" for r in rows.values()) else "succeeded"
    assert inj["outcome"] == expected
    print(json.dumps({n: e["outcome"] for n, e in found.items()}))


def test_the_review_scenarios_are_registered_with_issue_28_holes():
    from bench import attacks_review

    for name, (hole, group) in attacks_review.SCENARIOS.items():
        assert attacks.SCENARIOS[name] == (hole, group) and hole.startswith("28.")
        assert attacks.GROUPS[group] is attacks_review.GROUPS[group]


def test_the_decode_bomb_and_the_huge_round_pass_the_header_checks(tmp_path):
    """The bench's hand-made frames are what the victim verifies: correctly
    signed headers (so the hole is reached), the bomb within max_message_bytes."""
    from bench import attacks_review
    from node.provision import provision
    from p2pfl.secure.identity import LocalIdentity, Roster
    from p2pfl.secure.wire import PREFIX_LEN, SIG_LEN, WireCodec

    fed = tmp_path / "fed"
    protocol = {"name": "probe", "rounds": 1}
    provision(fed, ["v", "m"], protocol=protocol, federation=attacks_review.FEDERATION)
    m = attacks.RawPeer(fed, "m", {}, federation=attacks_review.FEDERATION)
    keys = fed / "v" / "state" / "keys"
    v = WireCodec(
        LocalIdentity.load("v", keys / "v.sign.pem", keys / "v.kex.pem"),
        Roster.load(fed / "roster.yaml"),
        attacks_review.FEDERATION,
        max_message_bytes=attacks_review.MAX_MESSAGE,
    )
    frame, msg_id = attacks_review.raw_frame(m, "heartbeat", "v", b"\x90" * 1000)
    n = v.header_length(frame[:PREFIX_LEN])
    header = v.verify_header(
        frame[PREFIX_LEN : PREFIX_LEN + n],
        frame[PREFIX_LEN + n : PREFIX_LEN + n + SIG_LEN],
        total_len=len(frame),
    )
    assert header.id_hex == msg_id and header.payload_len == 1000
    big, _ = attacks_review.raw_frame(m, "probe", "v", b"x", round=2**63, encrypt=True)
    assert len(big) < attacks_review.MAX_MESSAGE


@pytest.mark.slow
def test_two_cheap_review_scenarios_report_verdicts_their_evidence_supports(tmp_path):
    """One probe daemon; a rebound status request and a round-2**63 frame.
    Whatever the code under test does, each verdict follows from its evidence."""
    out = tmp_path / "attacks"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.attacks",
            "--scenarios",
            "status_rebinding,huge_round_header",
            "--out",
            str(out),
            "--timeout",
            "120",
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])["attacks"]
    assert set(found) == {"status_rebinding", "huge_round_header"}
    assert all(not e.get("inconclusive") for e in found.values()), found

    rebind = found["status_rebinding"]
    assert rebind["control_status"] == 200
    codes = rebind["rebound"].values()
    refused = all(c in (400, 401, 403, 421) for c in codes)
    assert rebind["outcome"] == ("refused" if refused else "succeeded"), rebind

    huge = found["huge_round_header"]
    row = huge["input"]
    if huge["outcome"] == "refused":
        assert 400 <= row["status"] < 500 and row["counted"].get(row["reason"], 0) >= 1, huge
    else:
        assert huge["outcome"] == "succeeded" and (
            row["status"] == 200 or row["status"] >= 500 or not row["counted"]
        ), huge
    print(json.dumps({n: e["outcome"] for n, e in found.items()}))
