"""Tensor parallelism (Megatron-LM): every weight matrix split across the ranks of `grid.tp`.

The idea, as in section 3 of Shoeybi et al. (2019). A linear layer Y = XA can be split two ways:

    by columns  A = [A_1 | A_2]      rank i computes Y_i = X A_i: a slice of Y's columns; needs all of X
    by rows     A = [A_1 ; A_2],     rank i computes X_i A_i: a partial sum; Y = X_1 A_1 + X_2 A_2
                X = [X_1 | X_2]

A column split followed by a row split needs nothing in between (the column layer's output slices are
the row layer's input slices) and one all-reduce at the end: that is `ParallelMLP`, and
`ParallelAttention` with whole heads on each rank. Two conjugate operators put that communication
into the autograd graph:

    f  identity forward, all-reduce backward: before a column-parallel layer, so the replicated X
       receives the gradient contributions of every rank's slice;
    g  all-reduce forward, identity backward: after a row-parallel layer, summing the partial outputs.

The vocabulary is split too: `VocabParallelEmbedding` (rows of the table; one all-reduce) and
`vocab_parallel_cross_entropy` (three all-reduces of batch*seq numbers; the (batch, seq, vocab)
logits are never gathered). Sizes tp does not divide (the vocabulary) are padded with zero rows.

What it saves: each rank holds 1/tp of the weights, gradients and optimizer state of every split
layer, and does 1/tp of its matmul FLOPs. What it costs: per transformer block two all-reduces of the
(batch, seq, d_model) activations forward and two backward, on the critical path of every layer:
that is why tensor parallelism stays inside a node, on the fastest links.
Lesson: lessons/05_tensor_parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.core import functional as F
from minipar.core.autograd import Function
from minipar.core.backend import xp_of
from minipar.core.nn import ModelOptions, Module, Parameter, attention_core, causal_attention
from minipar.core.options import option
from minipar.core.shards import Shard, padded_bounds
from minipar.parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
)

# ---- linear layers ----------------------------------------------------------------------------------


class ColumnParallelLinear(Module):
    """y = x A^T + b with A (out, in) split by output features: this rank computes y[..., start:stop].

    The input is replicated and goes through f, unless the caller already did that (`input_is_copied`:
    attention shares one f among query, key and value). The output stays split, ready for a
    row-parallel layer, unless `gather_output` all-gathers it.
    """

    def __init__(self, in_features, out_features, comm, bias=True, gather_output=False,
                 input_is_copied=False, std=0.02, dtype="float64"):
        super().__init__()
        self.comm, self.out_features = comm, out_features
        self.gather_output, self.input_is_copied = gather_output, input_is_copied
        self.start, self.stop = padded_bounds(out_features, comm.size, comm.rank)
        rows = self.stop - self.start
        self.weight = Parameter((rows, in_features), ("normal", std), dtype,
                                Shard((out_features, in_features), 0, self.start, self.stop))
        self.bias = Parameter((rows,), ("zeros",), dtype,
                              Shard((out_features,), 0, self.start, self.stop)) if bias else None

    def forward(self, x):
        if not self.input_is_copied:
            x = copy_to_tensor_parallel(x, self.comm)
        y = F.linear(x, self.weight, self.bias)
        if not self.gather_output:
            return y
        y = gather_from_tensor_parallel(y, self.comm)
        padded = y.shape[-1] != self.out_features
        return y[..., : self.out_features] if padded else y


class RowParallelLinear(Module):
    """y = x A^T + b with A (out, in) split by input features: this rank holds A[:, start:stop], takes
    the matching slice of x (the split output of a column-parallel layer), computes a partial y and
    sums the partials with g. The bias is not split: it is added once, after the sum."""

    def __init__(self, in_features, out_features, comm, bias=True, std=0.02, dtype="float64"):
        super().__init__()
        if in_features % comm.size:
            raise ValueError(f"RowParallelLinear: {in_features} inputs do not split over tp={comm.size}")
        self.comm = comm
        self.start, self.stop = padded_bounds(in_features, comm.size, comm.rank)
        self.weight = Parameter((out_features, self.stop - self.start), ("normal", std), dtype,
                                Shard((out_features, in_features), 1, self.start, self.stop))
        self.bias = Parameter((out_features,), ("zeros",), dtype) if bias else None

    def forward(self, x_parallel):
        y = reduce_from_tensor_parallel(F.linear(x_parallel, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y


# ---- transformer layers -----------------------------------------------------------------------------


class ParallelMLP(Module):
    """nn.MLP split: fc by columns, proj by rows. One all-reduce forward (g), one backward (f)."""

    def __init__(self, cfg, comm):
        super().__init__()
        d = cfg.d_model
        self.fc = ColumnParallelLinear(d, 4 * d, comm, dtype=cfg.dtype)
        self.proj = RowParallelLinear(4 * d, d, comm, std=cfg.residual_std, dtype=cfg.dtype)
        self.activation = F.gelu  # elementwise, so it runs on the split hidden layer as it is

    def forward(self, x):
        return self.proj(self.activation(self.fc(x)))


class ParallelAttention(Module):
    """nn.CausalSelfAttention split by heads: query, key and value by columns, so this rank owns
    n_head / tp whole heads and computes their attention alone; proj by rows.
    One all-reduce forward (g, in proj), one backward (the f shared by query, key and value)."""

    def __init__(self, cfg, comm, recompute_core: bool = False, attention=causal_attention):
        super().__init__()
        if cfg.n_head % comm.size:
            raise ValueError(f"ParallelAttention: {cfg.n_head} heads do not split over tp={comm.size}")
        d = cfg.d_model
        self.comm, self.local_heads = comm, cfg.n_head // comm.size
        self.recompute_core = recompute_core  # --recompute selective (core/recompute.py)
        self.attention = attention  # over this rank's heads: causal_attention, or context.py's ring
        self.query = ColumnParallelLinear(d, d, comm, input_is_copied=True, dtype=cfg.dtype)
        self.key = ColumnParallelLinear(d, d, comm, bias=False, input_is_copied=True, dtype=cfg.dtype)
        self.value = ColumnParallelLinear(d, d, comm, input_is_copied=True, dtype=cfg.dtype)
        self.proj = RowParallelLinear(d, d, comm, std=cfg.residual_std, dtype=cfg.dtype)

    def forward(self, x):
        # One f for all three: autograd adds their input gradients locally, then f all-reduces once.
        x = copy_to_tensor_parallel(x, self.comm)
        y = attention_core(self.query(x), self.key(x), self.value(x), self.local_heads, self.recompute_core,
                           self.attention)
        return self.proj(y)


# ---- the vocabulary -----------------------------------------------------------------------------------


class VocabParallelEmbedding(Module):
    """nn.Embedding with the rows (the vocabulary) split: this rank looks up the ids in its range,
    writes zeros for the others, and g sums the ranks' lookups. One all-reduce forward, none backward."""

    def __init__(self, num_embeddings, embedding_dim, comm, std=0.02, dtype="float64"):
        super().__init__()
        self.comm = comm
        self.start, self.stop = padded_bounds(num_embeddings, comm.size, comm.rank)
        self.weight = Parameter((self.stop - self.start, embedding_dim), ("normal", std), dtype,
                                Shard((num_embeddings, embedding_dim), 0, self.start, self.stop))

    def forward(self, ids):
        return reduce_from_tensor_parallel(self.partial_lookup(ids), self.comm)

    def partial_lookup(self, ids):
        """This rank's rows of the lookup, zeros for ids outside its range: one term of the sum."""
        xp = xp_of(self.weight.data)
        ids = xp.asarray(ids)
        outside = (ids < self.start) | (ids >= self.stop)
        rows = F.embedding(xp.where(outside, 0, ids - self.start), self.weight)
        mine = xp.asarray(~outside[..., None], dtype=self.weight.dtype)
        return rows * mine


class VocabParallelCrossEntropy(Function):
    """Summed cross-entropy of vocab-split logits (N, V/tp) against targets (N,) in the full vocabulary.

    softmax needs the max and the sum of exp over the whole row; each is a reduction of N numbers,
    and so is the target's logit (found on one rank, zero on the others): three all-reduces of N
    values instead of gathering N*V. Columns past `vocab_size` (padding) get probability zero.
    The gradient, softmax minus one-hot, is local: backward sends nothing.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, comm, correct=None):
        # exercise 05.2: vocab-parallel cross-entropy: three all-reduces of N numbers
        xp = xp_of(logits)
        n, width = logits.shape
        columns = vocab_start + xp.arange(width)
        logits = xp.where(columns < vocab_size, logits, -xp.inf)
        row_max = comm.all_reduce(logits.max(axis=-1), op="max")
        shifted = logits - row_max[:, None]
        local_target = xp.asarray(targets) - vocab_start
        mine = (local_target >= 0) & (local_target < width)
        rows = xp.arange(n)
        target_logit = comm.all_reduce(xp.where(mine, shifted[rows, xp.where(mine, local_target, 0)], 0))
        if correct is not None:  # the accuracy's count: the target's logit is the row's maximum
            correct[:] = target_logit == 0
        exp = xp.exp(shifted)
        sum_exp = comm.all_reduce(exp.sum(axis=-1))
        ctx.save_for_backward(exp / sum_exp[:, None], mine, local_target)  # sb bytes and sb indices
        return (xp.log(sum_exp) - target_logit).sum()
        # end exercise

    @staticmethod
    def backward(ctx, g):
        probs, mine, local_target = ctx.saved
        grad = probs.copy()
        grad[xp_of(grad).arange(len(mine))[mine], local_target[mine]] -= 1
        return grad * g, None, None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, vocab_start: int, vocab_size: int, comm, correct=None):
    """Like F.cross_entropy(logits, targets, "sum") for the vocab-split logits this rank holds.
    `correct` (bool, (N,), optional) is filled with where the target's logit is the row's largest."""
    return VocabParallelCrossEntropy.apply(logits, targets, vocab_start, vocab_size, comm, correct)


# ---- what `minipar train --tp` needs (trainer/validate.py gathers it) ----------------------------------


@dataclass
class TensorOptions:
    """Tensor parallelism (parallel/tensor.py)."""
    tp: int = option(1, "tensor-parallel size", single_process=1)


def config_errors(options: TensorOptions, model: ModelOptions) -> list[str]:
    """Tensor parallelism splits attention by whole heads, and only the GPT's layers."""
    if model.model == "mlp" and options.tp > 1:
        # MLPNet's layers are separate pipeline units; Megatron's column/row pairing would leave a
        # split activation at a unit boundary, so tensor parallelism is kept to the GPT.
        return [f"--tp {options.tp} needs --model gpt (tensor parallelism splits the GPT's layers)"]
    if model.n_head % options.tp:  # tp = 1 for the MLP here
        return [f"--tp {options.tp} does not divide --n-head {model.n_head}: "
                "each tensor-parallel rank must own whole attention heads"]
    return []
