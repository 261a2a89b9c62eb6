"""Words of other machines in this node's log: a relay's (or a stranger's on a
link without TLS) refusal `reason`, a peer's reply fields. Each is logged as
one short printable line, so none can write a line of node.log of its own
(a forged "roster reloaded") or copy megabytes into one."""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
import torch
from aiohttp import web

from node.transport_client import MessageClient, TransportError, reason_of_response
from p2pfl.config import TransportSection
from p2pfl.text import MAX_REASON_CHARS, one_line, shown
from protocols.base import PeerUnavailable
from protocols.compressed_exchange import CompressedGradientExchange
from protocols.exchange import GradientExchange, wrong_round

FORGED = (
    "timeout)\n2026-11-27 19:30:00,000 WARNING node.daemon: a: roster reloaded: a, b, mallory"
    "\r\n2026-11-27 19:30:00,001 INFO protocols.exchange: a round 3: merged ("
)
HUGE = FORGED + "x" * (1 << 20)


def one_short_line(text: str, limit: int) -> bool:
    return len(text) <= limit and text.isascii() and text.isprintable()


async def _relay_answering(status: int, reason: Any) -> tuple[web.AppRunner, int]:
    """An HTTP server that answers every POST `status` with {"reason": reason}."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"reason": reason}, status=status)

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


@pytest.mark.parametrize("reason", [FORGED, HUGE], ids=["newlines", "a_megabyte"])
async def test_a_relays_refusal_reason_is_one_short_line(reason: str, caplog) -> None:
    """A refusal's reason goes from the answer (reason_of_response, and the
    client's last reason of a retried one) to PeerUnavailable to the
    protocols' log lines: newlines and control characters become "?", and it
    is cut to MAX_REASON_CHARS where it enters."""
    frame = types.SimpleNamespace(chunks=[b"P2FL-frame"], nbytes=10)
    client = MessageClient(TransportSection(retries=0), None)
    for status in (400, 503):  # 503: retryable, its reason the client's last one
        runner, port = await _relay_answering(status, reason)
        client.set_relayed_peer("b", [f"127.0.0.1:{port}"])
        try:
            try:
                got, body = await client.post("b", frame, retries=0)
                said = reason_of_response(got, body)
            except TransportError as exc:
                said = exc.reason
        finally:
            await runner.cleanup()
        assert one_short_line(said, MAX_REASON_CHARS), (status, said[:200])
        if reason is FORGED:
            assert said.startswith("timeout)?2026-11-27"), said
        else:  # past ERROR_BODY_LIMIT the body is not read at all (the wire review)
            assert "2026-11-27" not in said, said
        exc = PeerUnavailable("b", said)
        with caplog.at_level(logging.INFO, logger="protocols.exchange"):
            logging.getLogger("protocols.exchange").info(
                "%s round %d: no model from %s (%s)", "a", 3, "b", exc.reason
            )
        assert "\n" not in caplog.records[-1].getMessage()
    await client.close()
    # PeerUnavailable keeps any reason to one line, whoever raises it
    assert one_short_line(PeerUnavailable("b", HUGE).reason, MAX_REASON_CHARS)
    assert PeerUnavailable("b", "queue_full").reason == "queue_full"  # codes unchanged


async def test_a_reason_that_is_not_text_is_not_taken() -> None:
    for odd in ([FORGED] * 1000, {"a": 1}, 7, ""):
        runner, port = await _relay_answering(400, odd)
        client = MessageClient(TransportSection(retries=0), None)
        client.set_relayed_peer("b", [f"127.0.0.1:{port}"])
        try:
            frame = types.SimpleNamespace(chunks=[b"x"], nbytes=1)
            status, body = await client.post("b", frame, retries=0)
            assert reason_of_response(status, body) == "http_400", odd
        finally:
            await client.close()
            await runner.cleanup()


class Ctx:
    """What GradientExchange.fetch uses of a RoundContext; `reply` is the peer's answer."""

    me = "a"

    def __init__(self, reply: Any) -> None:
        self.reply = reply
        self.rejected: list[str] = []

    async def request(self, peer: str, kind: str, query: Any, timeout: float) -> Any:
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply

    def reject(self, peer: str, reason: str) -> None:
        self.rejected.append(reason)


def _logged(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


async def test_a_peers_reply_values_are_logged_bounded_and_on_one_line(caplog) -> None:
    """The values of a reply a node refuses are named in its log (%r, before):
    a string of a megabyte, a list of a million items, bytes with newlines."""
    caplog.set_level(logging.INFO)
    hostile = (HUGE, [HUGE] * 1000, list(range(1_000_000)), HUGE.encode(), {HUGE: HUGE})
    for value in hostile:
        caplog.clear()
        ctx = Ctx({})
        wrong_round(ctx, 3, "b", {"round": value})  # type: ignore[arg-type]
        exchange = GradientExchange(keep=2, timeout=1.0, max_norm_ratio=None, max_weight_ratio=None)
        ctx.reply = {"round": 1, "step": 2, "grad": {"w": torch.zeros(1)}, "batch_size": value}
        assert await exchange.fetch(ctx, (1, 2), {}, "b", 1.0) is None  # type: ignore[arg-type]
        compressed = CompressedGradientExchange(
            compression="int8", keep=2, timeout=1.0, max_norm_ratio=None, max_weight_ratio=None
        )
        ctx.reply = {"round": 1, "step": 2, "grad": {}, "batch_size": 4, "format": value}
        assert await compressed.fetch(ctx, (1, 2), {}, "b", 1.0) is None  # type: ignore[arg-type]
        ctx.reply = PeerUnavailable("b", HUGE)
        assert await exchange.fetch(ctx, (1, 2), {}, "b", 1.0) is None  # type: ignore[arg-type]
        lines = _logged(caplog, "protocols.exchange") + _logged(
            caplog, "protocols.compressed_exchange"
        )
        assert len(lines) == 4, lines
        assert all(one_short_line(line, 300) for line in lines), [line[:300] for line in lines]
        assert ctx.rejected == ["model_wrong_round", "grad_bad_batch_size", "compression_mismatch"]


def test_shown_and_one_line_cut_before_they_scan() -> None:
    assert shown("abc") == "'abc'" and shown(3) == "3" and shown(None) == "None"
    assert shown("a\nb") == "'a\\nb'"  # repr's escape: one line
    assert shown({"k": HUGE}) == "<dict>" and shown(2**100) == "<int too large>"
    assert shown("x" * 100).endswith("...") and len(shown("x" * 100)) < 60
    assert one_line("é\u202e\x1b\n", 10) == "????"
    assert one_line(HUGE, 20) == "timeout)?2026-11-27 "


class BlockingCtx(Ctx):
    async def run_blocking(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


async def test_a_peers_model_reply_values_are_logged_bounded_and_on_one_line(caplog) -> None:
    """The same for a model reply, plain or compressed: its num_train, the round
    of a reply without a model, a format, and a compressed payload's entry name,
    entry shape and block. Until a review (rv_comp, 2026-11-28) num_train and
    that round were logged whole (%r, %s: a 50 MB string wrote 200 MB to node.log
    and held the event loop 4 s; the round's newlines forged lines) and the
    others were repr'd whole before they were cut."""
    from protocols.compressed_exchange import CompressedExchange
    from protocols.compression import compress_state, parse
    from protocols.exchange import PlainExchange, ServedModels

    own = {"w": torch.zeros(4)}
    options = {"max_staleness": 1, "timeout": 1.0, "max_norm_ratio": None, "max_weight_ratio": None}
    caplog.set_level(logging.INFO)
    hostile = (HUGE, [HUGE] * 1000, list(range(1_000_000)), HUGE.encode(), {HUGE: HUGE})
    for value in hostile:
        caplog.clear()
        ctx = BlockingCtx({})
        plain = PlainExchange(ServedModels(3), **options)
        compressed = CompressedExchange(ServedModels(3), compression="int8", **options)
        payload = compress_state(own, parse("int8"))
        good = {"round": 1, "num_train": 4, "format": "int8", "ref": 0, "id": 5}
        for exchange, reply in [
            (plain, {"round": 1, "num_train": value, "state": own}),
            (plain, {"round": value, "num_train": 4, "state": None}),  # past the round
            (plain, {"round": 1, "num_train": 4, "state": own, "format": value}),
            (compressed, {**good, "format": value, "state": payload}),
            (compressed, {**good, "state": {**payload, "entries": [[value, [4]]]}}),
            (compressed, {**good, "state": {**payload, "entries": [["w", value]]}}),
            (compressed, {**good, "state": {**payload, "block": value}}),
        ]:
            ctx.reply = reply
            assert await exchange.fetch(ctx, 1, own, "b", 1.0) is None  # type: ignore[arg-type]
        lines = _logged(caplog, "protocols.exchange") + _logged(
            caplog, "protocols.compressed_exchange"
        )
        assert len(lines) == 7, lines
        assert all(one_short_line(line, 300) for line in lines), [line[:300] for line in lines]
        assert ctx.rejected == [
            "model_bad_num_train",
            "compression_mismatch",
            "compression_mismatch",
            "compression_key_mismatch" if isinstance(value, str) else "compression_malformed",
            "compression_shape_mismatch",
            "compression_bad_block",
        ], value if not isinstance(value, str) else value[:20]


async def test_a_secure_sums_refusals_are_logged_bounded_and_on_one_line(caplog) -> None:
    """The same for secure aggregation: a contributor's `refused` answer, as
    its requester logs it. Until a review (rv_comp2, 2026-11-28) it was logged
    whole: a refusal of a megabyte wrote a megabyte to node.log, and one with
    newlines forged lines of its choosing. (A contributor's own refusals name
    the requester's members by repr, and only roster names by text.)"""
    from protocols.secagg import SecAggError, secure_sum

    caplog.set_level(logging.INFO)
    hostile = (FORGED, HUGE, [HUGE] * 1000, list(range(1_000_000)), HUGE.encode(), {HUGE: HUGE})
    for value in hostile:
        caplog.clear()
        ctx = Ctx({"refused": value})
        with pytest.raises(SecAggError):
            await secure_sum(
                ctx,  # type: ignore[arg-type]
                ["b", "c"],
                round_no=1,
                max_round=1,
                reference={"w": torch.zeros(4)},
                timeout=1.0,
                weight_scale=1.0,
            )
        lines = _logged(caplog, "protocols.secagg_requester")
        assert len(lines) == 2, lines
        assert all(one_short_line(line, 300) for line in lines), [line[:300] for line in lines]


def test_a_strangers_claimed_sender_name_is_logged_on_one_short_line(caplog) -> None:
    """Read-back review: a refused frame's sender is the name its header claims,
    unverified (a stranger's `unknown_sender`, `bad_signature`), and the node's
    debug line of every refusal wrote it whole, newlines included."""
    from node.inbound import Inbound

    counted: list[tuple[str, str | None]] = []
    node = types.SimpleNamespace(
        name="a",
        telemetry=types.SimpleNamespace(record_rejection=lambda r, s: counted.append((r, s))),
    )
    with caplog.at_level(logging.DEBUG, logger="node.inbound"):
        Inbound.on_reject(node, "unknown_sender", FORGED[:64])  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(one_short_line(line, 200) for line in lines), lines
    assert counted == [("unknown_sender", FORGED[:64])]  # counted as claimed (telemetry bounds it)
