"""A manifest that parses is not trusted: its digest, its pieces, its kinds, shapes and types are checked;
saving deletes only its own folders; periodic checkpoints, --keep-last, and the run settings of a resume.

    pytest -m "not mpi" tests/checkpoint/test_manifest.py
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from minipar.checkpoint import sharded
from minipar.checkpoint.sharded import CheckpointError
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate

MARKER = ".minipar-checkpoints"  # checkpoint/sharded.py: this folder is minipar's

TINY = TrainConfig(model="gpt", precision="fp64", n_layer=1, n_head=2, d_model=8, seq_len=8, batch_size=4,
                   steps=2, lr=1e-2, quiet=True)


def run(cfg: TrainConfig) -> list[dict]:
    trainer = train.Trainer(cfg.resolved(1), MPI.COMM_SELF)
    records = trainer.run()
    trainer.memory.close()
    return records


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("saved")
    run(TINY.replace(save=str(directory)))
    return directory


def edited(saved: Path, tmp_path: Path, edit, redigest: bool = True) -> Path:
    """A copy of the checkpoint whose manifest `edit(manifest)` changed; its digest recomputed by the
    rule the format states (SHA-256 of the sorted JSON of every other key), unless redigest=False."""
    copy = tmp_path / "checkpoint"
    shutil.copytree(saved, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    if redigest:
        content = {key: value for key, value in manifest.items() if key != "sha256"}
        manifest["sha256"] = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def first(manifest: dict, name: str = "blocks.0.mlp.fc.weight") -> dict:
    return manifest["tensors"][name]["pieces"][0]


def remove_kind(manifest: dict, kind: str):
    first(manifest)["kinds"].remove(kind)


def set_key(key, value):
    return lambda manifest: manifest.__setitem__(key, value)


# each edit, and a piece of the one line that must refuse it (before: exit 0 or a traceback)
EDITS = [
    (lambda m: first(m).__setitem__("flat", [0, 100]), "leave 156 elements out"),  # 32 x 8 = 256: a hole
    (set_key("files", {}), "which the manifest does not list"),
    (set_key("step", True), "step True is not a non-negative integer"),
    (set_key("step", -1), "step -1 is not a non-negative integer"),
    (lambda m: m["tensors"]["head.lm_head.weight"].__setitem__("shape", [14, 8]), "has shape [14, 8]"),
    (lambda m: remove_kind(m, "exp_avg_sq"), "its optimizer state 'exp_avg_sq' is missing"),
    (lambda m: first(m).__setitem__("flat", [0, 10**9]), "is out of range"),
    (lambda m: first(m).__setitem__("shard", [0, 5, 2]), "is out of range"),
    (lambda m: m["tensors"]["embed.wte.weight"]["counts"].__setitem__("step", "2"), "not a count"),
    (lambda m: m["tensors"].pop("blocks.0.ln_1.bias"), "has no tensor 'blocks.0.ln_1.bias'"),
    (lambda m: m["files"].__setitem__("../../elsewhere.npz", {"bytes": 1, "sha256": "0"}),
     "not a file of its folder"),
]


@pytest.mark.parametrize("edit, message", EDITS, ids=[message for _, message in EDITS])
def test_a_manifest_that_parses_but_lies_is_refused_in_one_line(saved, tmp_path, edit, message):
    directory = edited(saved, tmp_path, edit)
    cfg = TINY.replace(resume=str(directory), steps=3)
    errors = validate(cfg, 1)
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0], errors
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        train.Trainer(cfg.resolved(1), MPI.COMM_SELF)


def test_an_edited_manifest_without_a_new_digest_is_refused(saved, tmp_path):
    directory = edited(saved, tmp_path, set_key("step", 1), redigest=False)
    [error] = validate(TINY.replace(resume=str(directory), steps=3), 1)
    assert "manifest.json was altered" in error


def test_pieces_must_cover_every_element_once():
    """check_cover on pieces written out by hand: two flat halves cover 12 elements; one half leaves 6
    out; a half twice holds 6 twice."""
    files = {"f": {}}
    halves = [{"file": "f", "shard": None, "flat": [0, 6], "kinds": ["param"]},
              {"file": "f", "shard": None, "flat": [6, 12], "kinds": ["param"]}]
    sharded.check_cover(halves, (3, 4), files, "t")
    with pytest.raises(CheckpointError, match="leave 6 elements out and hold 0 twice"):
        sharded.check_cover(halves[:1], (3, 4), files, "t")
    with pytest.raises(CheckpointError, match="leave 6 elements out and hold 6 twice"):
        sharded.check_cover([halves[0], halves[0]], (3, 4), files, "t")
    rows = [{"file": "f", "shard": [0, 0, 2], "flat": None, "kinds": ["param"]},
            {"file": "f", "shard": [0, 2, 4], "flat": None, "kinds": ["param"]}]  # 3 rows, padded to 4
    sharded.check_cover(rows, (3, 4), files, "t")


def test_pieces_that_overlap_without_a_hole_are_refused():
    """Overlap alone is an error too, even when every element is there: halves [0, 6) and [6, 12) plus a
    middle [3, 9) hold 6 elements twice and leave none out; [0, 8) and [4, 12) hold 4 twice; rows 0-1
    and rows 1-2 of 3 hold row 1's 4 elements twice. A check for holes alone passes all three."""
    files = {"f": {}}
    flat = [{"file": "f", "shard": None, "flat": list(span), "kinds": ["param"]}
            for span in ((0, 6), (6, 12), (3, 9))]
    with pytest.raises(CheckpointError, match="leave 0 elements out and hold 6 twice"):
        sharded.check_cover(flat, (3, 4), files, "t")
    wide = [{"file": "f", "shard": None, "flat": list(span), "kinds": ["param"]}
            for span in ((0, 8), (4, 12))]
    with pytest.raises(CheckpointError, match="leave 0 elements out and hold 4 twice"):
        sharded.check_cover(wide, (3, 4), files, "t")
    rows = [{"file": "f", "shard": [0, 0, 2], "flat": None, "kinds": ["param"]},
            {"file": "f", "shard": [0, 1, 3], "flat": None, "kinds": ["param"]}]
    with pytest.raises(CheckpointError, match="leave 0 elements out and hold 4 twice"):
        sharded.check_cover(rows, (3, 4), files, "t")


# ---- saving deletes only what it wrote ----------------------------------------------------------------


def test_saving_leaves_the_users_own_step_folders_alone(tmp_path):
    notes = tmp_path / "step-notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    lookalike = tmp_path / "step-000002"  # save()'s name, but holding a file save() never writes
    lookalike.mkdir()
    (lookalike / "plot.png").write_bytes(b"png")
    run(TINY.replace(save=str(tmp_path)))
    run(TINY.replace(steps=3, resume=str(tmp_path), save=str(tmp_path)))
    assert (notes / "todo.txt").read_text() == "mine" and (lookalike / "plot.png").read_bytes() == b"png"
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders == [MARKER, "manifest.json", "step-000002", "step-000003", "step-notes"], folders


# ---- periodic checkpoints, --keep-last, and what a resume may change -----------------------------------


def test_save_every_and_keep_last_keep_the_newest_committed_checkpoints(tmp_path):
    whole = run(TINY.replace(steps=7))
    run(TINY.replace(steps=7, save=str(tmp_path), save_every=2, keep_last=2))
    listed = sorted(p.name for p in tmp_path.iterdir())
    assert listed == [MARKER, "manifest.json", "step-000006", "step-000007"]
    # the older one resumes too, from its own manifest, and trains on like the uninterrupted run
    rest = run(TINY.replace(steps=7, resume=str(tmp_path / "step-000006")))
    assert [r["step"] for r in rest] == [6] and rest[0]["loss"] == whole[6]["loss"]


def test_keep_last_one_is_the_default(tmp_path):
    run(TINY.replace(steps=5, save=str(tmp_path), save_every=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "manifest.json", "step-000005"]


@pytest.mark.parametrize("change, message", [
    (dict(lr=2e-2), "--lr 0.01 there, 0.02 here"),
    (dict(weight_decay=0.1), "--weight-decay 0.0 there, 0.1 here"),
    (dict(batch_size=8), "--batch-size 4 there, 8 here"),
])
def test_a_resume_that_changes_the_mathematics_needs_allow_changes(saved, tmp_path, change, message):
    cfg = TINY.replace(resume=str(saved), steps=3, **change)
    [error] = validate(cfg, 1)
    assert message in error and "--allow-changes" in error
    assert validate(cfg.replace(allow_changes=True), 1) == []
    log = tmp_path / "log.jsonl"
    run(cfg.replace(allow_changes=True, log=str(log)))
    [record] = [json.loads(line) for line in log.read_text().splitlines()]
    key = next(iter(change))
    assert record["changed_on_resume"] == {key: [getattr(TINY, key), change[key]]}


def test_microbatches_and_layout_change_freely_on_resume(saved):
    assert validate(TINY.replace(resume=str(saved), steps=3, microbatches=2), 1) == []


def test_digest_is_of_the_content(saved):
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["sha256"] == sharded.manifest_digest(manifest)
    assert manifest["run"] == {"lr": TINY.lr, "weight_decay": TINY.weight_decay,
                               "batch_size": TINY.batch_size}
    assert np.isfinite(manifest["run"]["lr"])


# ---- write_atomically (lesson 12's excerpt): a reader sees the old file or the new, whole -----------------


def test_write_atomically_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "shard.npz"
    path.write_bytes(b"old contents")
    sharded.write_atomically(path, b"0123456789abcdef", rank=0, phase="shard")
    assert path.read_bytes() == b"0123456789abcdef"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.npz"]


def test_a_crash_halfway_through_write_atomically_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """MINIPAR_FAULT stops the writer after the first half (distributed/faults.py): the file at PATH must
    still be the old one, byte for byte; only PATH.tmp holds the half written."""
    path = tmp_path / "manifest.json"
    path.write_bytes(b"the committed manifest")
    monkeypatch.setenv("MINIPAR_FAULT", "rank:0,save:manifest")
    with pytest.raises(RuntimeError, match="injected fault on rank 0 while saving its manifest"):
        sharded.write_atomically(path, b"0123456789abcdef", rank=0, phase="manifest")
    assert path.read_bytes() == b"the committed manifest"
    assert (tmp_path / "manifest.json.tmp").read_bytes() == b"01234567"
