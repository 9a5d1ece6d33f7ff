"""The log's `accuracy`: the share of scored predictions that are right, the same in every layout.

For the GPT the scored predictions are the digits of each sum whose whole problem the window shows
(tasks.py `answer_positions`); for the MLP every output, right within MLPNet.ACCURACY_TOLERANCE.
The oracles: the answer positions found again by a regular expression over the decoded window; the
count recomputed here with numpy's argmax from logits taken before the step; and, on several ranks,
one process's accuracy for every layout (dp, tp, pp, cp), whose counts each reduce differently.

    mpiexec -n K python -m pytest -m mpi tests/trainer/test_accuracy.py   # K = 2, 4
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from mpi4py import MPI
from mpi_harness import mpi_test, needs_world_size

from minipar.core.nn import MLPNet
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.tasks import AdditionTask, decode, encode

WORLD = MPI.COMM_WORLD
TINY = TrainConfig(precision="fp64", n_layer=2, n_head=4, d_model=16, seq_len=24, batch_size=16, steps=3,
                   lr=1e-2, quiet=True)


def answer_positions_by_regex(inputs, targets) -> np.ndarray:
    """Positions t whose target (the window's character t+1) is a digit of a sum "a+b=" that starts
    right after a newline inside the window."""
    scored = np.zeros(targets.shape, dtype=bool)
    for row, (x, y) in enumerate(zip(inputs, targets)):
        window = decode(np.concatenate([x[:1], y]))
        for problem in re.finditer(r"\n\d+\+\d+=(\d*)", window):
            for character in range(problem.start(1), problem.end(1)):
                scored[row, character - 1] = True  # character c of the window is the target of c - 1
    return scored


def test_answer_positions_are_the_sums_digits_of_whole_problems():
    window = encode("7+364=9980\n766+889=5561\n857+942=9971")  # cut at the start: its sum is not scored
    inputs, targets = window[None, :-1], window[None, 1:]
    scored = AdditionTask.answer_positions(inputs, targets)
    assert "".join(decode([t]) if s else "." for t, s in zip(targets[0], scored[0])) == \
        "." * 18 + "5561" + "." * 9 + "9971"
    for step in range(3):
        inputs, targets = AdditionTask(seq_len=32, seed=step).global_batch(step, 16)
        np.testing.assert_array_equal(AdditionTask.answer_positions(inputs, targets),
                                      answer_positions_by_regex(inputs, targets))


def test_the_tensor_parallel_verdict_ties_like_the_dense_one():
    """A tie with the largest logit counts as right in both losses (tp has only the maximum)."""
    from minipar.core.autograd import Tensor
    from minipar.core.nn import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=4, block_size=2, n_layer=1, n_head=1, d_model=4))
    logits = Tensor(np.array([[[1.0, 3.0, 3.0, 0.0], [2.0, 1.0, 0.0, -1.0]]]))
    _, correct = model.loss_and_correct(logits, np.array([[2, 1]]), 2)
    assert correct.tolist() == [[True, False]]


def expected_accuracy(trainer: train.Trainer, step: int) -> float:
    """The step's accuracy counted here: the model's predictions before its update, numpy's argmax."""
    inputs, targets = trainer.task.global_batch(step, trainer.cfg.batch_size)
    model = trainer.engine.model
    prediction = model(inputs).data
    if trainer.cfg.is_gpt:
        scored = answer_positions_by_regex(inputs, targets)
        return float((prediction.argmax(axis=-1) == targets)[scored].mean())
    return float(np.mean(np.abs(prediction - targets) <= MLPNet.ACCURACY_TOLERANCE))


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_accuracy_is_the_share_of_scored_predictions_numpy_finds_right(model):
    cfg = TINY.replace(model=model, steps=4, lr=3e-2).resolved(1)
    trainer = train.Trainer(cfg, MPI.COMM_SELF)
    logged = []
    for step in range(cfg.steps):
        expected = expected_accuracy(trainer, step)
        logged.append(trainer.step(step)["accuracy"])
        assert logged[-1] == pytest.approx(expected, abs=1e-15), step
    assert len(set(logged)) > 1  # it moved with training: not a constant that happens to match
    trainer.memory.close()


# ---- every layout counts what one process counts -------------------------------------------------------

LAYOUTS = {2: [dict(dp=2), dict(tp=2), dict(pp=2, microbatches=2), dict(cp=2), dict(dp=2, zero=1)],
           4: [dict(dp=2, tp=2), dict(dp=2, pp=2, microbatches=2), dict(pp=2, tp=2, schedule="gpipe",
                                                                       microbatches=4)]}


@needs_world_size(2, 4)
@mpi_test
def test_every_layout_logs_the_accuracy_of_one_process():
    reference = None
    if WORLD.rank == 0:
        single = train.Trainer(TINY.resolved(1), MPI.COMM_SELF)
        reference = [r["accuracy"] for r in single.run()]
        single.memory.close()
        assert len(set(reference)) > 1 and 0 < min(reference), reference
    differing = []  # asserted after every layout ran: a rank that stops early leaves the others waiting
    for layout in LAYOUTS[WORLD.size]:
        trainer = train.Trainer(TINY.replace(**layout).resolved(WORLD.size), WORLD)
        accuracy = [r["accuracy"] for r in trainer.run()]
        trainer.memory.close()
        if WORLD.rank == 0 and accuracy != reference:  # equal counts over the same answer digits
            differing.append((layout, accuracy))
    assert not differing, (reference, differing)


def test_decoded_problems_show_each_whole_answer_in_the_usual_order_with_its_prediction():
    window = encode("7+364=9980\n766+889=5561\n857+942=9971\n12")
    inputs, targets = window[None, :-1], window[None, 1:]
    predicted = targets.copy()
    predicted[0, 19] = encode("\n")[0]  # the second digit of 5561 (1655 reversed) predicted as a newline
    assert AdditionTask(seq_len=inputs.shape[1], seed=0).decoded_problems(inputs, targets, predicted) == \
        ["766+889=1655, predicted 16⏎5", "857+942=1799, predicted 1799"]
