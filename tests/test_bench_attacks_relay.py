"""Issue 31's attack scenarios (bench/attacks/relay.py) and `bench.transport
--via-relay`, against real processes on loopback: a relay process, two
`p2pfl-node` daemons of which one is outbound-only, a malicious relay in the
bench process. Each verdict must be a defence, and follow from the relay's or
the receiver's own answers and counters that it reports."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
from bench_main import last_json

from bench import attacks
from bench.attacks.relay import P99_FACTOR, p99

ROOT = Path(__file__).resolve().parents[1]
CHEAP = ["relay_unknown_client", "relay_identity_claim", "relay_plaintext", "relay_altered_message"]


def run_attacks(names: list[str], out: Path) -> dict[str, dict[str, Any]]:
    """`python -m bench.attacks --scenarios NAMES --out OUT --timeout 240`, run in
    this process (`run_bench` is what the command calls): the relay, the sites
    and the flooder are still processes of their own, and the bench's import
    (4 s before the flood scenario could start) is already paid."""
    result = attacks.run_bench(attacks.Options(out=out.resolve(), timeout_s=240.0), names)
    found = result["attacks"]
    assert set(found) == set(names)
    assert result["all_defended"] == all(e["outcome"] != "succeeded" for e in found.values())
    print(json.dumps({n: (e["outcome"], e["why"]) for n, e in found.items()}))
    return found


def test_the_relay_scenarios_are_registered_with_issue_31():
    for name in [*CHEAP, "relay_flood"]:
        assert attacks.SCENARIOS[name] == ("31", "relay")
    assert "relay" in attacks.GROUPS


def test_p99_is_the_sample_at_the_99th_percentile():
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([5.0]) == 5.0
    assert p99([3.0, 1.0, 2.0]) == 3.0


@pytest.mark.slow
def test_the_relay_refuses_strangers_impostors_and_plaintext_and_the_receiver_an_altered_frame(
    tmp_path,
):
    found = run_attacks(CHEAP, tmp_path / "attacks")
    for name, entry in found.items():
        assert entry["outcome"] == "refused" and not entry.get("inconclusive"), (name, entry)

    # A client on no roster: its WebSocket refused at the handshake, its frame at
    # the relay's door; each reason counted once by the relay.
    unknown = found["relay_unknown_client"]
    assert unknown["connect"]["answer"] == {"type": "refused", "reason": "unknown_site"}
    assert unknown["connect"]["counted"] == 1
    assert unknown["post"] == {
        "status": 403,
        "reason": "unknown_sender",
        "counted": 1,
        "outcome": "refused",
    }

    # m claims c: refused by signature, and c's own connection is the one it was.
    claim = found["relay_identity_claim"]
    assert claim["answer"] == {"type": "refused", "reason": "bad_signature"}
    assert claim["counted"] == 1
    assert claim["relay_sees_c"]["before"] == claim["relay_sees_c"]["after"]
    assert claim["relay_sees_c"]["after"]["connected"] is True
    assert claim["c_tunnel"]["after"] == {"connected": True, "connects": 1}

    # Plaintext through the relay: 403, counted, nothing of m's forwarded; the
    # encrypted control on the same path was carried.
    plain = found["relay_plaintext"]
    assert plain["control"]["status"] == 200
    assert plain["plaintext"]["status"] == 403
    assert plain["plaintext"]["reason"] == "encryption_required"
    assert plain["plaintext"]["counted"] == 1
    assert plain["forwarded_from_m"] == 0 and plain["c_rejections_from_m"] == 0

    # A relay flipping one payload byte: the receiver's digest check refuses and
    # counts it, and the untouched frame (same id) is taken afterwards, so the
    # altered copy was never processed.
    alt = found["relay_altered_message"]
    assert alt["flipped_by_r2"] == 1
    assert alt["altered"] == {"status": 400, "reason": "digest_mismatch", "counted_by_c": 1}
    assert alt["original_through_r1"]["status"] == 200


@pytest.mark.slow
@pytest.mark.exclusive  # compares latencies under a flood with unloaded ones: run alone
def test_one_site_flooding_the_relay_is_bounded_and_judged_by_its_figures(tmp_path):
    """Every relayed heartbeat of the other sites is answered under the flood,
    the flood is held to the sender's rate at the relay's door (its frames wait
    their turn, node/relay_admission.py), and the verdict follows the figures.
    Whether the p99 stays within 2x is the benchmark's figure, not a test
    bound: on this 2-core machine, shared by the flooder, the relay, the sites
    and other work, it varies from run to run (docs/benchmarks.md)."""
    flood = run_attacks(["relay_flood"], tmp_path / "attacks")["relay_flood"]
    assert gc.get_freeze_count() == 0  # the harness froze its heap only while it measured
    assert not flood.get("inconclusive"), flood
    assert flood["flood"]["sent"] >= 100 and flood["heartbeats"]["flooded"] >= 10
    assert flood["heartbeats_failed"]["loaded"] == []
    # the flood is bounded: past its burst the flooder's frames waited for its rate
    # at r1 (200 frames/s, a burst of 50: the provisioned relay.yaml), never beyond it
    assert flood["relay_delayed_from_m"] > 0, flood
    assert flood["relay_forwarded_from_m"] <= 50 + 200 * flood["flood"]["seconds"] + 1, flood
    assert set(flood["relay_refusals"]) <= {"rate_limited", "too_many_connections"}, flood
    # the verdict is the figures': neutralised exactly when the p99 stayed in the bound
    within = flood["flooded_p99_ms"] <= P99_FACTOR * flood["unloaded_p99_ms"] + 0.01
    assert flood["outcome"] == ("neutralised" if within else "succeeded")


@pytest.mark.slow
def test_transport_via_relay_reports_direct_and_relayed_throughput_and_latency(capsys):
    out = last_json(
        capsys,
        ["bench.transport", "--via-relay", "--mb", "2", "--repeats", "2", "--heartbeats", "20"],
    )
    assert out["payload_mb"] == 2.0 and out["repeats"] == 2 and out["encrypted"] is True
    assert out["direct_mb_s"] > 0 and out["relayed_mb_s"] > 0
    assert out["relayed_over_direct"] > 0
    for path in ("direct", "relayed"):
        assert 0 < out[f"heartbeat_{path}_p50_ms"] <= out[f"heartbeat_{path}_p99_ms"]
    # every pushed byte went through the relay: 2 MB payloads, 2 repeats (and heartbeats)
    assert out["relay_forwarded_bytes"] >= 2 * 2_000_000
    assert out["relay_forwarded_messages"] >= 2
    assert {"target_ratio", "relayed_extra_hops_p50"} <= set(out)
