"""Who may read the status endpoint: a DNS-rebinding page (a foreign Host
header), another site's page (a foreign Origin) and a local process without the
node's token are refused; loopback names, the bound host and the names an
operator allows are answered. A real server on 127.0.0.1, in this process."""

from __future__ import annotations

import asyncio
import json
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from test_status import TOKEN, fetch, populated_telemetry
from yarl import URL

from node.status import create_status_app, start_status_server
from node.telemetry import Telemetry
from p2pfl.config import config_from_dict

REBIND = "rebind.attacker.example"
DATA_ROUTES = ("/status", "/peers", "/metrics", "/history")
AUTH = {"Authorization": f"Bearer {TOKEN}"}

Serve = Callable[..., Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """serve(telemetry, token, **app options) -> base URL of a server bound to 127.0.0.1."""
    runners = []

    async def start(telemetry: Telemetry, token: str | None, **options: Any) -> str:
        app = create_status_app(
            telemetry, node_name="a", protocol_name="fedavgp2p", token=token, **options
        )
        runner, port = await start_status_server(app, "127.0.0.1", 0)
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


def rejected(telemetry: Telemetry) -> dict[str, int]:
    return telemetry.status_json("a", "fedavgp2p")["rejected"]


# ---- DNS rebinding --------------------------------------------------------------


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no_token", "token"])
async def test_a_rebinding_host_is_refused_on_every_route_but_healthz(
    serve: Serve, token: str | None
) -> None:
    """A page of rebind.attacker.example whose name now resolves to 127.0.0.1
    sends its own name as Host: 403 bad_host, counted, before any data is read
    (with the token too: a local page could have learnt it)."""
    telemetry = populated_telemetry()
    base = await serve(telemetry, token)
    port = URL(base).port
    for route in (*DATA_ROUTES, "/"):
        for host in (REBIND, f"{REBIND}:{port}"):
            status, _, body = await fetch(base + route, {**AUTH, "Host": host})
            assert status == 403, (route, host, status)
            assert json.loads(body)["reason"] == "bad_host"
            assert "mallory" not in body and "train_loss" not in body
    assert rejected(telemetry)["bad_host"] == 10
    # /healthz answers any Host (k8s probes send the pod's IP): only "ok".
    status, _, body = await fetch(base + "/healthz", {"Host": REBIND})
    assert (status, body) == (200, "ok")


async def test_loopback_names_the_bound_host_and_allowed_names_are_answered(serve: Serve) -> None:
    telemetry = populated_telemetry()
    base = await serve(telemetry, TOKEN, allowed_hosts=["node-a.lan"])
    port = URL(base).port
    for host in (
        "localhost",
        f"localhost:{port}",
        f"LocalHost.:{port}",
        "127.0.0.1",
        f"127.0.0.1:{port}",
        "127.0.0.2",
        "[::1]",
        f"[::1]:{port}",
        "node-a.lan",
        f"node-a.lan:{port}",
    ):
        for route in (*DATA_ROUTES, "/"):
            status, _, _ = await fetch(base + route, {**AUTH, "Host": host})
            assert status == 200, (route, host)
    for host in (
        "node-a.lan.attacker.example",
        "localhost.attacker.example",
        "127.0.0.1.nip.io",
        "10.0.0.5",
        f"10.0.0.5:{port}",
        "[fd00::5]",
        "localhost:notaport",
        "[::1",
    ):
        status, _, _ = await fetch(base + "/status", {**AUTH, "Host": host})
        assert status == 403, host
    assert rejected(telemetry)["bad_host"] == 8


async def test_bound_to_every_interface_any_ip_address_is_a_host(serve: Serve) -> None:
    """Bound to 0.0.0.0 (containers, k8s), Prometheus and probes send the pod's
    IP as Host: any IP literal is answered (a rebinding page cannot send one),
    names still must be allowed."""
    base = await serve(populated_telemetry(), TOKEN, host="0.0.0.0")
    for host in ("10.1.2.3:8000", "10.1.2.3", "[fd00::5]:8000", "localhost:8000"):
        status, _, _ = await fetch(base + "/metrics", {**AUTH, "Host": host})
        assert status == 200, host
    for host in (REBIND, "p2pfl-a.default.svc"):
        status, _, _ = await fetch(base + "/metrics", {**AUTH, "Host": host})
        assert status == 403, host


async def raw_get(port: int, host_header: bytes, path: str = "/status") -> tuple[int, bytes]:
    """One GET with the Host header's bytes as given (a client library would
    refuse to send them): (status, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"GET {path} HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n".encode()
        + b"Host: "
        + host_header
        + b"\r\nConnection: close\r\n\r\n"
    )
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


# Ports in digits that are not ASCII: "²".isdigit() is True but int("²") raises
# (a 500 with a traceback, before the fix); "١٢" (Arabic-Indic) was read as 12.
NON_ASCII_PORTS = ("localhost:\u00b2", "127.0.0.1:\u0661\u0662", "localhost:\uff18\uff10")


async def test_a_port_in_digits_that_are_not_ascii_is_refused_like_any_bad_host(
    serve: Serve,
) -> None:
    telemetry = populated_telemetry()
    port = URL(await serve(telemetry, TOKEN)).port
    for host in NON_ASCII_PORTS:
        status, body = await raw_get(port, host.encode("utf-8"))
        assert status == 403 and json.loads(body)["reason"] == "bad_host", (host, status, body)
    assert rejected(telemetry)["bad_host"] == len(NON_ASCII_PORTS)
    assert (await raw_get(port, b"localhost:8000"))[0] == 200


async def test_the_relays_status_refuses_a_non_ascii_port_too(roster: Any) -> None:
    from node.relay import RelayServer
    from node.relay_status import create_relay_status_app
    from p2pfl.config import RelaySettings

    server = RelayServer(
        "r1", "f", roster, RelaySettings(), max_message_bytes=1 << 20, clock_skew_s=60
    )
    app = create_relay_status_app(server, token=TOKEN)
    runner, port = await start_status_server(app, "127.0.0.1", 0)
    try:
        for host in NON_ASCII_PORTS:
            status, body = await raw_get(port, host.encode("utf-8"))
            assert status == 403 and json.loads(body)["reason"] == "bad_host", (host, status)
        assert (await raw_get(port, b"localhost:8100"))[0] == 200
    finally:
        await runner.cleanup()
        await server.close()
    assert server.snapshot()["refusals"] == {"bad_host": len(NON_ASCII_PORTS)}


# ---- cross-origin requests ------------------------------------------------------


async def test_a_request_from_another_origin_is_refused_on_data_routes(serve: Serve) -> None:
    telemetry = populated_telemetry()
    base = await serve(telemetry, TOKEN)
    port = URL(base).port
    foreign = (
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Origin": f"http://localhost:{port}"},  # sent to 127.0.0.1: another origin
        {"Origin": f"http://127.0.0.1:{port + 1}"},
        {"Origin": f"https://127.0.0.1:{port}"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
    )
    for route in DATA_ROUTES:
        for headers in foreign:
            status, _, body = await fetch(base + route, {**AUTH, **headers})
            assert (status, json.loads(body)["reason"]) == (403, "bad_origin"), (route, headers)
    assert rejected(telemetry)["bad_origin"] == len(DATA_ROUTES) * len(foreign)
    # The dashboard's own requests: same origin, or no Origin at all.
    for headers in ({"Origin": base}, {"Sec-Fetch-Site": "same-origin"}, {}):
        status, _, _ = await fetch(base + "/status", {**AUTH, **headers})
        assert status == 200, headers


# ---- a token by default ---------------------------------------------------------


def site_config(tmp_path: Path, **status: Any) -> Any:
    raw = {
        "node": {"name": "a", "state_dir": "state"},
        "federation": {"id": "f", "roster": "roster.yaml"},
        "protocol": {"name": "probe"},
        "status": status,
    }
    return config_from_dict(raw, tmp_path / "site.yaml", check_files=False)


async def test_without_a_configured_token_the_node_keeps_a_random_one_in_its_state(
    tmp_path: Path,
) -> None:
    """No status.token and no token_file: the node writes a random token to
    STATE/status.token (0600) once and reuses it; no token -> 401 on loopback."""
    from node.status import config_status_app

    app, token = config_status_app(site_config(tmp_path), Telemetry("a"))
    path = tmp_path / "state" / "status.token"
    assert path.read_text().strip() == token and len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    runner, port = await start_status_server(app, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    try:
        for route in DATA_ROUTES:
            assert (await fetch(base + route))[0] == 401, route
            ok = await fetch(base + route, {"Authorization": f"Bearer {token}"})
            assert ok[0] == 200, route
    finally:
        await runner.cleanup()
    # A restart reuses it (bookmarks and scrape configs keep working).
    assert config_status_app(site_config(tmp_path), Telemetry("a"))[1] == token


def test_a_configured_token_wins_and_a_short_or_missing_token_file_is_a_config_error(
    tmp_path: Path,
) -> None:
    from node.status import status_token
    from p2pfl.config import ConfigError

    assert status_token(site_config(tmp_path, token=TOKEN)) == TOKEN
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)  # others may not read it (tests/test_key_lifecycle.py)
    assert status_token(site_config(tmp_path, token_file="token")) == TOKEN
    assert not (tmp_path / "state" / "status.token").exists()
    token_file.write_text("short\n")
    with pytest.raises(ConfigError, match="status.token_file: .*fewer than 16"):
        status_token(site_config(tmp_path, token_file="token"))
    with pytest.raises(ConfigError, match="status.token_file: cannot read"):
        status_token(site_config(tmp_path, token_file="absent"))


def _planted_token(path: Path, how: str) -> None:
    """STATE/status.token as someone else could have left it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "a_symbolic_link":
        elsewhere = path.parent.parent / "planted.token"
        elsewhere.write_text("p" * 43 + "\n")
        elsewhere.chmod(0o600)
        path.symlink_to(elsewhere)
        return
    content = {
        "readable_by_others": "t" * 43,
        "whitespace_inside": "t" * 20 + " " + "t" * 20,
        "control_characters": "t" * 20 + "\x1b[2J" + "t" * 20,
        "too_long": "t" * 513,
        "too_short": "t" * 15,
        "not_ascii": "t" * 20 + "\u00e9" * 10,
    }[how]
    path.write_bytes(content.encode() + b"\n")
    path.chmod(0o644 if how == "readable_by_others" else 0o600)


@pytest.mark.parametrize(
    "how",
    [
        "a_symbolic_link",
        "readable_by_others",
        "whitespace_inside",
        "control_characters",
        "too_long",
        "too_short",
        "not_ascii",
    ],
)
def test_a_state_token_file_someone_else_made_or_exposed_is_refused(tmp_path: Path, how: str):
    """STATE/status.token was read whatever it was: a link to a token whoever
    made it knows, a file others may read, or text no node ever writes. Now
    refused at start with what to do (the relay's own file is read the same
    way: node/status.py read_own_token)."""
    from node.status import load_or_create_token, status_token
    from p2pfl.config import ConfigError

    path = tmp_path / "state" / "status.token"
    _planted_token(path, how)
    with pytest.raises(ConfigError, match="node.state_dir: .*status.token") as caught:
        status_token(site_config(tmp_path))
    message = str(caught.value)
    assert "chmod 600" in message and "delete it" in message, message
    assert "t" * 20 not in message and "p" * 20 not in message  # the token is not shown
    if how != "a_symbolic_link":
        path.unlink()
        made = load_or_create_token(path)  # deleted: a fresh one is made and read back
        assert status_token(site_config(tmp_path)) == made


def test_the_dashboard_url_carries_the_token_in_its_fragment() -> None:
    from node.status import dashboard_url

    assert dashboard_url("0.0.0.0", 8000, "abc") == "http://127.0.0.1:8000/#token=abc"
    assert dashboard_url("::1", 8001, "abc") == "http://[::1]:8001/#token=abc"
    assert dashboard_url("127.0.0.1", 8002, None) == "http://127.0.0.1:8002/"


def test_the_dashboard_banner_has_the_token_only_for_a_terminal() -> None:
    from node.status import dashboard_banner

    where = "state/status.token (readable by this user only)"
    on_tty = dashboard_banner("a", "0.0.0.0", 8000, "abc" * 8, where, terminal=True)
    assert on_tty == f"a: dashboard http://127.0.0.1:8000/#token={'abc' * 8}"
    logged = dashboard_banner("a", "0.0.0.0", 8000, "abc" * 8, where, terminal=False)
    assert logged == f"a: dashboard http://127.0.0.1:8000/ (token in {where})"


@pytest.mark.parametrize("terminal", [False, True], ids=["journal", "terminal"])
def test_a_node_prints_its_status_token_only_to_a_terminal(
    tmp_path: Path, capsys, monkeypatch, terminal: bool
) -> None:
    """The node printed `dashboard http://...#token=...` to stderr whatever it
    was: under systemd, docker or Kubernetes that is the journal or a log
    collector, which others read. A real node (in this process; its stderr
    is not a terminal unless the test says so) prints the token to a terminal
    only, and otherwise where the token is."""
    from inproc_util import InProcessFederation

    import node.daemon
    from node.provision import provision

    monkeypatch.setattr(node.daemon, "_is_terminal", lambda stream: terminal)
    plans = provision(
        tmp_path / "fed",
        ["a", "b"],
        protocol={"name": "probe", "rounds": 1},
        overrides={"node": {"startup_wait_s": 1}},
        per_site={"a": {"status": {"token_file": None}}},
    )
    with InProcessFederation(plans[:1]):
        pass
    token_file = plans[0].config_path.parent / "state" / "status.token"
    token = token_file.read_text().strip()
    printed = capsys.readouterr().err
    assert (token in printed) is terminal, printed
    assert f"dashboard http://127.0.0.1:{plans[0].status_port}/" in printed
    if not terminal:
        assert f"(token in {token_file} (readable by this user only))" in printed


def _token_in_child(path: str, barrier: Any, out: Any) -> None:
    from node.status import load_or_create_token

    barrier.wait()
    out.put(load_or_create_token(Path(path)))


def test_two_processes_creating_the_token_at_once_agree_on_one(tmp_path: Path) -> None:
    """A node and a relay (or two relays) started at once on one folder: the
    token file is created once, never replaced, so every process serves the
    token that is on disk. First the race forced (the file appears between the
    check and the write), then 8 real processes released together."""
    import multiprocessing

    import node.status as status_mod

    path = tmp_path / "status.token"
    theirs = "t" * 43
    path.write_text(theirs + "\n")
    path.chmod(0o600)
    # the other process's file appears after this one looked: it is kept, and read
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(status_mod.os.path, "lexists", lambda p: False)
        assert status_mod.load_or_create_token(path) == theirs
    assert path.read_text() == theirs + "\n"
    assert [p.name for p in tmp_path.iterdir()] == ["status.token"]  # no temporary left

    ctx = multiprocessing.get_context("fork")
    for attempt in range(3):
        target = tmp_path / f"race{attempt}" / "status.token"
        barrier, out = ctx.Barrier(8), ctx.Queue()
        procs = [
            ctx.Process(target=_token_in_child, args=(str(target), barrier, out)) for _ in range(8)
        ]
        for proc in procs:
            proc.start()
        tokens = [out.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
            assert proc.exitcode == 0
        assert len(set(tokens)) == 1 and tokens[0] == target.read_text().strip()
        assert stat.S_IMODE(target.stat().st_mode) == 0o600
        assert [p.name for p in target.parent.iterdir()] == ["status.token"]


def test_a_token_file_in_the_state_dir_is_read_as_the_nodes_own(tmp_path) -> None:
    """provision names `status.token_file: state/status.token`: a second
    review found that path read with no check at all (mode 644, a link to a
    file others wrote). A token file in the state dir is the node's own, and a
    token file of another account is refused wherever it is kept."""
    import os

    from node.status import TokenFileError, read_own_token, status_token
    from p2pfl.config.errors import ConfigError

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    token_file = state / "status.token"
    token_file.write_text("A" * 32 + "\n")
    token_file.chmod(0o644)
    cfg = site_config(tmp_path, token_file="state/status.token")
    with pytest.raises(ConfigError, match="others may read it"):
        status_token(cfg)
    token_file.chmod(0o600)
    assert status_token(cfg) == "A" * 32
    if os.getuid() == 0:  # another account's file: root can make one
        os.chown(token_file, 12345, 12345)
        with pytest.raises(TokenFileError, match="belongs to uid 12345"):
            read_own_token(token_file)
