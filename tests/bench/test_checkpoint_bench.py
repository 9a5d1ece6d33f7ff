"""`bench checkpoint` (minipar_lab/bench/checkpoint.py): its three ways of saving really save (or not)
as `train` does, train the same steps, and the table has a row per way. Times are not asserted: lesson
12's figures come from running the benchmark."""

import json

import pytest

from minipar.checkpoint import sharded
from minipar.trainer.config import TrainConfig
from minipar_lab.bench import checkpoint

TINY = TrainConfig(n_layer=1, d_model=16, n_head=2, seq_len=8, batch_size=2, steps=9, quiet=True)


def test_the_three_ways_train_alike_and_a_round_commits_the_saves_it_starts(tmp_path, monkeypatch):
    """Saving every 2 steps, two rounds of 4 steps: the first has the boundaries after 1, 2 and 3 steps,
    the second opens with the boundary after 4. The saving ways commit the checkpoints of steps 2, 4
    and 6, the asynchronous one through start_save (a writer thread), and a round ends with nothing in
    flight."""
    started, real = [], sharded.start_save

    def recorded(directory, engine, step, keep=1):
        started.append(step)
        return real(directory, engine, step, keep)

    monkeypatch.setattr(sharded, "start_save", recorded)
    ways = checkpoint.trainers(TINY, tmp_path, every=2)
    try:
        rounds = {mode: checkpoint.steps_of(trainer, 4) for mode, trainer in ways.items()}
        for mode, trainer in ways.items():
            rounds[mode]()
            assert trainer.pending_save is None and len(trainer.records) == 4
            rounds[mode]()
    finally:
        for trainer in ways.values():
            trainer.memory.close()
    losses = {mode: [r["loss"] for r in trainer.records] for mode, trainer in ways.items()}
    assert len(losses["none"]) == 8 and losses["sync"] == losses["none"] == losses["async"]
    assert not (tmp_path / "none").exists()
    for mode in ("sync", "async"):
        assert json.loads((tmp_path / mode / "manifest.json").read_text())["step"] == 6, mode
        assert ways[mode].pending_save is None
    assert started == [2, 4, 6]  # the asynchronous way's saves, and only its


def test_the_table_has_a_row_per_way(capsys):
    args = ["--d-model", "16", "--n-layer", "1", "--seq-len", "4", "--batch", "2", "--steps-per-round", "1",
            "--repeats", "1"]
    assert checkpoint.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("GPT d_model 16, 1 layers, seq 4, batch 2, fp32, one process; checkpoint ")
    assert [line.split()[0] for line in lines[1:]] == ["saving", "no", "--save-every", "--save-every"]
    assert lines[1].split()[-6:] == ["saving", "CPU:", "training", "thread", "other", "threads"]
    assert lines[2].split()[6] == "+0.0%"  # no saving over itself


def test_rounds_must_save_as_often_as_each_other():
    with pytest.raises(SystemExit) as refused:
        checkpoint.main(["--save-every", "3", "--steps-per-round", "4"])
    assert refused.value.code == 2
