"""The reference job across real network namespaces (issue 31, item 6): every
site reachable versus two sites behind a relay, in one run.

    python -m bench.network --data ../shared/data/pneumoniamnist.npz --seeds 0,1,2 \\
        --rounds 10 --nodes 5 --behind 2 --out runs/i31/net
    python -m bench.network ... --kill-relay-at 5 --restart-after 10     # relay SIGKILL drill
    python -m bench.network ... --relays 2 --kill-relay-at 5 --kill-for-good
    python -m bench.network --smoke --out /tmp/net                       # digits, 3 sites, 1 behind

Each site and each relay is a real process (`p2pfl-node`, `p2pfl-node relay`)
in its own Linux network namespace on a private bridge (bench/netns.py:
root, `ip netns`; nothing is made in the root namespace, and everything is
deleted at the end, also on failure). FedAVGP2P with `secure_aggregation:
true` (so `wire.encryption: true`), the data set split `dirichlet:0.5` once
per seed, the same split, steps and seed in both arms:
- `reachable`: every site listens on its namespace address; the relay runs
  but nobody is behind it (so both arms run the same processes);
- `behind`: the last `--behind` sites are outbound-only (`address: null`,
  `via:` every relay, listening on their own namespace's 127.0.0.1), reached
  only through the relay(s).
The arms' order alternates with the seed. The drill (`--kill-relay-at R`)
applies to the `behind` arm: the first relay runs with a fault plan
(node/faults.py, `P2PFL_FAULTS`) that SIGKILLs it as it is about to carry the
first frame of round R or later; the bench sees it die and starts it again
`--restart-after` s later (or never, with `--kill-for-good`, where
`--relays 2` leaves the other one to fail over to). The restarted relay reads
the same plan and does not fire again (`.fired`).

Reported per arm per seed: the mean final macro-F1 of the sites, whether every
node completed every round, bytes through the relay(s) (their /status
`forwarded` counters, summed over a killed relay's lives: polled every second,
and for a life its fault plan ended, the counters it wrote as it died), the wall
time, and the drill's counts as tests/test_faults.py counts them from each
site's last checkpoint ledger: rounds lost (a round some site never
committed) and models processed twice (a round committed twice, or a peer's
model merged twice in one round). Per seed the gap behind - reachable in
macro-F1 points, and its mean; the issue's target is |mean gap| <= 0.5.
Progress lines on stderr; OUT/results.json; the last stdout line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from bench.bandwidth import mean, rounded, seed_list
from bench.federation.outcome import bench_row
from bench.federation.processes import RoundWatcher, poll_node
from bench.federation.specs import RunSpec, node_overrides, partition, protocol_section, site_names
from bench.federation.stats import per_node_final
from bench.localfed import NodeProcess
from bench.netns import Netns, netns_available, processes
from node.metricslog import read_metrics
from node.provision import provision
from node.queues import Checkpoints
from p2pfl.files import atomic_write_text

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared/data/pneumoniamnist.npz"
ARMS = ("reachable", "behind")
F1_TARGET_POINTS = 0.5
RELAY_POLL_S = 1.0


def report(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.network",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", default=str(DEFAULT_DATA), help="'digits' or a MedMNIST .npz")
    p.add_argument("--out", type=Path, default=Path("runs/network"))
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--behind", type=int, default=2, help="outbound-only sites (the last ones)")
    p.add_argument("--relays", type=int, default=1)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seeds", type=seed_list, default=[0, 1, 2])
    p.add_argument("--partition", default="dirichlet:0.5")
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--steps-per-round", type=int, default=None, help="default: one epoch")
    p.add_argument("--rate-mbit", type=float, default=None, help="tc tbf rate of every link")
    p.add_argument("--kill-relay-at", type=int, default=None, help="SIGKILL relay r1 at round R")
    p.add_argument("--restart-after", type=float, default=10.0, help="seconds until restart")
    p.add_argument("--kill-for-good", action="store_true", help="never restart the killed relay")
    p.add_argument("--timeout", type=float, default=1800.0, help="per arm, seconds")
    p.add_argument("--smoke", action="store_true", help="digits, 3 sites, 1 behind, 2 rounds")
    args = p.parse_args(argv)
    args.image_size, args.augment = 28, "weak"
    if args.smoke:
        args.data, args.nodes, args.behind, args.rounds, args.seeds = "digits", 3, 1, 2, [0]
        args.steps_per_round, args.image_size, args.augment = 5, 8, "none"
        args.fraction, args.timeout = 1.0, min(args.timeout, 300.0)
    if args.nodes < 3 or not 1 <= args.behind < args.nodes or args.relays < 1 or args.rounds < 1:
        p.error("give at least 3 sites, 1 to nodes-1 behind, one relay and one round")
    if args.kill_for_good and args.relays < 2:
        p.error("--kill-for-good needs --relays 2 (the behind sites fail over to the other)")
    return args


def base_spec(args: argparse.Namespace, seed: int) -> RunSpec:
    return RunSpec(
        nodes=args.nodes,
        protocol="fedavgp2p",
        fraction=args.fraction,
        rounds=args.rounds,
        data=args.data,
        partition=args.partition,
        seed=seed,
        steps_per_round=args.steps_per_round,
        image_size=args.image_size,
        augment=args.augment,
        timeout_s=args.timeout,
        protocol_options=(("secure_aggregation", True),),
    )


class RelayBytes:
    """The relays' forwarded counters, summed over each relay's lives (a
    restarted relay starts from zero)."""

    def __init__(self) -> None:
        self.done: dict[str, dict[str, int]] = {}  # counters of lives that ended
        self.live: dict[str, dict[str, int]] = {}  # last polled, this life

    def poll(self, name: str, relay: NodeProcess) -> None:
        status = relay.status()
        if status is not None:
            fw = status.get("forwarded") or {}
            self.live[name] = {k: int(fw.get(k, 0)) for k in ("messages", "bytes", "reply_bytes")}
            self.live[name]["refused"] = sum((status.get("refusals") or {}).values())

    def life_ended(self, name: str, at_death: dict[str, Any] | None = None) -> None:
        """A relay's life is over: its last polled counters, or those it wrote
        in its fault plan's kill event as it died (exact: a poll is up to
        RELAY_POLL_S old)."""
        ended = self.live.pop(name, {})
        if at_death is not None:
            fw = at_death.get("forwarded") or {}
            ended = {k: int(fw.get(k, 0)) for k in ("messages", "bytes", "reply_bytes")}
            ended["refused"] = int(at_death.get("refusals", 0))
        total = self.done.setdefault(name, {})
        for k, v in ended.items():
            total[k] = total.get(k, 0) + v

    def totals(self) -> dict[str, Any]:
        """messages/bytes forwarded to the sites behind, reply_bytes of their
        answers (pulled models), bytes_total both, refused: every refusal."""
        out: dict[str, Any] = dict.fromkeys(("messages", "bytes", "reply_bytes", "refused"), 0)
        for counters in [*self.done.values(), *self.live.values()]:
            for k, v in counters.items():
                out[k] = out.get(k, 0) + v
        out["bytes_total"] = out["bytes"] + out["reply_bytes"]
        out["bytes_total_per_relay"] = {
            name: sum(c.get("bytes", 0) + c.get("reply_bytes", 0) for c in lives)
            for name, lives in self._lives().items()
        }
        return out

    def _lives(self) -> dict[str, list[dict[str, int]]]:
        lives: dict[str, list[dict[str, int]]] = {}
        for source in (self.done, self.live):
            for name, counters in source.items():
                lives.setdefault(name, []).append(counters)
        return lives


def ledger_counts(run_dir: Path, names: Sequence[str], rounds: int) -> dict[str, int]:
    """Rounds lost and models processed twice, from each site's last checkpoint
    ledger (tests/test_faults.py's count); and the rounds a site merged no
    peer's model at all (it went on alone: what an outage costs)."""
    lost = twice = merged = alone = 0
    for name in names:
        saved = Checkpoints(run_dir / name / "state" / "checkpoints").latest()
        entries = ((saved or {}).get("protocol") or {}).get("merged") or []
        committed = [r for r, _ in entries]
        lost += len(set(range(1, rounds + 1)) - set(committed))
        twice += len(committed) - len(set(committed))
        for _, models in entries:
            peers = [p for p, _ in models]
            twice += len(peers) - len(set(peers))
            merged += len(models)
            alone += not models
    return {
        "rounds_lost": lost,
        "processed_twice": twice,
        "models_merged": merged,
        "rounds_merged_alone": alone,
    }


def fault_kills(plan: Path) -> list[dict[str, Any]]:
    """The kill events a fault plan's process wrote (node/faults.py)."""
    events = plan.with_name(plan.name + ".events.jsonl")
    if not events.exists():
        return []
    rows = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("event") == "kill"]


def run_arm(
    args: argparse.Namespace,
    spec: RunSpec,
    run_dir: Path,
    sources: Sequence[Path],
    behind: Sequence[str],
    drill: bool,
) -> dict[str, Any]:
    names = site_names(spec.nodes)
    relays = [f"r{i + 1}" for i in range(args.relays)]
    bytes_ = RelayBytes()
    kills: list[dict[str, Any]] = []
    failure: str | None = None
    started = time.perf_counter()
    with Netns([*names, *relays], rate_mbit=args.rate_mbit) as net:
        plans = provision(
            run_dir,
            names,
            protocol=protocol_section(spec),
            data_sources=[str(s.resolve()) for s in sources],
            federation="bench-network",
            seed=spec.seed,
            overrides=node_overrides(spec),
            relays=relays,
            behind=set(behind),
            hosts={m: net.address(m) for m in [*names, *relays]},
        )
        faults = run_dir / "r1_faults.json"
        if drill:  # r1 kills itself by its fault plan (node/faults.py, phase `forward`)
            plan = {"kill": [{"id": "r1-drill", "round": args.kill_relay_at, "phase": "forward"}]}
            faults.write_text(json.dumps(plan))
        procs = processes(
            net,
            [*plans.relays, *plans],
            run_dir / "logs",
            node_env={"r1": {"P2PFL_FAULTS": str(faults)}} if drill else None,
        )
        sites = {n: procs[n] for n in names}
        watcher = RoundWatcher(spec.rounds, report)
        try:
            for r in relays:
                procs[r].start()
            for r in relays:
                procs[r].wait_for(lambda s: True, 60, "relay status")
            for n in names:
                sites[n].start()
            deadline = started + spec.timeout_s
            next_relay_poll = 0.0
            restart_at: float | None = None
            while time.perf_counter() < deadline and any(s.running for s in sites.values()):
                for name, node in sites.items():
                    reason = poll_node(node, None, {name: 0.0}, watcher)
                    if reason is not None:
                        failure = f"{name}: {reason}"
                if failure:
                    break
                now = time.perf_counter()
                if now >= next_relay_poll:
                    next_relay_poll = now + RELAY_POLL_S
                    for r in relays:
                        if procs[r].running:
                            bytes_.poll(r, procs[r])
                if drill and not kills and not procs["r1"].running:
                    fired = fault_kills(faults)
                    reached = max(watcher.last_round.values(), default=0)
                    report(
                        f"[{watcher.elapsed():7.1f}s] drill: relay r1 SIGKILLed by its fault "
                        f"plan: {fired or 'no kill event (it died otherwise)'}"
                    )
                    bytes_.life_ended("r1", fired[0].get("state") if fired else None)
                    kills.append(
                        {
                            "relay": "r1",
                            "by_fault_plan": bool(fired),
                            "frame_round": fired[0].get("round") if fired else None,
                            "sites_round": reached,
                            "t": round(watcher.elapsed(), 1),
                        }
                    )
                    if not args.kill_for_good:
                        restart_at = now + args.restart_after
                if restart_at is not None and now >= restart_at:
                    report(f"[{watcher.elapsed():7.1f}s] drill: relay r1 started again")
                    procs["r1"].start()
                    kills[-1]["restarted_t"] = round(watcher.elapsed(), 1)
                    restart_at = None
                time.sleep(0.5)
            timed_out = failure is None and any(s.running for s in sites.values())
            for r in relays:
                if procs[r].running:
                    bytes_.poll(r, procs[r])
        finally:
            codes = {n: p.stop(15) for n, p in procs.items()}
    wall = time.perf_counter() - started
    rows = [
        bench_row(record, spec)
        for plan in plans
        for record in read_metrics(plan.config_path.parent / "state" / "metrics.jsonl")
    ]
    final = per_node_final(rows)
    completed = {n: max((r["round"] for r in rows if r["node"] == n), default=0) for n in names}
    errors = {n: f"exit code {c}" for n, c in codes.items() if n in names and c not in (0, None)}
    return {
        "behind": list(behind),
        "macro_f1_final": rounded(mean(list(final.values()))),
        "macro_f1_final_per_node": final,
        "rounds_completed": completed,
        "every_node_every_round": all(v == spec.rounds for v in completed.values()),
        "relay": bytes_.totals(),
        "relay_kills": kills,
        **ledger_counts(run_dir, names, spec.rounds),
        "wall_s": round(wall, 1),
        "failure": failure,
        "timed_out": timed_out,
        "errors": errors,
    }


def one_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    out = args.out / f"seed{seed}"
    spec = base_spec(args, seed)
    sources, _ = partition(spec, out / "data")
    names = site_names(args.nodes)
    order = list(ARMS) if seed % 2 == 0 else list(reversed(ARMS))
    figures: dict[str, Any] = {"seed": seed, "order": order}
    for arm in order:
        behind = names[-args.behind :] if arm == "behind" else []
        report(f"--- seed {seed}: {arm} ({args.nodes} sites, behind: {behind or 'none'})")
        drill = arm == "behind" and args.kill_relay_at is not None
        figures[arm] = run_arm(args, spec, out / arm, sources, behind, drill)
        f = figures[arm]
        report(
            f"--- seed {seed} {arm}: macro-F1 {f['macro_f1_final']}, every round "
            f"{f['every_node_every_round']}, relay bytes {f['relay']['bytes_total']}, "
            f"wall {f['wall_s']} s"
        )
    a, b = figures["behind"]["macro_f1_final"], figures["reachable"]["macro_f1_final"]
    figures["behind_minus_reachable_f1_points"] = (
        None if a is None or b is None else round(100 * (a - b), 2)
    )
    return figures


def plot(per_seed: list[dict[str, Any]], path: Path) -> Path:
    """Final mean macro-F1 per seed, the two arms side by side."""
    import matplotlib.pyplot as plt

    import bench.plots  # chooses the Agg backend

    fig, ax = plt.subplots(figsize=(6.0, 3.5))
    width = 0.38
    for i, arm in enumerate(ARMS):
        values = [s[arm]["macro_f1_final"] or 0.0 for s in per_seed]
        xs = [k + (i - 0.5) * width for k in range(len(per_seed))]
        ax.bar(xs, values, width, label=arm, color=("C0", "C1")[i])
    ax.set_xticks(range(len(per_seed)), [f"seed {s['seed']}" for s in per_seed])
    ax.set_ylabel("mean final macro-F1")
    ax.legend(loc="lower right")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("every site reachable vs sites behind a relay", fontsize="medium")
    return bench.plots.save(fig, path)


def _stop(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through Netns: its namespaces are deleted


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ok, why = netns_available()
    if not ok:
        report(f"bench.network needs network namespaces: {why}")
        sys.stdout.write(json.dumps({"bench": "network", "skipped": why}) + "\n")
        return 2
    signal.signal(signal.SIGTERM, _stop)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    per_seed: list[dict[str, Any]] = []
    for seed in args.seeds:
        per_seed.append(one_seed(args, seed))
        atomic_write_text(
            args.out / "results.json", json.dumps({"seeds": per_seed}, indent=2) + "\n"
        )
    gaps = [s["behind_minus_reachable_f1_points"] for s in per_seed]
    arms = [s[arm] for s in per_seed for arm in ARMS]
    summary: dict[str, Any] = {
        "bench": "network",
        "data": args.data,
        "nodes": args.nodes,
        "behind": args.behind,
        "relays": args.relays,
        "rounds": args.rounds,
        "seeds": args.seeds,
        "partition": args.partition,
        "rate_mbit": args.rate_mbit,
        "drill": None
        if args.kill_relay_at is None
        else {
            "kill_relay_at": args.kill_relay_at,
            "restart_after_s": None if args.kill_for_good else args.restart_after,
            "for_good": args.kill_for_good,
        },
        "macro_f1_final": {
            arm: {s["seed"]: s[arm]["macro_f1_final"] for s in per_seed} for arm in ARMS
        },
        "macro_f1_final_mean": {
            arm: rounded(mean([s[arm]["macro_f1_final"] for s in per_seed])) for arm in ARMS
        },
        "every_node_every_round": {
            arm: {s["seed"]: s[arm]["every_node_every_round"] for s in per_seed} for arm in ARMS
        },
        "relay_bytes": {arm: {s["seed"]: s[arm]["relay"] for s in per_seed} for arm in ARMS},
        "relay_kills": {s["seed"]: s["behind"]["relay_kills"] for s in per_seed},
        "wall_s_per_arm": {arm: {s["seed"]: s[arm]["wall_s"] for s in per_seed} for arm in ARMS},
        "models_merged": {
            arm: {s["seed"]: s[arm]["models_merged"] for s in per_seed} for arm in ARMS
        },
        "rounds_merged_alone": {
            arm: {s["seed"]: s[arm]["rounds_merged_alone"] for s in per_seed} for arm in ARMS
        },
        "rounds_lost": sum(a["rounds_lost"] for a in arms),
        "processed_twice": sum(a["processed_twice"] for a in arms),
        "behind_minus_reachable_f1_points_per_seed": gaps,
        "behind_minus_reachable_f1_points": rounded(mean(gaps), 2),
        "target": f"|behind - reachable| <= {F1_TARGET_POINTS} macro-F1 points (mean)",
        "wall_s": round(time.perf_counter() - started, 1),
    }
    summary["plot"] = str(plot(per_seed, args.out / "network.png"))
    summary["runs_ok"] = all(
        a["every_node_every_round"] and not a["failure"] and not a["timed_out"] for a in arms
    )
    gap = summary["behind_minus_reachable_f1_points"]
    summary["met"] = None if gap is None else abs(gap) <= F1_TARGET_POINTS
    atomic_write_text(
        args.out / "results.json",
        json.dumps({"seeds": per_seed, "summary": summary}, indent=2) + "\n",
    )
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0 if summary["runs_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
