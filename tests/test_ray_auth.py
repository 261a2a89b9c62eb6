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
from pathlib import Path

from protocols.memory import ray_engine

REPO = Path(__file__).resolve().parents[1]


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
