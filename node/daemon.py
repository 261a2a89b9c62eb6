"""The node daemon: owns the event loop, transport, queues, peer table, state
directory, status endpoint and the protocol task. Everything a node owns hangs
off `Node` and is closed in `Node.stop()`.

`Node` builds the parts and wires them here, in one place: Inbound answers
what arrives (node/inbound.py), Outbound sends pushes and requests
(node/outbound.py), Membership runs the heartbeats and the roster
(node/membership.py), SiteRelays keeps an outbound-only site reachable
through its relays or makes this site a relay (node/relay_tunnel.py, issue 31),
NodeContext is what the protocol sees (node/context.py, handed those parts,
never the Node).
`Node` itself keeps the lifecycle and the protocol's state: start and resume,
checkpoints, metrics, stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import protocols
from node.context import NodeContext, NodeState
from node.faults import FaultPlan
from node.inbound import Inbound
from node.logsetup import configure_logging, stderr_error
from node.membership import Membership, Progress
from node.outbound import Outbound
from node.peers import PeerTable
from node.queues import Checkpoints, Inboxes, Journal, Outbox, ReplayMarks, Spool
from node.relay_tunnel import SiteRelays
from node.resources import (
    CHECK_EVERY_S,
    HostThreads,
    available_cores,
    freeze_startup_heap,
    registry_dir,
)
from node.status import (
    config_status_app,
    dashboard_banner,
    dashboard_url,
    start_status_server,
    token_location,
)
from node.telemetry import Telemetry
from node.tls import client_ssl_context, server_ssl_context
from node.transport import MessageServer
from node.transport_client import MessageClient
from p2pfl.config import SiteConfig, parse_hostport
from p2pfl.errors import UserError
from p2pfl.files import make_private_dir, make_private_tree, open_append
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec
from protocols.base import FAILED

log = logging.getLogger(__name__)


class Node:
    def __init__(
        self,
        cfg: SiteConfig,
        roster: Roster,
        identity: LocalIdentity,
        *,
        config_path: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.name = cfg.node.name
        self.identity = identity
        self.config_path = config_path
        # 0700 folders, no group or other bits on any file: also what a version
        # before the 0600 files left (its checkpoints are never rewritten)
        state = make_private_tree(cfg.node.state_dir)
        self.state_dir = state
        self.faults = FaultPlan.from_env()
        self.codec = WireCodec(
            identity,
            roster,
            cfg.federation.id,
            max_message_bytes=cfg.wire.max_message_bytes,
            clock_skew_s=cfg.wire.clock_skew_s,
            replay_cache_size=cfg.wire.replay_cache_size,
            require_encryption=cfg.wire.encryption,
        )
        # What the last run accepted is refused from now on (node/queues.py).
        self.marks = ReplayMarks(
            state / "replay_marks.json", cfg.wire.replay_margin_s, cfg.wire.clock_skew_s
        )
        self.codec.restart_floor = dict(self.marks.floor)
        self.codec.restart_floor_all = self.marks.floor_all
        self.telemetry = Telemetry(self.name)
        self.spool = Spool(state / "spool")
        self.journal = Journal(state / "journal.jsonl")
        self.outbox = Outbox(state / "outbox")
        self.checkpoints = Checkpoints(state / "checkpoints")
        self.inboxes = Inboxes(cfg.transport.inbox_size)
        self.peers = PeerTable(self.name, roster.names(), cfg.transport)
        tls = cfg.transport.tls
        self.server_ssl = (
            server_ssl_context(str(tls.cert), str(tls.key), str(tls.ca)) if tls else None
        )
        client_ssl = client_ssl_context(str(tls.cert), str(tls.key), str(tls.ca)) if tls else None
        self.client = MessageClient(
            cfg.transport, client_ssl, max_message_bytes=cfg.wire.max_message_bytes
        )
        self.stopping = asyncio.Event()
        self.protocol = protocols.from_params(cfg.protocol)
        self.membership = Membership(
            name=self.name,
            cfg=cfg,
            roster=roster,
            codec=self.codec,
            client=self.client,
            peers=self.peers,
            telemetry=self.telemetry,
            inboxes=self.inboxes,
            progress=self.progress,
            spawn=self._spawn,
        )
        self.outbound = Outbound(
            name=self.name,
            cfg=cfg,
            codec=self.codec,
            client=self.client,
            outbox=self.outbox,
            peers=self.peers,
            telemetry=self.telemetry,
            marks=self.marks,
            current_round=lambda: self.ctx.round,
        )
        self.inbound = Inbound(
            name=self.name,
            cfg=cfg,
            codec=self.codec,
            spool=self.spool,
            journal=self.journal,
            inboxes=self.inboxes,
            telemetry=self.telemetry,
            membership=self.membership,
            faults=self.faults,
            marks=self.marks,
            count_sent=self.outbound.count_sent,
            stopping=self.stopping,
        )
        # Only the protocol's kinds are accepted, from the first message on (issue 28).
        self.inbound.accept_kinds(
            self.protocol.message_kinds(), pushes=self.protocol.pushed_kinds()
        )
        self.client.on_reject = self.telemetry.record_rejection
        self.server = MessageServer(
            self.codec,
            cfg.transport,
            self.inbound.on_frame,
            self.inbound.on_reject,
            check_header=self.inbound.check_header,
        )
        self.relays = SiteRelays(
            cfg=cfg,
            roster=roster,
            identity=identity,
            client_ssl=client_ssl,
            publish_to=self.telemetry.set_relays,
        )
        self.trainer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-train")
        self.restored_state: dict[str, Any] | None = None
        # The protocol's context gets the parts it uses, not the Node (issue 29).
        # Membership and Outbound read its round and phase only once the node runs.
        self.ctx = NodeContext(
            name=self.name,
            cfg=cfg,
            telemetry=self.telemetry,
            peers=self.peers,
            membership=self.membership,
            outbound=self.outbound,
            inbound=self.inbound,
            inboxes=self.inboxes,
            trainer=self.trainer,
            codec=self.codec,
            state=NodeState(
                on_progress=self.on_progress,
                save_checkpoint=self.save_checkpoint,
                restored_state=lambda: self.restored_state,
                log_metrics=self.log_metrics,
            ),
        )
        self.protocol_done = False
        self.protocol_failed: str | None = None
        self.failed_kind = ""  # the class of the error that stopped the protocol
        self.failed_line = ""  # why, as stderr may say it (logsetup.stderr_error)
        self._tasks: list[asyncio.Task[Any]] = []
        self._status_runner: Any = None
        self.status_port: int | None = None
        self.peer_port: int | None = None
        self._metrics_file = open_append(state / "metrics.jsonl")  # closed in stop()
        self.host_threads: HostThreads | None = None  # registered once the node runs
        self.telemetry.mark_startup("node_created")

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        uncapped = uncapped_peers(self.cfg, self.membership.roster)
        if uncapped:
            log.warning(
                "%s: roster cards without max_samples: %s — their claimed sample counts weigh "
                "in this node's averages up to protocol.max_weight_ratio x the median claim; "
                "set max_samples to each site's size (docs/threat-model.md)",
                self.name,
                ", ".join(uncapped),
            )
        checkpoint = self.checkpoints.latest()
        self.restored_state = checkpoint.get("protocol") if checkpoint else None
        if checkpoint:
            self.ctx.round = int(checkpoint.get("round", 0))
            log.info("%s: resuming from checkpoint (round %d)", self.name, self.ctx.round)
        requeued = self.inbound.recover(list(checkpoint.get("consumed", [])) if checkpoint else [])
        self.relays.mount(self.server)  # relay.serve: the relay's routes on our peer port
        host, port = parse_hostport(self.cfg.node.listen)
        try:
            self.peer_port = await self.server.start(host, port, self.server_ssl)
        except OSError as exc:
            raise UserError(
                f"node.listen {self.cfg.node.listen}: cannot bind ({exc.strerror}) — stop the process using that port or choose another one"
            ) from None
        scheme = "https" if self.server_ssl else "http"
        log.info(
            "%s: peer transport on %s://%s:%d (%d spooled messages re-queued)",
            self.name,
            scheme,
            host,
            self.peer_port,
            requeued,
        )
        if self.cfg.status.enabled:
            app, token = config_status_app(self.cfg, self.telemetry, self.config_path or "<config>")
            try:
                self._status_runner, self.status_port = await start_status_server(
                    app, self.cfg.status.host, self.cfg.status.port
                )
            except OSError as exc:
                await self.server.stop()
                raise UserError(
                    f"status.port {self.cfg.status.port}: cannot bind ({exc.strerror}) — choose another port or set status.enabled: false"
                ) from None
            # The token goes to the operator's terminal only, never to node.log
            # nor to a stderr that is the journal or a log collector.
            where = token_location(self.cfg, self.config_path or "<config>")
            banner = dashboard_banner(
                self.name,
                self.cfg.status.host,
                self.status_port,
                token,
                where,
                terminal=_is_terminal(sys.stderr),
            )
            print(banner, file=sys.stderr, flush=True)
            log.info(
                "%s: dashboard %s (token in %s)",
                self.name,
                dashboard_url(self.cfg.status.host, self.status_port, None),
                where,
            )
        if self.relays.start_tunnels(self.server if self.peer_port is not None else None):
            self._spawn(self._watch_relays(), "relays")
        self._spawn(self._heartbeats(), "heartbeat")
        self._spawn(self.outbound.resend_outbox(), "outbox")
        self._spawn(self._watch_threads(), "threads")
        self._spawn(self._run_protocol(), "protocol")

    async def _heartbeats(self) -> None:
        """The membership's heartbeats; an outbound-only site's once a relay
        carries it (node/relay_tunnel.py `wait_reachable`)."""
        await self.relays.wait_reachable(self.cfg.node.startup_wait_s)
        await self.membership.run()

    async def _watch_relays(self) -> None:
        """/status `relays`: refreshed now and then (connects and losses at once)."""
        while True:
            await asyncio.sleep(max(1.0, self.cfg.transport.heartbeat_s))
            self.relays.publish()

    def reload_roster(self) -> None:
        """SIGHUP: the roster again, for the relay this site serves too; pushes
        queued from sites it no longer lists are dropped (node/inbound.py)."""
        self.membership.reload_roster()
        self.relays.set_roster(self.membership.roster)
        self.inbound.drop_unlisted()

    async def _watch_threads(self) -> None:
        """Register this node's training threads on the host and check, every few
        seconds, that all nodes here together do not oversubscribe the cores
        (node/resources.py: warned once in the log, shown on /status)."""
        import torch

        self.host_threads = HostThreads(
            self.name, torch.get_num_threads(), registry_dir(), available_cores()
        )
        try:
            self.host_threads.register()
        except OSError as exc:
            log.warning("%s: cannot register in %s: %s", self.name, registry_dir(), exc)
        while True:
            try:
                self.telemetry.set_resources(self.host_threads.check())
            except OSError as exc:  # the registry went away: say so, keep running
                log.debug("%s: thread registry unreadable: %s", self.name, exc)
            await asyncio.sleep(CHECK_EVERY_S)

    def _spawn(self, coro: Any, name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=f"{self.name}:{name}"))

    async def stop(self) -> None:
        """Graceful: stop the protocol (it resumes from its checkpoint), say goodbye, close."""
        self.stopping.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.membership.broadcast(bye=True), timeout=2.0)
        await self.relays.stop()
        await self.server.stop()
        if self._status_runner is not None:
            await self._status_runner.cleanup()
        await self.client.close()
        self.trainer.shutdown(wait=True, cancel_futures=True)
        if self.host_threads is not None:
            self.host_threads.unregister()
        self._metrics_file.close()
        log.info("%s: stopped", self.name)

    async def _wait_for_peers(self) -> None:
        """Give the federation a moment to come up, so round 1 is not run alone."""
        deadline = time.monotonic() + self.cfg.node.startup_wait_s
        while time.monotonic() < deadline:
            everyone = self.peers.peers(alive_only=False)
            if all(p.state in ("alive", FAILED) or p.phase == "done" for p in everyone):
                return
            await asyncio.sleep(0.2)
        alive = [p.name for p in self.peers.peers()]
        log.warning(
            "%s: starting with %d of %d peers alive after %.0f s: %s",
            self.name,
            len(alive),
            len(self.peers.records),
            self.cfg.node.startup_wait_s,
            ", ".join(alive) or "none",
        )

    async def _run_protocol(self) -> None:
        self.ctx.set_phase("waiting_for_peers")
        await self._wait_for_peers()
        self.ctx.set_phase("start")
        try:
            await self.protocol.run(self.ctx)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed protocol must not take the node (and its serving) down
            self.protocol_failed = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, UserError):  # a reason a person can act on: one line, no traceback
                log.error("%s: protocol %s failed: %s", self.name, self.cfg.protocol.name, exc)
            else:
                log.exception("%s: protocol %s failed", self.name, self.cfg.protocol.name)
            self.failed_kind = type(exc).__name__
            self.failed_line = stderr_error(exc)
            # /status as stderr: the ServiceMonitor hands its token to Prometheus, and a
            # review read a patient's file name there; node.log has the whole message
            self.telemetry.set_error(self.failed_line)
            self.ctx.set_phase(FAILED)
            self.inbound.gone.set()  # requests held open for what will never come: refused now
            self._spawn(self.membership.broadcast(), "hb-failed")  # peers know at once
            return
        self.protocol_done = True
        self.ctx.set_phase("done")
        log.info(
            "%s: protocol %s finished at round %d",
            self.name,
            self.cfg.protocol.name,
            self.ctx.round,
        )

    async def wait_until_finished(self) -> None:
        """For exit_when_done: our protocol finished and every peer is done or gone."""
        while not self.stopping.is_set():
            if (self.protocol_done or self.protocol_failed) and self.peers.all_done_or_gone():
                return
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ state
    def progress(self) -> Progress:
        return Progress(self.ctx.round, self.ctx.phase, self.protocol_done, self.failed_kind)

    def on_progress(self) -> None:
        """Round or phase changed: let the fault plan (drills only) act."""
        if not self.faults.active:
            return
        self.faults.on_progress(self.ctx.round, self.ctx.phase)
        self.faults.partition(self.server, self.client)

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """The protocol's state for this round with the ids of the pushes it
        consumed since the last one, in one atomic write; then those ids are
        journaled and leave the spool (node/queues.py)."""
        consumed = self.inbound.consumed_records(self.inboxes.take_consumed())
        self.checkpoints.save({"round": self.ctx.round, "protocol": state, "consumed": consumed})
        if self.faults.active:
            self.faults.on_progress(self.ctx.round, "checkpointed")  # drill: before the journal
        self.inbound.settle(consumed)

    def log_metrics(self, round_no: int, values: dict[str, Any]) -> None:
        clean = {
            k: v
            for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        # Protocol traffic since start (heartbeats excluded), as the in-memory network reports it.
        clean.setdefault("messages_sent", self.outbound.sent.messages)
        clean.setdefault("bytes_sent", self.outbound.sent.bytes)
        self._metrics_file.write(
            json.dumps({"t": _now(), "node": self.name, "round": round_no, **clean}) + "\n"
        )
        self._metrics_file.flush()
        self.telemetry.log_metrics(round_no, **clean)


def uncapped_peers(cfg: SiteConfig, roster: Roster) -> list[str]:
    """The other sites whose claimed sample counts this node's protocol weighs
    (a weighted mean of models or gradients) with no `max_samples` on their
    roster card: what a compromised one could inflate unnoticed."""
    method = getattr(cfg.protocol, "aggregation", None)
    if method not in ("mean", "norm_clip") or not hasattr(cfg.protocol, "max_weight_ratio"):
        return []
    return sorted(
        c.name for c in roster.cards() if c.name != cfg.node.name and c.max_samples is None
    )


def _is_terminal(stream: Any) -> bool:
    """True when `stream` is a terminal (closed or missing: not one)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _now() -> float:
    """Wall-clock seconds to the millisecond (log_metrics' `round` argument hides the builtin)."""
    return round(time.time(), 3)


async def serve(node: Node) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, node.reload_roster)
    try:
        await node.start()
    except UserError:
        await node.relays.stop()
        await node.client.close()
        node.trainer.shutdown(wait=False)
        node._metrics_file.close()
        raise
    log.debug("start-up heap frozen: %d objects", freeze_startup_heap())
    waiters = [asyncio.create_task(stop.wait())]
    if node.cfg.node.exit_when_done:
        waiters.append(asyncio.create_task(node.wait_until_finished()))
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    await node.stop()
    if node.protocol_failed:  # the last line of the node's output says why it exits 1
        first = (node.failed_line.splitlines() or [""])[0]
        print(f"error: {first}", file=sys.stderr, flush=True)
    return 1 if node.protocol_failed else 0


def run_node(
    cfg: SiteConfig, roster: Roster, identity: LocalIdentity, *, config_path: Path | None = None
) -> int:
    Path(cfg.node.state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    configure_logging(cfg)  # first, so that node.log says where the folder cannot be made private
    make_private_dir(cfg.node.state_dir)  # keys, spool and logs: this account's only
    if cfg.training.threads:
        import torch

        torch.set_num_threads(cfg.training.threads)
    node = Node(cfg, roster, identity, config_path=config_path)
    return asyncio.run(serve(node))
