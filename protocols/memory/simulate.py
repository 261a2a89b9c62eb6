"""Running a federation in memory: `simulate(configs)` runs each site's
protocol concurrently on one `InMemoryNetwork` and returns a `SimulationResult`;
`simulation_configs` builds the per-site configs for it without key, roster or
status files."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pfl.config import SiteConfig, config_from_dict
from protocols import from_params

from .network import InMemoryContext, InMemoryNetwork
from .results import SimulationResult

log = logging.getLogger(__name__)


async def _run_node(ctx: InMemoryContext, config: SiteConfig) -> None:
    protocol = from_params(config.protocol)
    try:
        await protocol.run(ctx)
    except Exception as exc:
        ctx.network.mark_failed(ctx.me, exc)  # its peers stop choosing it at once
        raise


async def simulate(
    configs: Sequence[SiteConfig],
    *,
    network: InMemoryNetwork | None = None,
    fail_fast: bool = False,
    engine: str = "local",
    shards: int = 2,
    address: str | None = None,
    shard_cpus: float = 1.0,
    shard_gpus: float = 0.0,
) -> SimulationResult:
    """Run every site's protocol concurrently in this process until all finish
    (or are killed). Nodes the network already marks dead are not started. A
    node that raises is recorded in `errors`; the others go on, or with
    `fail_fast` are stopped at once (recorded as stopped), as a benchmark wants.

    engine="ray": the same over `shards` Ray actors of the cluster at `address`
    (protocols/memory/ray_engine.py; `network` only lends its settings), each
    of `shard_cpus` CPUs (its training pool) and `shard_gpus` GPUs."""
    if engine == "ray":
        from .ray_engine import simulate_on_ray

        return await simulate_on_ray(
            configs,
            local=simulate,
            shards=shards,
            address=address,
            network=network,
            fail_fast=fail_fast,
            shard_cpus=shard_cpus,
            shard_gpus=shard_gpus,
        )
    if engine != "local":
        raise ValueError(f"engine must be 'local' or 'ray', got {engine!r}")
    network = network if network is not None else InMemoryNetwork()
    names = [c.node.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"node names must be unique, got {names}")
    contexts: dict[str, InMemoryContext] = {}
    for cfg in configs:
        existing = network._nodes.get(cfg.node.name)
        if existing is not None and not existing.alive:
            continue  # killed before the start: it never runs
        contexts[cfg.node.name] = network.join(cfg.node.name, cfg)
    start = time.perf_counter()
    first_record, first_choice = len(network.records), len(network.choices)
    tasks: dict[str, asyncio.Task[None]] = {}
    for cfg in configs:
        if cfg.node.name in contexts:
            task = asyncio.create_task(
                _run_node(contexts[cfg.node.name], cfg), name=f"node:{cfg.node.name}"
            )
            network._nodes[cfg.node.name].task = task
            tasks[cfg.node.name] = task
    errors: dict[str, str] = {name: "killed before start" for name in names if name not in contexts}
    stopped: set[str] = set()
    if fail_fast and tasks:
        pending: set[asyncio.Task[None]] = set(tasks.values())
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            if any(not t.cancelled() and t.exception() is not None for t in done):
                stopped = {name for name, t in tasks.items() if t in pending}
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                break
    for name, task in tasks.items():
        try:
            await task
        except asyncio.CancelledError:
            if not network._nodes[name].alive:
                errors[name] = "killed"
            elif name in stopped:
                errors[name] = "stopped: another node failed"
            else:
                for other in tasks.values():
                    other.cancel()
                raise
        except Exception as exc:  # noqa: BLE001 - one failing node is a result, not a crash of the simulation
            log.exception("node %s failed", name)
            errors[name] = f"{type(exc).__name__}: {exc}"
    wall = time.perf_counter() - start
    return SimulationResult(
        records=[r for r in network.records[first_record:] if r["node"] in names],
        choices=[c for c in network.choices[first_choice:] if c["node"] in names],
        traffic={name: network.traffic(name).as_dict() for name in names if name in network._nodes},
        errors=errors,
        wall_s=wall,
    )


def simulation_configs(
    sources: Sequence[str],
    *,
    protocol: dict[str, Any],
    names: Sequence[str] | None = None,
    federation_id: str = "sim",
    seed: int = 0,
    state_root: str | Path = "state",
    **sections: dict[str, Any],
) -> list[SiteConfig]:
    """One SiteConfig per data source, for simulations and benchmarks: no key,
    roster or status files are needed, and `wire.encryption` is on (nothing leaves
    the process; secure aggregation asks for it). `sections` are site.yaml sections shared
    by every site (training={...}, selection={...}, model={...}, data={...});
    `data.source` is set per site from `sources`."""
    names = list(names) if names is not None else [f"site{i}" for i in range(len(sources))]
    if len(names) != len(sources):
        raise ValueError(f"{len(names)} names for {len(sources)} sources")
    out: list[SiteConfig] = []
    for name, source in zip(names, sources, strict=True):
        raw: dict[str, Any] = {
            "node": {"name": name, "state_dir": str(Path(state_root) / name)},
            "federation": {"id": federation_id, "roster": "roster.yaml", "seed": seed},
            "protocol": dict(protocol),
            "status": {"enabled": False},
            # Messages stay inside this process, as if encrypted: so a config with
            # secure_aggregation (which asks for wire.encryption) validates here too.
            "wire": {"encryption": True},
        }
        for section, values in sections.items():
            raw[section] = dict(values)
        raw["data"] = {**raw.get("data", {}), "source": source}
        out.append(config_from_dict(raw, check_files=False))
    return out
