"""`bench checkpoint` (minipar_lab/bench/checkpoint.py): its three ways of saving really save (or not)
as `train` does, train the same steps, and the table has a row per way. Times are not asserted: lesson
12's figures come from running the benchmark."""

import json

from minipar.checkpoint import sharded
from minipar.trainer.config import TrainConfig
from minipar_lab.bench import checkpoint

TINY = TrainConfig(n_layer=1, d_model=16, n_head=2, seq_len=8, batch_size=2, steps=8, quiet=True)


def test_the_three_ways_train_alike_and_only_the_saving_ones_commit_a_checkpoint_a_step(tmp_path):
    ways = checkpoint.trainers(TINY, tmp_path)
    try:
        for trainer in ways.values():
            checkpoint.steps_of(trainer, 3)()
        async_in_flight = ways["async"].pending_save
        for trainer in ways.values():
            sharded.finish_save(trainer.pending_save, trainer.engine, wait=True)
    finally:
        for trainer in ways.values():
            trainer.memory.close()
    losses = {mode: [r["loss"] for r in trainer.records] for mode, trainer in ways.items()}
    assert len(losses["none"]) == 3 and losses["sync"] == losses["none"] == losses["async"]
    assert not (tmp_path / "none").exists()
    for mode in ("sync", "async"):
        assert json.loads((tmp_path / mode / "manifest.json").read_text())["step"] == 3, mode
    assert async_in_flight is not None and async_in_flight.step == 3  # written by the thread: in flight
    assert ways["sync"].pending_save is None


def test_the_table_has_a_row_per_way(capsys):
    args = ["--d-model", "16", "--n-layer", "1", "--seq-len", "4", "--batch", "2", "--steps-per-round", "1",
            "--repeats", "1"]
    assert checkpoint.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("GPT d_model 16, 1 layers, seq 4, batch 2, fp32, one process; checkpoint ")
    assert [line.split()[0] for line in lines[1:]] == ["saving", "no", "--save-every", "--save-every"]
    assert lines[2].endswith("+0.0%")  # no saving over itself
