"""The autograd collectives: every communication that sits inside the autograd graph, in one place.

The idea, as Megatron-LM's `tensor_parallel/mappings.py`: a collective in the forward pass is a
Function whose backward is its adjoint, the collective that carries the gradient back the same way.

    f  CopyToTensorParallel          identity            | all-reduce          (before a column layer)
    g  ReduceFromTensorParallel      all-reduce          | identity            (after a row layer)
       GatherFromTensorParallel      all-gather columns  | keep this rank's columns
       GatherFromSequenceParallel    all-gather sequence | reduce-scatter sequence   (entering tp, sp)
       LinearOnGatheredSequence  x W^T, keeps the piece | all-gather the piece again (once per
                                                            gathered input), then x W^T's gradients (sp)
       ReduceScatterToSequenceParallel  reduce-scatter   | all-gather sequence       (leaving tp, sp)
       ReplicatedOnSequencePiece     a copy              | all-reduce          (a bias or table, sp)
       AllToAll                      all-to-all          | all-to-all          (tokens to experts, ep)

Read forward and backward of each pair side by side: an all-reduce forward has an identity backward,
an all-gather a reduce-scatter, and an all-to-all (a permutation of blocks) is its own inverse. Ring
attention's exchange of keys and values stays one Function in context.py: its backward is a second
ring, not the adjoint of one collective. What they save or cost: nothing of their own; each is the
communication of the technique that uses it (tensor.py, sequence.py, experts.py).
Lessons: lessons/05_tensor_parallel.md (f, g, sequence parallelism), lessons/15_experts.md (all-to-all).
"""

from __future__ import annotations

import contextlib

from minipar.core.autograd import Function
from minipar.core.backend import xp_of
from minipar.core.tensor_ops import linear_product
from minipar.memory.ledger import buffer_meter
from minipar.parallel import f_and_b

# ---- the conjugate operators f and g ---------------------------------------------------------------


class CopyToTensorParallel(Function):
    """f: identity forward; all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        # exercise 05.1: f and g: the communication of column- and row-parallel layers
        return ctx.comm.all_reduce(grad), None
        # end exercise


class ReduceFromTensorParallel(Function):
    """g: all-reduce forward (the sum of the ranks' partial results); identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        # exercise 05.1: f and g: the communication of column- and row-parallel layers
        return comm.all_reduce(x)
        # end exercise

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTensorParallel(Function):
    """All-gather of the last axis forward (every rank's columns side by side); backward keeps this
    rank's columns of the gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm, ctx.width = comm, x.shape[-1]
        parts = comm.all_gather(x, numel=x.size * comm.size).reshape(comm.size, *x.shape)
        return xp_of(x).concatenate(list(parts), axis=-1)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.comm.rank * ctx.width
        return grad[..., start : start + ctx.width], None


def copy_to_tensor_parallel(x, comm):
    return CopyToTensorParallel.apply(x, comm)


def reduce_from_tensor_parallel(x, comm):
    return ReduceFromTensorParallel.apply(x, comm)


def gather_from_tensor_parallel(x, comm):
    return GatherFromTensorParallel.apply(x, comm)


# ---- the two collectives along the sequence, each the other's adjoint -------------------------------


def _sequence_first(x):
    """(b, s, h) as a contiguous (s, b, h): each rank's run of positions becomes one flat shard."""
    return xp_of(x).ascontiguousarray(x.transpose(1, 0, 2))


def all_gather_sequence(x, comm):
    """Every rank's (b, s/t, h) piece, concatenated along the sequence into (b, s, h)."""
    # exercise 05.3: sequence parallelism: all-gather and reduce-scatter along the sequence
    b, piece, h = x.shape
    gathered = comm.all_gather(_sequence_first(x), numel=x.size * comm.size)
    return gathered.reshape(piece * comm.size, b, h).transpose(1, 0, 2)
    # end exercise


def reduce_scatter_sequence(x, comm):
    """The sum over ranks of (b, s, h) partial results, of which this rank keeps its s/t positions."""
    # exercise 05.3: sequence parallelism: all-gather and reduce-scatter along the sequence
    b, s, h = x.shape
    return comm.reduce_scatter(_sequence_first(x)).reshape(s // comm.size, b, h).transpose(1, 0, 2)
    # end exercise


class GatherFromSequenceParallel(Function):
    """Entering a tensor-parallel region: all-gather along the sequence; backward reduce-scatters
    (every rank's columns contributed to the gradient of every position)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return all_gather_sequence(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.comm), None


class ReduceScatterToSequenceParallel(Function):
    """Leaving a tensor-parallel region: the partial sums reduce-scattered along the sequence;
    backward all-gathers the pieces' gradients (each rank's partial needs the whole gradient)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return reduce_scatter_sequence(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.comm), None


class ReplicatedOnSequencePiece(Function):
    """A replicated parameter used on this rank's piece of the sequence: backward all-reduces its
    gradient over tp (the sum over the pieces is the whole gradient). The forward hands out a copy of
    the (small) parameter rather than the array itself, so no reference to a buffer ZeRO-3 gathered
    outlives the unit's forward. For an operation that keeps nothing of it (an add, a lookup): one
    that reads it in backward would keep the copy, uncounted, until then, so sequence.py's LayerNorm
    sums its weight's gradient in its own backward instead."""

    @staticmethod
    def forward(ctx, parameter, comm):
        ctx.comm = comm
        return parameter.copy()

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad), None


def gather_from_sequence_parallel(x, comm):
    return GatherFromSequenceParallel.apply(x, comm)


# ---- the gathered input kept as its piece, gathered again in backward (Megatron's sequence_parallel) --


class GatheredPiece:
    """This rank's (b, s/t, h) piece of an input all-gathered into a tensor-parallel region, shared by
    the column-parallel layers that read the gathered input (query, key and value; fc; lm_head).

    Each layer keeps the piece for backward (one buffer: the meter counts it once) instead of the
    (b, s, h) it multiplied. Its weight gradient needs the whole input again: the first reader to
    reach backward all-gathers the piece once more, the others use that copy, and the last one drops
    it. Between the two it is a temporary buffer (the buffer meter's), as Megatron's re-gather into
    its global memory buffer; the activation meter keeps counting only what is saved for backward."""

    def __init__(self, piece, comm):
        self.piece, self.comm = piece.data, comm
        self.readers = 0  # the recorded layers whose weight gradient will read the whole input
        self.whole = None  # the gathered-again input, from the first reader's backward to the last's

    @contextlib.contextmanager
    def gathered_again(self, piece):
        """The whole (b, s, h) input for one reader's weight gradient; one all-gather for all readers."""
        if self.whole is None:
            self.whole = all_gather_sequence(piece, self.comm)
            buffer_meter.add(self.whole.nbytes)
        try:
            yield self.whole
        finally:
            self.readers -= 1
            if not self.readers:  # the last reader: the copy goes, and so does the piece
                buffer_meter.release(self.whole.nbytes)
                self.whole = self.piece = None


class LinearOnGatheredSequence(Function):
    """y = x W^T + b on x, the all-gathered input of `gathered` (a GatheredPiece), keeping only the piece.

    x comes in as the gathered Tensor, so its gradient goes back through GatherFromSequenceParallel's
    reduce-scatter, summed with the other readers' (one reduce-scatter per gathered input). What is
    saved is this rank's piece: s/t of the positions, where core's Linear would keep all s. Backward
    computes the input's gradient from the weight alone, and the weight's from the input gathered again
    (`GatheredPiece.gathered_again`): the same values as the forward's gather, so the same gradient.
    A split backward (ZB-H1) gathers in W, where the weight's gradient is computed."""

    reads_in_backward = (1, 2)  # the weight (its data then: ZeRO-3 re-gathers it) and whether a bias

    @staticmethod
    def forward(ctx, x, weight, bias, gathered):
        ctx.save_for_backward(gathered.piece)
        if ctx.recording and ctx.needs_input_grad[1]:  # a reader in backward (not in a no_grad pass)
            ctx.gathered = gathered
            gathered.readers += 1
        y = linear_product(x.reshape(-1, x.shape[-1]), weight.T, "forward")
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        (piece,) = ctx.saved
        weight, bias = ctx.inputs[1].data, ctx.inputs[2]
        g2 = g.reshape(-1, g.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = linear_product(g2, weight, "input_grad").reshape(*g.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            with ctx.gathered.gathered_again(piece) as x:
                gw = linear_product(g2.T, x.reshape(-1, x.shape[-1]), "weight_grad")
        if bias is not None and ctx.needs_input_grad[2]:
            gb = g2.sum(axis=0)
        return gx, gw, gb, None


def linear_on_gathered_sequence(x, weight, bias, gathered: GatheredPiece):
    return LinearOnGatheredSequence.apply(x, weight, bias, gathered)


def reduce_scatter_to_sequence_parallel(x, comm):
    return ReduceScatterToSequenceParallel.apply(x, comm)


def replicated_on_sequence_piece(parameter, comm):
    return ReplicatedOnSequencePiece.apply(parameter, comm)


# ---- expert parallelism: tokens to the ranks of their experts and back ---------------------------


class AllToAll(Function):
    """Forward: the all-to-all of blocks over `comm`. Backward: the same exchange of the gradients,
    since sending block s to rank s is a permutation whose inverse sends block r back to rank r."""

    @staticmethod
    def forward(ctx, blocks, comm):
        ctx.comm = comm
        return f_and_b.exchange(comm, blocks)  # all_to_all; inside an F&B step, the other part runs meanwhile

    @staticmethod
    def backward(ctx, g):
        return f_and_b.exchange(ctx.comm, g), None
