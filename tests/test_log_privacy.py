"""stderr never names a patient's data file: a review put an unreadable image named
`DOE_JANE_MRN4471920_1961-03-02.png` in a site's folder, and the node's failure
(a DataError's message and traceback) printed that name on stderr, which under
systemd, docker or Kubernetes is a journal or a log collector that others read.
node.log (0600) keeps the whole message; stderr gets the error's kind and reason."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from node.logsetup import configure_logging, stderr_error
from p2pfl.config import DataSection
from p2pfl.learning.data import DataError, load_site_data
from protocols.memory import simulation_configs

PATIENT = "DOE_JANE_MRN4471920_1961-03-02"


def _folder_with_a_patients_broken_file(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls in ("normal", "pneumonia"):
            (root / split / cls).mkdir(parents=True)
            for i in range(3):
                image = rng.integers(0, 256, (8, 8), dtype=np.uint8)
                Image.fromarray(image).save(root / split / cls / f"{i}.png")
    (root / "train" / "pneumonia" / f"{PATIENT}.png").write_bytes(b"not a png")
    return root


def test_a_data_error_names_the_patients_file_in_node_log_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _folder_with_a_patients_broken_file(tmp_path / "images")
    with pytest.raises(DataError) as raised:
        load_site_data(DataSection(source=str(source), image_size=8), seed=0)
    assert PATIENT in str(raised.value)  # the operator's log must say which file
    (cfg,) = simulation_configs(
        ["digits"], protocol={"name": "fedavgp2p"}, state_root=tmp_path / "state"
    )
    Path(cfg.node.state_dir).mkdir(parents=True)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging(cfg)
        log = logging.getLogger("node.daemon")
        try:
            raise RuntimeError("setup failed") from raised.value
        except RuntimeError:
            log.exception("a: protocol %s failed", "fedavgp2p")
        log.error("a: cannot read %s", raised.value)
        log.warning("a: %s%%", "an unrelated line")
        for handler in root.handlers:
            handler.flush()
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
            handler.close()
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
    err = capsys.readouterr().err
    assert PATIENT not in err, err
    assert err.count("<DataError corrupt_image: the file it names is in node.log>") == 2, err
    assert "a: protocol fedavgp2p failed" in err and "a: an unrelated line%" in err
    assert "Traceback" not in err
    kept = (Path(cfg.node.state_dir) / "node.log").read_text()
    assert kept.count(PATIENT) >= 2 and "Traceback" in kept  # the operator's copy is whole
    # the node's last stderr line on exit (node/daemon.py serve)
    assert PATIENT not in stderr_error(raised.value)
    assert stderr_error(ValueError("x")) == "ValueError: x"


def test_status_withholds_the_patients_file_name_too(tmp_path: Path) -> None:
    """/status's `error` said the whole message: the ServiceMonitor hands the status
    token to Prometheus, and a review read DOE_JANE_MRN...png there from a real
    node whose data folder held the file. It says what stderr says now."""
    from inproc_util import InProcessFederation

    from node.provision import provision
    from p2pfl.learning.data.partition import partition_dataset

    partition_dataset("digits", 1, "iid", tmp_path / "parts", seed=0)
    source = _folder_with_a_patients_broken_file(tmp_path / "images")
    plans = provision(
        tmp_path / "fed",
        ["a", "c"],
        protocol={"name": "fedavgp2p", "rounds": 1, "fraction": 1.0, "round_timeout_s": 5},
        data_sources=[str(tmp_path / "parts" / "site_0.npz"), str(source)],
        overrides={
            "transport": {"heartbeat_s": 0.5, "suspect_after_s": 3.0, "dead_after_s": 6.0},
            "node": {"exit_when_done": True, "startup_wait_s": 2},
            "data": {"image_size": 8, "augment": "none"},
            "training": {"max_steps_per_epoch": 1, "batch_size": 16, "threads": 1},
        },
    )
    with InProcessFederation(plans) as fed:
        status = fed["c"].wait_for(lambda s: bool(s.get("error")), 60, "c's failure")
        fed.stop_all()
    assert (
        status["error"] == "DataError: <DataError corrupt_image: the file it names is in node.log>"
    )
    # (node.log keeps the whole message: the test above; an in-process node has none)
