"""p2pfl/files.py: crash-safe writes keep their mode and never write through a
link planted at their temporary name."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from p2pfl.files import (
    atomic_savefig,
    atomic_torch_save,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    make_private_dir,
    make_private_tree,
)


def test_a_write_is_whole_with_the_asked_mode_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "key.pem"
    atomic_write_text(target, "old", mode=0o600)
    previous = os.umask(0o077)
    try:
        atomic_write_bytes(target, [b"new ", memoryview(b"bytes")], mode=0o644)
    finally:
        os.umask(previous)
    assert target.read_bytes() == b"new bytes"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # not narrowed by the umask
    assert sorted(p.name for p in target.parent.iterdir()) == ["key.pem"]
    atomic_write_json(target, {"a": 1}, mode=0o600)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and '"a": 1' in target.read_text()


def test_a_link_or_file_planted_at_a_temporary_name_is_never_written(tmp_path):
    """Anyone who can write the folder (an existing `partition --out` keeps its
    mode) could plant the fixed temporary name: a link was refused, but a plain
    0666 file of theirs was opened and written, and a review's other account
    owned the site copy renamed over the target. The temporary file is now
    created O_EXCL under a name no one can guess: what is planted is ignored."""
    secret = tmp_path / "elsewhere.txt"
    secret.write_text("not yours")
    os.chmod(secret, 0o600)
    folder = tmp_path / "state"
    folder.mkdir()
    (folder / ".status.token.tmp").symlink_to(secret)
    (folder / ".site_0.npz.tmp").write_bytes(b"")
    os.chmod(folder / ".site_0.npz.tmp", 0o666)
    atomic_write_text(folder / "status.token", "token", mode=0o644)
    atomic_write_bytes(folder / "site_0.npz", b"images")
    assert secret.read_text() == "not yours"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert (folder / "status.token").read_text() == "token"
    assert (folder / ".site_0.npz.tmp").read_bytes() == b""  # the planted file: untouched
    assert (folder / "site_0.npz").read_bytes() == b"images"
    assert (folder / "site_0.npz").stat().st_ino != (folder / ".site_0.npz.tmp").stat().st_ino
    assert stat.S_IMODE((folder / "site_0.npz").stat().st_mode) == 0o600
    assert sorted(p.name for p in folder.iterdir()) == [
        ".site_0.npz.tmp",
        ".status.token.tmp",
        "site_0.npz",
        "status.token",
    ]


def test_a_failed_write_leaves_no_temporary(tmp_path):
    def chunks():
        yield b"half"
        raise RuntimeError("the source failed")

    with pytest.raises(RuntimeError):
        atomic_write_bytes(tmp_path / "a.bin", chunks())
    assert list(tmp_path.iterdir()) == []


def test_private_folders_are_tightened_and_figures_and_weights_keep_their_mode(tmp_path):
    """What is derived from private images (a figure of them, weights trained on
    them) is written 0600 under the usual umask 022, into a folder made 0700 even
    when `p2pfl-node provision` left it 0755."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    previous = os.umask(0o022)
    try:
        private = make_private_dir(state / "genbuffer")
        make_private_dir(state)
        figure = Figure(figsize=(1, 1))
        FigureCanvasAgg(figure)
        atomic_savefig(figure, private / "grid.png", mode=0o600)
        atomic_torch_save({"w": 1}, private / "generator.pt", mode=0o600)
    finally:
        os.umask(previous)
    for folder in (state, private):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert sorted(p.name for p in private.iterdir()) == ["generator.pt", "grid.png"]
    for path in private.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert (private / "grid.png").read_bytes().startswith(b"\x89PNG")


def _modes(root):
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_every_file_a_node_keeps_is_created_0600_under_umask_022(tmp_path, monkeypatch):
    """Review finding 3: the model, the queues, the logs and the DP ledger were
    created 0644 (or with the umask), so a state folder the node cannot make
    0700 (a volume root it does not own) let any account read the weights.
    Each writer of the state directory is called here, directly, in a folder
    left 0755 as such a mount stays; every file must come out 0600."""
    import asyncio
    import json
    import time

    import torch

    from node.queues import (
        Checkpoints,
        Journal,
        Outbox,
        OutboxEntry,
        ReplayMarks,
        Spool,
    )
    from p2pfl.config.sections import DPSection
    from p2pfl.files import append_lines, open_append
    from p2pfl.learning.dp import DPTraining
    from p2pfl.learning.mae import save_encoder
    from p2pfl.learning.mae_site import save_image_grid
    from p2pfl.learning.tokenizer import save_tokenizer
    from protocols.compressed_exchange import CompressedExchange
    from protocols.exchange import ServedModels

    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o755)
    previous = os.umask(0o022)
    try:
        Spool(state / "spool").persist("ab" * 16, b"P2FL frame bytes")
        Outbox(state / "outbox").add(
            OutboxEntry(b"\x01" * 16, "b", "relay", 3, {"w": torch.ones(4)}, 0.0)
        )
        Checkpoints(state / "checkpoints").save({"round": 3, "protocol": {"w": torch.ones(4)}})
        Journal(state / "journal.jsonl").append([{"id": "ab" * 16, "ts": 1}])
        with open_append(state / "metrics.jsonl") as fh:  # as Node opens it
            fh.write(json.dumps({"round": 1}) + "\n")
        append_lines(state / "faults.events.jsonl", ["{}"])
        marks = ReplayMarks(state / "replay_marks.json", margin_s=1.0, clock_skew_s=300.0)
        asyncio.run(marks.cover("b", int(time.time() * 1000)))
        dp = DPTraining(DPSection(noise_multiplier=1.0), n_train=100, batch_size=10, total_steps=4)
        dp.keep_ledger(state / "dp_ledger.json")
        dp.step_taken()
        exchange = CompressedExchange(
            ServedModels(3),
            compression="fp16",
            max_staleness=1,
            timeout=1.0,
            max_norm_ratio=10.0,
            max_weight_ratio=16.0,
        )
        exchange.path = state / "compression.safetensors"
        exchange.write([("sent", "b", 1, {"w": torch.ones(4)})])
        assert list((state / "compression.copies").iterdir())

        class Encoder:
            def encoder_state_dict(self):
                return {"w": torch.ones(2)}

        save_encoder(Encoder(), state / "pretrained_encoder.pt")
        save_tokenizer(torch.nn.Linear(2, 2), state / "tokenizer.pt")
        save_image_grid(state / "mae_reconstruction.png", [("x", lambda ax, row: None)], 1)
    finally:
        os.umask(previous)
    modes = _modes(state)
    assert len(modes) == 13, modes
    assert all(mode == 0o600 for mode in modes.values()), {k: oct(v) for k, v in modes.items()}
    for folder in ("spool", "outbox", "checkpoints", "compression.copies"):
        assert stat.S_IMODE((state / folder).stat().st_mode) == 0o700, folder
    # A metrics file an older version left 0644 is narrowed when the node opens it.
    os.chmod(state / "metrics.jsonl", 0o644)
    open_append(state / "metrics.jsonl").close()
    assert stat.S_IMODE((state / "metrics.jsonl").stat().st_mode) == 0o600


def test_an_export_the_operator_asked_for_is_written_readable_on_purpose(tmp_path):
    """Only what a caller names PUBLIC_FILE is 0644: the model card of an export
    and a roster of public keys."""
    from p2pfl.files import PUBLIC_FILE

    previous = os.umask(0o077)
    try:
        atomic_write_text(tmp_path / "model_card.md", "card", mode=PUBLIC_FILE)
        atomic_write_text(tmp_path / "private.json", "{}")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "model_card.md").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private.json").stat().st_mode) == 0o600


def test_a_folder_that_cannot_be_made_private_is_named_in_one_warning(
    tmp_path, monkeypatch, caplog
):
    """A folder this account does not own (chmod refused, as on a volume root
    under fsGroup) stays as it is, and the log says so once, with its mode."""
    import pathlib

    folder = tmp_path / "mounted"
    folder.mkdir()
    os.chmod(folder, 0o2775)

    def refuse(self, mode, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(self))

    monkeypatch.setattr(pathlib.Path, "chmod", refuse)
    with caplog.at_level("WARNING", logger="p2pfl.files"):
        make_private_dir(folder)
        make_private_dir(folder)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert str(folder) in warnings[0] and "mode 2775" in warnings[0], warnings[0]
    assert "Operation not permitted" in warnings[0] and "0600" in warnings[0]
    # a folder it can tighten says nothing
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level("WARNING", logger="p2pfl.files"):
        make_private_dir(tmp_path / "own")
    assert not caplog.records


def test_an_append_after_a_torn_last_line_starts_a_line_of_its_own(tmp_path, caplog):
    """Review finding 4: an append glued onto the fragment a crash left made the
    new entry unreadable too. The fragment (here longer than the block the tail
    is searched in) is cut back to the last newline, durably and logged."""
    from p2pfl.files import TAIL_BLOCK, append_lines, cut_torn_tail, open_append

    log = tmp_path / "journal.jsonl"
    log.write_text('{"id": 1}\n' + '{"id": 2, "pad": "' + "x" * (2 * TAIL_BLOCK))
    with caplog.at_level("WARNING", logger="p2pfl.files"):
        append_lines(log, ['{"id": 3}'])
    assert log.read_text().splitlines() == ['{"id": 1}', '{"id": 3}']
    (message,) = [r.getMessage() for r in caplog.records]
    assert f"cut {2 * TAIL_BLOCK + 18} bytes" in message and '{"id": 2, "pad"' in message
    # a whole log is left alone; a log of one torn line is emptied
    assert cut_torn_tail(log) == 0 and cut_torn_tail(tmp_path / "absent") == 0
    (tmp_path / "m.jsonl").write_text('{"round": 1')
    with open_append(tmp_path / "m.jsonl") as fh:
        fh.write('{"round": 2}\n')
    assert (tmp_path / "m.jsonl").read_text() == '{"round": 2}\n'


def test_a_state_dir_of_an_older_version_is_made_private_file_by_file(
    tmp_path, monkeypatch, caplog
):
    """Review 2, finding 4: make_private_dir tightened only the state root and
    the queues' mkdir(exist_ok=True) never changed an existing folder, so the
    0644 checkpoints, encoder and spooled frames an older version left in 0755
    folders stayed readable after the upgrade. One walk at start narrows every
    folder to 0700 and every file to mode & ~0o077; a link is neither followed
    nor changed; what cannot be changed is named in one WARNING line."""
    from node.queues import Checkpoints, Spool

    state = tmp_path / "state"
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("not the node's")
    os.chmod(outside, 0o644)
    tree = {
        "checkpoints": 0o755,
        "checkpoints/ckpt-00000007.bin": 0o644,
        "compression": 0o775,
        "compression/copy.safetensors": 0o664,
        "pretrained_encoder.pt": 0o644,
        "tokenizer": 0o755,
        "tokenizer/deep": 0o711,
        "tokenizer/deep/vocab.json": 0o640,
        "run.sh": 0o755,
        "already.bin": 0o600,
        "mounted": 0o2775,
        "mounted/shared.bin": 0o644,
        "foreign.bin": 0o644,
    }
    for name, mode in tree.items():
        path = state / name
        if name.endswith((".bin", ".pt", ".json", ".safetensors", ".sh")):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
        else:
            path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, mode)
    os.chmod(state, 0o755)
    (state / "link.txt").symlink_to(outside)
    (state / "linkdir").symlink_to(tmp_path)
    refused = {str(state / "mounted"), str(state / "foreign.bin")}
    chmod = os.chmod

    def some_not_ours(path, mode, **kwargs):  # chmod as a non-owner gets it
        if str(path) in refused:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return chmod(path, mode, **kwargs)

    monkeypatch.setattr(os, "chmod", some_not_ours)
    with caplog.at_level("WARNING", logger="p2pfl.files"):
        make_private_tree(state)
    monkeypatch.undo()
    expected = {
        "checkpoints": 0o700,
        "checkpoints/ckpt-00000007.bin": 0o600,
        "compression": 0o700,
        "compression/copy.safetensors": 0o600,
        "pretrained_encoder.pt": 0o600,
        "tokenizer": 0o700,
        "tokenizer/deep": 0o700,
        "tokenizer/deep/vocab.json": 0o600,
        "run.sh": 0o700,
        "already.bin": 0o600,
        "mounted": 0o2775,  # refused: named below
        "mounted/shared.bin": 0o600,
        "foreign.bin": 0o644,  # refused: named below
    }
    found = {name: stat.S_IMODE((state / name).stat().st_mode) for name in expected}
    assert found == expected, {k: oct(v) for k, v in found.items()}
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644  # the link was not followed
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "2 entries" in warnings[0] and "Operation not permitted" in warnings[0]
    assert f"{state / 'mounted'} (2775" in warnings[0], warnings[0]
    assert f"{state / 'foreign.bin'} (0644" in warnings[0], warnings[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="p2pfl.files"):
        make_private_tree(state)  # nothing left to change: nothing said
    assert not caplog.records

    # the queues tighten their own folder too, not only create it
    for folder, opener in (("spool2", Spool), ("checkpoints2", Checkpoints)):
        (state / folder).mkdir(mode=0o755)
        os.chmod(state / folder, 0o755)
        opener(state / folder)
        assert stat.S_IMODE((state / folder).stat().st_mode) == 0o700, folder


def test_a_write_removes_the_temporaries_crashed_writes_left(tmp_path):
    """A kill -9 during an atomic write leaves its randomly named temporary file;
    nothing else deletes it, so a node in a crash loop (a 45 MB checkpoint each
    time) filled its checkpoints folder. The first write in a folder removes
    this module's own stale temporaries, and nothing else."""
    import time

    from p2pfl import files

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    old = time.time() - 3600
    dead = 999_999_999  # above any pid_max: no process
    stale = [folder / f".ckpt-{n:08d}.bin.{dead}.0123abc{n}.tmp" for n in range(2)]
    stale.append(folder / f".ckpt-00000002.bin.{os.getpid()}.01234567.tmp")  # pid 1 again
    running = folder / f".ckpt-00000003.bin.{os.getppid()}.89abcdef.tmp"  # another live writer
    running.write_bytes(b"r")
    os.utime(running, (time.time() - 3600, time.time() - 3600))
    for path in stale:
        path.write_bytes(b"x" * 1000)
        os.utime(path, (old, old))
    live = folder / f".ckpt-00000009.bin.{dead}.deadbeef.tmp"  # a write of a process started later
    live.write_bytes(b"y")
    os.utime(live, (time.time() + 60, time.time() + 60))
    other = folder / ".notes.tmp"  # not this module's pattern
    other.write_bytes(b"z")
    os.utime(other, (old, old))
    target = tmp_path / "elsewhere"
    target.write_bytes(b"t")
    link = folder / f".ckpt-00000008.bin.{dead}.feedface.tmp"
    link.symlink_to(target)
    files.atomic_write_bytes(folder / "ckpt-00000004.bin", b"data")
    assert not any(p.exists() for p in stale)
    assert live.exists() and other.exists() and link.is_symlink() and target.exists()
    assert running.exists()
    assert (folder / "ckpt-00000004.bin").read_bytes() == b"data"
