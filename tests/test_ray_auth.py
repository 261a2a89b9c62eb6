"""The Ray engine's own Ray asks for a token (a key review): its GCS, raylet
and worker ports listen on every interface, and a Ray without token auth let
a process with no credential join the simulation's cluster and run code
(/tmp/r4_scratch/f7_ray_noauth.py showed it against `connect(None)` with
RAY_AUTH_MODE=disabled, the default of the Ray versions the extra allowed).
Starting Ray takes longer than a test here may, so what is checked is what
`connect(None)` and `local_cluster` hand Ray: the environment it reads."""

from __future__ import annotations

import logging
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocols.memory import ray_engine

REPO = Path(__file__).resolve().parents[1]
RAY_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@pytest.fixture(autouse=True)
def ray_auth_restored() -> Iterator[None]:
    """require_ray_auth sets RAY_AUTH_MODE and RAY_AUTH_TOKEN with setdefault
    (monkeypatch.delenv of an unset name does not undo that) and refreshes
    Ray's cached copies: put all of it back, or a later test's own Ray
    (tests/test_ray_engine.py) starts in a mode its driver does not share."""
    saved = {name: os.environ.get(name) for name in RAY_ENV}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def test_a_ray_of_its_own_is_started_with_token_authentication(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    ray_engine.require_ray_auth()
    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_an_operator_who_turns_it_off_is_warned(monkeypatch, caplog):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with caplog.at_level(logging.WARNING):
        ray_engine.require_ray_auth()
    assert "accepts anyone who reaches its ports" in caplog.text


def test_both_ways_of_starting_ray_ask_for_it():
    source = Path(ray_engine.__file__).read_text()
    for function in ("def connect(", "def local_cluster("):
        body = source[source.index(function) :].split("\ndef ", 1)[0]
        assert "require_ray_auth()" in body, function
        assert body.index("require_ray_auth()") < body.index(
            "ray.init(" if "connect" in function else "Cluster("
        )


def test_the_ray_extra_needs_a_ray_that_has_token_authentication():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["ray"]
    (floor,) = [re.fullmatch(r"ray>=(\d+)\.(\d+)(?:\.\d+)?", spec) for spec in extra]
    assert floor is not None and (int(floor[1]), int(floor[2])) >= (2, 52)


def test_the_token_is_in_the_environment_not_a_file_other_accounts_may_read(monkeypatch, tmp_path):
    # Before: Ray wrote the token it generated to ~/.ray/auth_token by a plain
    # open(): 0644 under umask 022, so any account on the host could join.
    setup = pytest.importorskip("ray._private.authentication.authentication_token_setup")
    from ray._raylet import AuthenticationTokenLoader

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    old = os.umask(0o022)
    try:
        ray_engine.require_ray_auth()
        AuthenticationTokenLoader.instance().reset_cache()
        setup.ensure_token_if_auth_enabled(None, create_token_if_missing=True)  # ray.init's
    finally:
        os.umask(old)
        AuthenticationTokenLoader.instance().reset_cache()
    assert not (tmp_path / ".ray" / "auth_token").exists()
    token = os.environ["RAY_AUTH_TOKEN"]
    assert len(token) == 64
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the operator's")  # theirs is kept
    ray_engine.require_ray_auth()
    assert os.environ["RAY_AUTH_TOKEN"] == "the operator's"


def test_the_driver_sees_the_mode_and_token_its_ray_processes_get(monkeypatch, tmp_path):
    # Before: Ray caches the mode and token at import; the env set afterwards
    # reached the GCS (token mode) but not the driver (auth off, no token made),
    # and the GCS died: "Token authentication is enabled but Ray couldn't find
    # an authentication token" (a live start with ray 2.60).
    pytest.importorskip("ray")
    from ray._raylet import AuthenticationTokenLoader, Config, get_authentication_mode

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    Config.initialize("")  # what an earlier import of Ray cached
    AuthenticationTokenLoader.instance().reset_cache()
    disabled = get_authentication_mode()
    ray_engine.require_ray_auth()
    assert get_authentication_mode() != disabled
    assert AuthenticationTokenLoader.instance().get_raw_token() == os.environ["RAY_AUTH_TOKEN"]
