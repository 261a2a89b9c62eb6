"""Roster cards of outbound-only sites (address null, via relays) and the
roster's `relays:` list (issue 31): what loads, what round-trips, and the one-line
refusals of what cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from node.cli import main
from p2pfl.secure.identity import IdentityError, LocalIdentity, Roster


def write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "roster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def cards() -> tuple[dict, dict]:
    reachable = LocalIdentity.generate("a").card("127.0.0.1:7000").to_dict()
    behind = LocalIdentity.generate("c").card("unused").to_dict()
    behind.update(address=None, via=["r1", "r2"])
    return reachable, behind


RELAYS = [{"name": "r1", "address": "10.0.0.9:7100"}, {"name": "r2", "address": "127.0.0.1:7000"}]


def test_an_outbound_only_card_loads_and_round_trips(tmp_path):
    a, c = cards()
    roster = Roster.load(write(tmp_path, {"sites": [a, c], "relays": RELAYS}))
    assert roster["c"].address is None and roster["c"].card.via == ("r1", "r2")
    assert roster["a"].card.via == ()
    assert roster.relays == {"r1": "10.0.0.9:7100", "r2": "127.0.0.1:7000"}
    again = Roster.load(roster.save(tmp_path / "copy.yaml"))
    assert again.relays == roster.relays
    assert again["c"].card == roster["c"].card
    saved = yaml.safe_load((tmp_path / "copy.yaml").read_text())
    assert "via" not in saved["sites"][0]  # only outbound-only cards carry it
    assert saved["sites"][1]["address"] is None


def test_a_roster_without_relays_saves_as_before(tmp_path):
    a, _ = cards()
    roster = Roster.load(write(tmp_path, {"sites": [a]}))
    assert roster.relays == {}
    assert "relays" not in yaml.safe_load(roster.save(tmp_path / "copy.yaml").read_text())


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda a, c, d: c.pop("via"), "no relay is named"),
        (lambda a, c, d: c.update(via=["r9"]), "'r9'"),
        (lambda a, c, d: c.update(via="r1"), "via must be a list"),
        (lambda a, c, d: c.update(via=["r1", "r1"]), "distinct relay names"),
        (lambda a, c, d: c.update(address=""), "address must be HOST:PORT or null"),
        (
            lambda a, c, d: d.update(relays=[{"name": "a", "address": "x:1"}]),
            "both a site and a relay",
        ),
        (lambda a, c, d: d.update(relays=[{"name": "r1"}]), "exactly a name and an address"),
        (lambda a, c, d: d.update(relays=RELAYS + RELAYS[:1]), "listed twice"),
        (lambda a, c, d: d.update(relays={"r1": "x:1"}), "relays must be a list"),
    ],
)
def test_what_cannot_work_is_refused_in_one_line(tmp_path, change, says):
    a, c = cards()
    doc = {"sites": [a, c], "relays": list(RELAYS)}
    change(a, c, doc)
    with pytest.raises(IdentityError) as err:
        Roster.load(write(tmp_path, doc))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_roster_add_and_remove_keep_the_relays(tmp_path, capsys):
    a, c = cards()
    path = write(tmp_path, {"sites": [a, c], "relays": RELAYS})
    card = tmp_path / "b.card.yaml"
    card.write_text(yaml.safe_dump(LocalIdentity.generate("b").card("127.0.0.1:7002").to_dict()))
    assert main(["roster", "add", "--roster", str(path), str(card)]) == 0
    assert Roster.load(path).relays == {r["name"]: r["address"] for r in RELAYS}
    assert main(["roster", "remove", "--roster", str(path), "b"]) == 0
    assert Roster.load(path).relays == {r["name"]: r["address"] for r in RELAYS}
    assert main(["roster", "list", "--roster", str(path)]) == 0
    assert "c\tvia r1,r2" in capsys.readouterr().out
