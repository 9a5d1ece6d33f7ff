"""Nothing the user owns is overwritten, and nothing that is not a checkpoint is read as one: a folder
holding the user's own manifest.json is refused by --save; a manifest or shard that is a FIFO, a
symlink to /dev/zero or larger than the manifest says is refused before it is read; a forged loss
scaler is refused at validation; SGD's momentum and MoE's aux-loss weight need --allow-changes.

    pytest -m "not mpi" tests/checkpoint/test_user_files.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_manifest import TINY, edited, run

from minipar.checkpoint import sharded
from minipar.trainer import loop as train
from minipar.trainer.validate import validate

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("saved")
    run(TINY.replace(save=str(directory)))
    return directory


# ---- --save never overwrites a manifest.json minipar did not write --------------------------------------


def test_save_refuses_a_folder_holding_the_users_own_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text('{"my": "project notes"}\n')
    [error] = validate(TINY.replace(save=str(tmp_path)), 1)
    assert error == (f"--save {tmp_path} holds a manifest.json that minipar did not write (no "
                     ".minipar-checkpoints there): saving would overwrite it; choose another folder")


def test_spawns_mpiexec_save_into_the_users_manifest_folder_ends_every_rank_and_touches_nothing(tmp_path):
    mine = tmp_path / "manifest.json"
    mine.write_text('{"format": "my-own", "sha256": "whatever"}\n')
    small = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4"]
    command = [MPIEXEC, "-n", "2", sys.executable, "-m", "minipar", "train", *small, "--steps", "1",
               "--save", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "MPIEXEC_TIMEOUT": "90"})
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.count("minipar train: error:") == 2, result.stderr
    assert result.stderr.count("holds a manifest.json that minipar did not write") == 2
    assert mine.read_text() == '{"format": "my-own", "sha256": "whatever"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_a_folder_minipar_saved_into_is_saved_into_again(saved, tmp_path):
    assert (saved / ".minipar-checkpoints").is_file()
    assert validate(TINY.replace(save=str(saved), resume=str(saved), steps=3), 1) == []
    # saved before the marker existed: a manifest whose format and digest are minipar's is minipar's
    legacy = tmp_path / "legacy"
    shutil.copytree(saved, legacy)
    (legacy / ".minipar-checkpoints").unlink()
    assert validate(TINY.replace(save=str(legacy)), 1) == []
    # ... but not once it was edited by hand (its digest no longer checks)
    text = (legacy / "manifest.json").read_text()
    (legacy / "manifest.json").write_text(text.replace('"step": 2', '"step": 1'))
    assert "minipar did not write" in validate(TINY.replace(save=str(legacy)), 1)[0]


# ---- what is read must be a regular file of the manifest's size ----------------------------------------


def test_a_manifest_that_is_a_fifo_is_refused_without_blocking(saved, tmp_path):
    copy = tmp_path / "checkpoint"
    shutil.copytree(saved, copy)
    (copy / "manifest.json").unlink()
    os.mkfifo(copy / "manifest.json")  # opened for reading, it would wait for a writer for ever
    [error] = validate(TINY.replace(resume=str(copy), steps=3), 1)
    assert error == f"--resume {copy}: manifest.json cannot be read (not a regular file)"
    (copy / ".minipar-checkpoints").unlink()  # not known to be ours: --save must look, and not block
    [error] = validate(TINY.replace(save=str(copy)), 1)
    assert "holds a manifest.json that minipar did not write" in error


@pytest.mark.parametrize("which", ["manifest", "shard"])
def test_a_symlink_to_dev_zero_is_refused_without_reading_it(saved, tmp_path, which):
    copy = tmp_path / "checkpoint"
    shutil.copytree(saved, copy)
    target = copy / "manifest.json" if which == "manifest" else sorted(copy.glob("step-*/rank*.npz"))[0]
    target.unlink()
    target.symlink_to("/dev/zero")  # read to its end, it never ends
    [error] = validate(TINY.replace(resume=str(copy), steps=3), 1)
    assert error.endswith("cannot be read (not a regular file)"), error


def test_a_shard_larger_than_the_manifest_says_is_refused_before_it_is_read(saved, tmp_path):
    copy = tmp_path / "checkpoint"
    shutil.copytree(saved, copy)
    shard = sorted(copy.glob("step-*/rank*.npz"))[0]
    expected = shard.stat().st_size
    os.truncate(shard, 2**40)  # a sparse terabyte: reading it whole would exhaust memory
    [error] = validate(TINY.replace(resume=str(copy), steps=3), 1)
    assert error.endswith(f"is truncated or altered: {2**40} bytes, the manifest says {expected}"), error


SCALER = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
          "_growth_tracker": 3}  # DynamicLossScaler.state_dict's keys


@pytest.mark.parametrize("scaler", [
    {**SCALER, "scale": 0.0},
    {**SCALER, "scale": "abc"},
    {**SCALER, "growth_interval": 0},
    {**SCALER, "backoff_factor": 2.0},
    {"scale": 1024.0},
    "abc",
])
def test_a_forged_loss_scaler_is_refused_at_validation(saved, tmp_path, scaler):
    copy = edited(saved, tmp_path, lambda manifest: manifest.update(loss_scaler=scaler))  # digest recomputed
    [error] = validate(TINY.replace(resume=str(copy), steps=3), 1)
    assert error.startswith(f"--resume {copy}: manifest.json is malformed (loss_scaler "), error


def test_a_loss_scalers_own_state_passes(saved, tmp_path):
    copy = edited(saved, tmp_path, lambda manifest: manifest.update(loss_scaler=SCALER))
    assert validate(TINY.replace(resume=str(copy), steps=3), 1) == []


# ---- what a resume may change only with --allow-changes --------------------------------------------------


@pytest.mark.parametrize("model, change, message", [
    (dict(optimizer="sgd", momentum=0.9), dict(momentum=0.5), "--momentum 0.9 there, 0.5 here"),
    (dict(model="moe", n_experts=2, aux_loss_coef=0.01), dict(aux_loss_coef=0.1),
     "--aux-loss-coef 0.01 there, 0.1 here"),
])
def test_momentum_and_the_aux_loss_weight_need_allow_changes(tmp_path, model, change, message):
    first = TINY.replace(**model, save=str(tmp_path / "saved"))
    run(first)
    cfg = first.replace(save=None, resume=str(tmp_path / "saved"), steps=3, **change)
    [error] = validate(cfg, 1)
    assert message in error and "--allow-changes" in error, error
    log = tmp_path / "log.jsonl"
    run(cfg.replace(allow_changes=True, log=str(log)))
    [record] = [json.loads(line) for line in log.read_text().splitlines()]
    [(key, value)] = change.items()
    assert record["changed_on_resume"] == {key: [model[key], value]}
    # what does not enter the steps' mathematics stays free: precision, micro-batches, recompute
    assert validate(cfg.replace(**{key: model[key]}, microbatches=2, recompute="full"), 1) == []


def test_settings_a_run_does_not_use_are_not_compared(saved):
    """AdamW has no momentum option and a dense GPT no aux loss: changing them changes nothing."""
    assert sharded.run_settings(TINY) == {"lr": TINY.lr, "weight_decay": TINY.weight_decay,
                                          "batch_size": TINY.batch_size}
    assert validate(TINY.replace(resume=str(saved), steps=3, momentum=0.5, aux_loss_coef=0.5), 1) == []


# ---- a full disk during a periodic save: one line, the previous checkpoint intact ------------------------


@pytest.mark.parametrize("fails", ["write_npz", "write_atomically"])  # a rank's shard, rank 0's manifest
def test_a_full_disk_at_the_second_save_stops_in_one_line_and_keeps_the_first(tmp_path, monkeypatch, fails):
    import errno

    real = getattr(sharded, fails)

    def full_disk_after_the_first_save(path, *args):
        if (tmp_path / "manifest.json").exists():  # the first checkpoint is committed
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, *args)

    monkeypatch.setattr(sharded, fails, full_disk_after_the_first_save)
    cfg = TINY.replace(steps=6, save=str(tmp_path), save_every=2)
    with pytest.raises(train.RunStopped) as stopped:
        run(cfg)
    assert str(stopped.value).startswith(f"--save {tmp_path}: the checkpoint of step 4 was not written "
                                         "(No space left on device ")
    assert str(stopped.value).endswith("; the previous one is intact") and "\n" not in str(stopped.value)
    monkeypatch.undo()
    assert json.loads((tmp_path / "manifest.json").read_text())["step"] == 2
    resumed = run(TINY.replace(steps=6, resume=str(tmp_path)))  # and it resumes like the whole run
    assert [r["loss"] for r in resumed] == [r["loss"] for r in run(TINY.replace(steps=6))][2:]
