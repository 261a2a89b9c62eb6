"""The in-memory simulator sharded over Ray actors: simulations larger than one
machine, with the same per-node, per-round results as one process.

    await simulate(configs, engine="ray", shards=K, address=None | "auto" | "HOST:PORT")

This module is the driver: it places K shard actors (protocols/memory/
ray_actor.py: async Ray actors of `cpus_per_shard` CPUs and `gpus_per_shard`
GPUs, reserved together in a placement group spread over the cluster's
machines; shards Ray cannot place are refused in one line, `ShardsDoNotFit`),
each holding an `InMemoryNetwork` for a contiguous block of the nodes, wires
them to each other, runs them and merges their results. How the shards talk
(batched actor calls for another shard's node, broadcast membership,
gossiped rounds and metadata, kept models through Ray's object store) is
ray_shard.py's and ray_mail.py's.

Progress (`records_since`, `rounds_logged`, `round_ends`, `mail`,
`peak_rss_mb`) is read in the actors' PROGRESS concurrency group, a thread
of its own, so a read does not wait for the nodes' event loop (it can still
wait in Ray's queue of calls to the actor: ray_actor.py). `round_ends`
gives each round's end as the shards logged it (wall clock: over several
machines, as close as their clocks are), whenever it is read.

- A shard actor that dies stops the run at once: `ShardDied` says which shard
  (its nodes) and why, in one line. Nodes are not resumed on another actor
  (the in-memory checkpoints die with the shard).

The results equal one process's for a deterministic configuration: seeded
neighbour choices (`selection.seeded_rng`), inline training, and no draw from
torch's global generator (the `weak`/`strong` augmentations draw from it, so
what each node draws depends on the order the nodes happen to train in).

This module and ray_shard.py are the only ones that import ray, and only
inside functions: without ray installed, importing them works and running
the engine says how to install it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from p2pfl.config import SiteConfig
from protocols.memory.network import InMemoryNetwork
from protocols.memory.ray_actor import PROGRESS, Shard
from protocols.memory.ray_mail import WINDOW_S
from protocols.memory.ray_shard import (
    RAY_MISSING,
    LocalSimulate,
    RayMissing,
    ShardNetwork,
    awaited,
    import_ray,
)
from protocols.memory.results import SimulationResult

log = logging.getLogger(__name__)


class ShardDied(RuntimeError):
    """A shard actor died mid-run; the message is the one-line reason."""


def blocks(count: int, shards: int) -> list[range]:
    """`shards` contiguous blocks of `count` nodes, sizes differing by one at most."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    size, extra = divmod(count, shards)
    out, start = [], 0
    for i in range(shards):
        end = start + size + (1 if i < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def network_settings(network: InMemoryNetwork | None) -> dict[str, Any]:
    """What a shard's network copies of the caller's: its settings, never its
    nodes (a network that already holds nodes or writes checkpoints is the
    local engine's)."""
    if network is None:
        return {"inline_train": True, "keep_checkpoints": False}
    if network._nodes or network.checkpoint_dir is not None:
        raise ValueError(
            "the ray engine builds its own networks: pass an empty InMemoryNetwork "
            "without checkpoint_dir (its settings are copied), or none"
        )
    return {
        "inline_train": network.inline_train,
        "keep_checkpoints": network.keep_checkpoints,
        "poll_interval_s": network.poll_interval_s,
        "send_timeout_s": network.send_timeout_s,
        "sample_caps": dict(network.sample_caps),
    }


class ShardsDoNotFit(ValueError):
    """The Ray cluster cannot hold the shards asked for (one line)."""


# How long `RayRun.start` waits for the cluster to hold every shard.
PLACE_WAIT_S = 60.0


def check_shard_resources(cpus: float, gpus: float) -> None:
    """A shard's CPUs and GPUs as Ray takes them, or one line saying why not."""
    if not (math.isfinite(cpus) and cpus > 0):
        raise ValueError(f"a shard needs more than 0 CPUs, got {cpus}")
    if not (math.isfinite(gpus) and gpus >= 0):
        raise ValueError(f"a shard's GPUs must be 0 or more, got {gpus}")
    if gpus > 1 and gpus != int(gpus):
        raise ValueError(f"a shard's GPUs above 1 must be whole (Ray's rule), got {gpus:g}")


class RayRun:
    """One simulation over K shard actors: `start()`, then `wait()`; `shards`
    and `block_of` let a caller follow it (progress) or kill a shard (drills)."""

    def __init__(
        self,
        configs: Sequence[SiteConfig],
        *,
        shards: int,
        network: InMemoryNetwork | None = None,
        cpus_per_shard: float = 1.0,
        gpus_per_shard: float = 0.0,
        gossip_s: float = 0.05,
        window_s: float = WINDOW_S,
        place_wait_s: float = PLACE_WAIT_S,
    ) -> None:
        names = [c.node.name for c in configs]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique, got {names}")
        self.configs = list(configs)
        self.settings = network_settings(network)
        self.ranges = blocks(len(self.configs), min(shards, max(1, len(self.configs))))
        check_shard_resources(cpus_per_shard, gpus_per_shard)
        self.cpus_per_shard = cpus_per_shard
        self.gpus_per_shard = gpus_per_shard
        self.place_wait_s = place_wait_s
        self._group: Any = None  # the placement group holding the shards' resources
        self.gossip_s = gossip_s
        self.window_s = window_s
        self.shards: list[Any] = []
        self._records_read: list[int] = []  # per shard: records `records_since` has read

    def block_of(self, i: int) -> str:
        r = self.ranges[i]
        first, last = self.configs[r.start].node.name, self.configs[r.stop - 1].node.name
        return f"shard {i} (nodes {first}..{last})"

    async def _place(self) -> Any:
        """Reserve every shard's CPUs and GPUs at once (a placement group,
        spread over the cluster's nodes); shards Ray cannot place within
        `place_wait_s` (too few free CPUs or GPUs, a fraction of a GPU that
        fits no single GPU) are refused in one line, not waited for."""
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        bundle = {"CPU": self.cpus_per_shard}
        if self.gpus_per_shard:
            bundle["GPU"] = self.gpus_per_shard
        group = placement_group([bundle] * len(self.ranges), strategy="SPREAD")
        try:
            await asyncio.wait_for(awaited(group.ready()), self.place_wait_s)
        except BaseException as exc:  # not placed in time, or the caller gave up
            remove_placement_group(group)  # else it would take the resources later
            if not isinstance(exc, TimeoutError):
                raise
            free = ray.available_resources()
            raise ShardsDoNotFit(
                f"{len(self.ranges)} shards of {self.cpus_per_shard:g} CPU and "
                f"{self.gpus_per_shard:g} GPU each could not be placed on the Ray cluster "
                f"within {self.place_wait_s:g} s (free now: {free.get('CPU', 0.0):g} CPU, "
                f"{free.get('GPU', 0.0):g} GPU)"
            ) from None
        return group

    async def start(self) -> None:
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._group = await self._place()
        actor = ray.remote(
            num_cpus=self.cpus_per_shard,
            num_gpus=self.gpus_per_shard,
            max_restarts=0,
            max_concurrency=100_000,
            concurrency_groups={PROGRESS: 4},
        )(Shard)
        self.shards = [
            actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=i
                )
            ).remote(
                i,
                self.settings,
                self.gossip_s,
                self.window_s,
                train_workers(self.cpus_per_shard),
                hide_gpus=not self.gpus_per_shard,
            )
            for i in range(len(self.ranges))
        ]
        keys = await asyncio.gather(
            *(
                shard.setup.remote(
                    self.shards, [self.configs[j].model_dump_json() for j in self.ranges[i]]
                )
                for i, shard in enumerate(self.shards)
            )
        )
        owners = {name: (i, key) for i, block in enumerate(keys) for name, key in block.items()}
        await asyncio.gather(*(shard.add_proxies.remote(owners) for shard in self.shards))

    async def wait(self, local: LocalSimulate, *, fail_fast: bool = False) -> SimulationResult:
        """Every shard's result merged; the first shard that dies stops the
        run at once (`ShardDied`, one line). With `fail_fast`, a shard whose
        node failed ends the others too (`_stopped`), as one process would
        stop every node: their nodes would otherwise wait on the failed
        shard's stopped ones until their round timeouts."""
        ray = import_ray()
        started = time.perf_counter()
        runs = {
            asyncio.ensure_future(shard.run.remote(local, fail_fast)): i
            for i, shard in enumerate(self.shards)
        }
        parts: dict[int, dict[str, Any]] = {}
        pending = set(runs)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                error = future.exception()
                if error is None:
                    parts[runs[future]] = json.loads(future.result())
                    continue
                for other in pending:
                    other.cancel()
                cause = (
                    _one_line(error) if isinstance(error, ray.exceptions.RayError) else repr(error)
                )
                raise ShardDied(f"{self.block_of(runs[future])} died: {cause}")
            failed = any(_failed(part) for part in parts.values())
            if fail_fast and failed and pending:
                for future in pending:
                    parts[runs[future]] = await self._stopped(runs[future])
                    future.cancel()
                pending = set()
        ordered = [parts[i] for i in sorted(parts)]
        return SimulationResult(
            records=[r for p in ordered for r in p["records"]],
            choices=[c for p in ordered for c in p["choices"]],
            traffic={k: v for p in ordered for k, v in p["traffic"].items()},
            errors={k: v for p in ordered for k, v in p["errors"].items()},
            wall_s=time.perf_counter() - started,
        )

    async def _stopped(self, i: int) -> dict[str, Any]:
        """A still-running shard's part of a run another shard's failed node
        ended: the records its nodes logged, and each of its nodes that had
        not finished the run recorded as stopped (its actor is killed by `stop`)."""
        records = json.loads(await progress(self.shards[i], "new_records").remote(0))
        block = [self.configs[j] for j in self.ranges[i]]
        finished = {(r["node"], r["round"]) for r in records}
        errors = {
            c.node.name: "stopped: another node failed"
            for c in block
            if (c.node.name, getattr(c.protocol, "rounds", None)) not in finished
        }
        return {"records": records, "choices": [], "traffic": {}, "errors": errors}

    async def records_since(self) -> list[dict[str, Any]]:
        """Every shard's records logged since this method's last call
        (progress). A dead shard's are skipped: `wait` says it died."""
        ray = import_ray()
        starts = self._records_read or [0] * len(self.shards)
        parts = await asyncio.gather(
            *(
                progress(s, "new_records").remote(start)
                for s, start in zip(self.shards, starts, strict=True)
            ),
            return_exceptions=True,
        )
        out: list[dict[str, Any]] = []
        self._records_read = []
        for start, part in zip(starts, parts, strict=True):
            if isinstance(part, ray.exceptions.RayError):
                self._records_read.append(start)
                continue
            if isinstance(part, BaseException):
                raise part
            new = json.loads(part)
            out.extend(new)
            self._records_read.append(start + len(new))
        return out

    async def rounds_logged(self) -> dict[int, int]:
        """round -> how many nodes (of every shard) logged it."""
        counts: dict[int, int] = {}
        for part in await self._ask_all("rounds_logged"):
            for round_no, count in part.items():
                counts[int(round_no)] = counts.get(int(round_no), 0) + count
        return counts

    async def round_ends(self) -> dict[int, tuple[int, float]]:
        """round -> (records logged for it over every shard, wall time
        (`time.time()`) of the last one): the round ended then if every node
        logged it. The shards' own times, whenever the driver asks."""
        ends: dict[int, tuple[int, float]] = {}
        for part in await self._ask_all("round_ends"):
            for round_no, count, at in part:
                before = ends.get(int(round_no), (0, 0.0))
                ends[int(round_no)] = (before[0] + count, max(before[1], at))
        return ends

    async def mail(self) -> dict[str, int]:
        """Actor calls the shards made to each other, the messages (requests,
        replies, gossip, ...) those calls carried, and the kept payloads put
        into the object store, the replies that carried a reference to one,
        and the fetches of one."""
        total: dict[str, int] = {}
        for part in await self._ask_all("mail"):
            for key, value in part.items():
                total[key] = total.get(key, 0) + value
        return total

    async def peak_rss_mb(self) -> list[tuple[float, float]]:
        """Each shard actor's (peak, base) resident memory in MB (before `stop`)."""
        return [(peak, base) for peak, base in await self._ask_all("peak_rss_mb")]

    async def _ask_all(self, method: str) -> list[Any]:
        return list(await asyncio.gather(*(progress(s, method).remote() for s in self.shards)))

    def stop(self) -> None:
        """Kill every shard actor (the run's end, or its failure) and give
        their resources back."""
        if not self.shards and self._group is None:
            return
        ray = import_ray()
        for shard in self.shards:
            ray.kill(shard, no_restart=True)
        self.shards = []
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
            self._group = None


def progress(shard: Any, method: str) -> Any:
    """A shard's read-only method, called in its PROGRESS concurrency group
    (its own thread: it does not wait for the nodes' event loop)."""
    return getattr(shard, method).options(concurrency_group=PROGRESS)


def _failed(part: dict[str, Any]) -> bool:
    """Whether a shard's result has a node that failed (not one stopped or
    killed: `SimulationResult.first_failure`)."""
    return SimulationResult([], [], {}, part["errors"], 0.0).first_failure() is not None


def _one_line(error: BaseException) -> str:
    """A Ray error's cause in one line (its text runs over many)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # the most telling line: who killed it (ray.kill, out of memory), else that it died
    cause = next((line for line in lines if "killed" in line), None)
    cause = cause or next((line for line in lines if "died" in line), None)
    text = cause or (lines[0] if lines else type(error).__name__)
    return f"{type(error).__name__}: {text}"[:300]


def train_workers(cpus: float) -> int:
    """A shard's training pool: one worker per whole CPU Ray gives it, at least one."""
    return max(1, int(cpus))


RAY_AUTH_ENV = "RAY_AUTH_MODE"


def require_ray_auth() -> None:
    """Token authentication for a Ray this process starts: Ray's GCS, raylet
    and worker ports listen on every interface whatever address it is given,
    and a Ray without token auth (before 2.52, or 2.52 by default) let a
    stranger who reached this host join the simulation's cluster and run code
    in it (a key review). The token is a fresh one in RAY_AUTH_TOKEN, which
    Ray reads before any file and which the Ray processes this one starts
    inherit (only this account and root may read a process's environment):
    left to Ray, the token went to ~/.ray/auth_token by a plain open(), 0644
    under umask 022, readable by every account on the host (a second key
    review). An operator's RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH is kept, so
    is an explicit RAY_AUTH_MODE, with a WARNING if it turns auth off."""
    mode = os.environ.setdefault(RAY_AUTH_ENV, "token")
    if mode.lower() == "token" and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    if mode.lower() != "token":
        log.warning(
            "%s=%s: the Ray this simulation starts accepts anyone who reaches its ports "
            "(every interface of this host) and runs their code; unset it or set it to token",
            RAY_AUTH_ENV,
            mode,
        )
    # Ray caches the mode and the token at import: refresh both, as Ray's own
    # _enable_token_auth does. Without it the driver kept auth off while the GCS
    # it started had it on, and the GCS died for want of a token (a key review).
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # no Ray (or one without token auth): nothing cached
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def local_cluster(
    nodes: int, *, cpus: int = 1, gpus: int = 0, object_store_mb: int = 300
) -> Callable[[], None]:
    """Start `nodes` Ray nodes on this machine (`ray.cluster_utils.Cluster`,
    `cpus` each) and connect this process; returns what shuts it all down."""
    ray = import_ray()
    from ray.cluster_utils import Cluster

    require_ray_auth()
    node = {"num_cpus": cpus, "num_gpus": gpus, "object_store_memory": object_store_mb << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**node)
        ray.init(address=cluster.address, log_to_driver=False)
    except BaseException:
        cluster.shutdown()
        raise

    def shutdown() -> None:
        try:
            ray.shutdown()
        finally:
            cluster.shutdown()

    return shutdown


def connect(address: str | None, *, num_cpus: int | None = None) -> bool:
    """Join the cluster at `address` ("auto": the one `ray start` runs here),
    or start a small local one; True if this call started Ray."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if address is None:  # a Ray of its own, even when a cluster runs on this machine
        address, options["num_cpus"] = "local", num_cpus
        require_ray_auth()
    ray.init(address=address, **options)
    return True


async def simulate_on_ray(
    configs: Sequence[SiteConfig],
    *,
    local: LocalSimulate,
    shards: int = 2,
    address: str | None = None,
    network: InMemoryNetwork | None = None,
    fail_fast: bool = False,
    shard_cpus: float = 1.0,
    shard_gpus: float = 0.0,
) -> SimulationResult:
    """`simulate(configs, engine="ray")`: the configs over `shards` actors of
    the Ray cluster at `address` (None: this process's Ray, or a local one it
    starts and stops). `local` is the local simulator each shard runs. Each
    shard's network takes `network`'s settings; without one, inline training
    and no checkpoints kept (the repeatable, frugal settings of a large run).
    Each shard actor asks Ray for `shard_cpus` CPUs (its training pool has one
    worker per whole CPU) and `shard_gpus` GPUs (a fraction shares one)."""
    run = RayRun(
        configs,
        shards=shards,
        network=network,
        cpus_per_shard=shard_cpus,
        gpus_per_shard=shard_gpus,
    )
    cpus = math.ceil(len(run.ranges) * shard_cpus)
    started = connect(address, num_cpus=cpus if address is None else None)
    try:
        await run.start()
        return await run.wait(local, fail_fast=fail_fast)
    finally:
        try:
            run.stop()
        finally:
            if started:
                import_ray().shutdown()


__all__ = [
    "RAY_MISSING",
    "RayMissing",
    "RayRun",
    "ShardDied",
    "ShardsDoNotFit",
    "check_shard_resources",
    "ShardNetwork",
    "connect",
    "import_ray",
    "progress",
    "local_cluster",
    "simulate_on_ray",
]
