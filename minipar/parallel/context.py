"""Context parallelism: the sequence split over the ranks of `grid.cp`, attention as a ring.

The idea (Liu et al., "Ring Attention with Blockwise Transformers", 2023; Megatron-core's context
parallelism). Everything in a transformer but attention works position by position, so a rank that
holds T/C of the sequence computes its share of those layers alone. Attention needs every earlier
key and value: the ranks pass their key/value blocks around a ring, C - 1 hops, and each rank folds
every block it sees into its queries' outputs with the online softmax (a running maximum m, a running
sum l of exp(s - m), and the output accumulated under the same rescaling), so the (T, T) scores never
exist anywhere. The causal mask makes late positions costlier than early ones; the zig-zag split
balances it: the sequence is cut into 2C chunks and rank r holds chunks r and 2C-1-r, one early and
one late, so every rank does the same number of score blocks.

Backward goes around the ring again: each key/value block travels with its gradient accumulators,
every rank adds its queries' contribution, and after C hops the gradients arrive at the block's
owner, so no rank keeps the others' keys and values. The weights are replicated over cp; their
gradients (each rank's share of the tokens) are summed over dp and cp together (`grid.dp_cp`).

What it saves: the activations of every layer are those of T/C positions; attention keeps no (T, T)
matrix at all, only its (T/C)-long outputs and their log-sum-exp. What it costs, per attention layer
and micro-batch, with S the bytes of one rank's keys (b * T/C * d_model/tp * itemsize):
forward (C-1) * 2S (keys and values), backward (C-1) * 4S (keys, values and their gradients) and a
last hop of 2S (the gradients home), all point-to-point on the cp ring; plus the gradient all-reduce
over dp x cp instead of dp. Lesson: lessons/13_context_parallel.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minipar.core.autograd import Function
from minipar.core.backend import current as current_backend
from minipar.core.backend import xp_of
from minipar.core.hooks import RemovableHandle
from minipar.core.nn import GPTEmbedding, ModelOptions
from minipar.core.options import option
from minipar.parallel.api import Runner, RunnerWrapper

# ---- the zig-zag split -------------------------------------------------------------------------------


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) that `rank` holds: one from the front, its mirror from the back."""
    return rank, 2 * cp - 1 - rank


def zigzag_positions(seq_len: int, cp: int, rank: int) -> np.ndarray:
    """The sequence positions `rank` holds, in the order it holds them: chunk r, then chunk 2C-1-r."""
    size = seq_len // (2 * cp)
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in chunks_of(rank, cp)])


def causal_blocks(cp: int, rank: int) -> int:
    """Score blocks (chunk of queries x chunk of keys) `rank` computes under the causal mask: a query
    chunk a sees the key chunks b <= a. With the zig-zag split it is 2C + 1 on every rank."""
    return sum(b <= a for a in chunks_of(rank, cp) for owner in range(cp) for b in chunks_of(owner, cp))


# ---- ring attention ----------------------------------------------------------------------------------


def _halves(t):
    """The two chunks of a (..., 2c, head_dim) array, as views."""
    c = t.shape[-2] // 2
    return t[..., :c, :], t[..., c:, :]


def _scores(q, k, scale: float, diagonal: bool):
    """q k^T / sqrt(head_dim) for one chunk of queries against one of keys; on the diagonal (a chunk
    against itself) position i sees only j <= i."""
    s = (q @ k.swapaxes(-1, -2)) * scale
    if diagonal:
        xp, c = xp_of(s), s.shape[-1]
        s = s + xp.triu(xp.full((c, c), -xp.inf, dtype=s.dtype), k=1)
    return s


class OnlineSoftmax:
    """softmax(s) @ v over key blocks that arrive one at a time, for one chunk of queries.

    After each block, `out / total` is the attention output over the blocks seen so far: when the
    running maximum grows, what was summed under the old one is rescaled by exp(old - new)."""

    def __init__(self, q):
        xp = xp_of(q)
        self.maximum = xp.full((*q.shape[:-1], 1), -xp.inf, dtype=q.dtype)
        self.total = xp.zeros((*q.shape[:-1], 1), dtype=q.dtype)
        self.out = xp.zeros_like(q)

    def add(self, s, v):
        # exercise 13.1: the online softmax: one block of scores at a time
        xp = xp_of(s)
        maximum = xp.maximum(self.maximum, s.max(axis=-1, keepdims=True))
        rescale, p = xp.exp(self.maximum - maximum), xp.exp(s - maximum)
        self.total = self.total * rescale + p.sum(axis=-1, keepdims=True)
        self.out = self.out * rescale + p @ v
        self.maximum = maximum
        # end exercise

    def result(self):
        """The output and the log-sum-exp of the scores (what backward needs to rebuild softmax)."""
        return self.out / self.total, self.maximum + xp_of(self.total).log(self.total)


class RingAttention(Function):
    """Causal attention of this rank's zig-zag chunks of q against every rank's k and v over `comm`.

    q, k, v are (B, T/C, n_head * head_dim), this rank's positions (zigzag_positions)."""

    @staticmethod
    def forward(ctx, q, k, v, n_head, comm):
        B, T, C = q.shape
        q, k, v = (t.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3) for t in (q, k, v))
        scale = 1.0 / math.sqrt(C // n_head)
        mine = chunks_of(comm.rank, comm.size)
        accumulators = [OnlineSoftmax(q_a) for q_a in _halves(q)]
        kv = xp_of(k).stack([k, v])  # one message per hop
        for hop in range(comm.size):
            owner = (comm.rank - hop) % comm.size  # whose keys and values arrived on this hop
            for a, q_a, acc in zip(mine, _halves(q), accumulators):
                for b, k_b, v_b in zip(chunks_of(owner, comm.size), _halves(kv[0]), _halves(kv[1])):
                    if b <= a:
                        acc.add(_scores(q_a, k_b, scale, b == a), v_b)
            if hop < comm.size - 1:
                kv = _pass_on(comm, kv)
        outs, lses = zip(*(acc.result() for acc in accumulators))
        xp = xp_of(q)
        out, lse = xp.concatenate(outs, axis=-2), xp.concatenate(lses, axis=-2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.n_head, ctx.comm, ctx.scale = n_head, comm, scale
        return out.transpose(0, 2, 1, 3).reshape(B, T, C)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved
        comm, scale = ctx.comm, ctx.scale
        B, H, T, hd = q.shape
        xp = xp_of(q)
        d_out = grad.reshape(B, T, H, hd).transpose(0, 2, 1, 3)
        delta = (d_out * out).sum(axis=-1, keepdims=True)  # sum_j p_ij dp_ij, the softmax's correction
        dq = xp.zeros_like(q)
        mine = chunks_of(comm.rank, comm.size)
        block = xp.stack([k, v, xp.zeros_like(k), xp.zeros_like(v)])  # keys, values, their gradients
        for hop in range(comm.size):
            owner = (comm.rank - hop) % comm.size
            for a, q_a, dq_a, do_a, delta_a, lse_a in zip(mine, _halves(q), _halves(dq), _halves(d_out),
                                                          _halves(delta), _halves(lse)):
                keys = zip(chunks_of(owner, comm.size), *(_halves(part) for part in block))
                for b, k_b, v_b, dk_b, dv_b in keys:
                    if b > a:
                        continue
                    p = xp.exp(_scores(q_a, k_b, scale, b == a) - lse_a)
                    dv_b += p.swapaxes(-1, -2) @ do_a
                    ds = p * (do_a @ v_b.swapaxes(-1, -2) - delta_a)
                    dq_a += (ds @ k_b) * scale
                    dk_b += (ds.swapaxes(-1, -2) @ q_a) * scale
            if hop < comm.size - 1:
                block = _pass_on(comm, block)
        dk, dv = _pass_on(comm, block[2:]) if comm.size > 1 else block[2:]  # the last hop: home
        merge = lambda t: t.transpose(0, 2, 1, 3).reshape(B, T, H * hd)  # noqa: E731
        return merge(dq), merge(dk), merge(dv), None, None


def _pass_on(comm, array):
    """One hop of the ring: send to the next rank, receive from the previous one."""
    received = comm.sendrecv(array, dest=(comm.rank + 1) % comm.size, source=(comm.rank - 1) % comm.size)
    return received.reshape(array.shape)


class RingAttentionOver:
    """The attention hook of CausalSelfAttention and ParallelAttention (core/nn.py, tensor.py):
    `attention(q, k, v, n_head)` as ring attention over `comm`."""

    def __init__(self, comm):
        self.comm = comm

    def __call__(self, q, k, v, n_head):
        return RingAttention.apply(q, k, v, n_head, self.comm)


# ---- this rank's positions: the tokens it takes, the position embedding it looks up -------------------


def hold_positions(model, positions) -> list[RemovableHandle]:
    """The position embedding of `model` (where this pipeline stage has one) looks up `positions`
    instead of 0..T/C-1: a forward pre-hook on GPTEmbedding.wpe, replacing its argument."""
    def zigzag(module, args):
        return (current_backend().xp.asarray(positions),)

    return [unit.wpe.register_forward_pre_hook(zigzag) for unit in model.modules()
            if isinstance(unit, GPTEmbedding)]


class ContextParallelRunner(RunnerWrapper):
    """The inner runner on this rank's columns of the batch: the tokens and targets at `positions`,
    with `model`'s position embedding looking them up (hold_positions). The normaliser stays the
    global token count, so the gradients summed over cp are one process's."""

    def __init__(self, runner: Runner, model, positions):
        self.runner, self.positions = runner, np.asarray(positions)
        self.handles = hold_positions(model, self.positions)

    def forward_backward(self, inputs, targets, normaliser: int, scored=None) -> float:
        mine = self.positions
        return self.runner.forward_backward(inputs[:, mine], targets[:, mine], normaliser,
                                            None if scored is None else scored[:, mine])


def ring_attention_bytes(batch: int, seq_len: int, d_model: int, cp: int, tp: int, itemsize: int) -> int:
    """Bytes one rank sends on the cp ring for one attention layer and one micro-batch of `batch`
    sequences, forward and backward (the docstring's formula)."""
    keys = batch * (seq_len // cp) * (d_model // tp) * itemsize
    return (cp - 1) * 2 * keys + (cp - 1) * 4 * keys + 2 * keys if cp > 1 else 0


# ---- what `minipar train --cp` needs (trainer/validate.py gathers it) ----------------------------------


@dataclass
class ContextOptions:
    """Context parallelism (parallel/context.py)."""
    cp: int = option(1, "context-parallel size: the sequence split over cp ranks, attention as a ring "
                     "(parallel/context.py); --dp then defaults to world / (tp*pp*cp)", single_process=1)


def config_errors(options: ContextOptions, model: ModelOptions) -> list[str]:
    """The zig-zag split needs 2*cp chunks of the sequence; only the GPT has one."""
    if options.cp == 1:
        return []
    if model.model != "gpt":
        return [f"--cp {options.cp} needs --model gpt (context parallelism splits the GPT's sequence)"]
    if model.seq_len % (2 * options.cp):
        return [f"--seq-len {model.seq_len} is not divisible by 2*cp = {2 * options.cp}: the zig-zag split "
                f"cuts the sequence into 2*cp chunks"]
    return []
