"""--save-async (checkpoint/sharded.py start_save / finish_save): a periodic checkpoint written by a
thread while training goes on, committed at a later step boundary.

The oracles: the uninterrupted synchronous run (a resume from an asynchronous checkpoint reproduces
its losses and weights bit for bit); a writer held on an event (training must pass the next step
while no manifest exists, or the save was not asynchronous), and so the commit (rank 0's writer writes
the manifests and prunes); np.savez (a shard is its bytes, and the manifest their size and SHA-256);
a writer whose disk is full (one line at the next boundary, the previous checkpoint intact). One
process here; spawned kills on 2 ranks.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from minipar.checkpoint import sharded
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate

CFG = TrainConfig(n_layer=1, d_model=16, n_head=2, seq_len=8, batch_size=4, precision="fp64", quiet=True)
ROOT = Path(__file__).resolve().parents[2]


def run(cfg: TrainConfig, trainer_class=train.Trainer) -> train.Trainer:
    trainer = trainer_class(cfg.resolved(1), MPI.COMM_SELF)
    trainer.run()
    trainer.memory.close()
    return trainer


def weights(trainer: train.Trainer) -> dict:
    return {name: array.copy() for name, (_, array) in trainer.engine.updater.local_state().items()}


def test_save_async_needs_periodic_saves():
    assert validate(CFG.replace(save_async=True), 1) == [
        "--save-async needs --save DIR --save-every N (it writes the periodic checkpoints)"]
    assert validate(CFG.replace(save_async=True, save="d", save_every=2), 1) == []


def test_the_writer_held_on_an_event_training_passes_the_next_step_and_resuming_is_bitwise(
        tmp_path, monkeypatch):
    """The writer of step 2's checkpoint waits on an event that step 3 sets: training reached step 3
    with the save still in flight and no manifest committed. Then every checkpoint it committed resumes
    to the uninterrupted synchronous run's losses and weights, bit for bit."""
    released, seen = threading.Event(), []
    real = sharded.write_npz

    def held_writer(path, arrays, rank):
        released.wait(60)
        return real(path, arrays, rank)

    monkeypatch.setattr(sharded, "write_npz", held_writer)

    class Probe(train.Trainer):
        def step(self, step):
            if step == 3:
                seen.append((self.pending_save is not None and not self.pending_save.done(),
                             (tmp_path / "async" / "manifest.json").exists()))
                released.set()
            return super().step(step)

    cfg = CFG.replace(steps=8, save_every=2, keep_last=4)
    asynchronous = run(cfg.replace(save=str(tmp_path / "async"), save_async=True), Probe)
    assert seen == [(True, False)]  # at step 3: the save of step 2 in flight, nothing committed yet
    monkeypatch.setattr(sharded, "write_npz", real)
    whole = run(cfg)
    assert [r["loss"] for r in asynchronous.records] == [r["loss"] for r in whole.records]
    folders = sorted(p.name for p in (tmp_path / "async").glob("step-*"))
    assert folders == ["step-000002", "step-000004", "step-000006", "step-000008"]
    for folder in folders[:-1]:
        resumed = run(cfg.replace(resume=str(tmp_path / "async" / folder)))
        saved_step = int(folder.removeprefix("step-"))
        assert [r["loss"] for r in resumed.records] == [r["loss"] for r in whole.records][saved_step:]
        final, expected = weights(resumed), weights(whole)
        assert all(final[name].tobytes() == expected[name].tobytes() for name in expected), folder


def test_the_commit_held_on_an_event_training_passes_the_next_step(tmp_path, monkeypatch):
    """Once every shard of step 2's save is written (joined before step 2 runs), the boundary after step
    2 hands the manifests to rank 0's writer, held on an event that step 3 sets: training reaches step 3
    with the commit in flight and no manifest written (the fsyncs and the pruning are not the training
    thread's). The run then ends with its last checkpoint committed."""
    released, seen = threading.Event(), []
    real = sharded.write_manifests

    def held_manifests(*args):
        released.wait(10)  # a commit on the training thread would wait here, then be seen written
        return real(*args)

    monkeypatch.setattr(sharded, "write_manifests", held_manifests)

    class Probe(train.Trainer):
        def step(self, step):
            if step == 2:
                self.pending_save.wait()  # the shards are written: the next boundary commits
            if step == 3:
                seen.append((self.pending_save.stage, self.pending_save.done(),
                             (tmp_path / "manifest.json").exists()))
                released.set()
            return super().step(step)

    run(CFG.replace(steps=6, save_every=2, save=str(tmp_path), save_async=True), Probe)
    assert seen == [("commit", False, False)]
    assert json.loads((tmp_path / "manifest.json").read_text())["step"] == 6


def test_a_shard_holds_the_bytes_np_savez_writes_and_the_manifest_gets_their_size_and_sha256(tmp_path):
    """write_npz writes from the arrays' own memory and hashes the file through a memory map: the file
    must be np.savez's bytes exactly (an independent writer of the format; of the arrays in C order: a
    Fortran-ordered one is written as its C-ordered copy), whole before it is hashed."""
    rng = np.random.default_rng(0)
    arrays = {"w/param": rng.standard_normal((5, 7)).astype(np.float32), "w/exp_avg": rng.standard_normal(35),
              "b/param": np.arange(12.0).reshape(3, 4)[:, ::2], "e/param": np.zeros((0, 3)),
              "f/param": np.asfortranarray(rng.standard_normal((3, 4)))}
    expected = io.BytesIO()
    np.savez(expected, **{name: np.ascontiguousarray(array) for name, array in arrays.items()})
    size, digest = sharded.write_npz(tmp_path / "rank00000.npz", arrays, 0)
    written = (tmp_path / "rank00000.npz").read_bytes()
    assert written == expected.getvalue()
    assert (size, digest) == (len(written), hashlib.sha256(written).hexdigest())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank00000.npz"]  # renamed, no .tmp left


def test_a_full_disk_in_the_writer_is_one_line_at_the_next_boundary(tmp_path, monkeypatch):
    cfg = CFG.replace(steps=6, save_every=2, save=str(tmp_path), save_async=True)
    run(cfg.replace(steps=2, save_async=False))  # a committed checkpoint of step 2
    before = (tmp_path / "manifest.json").read_bytes()

    def full_disk(path, arrays, rank):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(sharded, "write_npz", full_disk)
    with pytest.raises(train.RunStopped) as stopped:
        run(cfg.replace(resume=str(tmp_path)))
    assert str(stopped.value).startswith(f"--save {tmp_path}: the checkpoint of step 4 was not written "
                                         "(No space left on device")
    assert str(stopped.value).endswith("the previous one is intact")
    assert (tmp_path / "manifest.json").read_bytes() == before


SMALL = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4",
         "--precision", "fp64", "--quiet", "--steps", "8"]
MPI_ENV = {**os.environ, "MPIEXEC_TIMEOUT": "120", "OPENBLAS_NUM_THREADS": "1"}


def train_2_ranks_command(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "mpiexec"), "-n", "2", sys.executable, "-m", "minipar",
            "train", *SMALL, *args]


def train_2_ranks(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(train_2_ranks_command(*args), capture_output=True, text=True, timeout=150,
                          cwd=ROOT, env=MPI_ENV)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    """The losses of the same 2-rank job, never killed (the same layout: bit for bit)."""
    log = tmp_path_factory.mktemp("whole") / "whole.jsonl"
    done = train_2_ranks("--log", str(log))
    assert done.returncode == 0, done.stderr
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


KILLS = [(0, "snapshot"), (1, "snapshot"), (1, "shard"), (0, "shard-fsynced"), (0, "shards-written"),
         (0, "manifest"), (0, "committed")]


@pytest.mark.parametrize("rank, point", KILLS)
def test_spawns_mpiexec_a_kill_during_an_asynchronous_save_leaves_a_checkpoint_that_resumes_exactly(
        tmp_path, uninterrupted, rank, point):
    """2 ranks resumed from step 2 with --save-every 2 --save-async, SIGKILL on one rank at a named
    point of the save of step 4: after the snapshot, mid shard write (in the writer thread), after the
    fsync before the rename, between the shards and the manifest, mid manifest, after the commit
    before pruning. The newest manifest validates (step 2, or 4 once committed), and resuming from it
    reproduces the uninterrupted run's losses bit for bit."""
    folder = tmp_path / "ck"
    first = train_2_ranks("--steps", "2", "--save", str(folder))  # committed: step 2
    assert first.returncode == 0, first.stderr
    fault = f"rank:{rank},save:{point},signal:KILL,once:{tmp_path / 'fired'}"  # at the save of step 4
    killed = subprocess.run(train_2_ranks_command("--resume", str(folder), "--save", str(folder),
                                                  "--save-every", "2", "--save-async"),
                            capture_output=True, text=True, timeout=150, cwd=ROOT,
                            env={**MPI_ENV, "MINIPAR_FAULT": fault})
    assert killed.returncode != 0 and (tmp_path / "fired").exists(), killed.stderr
    step = json.loads((folder / "manifest.json").read_text())["step"]
    assert step in (2, 4)
    log = tmp_path / "resumed.jsonl"
    resumed = train_2_ranks("--resume", str(folder), "--log", str(log))
    assert resumed.returncode == 0, resumed.stderr
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert losses == uninterrupted[step:]  # bit for bit
