"""bench.personalization: every method x protocol on one partition, in one run;
FedBN is reported not applicable for FedSGDP2P with the node's own reason; the
table, results.json, the plot and the last stdout line agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import personalization
from bench.federation.specs import RunSpec, in_process_configs, partition

TINY = [
    "--data",
    "digits",
    "--nodes",
    "2",
    "--rounds",
    "1",
    "--partition",
    "iid",
    "--image-size",
    "8",
    "--max-steps-per-epoch",
    "2",
    "--seed",
    "1",
]
PROTOCOLS = ("fedavgp2p", "fedsgdp2p")


def test_every_method_and_protocol_in_one_run_with_fedbn_not_applicable_to_fedsgd(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pers"
    code = personalization.main([*TINY, "--protocols", ",".join(PROTOCOLS), "--out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert json.loads(lines[-1]) == results["summary"]

    methods = list(personalization.METHODS)
    assert methods == ["none", "finetune", "ditto", "fedbn", "label_skew"]
    cells = {(c["protocol"], c["method"]): c for c in results["cells"]}
    assert set(cells) == {(p, m) for p in PROTOCOLS for m in methods}
    assert set(results["summary"]["cells"]) == {f"{p}/{m}" for p, m in cells}

    # FedBN needs a merge of models: FedSGDP2P's nodes refuse it, and say why
    refused = cells[("fedsgdp2p", "fedbn")]
    assert refused["status"] == "not_applicable"
    assert "local_norm" in refused["reason"] and "aggregate" in refused["reason"]
    assert results["summary"]["cells"]["fedsgdp2p/fedbn"] == {"not_applicable": refused["reason"]}
    ok = {key: c for key, c in cells.items() if key != ("fedsgdp2p", "fedbn")}
    assert all(c["status"] == "ok" for c in ok.values())

    # every site of every run is compared with the same site alone, on the same partition
    alone = results["standalone"]["per_site"]
    assert set(alone) == {"site_0", "site_1"}
    for cell in ok.values():
        sites = cell["sites"]["sites"]
        assert [s["node"] for s in sites] == ["site_0", "site_1"]
        for s in sites:
            assert s["standalone_macro_f1"] == pytest.approx(
                alone[s["node"]]["best_macro_f1"], abs=1e-4
            )
            assert s["gain_macro_f1"] == pytest.approx(
                s["macro_f1"] - s["standalone_macro_f1"], abs=2e-4
            )
        summary = cell["summary"]
        assert summary["min_gain_macro_f1"] == pytest.approx(
            min(s["gain_macro_f1"] for s in sites), abs=1e-4
        )
        assert summary["sites_compared"] == 2 and 0.0 <= summary["share_gained"] <= 1.0
        last = [r for r in cell["rounds"] if r["round"] == 1]
        assert len(last) == 2 and all("reported_macro_f1" in r for r in last)

    # the methods really ran: no personal model without one; fine-tuning and
    # Ditto trained theirs (Ditto every round, beside the federated model)
    for protocol in PROTOCOLS:
        assert ok[(protocol, "none")]["summary"]["sites_reporting_personal"] == 0
        assert all(
            "personal_macro_f1" in r
            for r in ok[(protocol, "finetune")]["rounds"]
            if r["round"] == 1
        )
        assert all("personal_loss" in r for r in ok[(protocol, "ditto")]["rounds"])

    # the table: the standalone line and one line per method x protocol
    start = lines.index(next(line for line in lines if line.startswith("method ")))
    table = lines[start + 2 : start + 3 + len(cells)]
    assert table[0].startswith("standalone")
    rows = {tuple(line.split()[:2]) for line in table[1:]}
    assert rows == {(m, p) for p, m in cells}
    (na_line,) = [line for line in table if line.split()[:2] == ["fedbn", "fedsgdp2p"]]
    assert "n/a" in na_line

    plot = Path(results["plots"]["gain"])
    assert plot == out / personalization.PLOT_NAME
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_method_sets_only_its_own_training_fields(tmp_path: Path) -> None:
    spec = RunSpec(nodes=2, data="digits", partition="iid", image_size=8)
    sources, _ = partition(spec, tmp_path / "data")
    seen = {}
    for method, fields in personalization.METHODS.items():
        configs = in_process_configs(spec, sources, tmp_path / method, fields)
        training = configs[0].training
        seen[method] = (
            training.personalization.method,
            training.personalization.local_norm,
            training.logit_adjustment,
        )
        # the rest of the training section is the run's own, identical for every method
        assert (training.seed, training.epochs, training.lr) == (spec.seed, spec.epochs, spec.lr)
    assert seen == {
        "none": ("none", False, False),
        "finetune": ("finetune", False, False),
        "ditto": ("ditto", False, False),
        "fedbn": ("none", True, False),
        "label_skew": ("none", False, True),
    }


def test_unknown_method_or_protocol_is_refused_with_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for flag, value in (("--methods", "none,fedprox"), ("--protocols", "fedavgp2p,nope")):
        with pytest.raises(SystemExit) as exc:
            personalization.main(["--out", "x", flag, value])
        assert exc.value.code == 2
        assert "use a comma list of" in capsys.readouterr().err
