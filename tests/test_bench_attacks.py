"""The attack bench (bench/attacks/): the `inflated_count` fault, its registry,
its hand-made frames, and cheap runs against real daemons whose verdicts must
agree with the evidence they report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from bench_main import last_json

from bench import attacks
from node.faults import CYCLE_MODES, FaultPlan

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


def test_a_claimed_dropout_peels_the_pair_masks_and_leaves_the_self_mask():
    """What fedperl_subset_difference's `claimed_dropout` does with the mask key
    the others reveal, against secure aggregation's own masking: a masked
    input built by protocols/secagg_primitives.py (pair seeds derived from the
    partners' side), peeled of its pair masks, is the weighted model plus the
    self mask; only the self-mask seed (which the lie does not get) removes
    the rest, to the fixed-point step."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from bench.attacks.requester import peel_pair_masks
    from protocols.masking import FIXED_POINT_BITS, WEIGHT_KEY, from_fixed, mask_stream, ring_of
    from protocols.secagg_primitives import mask_seed, masked_input

    torch.manual_seed(0)
    names = ["a", "b", "d", "e"]
    keys = {n: X25519PrivateKey.generate() for n in names}
    public = {n: k.public_key().public_bytes_raw() for n, k in keys.items()}
    context, self_seed, weight = b"session", os.urandom(32), 3.0
    state = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    pair_seeds = {u: mask_seed(keys[u], public["d"], context, u, "d") for u in names if u != "d"}
    masked = masked_input(state, weight, me="d", self_seed=self_seed, pair_seeds=pair_seeds)
    private_d = keys["d"].private_bytes_raw()
    peeled = peel_pair_masks(masked, "d", private_d, public, names, context)
    assert set(peeled) == {"w", "b"} and WEIGHT_KEY in masked
    for key, value in state.items():
        truth = (value.double() * weight).numpy().reshape(-1)
        assert abs(peeled[key] - truth).max() > 10  # the self mask (+-2^11) is still on
        fixed = ring_of(masked[key])
        for u, seed in pair_seeds.items():
            mask = mask_stream(seed, key, fixed.size)
            fixed = fixed - mask if u > "d" else fixed + mask
        assert (peeled[key] == from_fixed(fixed)).all()  # exactly the pair masks removed
        unmasked = from_fixed(fixed - mask_stream(self_seed, key, fixed.size))
        assert abs(unmasked - truth).max() <= 2.0 ** -(FIXED_POINT_BITS - 1), key


def test_list_names_every_scenario(capsys):
    assert attacks.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(attacks.SCENARIOS)
    assert set(group for _, group in attacks.SCENARIOS.values()) == set(attacks.GROUPS)


@pytest.mark.slow
def test_two_cheap_scenarios_against_real_daemons_report_verdicts_their_evidence_supports(
    tmp_path, capsys
):
    """Two daemons with wire.encryption on; a raw roster member sends a frame of
    another federation and unencrypted inputs. Whatever the code under test
    does, each verdict must follow from the evidence it records, and the last
    stdout line is the result object."""
    out = tmp_path / "attacks"
    result = last_json(
        capsys,
        ["bench.attacks", "--scenarios", "wrong_federation,unencrypted_injection"]
        + ["--out", str(out), "--timeout", "240"],
    )
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
    control = inj["encrypted_control"]
    # FedAVGP2P reads no pushes: the encrypted push passes the encryption check
    # and is refused for its kind (node/inbound.py push_not_accepted)
    assert control["push"] == {"status": 404, "reason": "push_not_accepted"}
    assert {control["request"]["status"], control["heartbeat"]["status"]} == {200}
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
    from bench.attacks import review, secagg

    for module in (review, secagg):
        for name, (hole, group) in module.SCENARIOS.items():
            assert attacks.SCENARIOS[name] == (hole, group) and hole.startswith("28.")
            assert attacks.GROUPS[group] is module.GROUPS[group]


def test_the_decode_bomb_and_the_huge_round_pass_the_header_checks(tmp_path):
    """The bench's hand-made frames are what the victim verifies: correctly
    signed headers (so the hole is reached), the bomb within max_message_bytes."""
    from bench.attacks import review
    from bench.attacks.victim import MAX_MESSAGE, raw_frame
    from node.provision import provision
    from p2pfl.secure.identity import LocalIdentity, Roster
    from p2pfl.secure.wire import PREFIX_LEN, SIG_LEN, WireCodec

    fed = tmp_path / "fed"
    protocol = {"name": "probe", "rounds": 1}
    provision(fed, ["v", "m"], protocol=protocol, federation=review.FEDERATION)
    m = attacks.RawPeer(fed, "m", {}, federation=review.FEDERATION)
    keys = fed / "v" / "state" / "keys"
    v = WireCodec(
        LocalIdentity.load("v", keys / "v.sign.pem", keys / "v.kex.pem"),
        Roster.load(fed / "roster.yaml"),
        review.FEDERATION,
        max_message_bytes=MAX_MESSAGE,
    )
    frame, msg_id = raw_frame(m, "heartbeat", "v", b"\x90" * 1000)
    n = v.header_length(frame[:PREFIX_LEN])
    header = v.verify_header(
        frame[PREFIX_LEN : PREFIX_LEN + n],
        frame[PREFIX_LEN + n : PREFIX_LEN + n + SIG_LEN],
        total_len=len(frame),
    )
    assert header.id_hex == msg_id and header.payload_len == 1000
    big, _ = raw_frame(m, "probe", "v", b"x", round_no=2**63, encrypt=True)
    assert len(big) < MAX_MESSAGE


@pytest.mark.slow
def test_two_cheap_review_scenarios_report_verdicts_their_evidence_supports(tmp_path, capsys):
    """One probe daemon; a rebound status request and a round-2**63 frame.
    Whatever the code under test does, each verdict follows from its evidence."""
    out = tmp_path / "attacks"
    found = last_json(
        capsys,
        ["bench.attacks", "--scenarios", "status_rebinding,huge_round_header"]
        + ["--out", str(out), "--timeout", "120"],
    )["attacks"]
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


def test_a_junk_share_index_leaves_the_requesters_sum_correct_to_the_ring_step():
    """secagg_bad_share_index against the real Contributors and requester: a
    holder revealing a negative index, then junk under index 1, is counted and
    skipped, and both sums come out right. Its tolerance was the 32-bit ring's
    step only when the session's weight unit is 1: before the scenario set it,
    the unbounded default W made every honest sum 'wrong' (1.3e-4 off), and the
    bench reported a hole that was not there."""
    from bench.attacks.secagg import bad_share_index

    found = bad_share_index()
    assert found["outcome"] == "refused", found
    assert {row["sum"] for row in found["sums"].values()} == {"correct"}
    assert "secagg_bad_share" in found["counted_against_liar"]


@pytest.mark.slow
def test_the_scenarios_that_drive_the_real_requester_or_restart_a_victim_are_conclusive(
    tmp_path, capsys
):
    """The attacker's WireContext plays the part of a RoundContext that
    secure_sum uses, and the replay scenario's victim reads no pushes of the
    kind it serves: both drifted from the code they attack (a renamed keyword,
    a new `sample_caps`, pushes of served kinds refused) and reported a hole as
    'harness error' or 'did not take the legitimate frames'. Each must now
    reach a verdict its evidence supports."""
    out = tmp_path / "attacks"
    result = last_json(
        capsys,
        ["bench.attacks", "--scenarios", "fedperl_subset_difference,replay_after_restart"]
        + ["--out", str(out), "--timeout", "240"],
    )
    found = result["attacks"]
    assert set(found) == {"fedperl_subset_difference", "replay_after_restart"}
    for name, entry in found.items():
        assert not entry.get("inconclusive"), (name, entry)
        assert entry["outcome"] in ("refused", "neutralised"), (name, entry)
    replay = found["replay_after_restart"]
    assert replay["push_not_read_by_victim"] is True
    assert {row["outcome"] for row in replay["resent_after_restart"].values()} == {"refused"}
    subsets = found["fedperl_subset_difference"]
    assert subsets["outcome"] == "neutralised", subsets  # the claimed dropout leaves noise
