"""The attack bench (bench/attacks.py): its attacker's arithmetic against the real
masking, the `inflated_count` fault, and one cheap run against real daemons
whose verdicts must agree with the evidence they report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import attacks
from node.faults import CYCLE_MODES, FaultPlan
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec
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


def _contributions(
    states: dict[str, dict[str, torch.Tensor]], codecs: dict[str, WireCodec], request_id: str
) -> dict[str, dict[str, torch.Tensor]]:
    """Each contributor's masked contribution to one request over `states`' keys,
    with the pair secrets the daemons derive (node/context.py pair_secret)."""
    names = sorted(states)
    context = masking.request_context("m", request_id, 2)
    out = {}
    for me in names:
        secrets = {
            p: masking.pair_secret_from_shared(codecs[me].shared_secret(p), me, p, context)
            for p in names
            if p != me
        }
        out[me] = masking.masked_contribution(
            states[me], me=me, contributors=names, secrets=secrets
        )
    return out


def test_the_attackers_subset_difference_recovers_a_model_from_real_masked_sums():
    """What fedperl_subset_difference does with the contributors' answers, on
    contributions masked by protocols/masking.py: the sum over {a, b, c} less
    the sum over {a, b} (fresh masks) is c's model, to the fixed-point step;
    one sum alone reveals nothing close to it."""
    torch.manual_seed(0)
    ids = {n: LocalIdentity.generate(n) for n in ("a", "b", "c", "m")}
    roster = Roster([i.card("127.0.0.1:1") for i in ids.values()])
    codecs = {n: WireCodec(i, roster, "f") for n, i in ids.items()}
    models = {n: {"w": torch.randn(5, 3), "b": torch.randn(3)} for n in ("a", "b", "c")}
    full = _contributions(models, codecs, "1" * 32)
    rest = _contributions({n: models[n] for n in ("a", "b")}, codecs, "2" * 32)
    total_full: dict = {}
    total_rest: dict = {}
    for masked in full.values():
        attacks.add_masked(total_full, masked)
    for masked in rest.values():
        attacks.add_masked(total_rest, masked)
    recovered = attacks.difference(total_full, total_rest)
    assert set(recovered) == {"w", "b"}
    for key, value in models["c"].items():
        gap = abs(recovered[key] - value.double().numpy().reshape(-1)).max()
        assert gap <= 2.0 ** -(attacks.FIXED_POINT_BITS - 1), (key, gap)
    # A single contribution is masked: nowhere near c's model.
    alone = attacks.fixed_to_float(full["c"]["w"].numpy().reshape(-1).view(attacks.np.uint64))
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
