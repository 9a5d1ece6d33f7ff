"""Activation recomputation (gradient checkpointing): keep a block's inputs, rerun it in backward.

The idea (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016): a Function whose
forward runs a piece of the model with the graph off, so none of the piece's intermediate arrays are
kept, and saves only the piece's inputs. Its backward runs the piece again, this time recording, and
back-propagates through the fresh graph; the parameters' gradients accumulate into their `.grad` as in
any backward, and the inputs' gradients go on to the rest of the graph. Two granularities
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022):

    full       each transformer block keeps only its input (b, s, h) and is recomputed whole
    selective  only the attention core (scores, softmax, the weighted sum) is recomputed: the part
               whose memory grows with the square of the sequence, and that costs few FLOPs

What it saves: the activations of the recomputed part (core/nn.py's blocks; memory/activations.py has
the bytes per block as a formula). What it costs: one more forward of the recomputed part in backward;
under tensor parallelism a fully recomputed block repeats its two forward all-reduces. ZeRO-3 needs no
extra gather: the block is recomputed inside its backward, after the backward pre-hook gathered it.
It is exact: the recomputation does the same arithmetic on the same arrays (the models have no dropout).
Lesson: lessons/01_autograd.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from minipar.core import autograd
from minipar.core.autograd import Function, Tensor
from minipar.core.options import option

RECOMPUTE_MODES = ("none", "selective", "full")  # `minipar train --recompute`
_rerunning = 0  # how many Recompute backwards are rerunning their function now (they may nest)


def recomputing() -> bool:
    """Whether this forward is a Recompute backward's rerun: a layer that records what its forward
    did (MoE's routing statistics, core/moe.py) records it in the first pass only."""
    return _rerunning > 0


def rerun_depth() -> int:
    """How many reruns are under way: with `restore_rerun_depth`, a part of an overlapped pipeline
    step keeps its own across a hand-over to the other part (parallel/f_and_b.py)."""
    return _rerunning


def restore_rerun_depth(depth: int) -> None:
    global _rerunning
    _rerunning = depth


@contextlib.contextmanager
def rerunning():
    global _rerunning
    _rerunning += 1
    try:
        yield
    finally:
        _rerunning -= 1


class Recompute(Function):
    """`function(*inputs)` with only the inputs saved; backward recomputes it, then back-propagates.

    Applied to (function, n, *inputs, *parameters): the parameters the function uses are arguments
    only so that the output requires a gradient even when no input does (an MLP's first layer)."""

    @staticmethod
    def forward(ctx, function, n_inputs, *arrays):
        ctx.function, inputs = function, arrays[:n_inputs]
        ctx.save_for_backward(*inputs)
        with autograd.no_grad():  # nothing inside records a graph, so nothing inside is saved
            return function(*[Tensor(a) for a in inputs]).data

    @staticmethod
    def backward(ctx, grad):
        # exercise 01.3: recomputation: the backward that runs the forward again
        needed = ctx.needs_input_grad[2:]
        inputs = [Tensor(a, requires_grad=needs) for a, needs in zip(ctx.saved, needed)]
        with autograd.enable_grad(), rerunning():
            output = ctx.function(*inputs)
        output.backward(grad)  # the parameters' gradients accumulate into their .grad here
        parameters = [None] * (len(needed) - len(inputs))
        return (None, None, *[t.grad for t in inputs], *parameters)
        # end exercise


def checkpoint(function, *inputs: Tensor, parameters=()) -> Tensor:
    """Like torch.utils.checkpoint.checkpoint: `function(*inputs)`, its activations recomputed in
    backward. `function` takes and returns Tensors (settings go in a closure); `parameters` are those
    it uses (a module's `parameters()`)."""
    return Recompute.apply(function, len(inputs), *inputs, *parameters)


@dataclass
class RecomputeOptions:
    """Recomputation (core/recompute.py)."""
    recompute: str = option("none", "activations recomputed in backward instead of kept: the attention "
                            "cores (selective) or whole blocks (full)", RECOMPUTE_MODES,
                            single_process="none")


def config_errors(options: RecomputeOptions, model: str) -> list[str]:
    """Selective recomputation is of the attention core, which the MLP model does not have. `model`:
    --model's value (nn.py's ModelOptions, which imports this module)."""
    if options.recompute == "selective" and model != "gpt":
        return ["--recompute selective needs --model gpt (it recomputes the attention core; "
                "the MLP has none: use --recompute full)"]
    return []
