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
| nan_wait | 28.3 | 1 FedAVGP2P daemon after its round (bench/attacks/review.py) | a signed request with `_wait_s: NaN`; /healthz must answer within 1 s |
| held_request_flood | 28.held | the same | 300 held requests from one member (100/s); a per-peer cap, /healthz, descriptors |
| response_bomb | 28.5 | 1 probe daemon, max_message_bytes 4 MiB, + a fake peer at a roster address | 64 MiB answers to its heartbeats; RSS growth < 2 x max_message_bytes |
| unbounded_kinds | 28.6 | the same, inbox_size 4 | 50 pushes of 50 unregistered kinds; none spooled, none re-queued after a restart |
| decode_bomb | 28.7 | the same | a 1 MiB heartbeat of ~1M empty arrays; RSS < 2 x max_message_bytes, /healthz p99 < 100 ms |
| concurrent_replay | 28.8 | the same | 3 copies of one push, every header before any payload; processed once |
| status_rebinding | 28.9 | the same | /status, /peers, /metrics with `Host: rebind.attacker.example` |
| huge_round_header | 28.10 | the same | an encrypted push whose header says round 2**63 |
| stale_feder_relay | 28.feder | 1 FedER daemon + a raw ring member | a relay of round 0 taken in round 1 |
| secagg_u2_split | 28.1 | real Contributors in one process (bench/attacks/secagg.py) | the victim told U2 = {a, b}, the others the full U2, then that b dropped |
| secagg_session_reuse | 28.2 | the same | one session id and range twice, the victim said to have dropped the second time |
| secagg_story_search | 28.1/2 | the same | hypothesis: any U1..U4 per contributor, thresholds, ids, ranges (bench/secagg_adversary.py) |
| secagg_bad_share_index | 28.4 | 9 Contributors + a requester in memory | one reveals a negative index, then junk under index 1 |
| relay_unknown_client | 31 | probe daemons a, c (c outbound-only via r1, r2), relay process r1 (bench/attacks/relay.py) | a key pair on no roster opens r1's WebSocket, then POSTs a frame through it |
| relay_identity_claim | 31 | the same | roster member m fetches r1's challenge and claims to be c on the upgrade, signed with its own key; c must stay connected |
| relay_altered_message | 31 | the same; r2 a malicious relay in the bench process | r2 flips one payload byte of an encrypted heartbeat to c; c must refuse it (digest_mismatch) |
| relay_plaintext | 31 | the same | a signed heartbeat in the clear through r1 to c (403 encryption_required; c never sees it) |
| relay_flood | 31 | the same | m floods r1 (4000 frames, 8 s at most, 16 connections); h's relayed heartbeat p99 within 2x unloaded |

Attackers: a compromised roster member is either a raw client (bench/peer.py
`RawPeer`: a `WireCodec` with that member's own keys from the harness's state
dir, plain HTTP POSTs to the victim's peer port; for hole 1 it runs the real
secure-aggregation requester, bench/attacks/requester.py) or a real daemon
with a fault plan (node/faults.py `poison`), as bench/robustness.py does. A network observer's
capture is simulated by building the frame exactly as the legitimate peer's
daemon would (its keys, the victim's encryption setting) and recording the
bytes before delivering them.

Data: the embedded scikit-learn digits at 16 x 16, small CNN, a few rounds;
every federation is bounded by `--timeout` and stopped (SIGTERM, then SIGKILL)
whatever happens. Progress goes to stderr; DIR/results.json keeps every
scenario's evidence; the last stdout line is one JSON object
`{"attacks": {NAME: {"outcome": ..., ...}}, "all_defended": BOOL}`.

The package: `kit` (options, verdicts, counters, the registry), `federations`
(small daemon federations), `victim` (a watched victim, raw frames), the
scenarios by federation (`wire`, `fedperl` with `requester`, `poisoning`,
`review` with `review_load`, `secagg`, `relay` with `relay_flood`) and `runner` (the registry's
order, `run_bench`, the command line).
"""

from __future__ import annotations

from bench.attacks.kit import (
    GROUPS,
    NOT_A_DEFENCE,
    OUTCOMES,
    SCENARIOS,
    TINY_GAN,
    Options,
)
from bench.attacks.runner import build_parser, main, run_bench
from bench.peer import RawPeer

__all__ = [
    "GROUPS",
    "NOT_A_DEFENCE",
    "OUTCOMES",
    "SCENARIOS",
    "TINY_GAN",
    "Options",
    "RawPeer",
    "build_parser",
    "main",
    "run_bench",
]
