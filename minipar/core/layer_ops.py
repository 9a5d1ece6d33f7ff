"""The operations of neural-network layers, with backward rules: GELU, softmax, losses, LayerNorm,
embedding lookup and dropout.

Part of `minipar.core.functional` (imported as F). Integer inputs (token ids, targets) are plain integer
arrays, never Tensors; randomness (dropout) comes only from an explicit generator.
Lesson: lessons/01_autograd.md.
"""

from __future__ import annotations

import math

import numpy

from minipar.core import kernels
from minipar.core.autograd import Function, Tensor
from minipar.core.backend import xp_of
from minipar.core.tensor_ops import mul, sub, sum

GELU_C = math.sqrt(2.0 / math.pi)


def _data(x):
    return x.data if isinstance(x, Tensor) else x


# ---- activations ----------------------------------------------------------------------------------


def gelu_forward(x):
    """GPT-2's tanh approximation of GELU on arrays: 0.5 x (1 + tanh(c (x + 0.044715 x^3))). The plain
    form below, or the one installed for "gelu_forward" (core/kernels.py; minipar/speed: same bits)."""
    return kernels.chosen("gelu_forward", gelu_forward_plain)(x)


def gelu_forward_plain(x):
    return 0.5 * x * (1.0 + xp_of(x).tanh(GELU_C * (x + 0.044715 * x * x * x)))


def gelu_backward(x, g):
    """g times GELU'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 0.044715 x^2), t = tanh(inner). The
    plain form below, or the one installed for "gelu_backward" (core/kernels.py; minipar/speed)."""
    return kernels.chosen("gelu_backward", gelu_backward_plain)(x, g)


def gelu_backward_plain(x, g):
    t = xp_of(x).tanh(GELU_C * (x + 0.044715 * x * x * x))
    d_inner = GELU_C * (1.0 + 3 * 0.044715 * x * x)
    return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner)


class GELU(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return gelu_forward(x)

    @staticmethod
    def backward(ctx, g):
        return gelu_backward(ctx.saved[0], g)


def gelu(a):
    return GELU.apply(a)


# ---- normalisation and losses -------------------------------------------------------------------


class Softmax(Function):
    @staticmethod
    def forward(ctx, a, axis=-1):
        xp = xp_of(a)
        out = a - a.max(axis=axis, keepdims=True)  # exp(a - max) / sum, in place on our own array
        xp.exp(out, out=out)
        out /= out.sum(axis=axis, keepdims=True)
        ctx.save_for_backward(out)
        ctx.axis = axis
        return out

    @staticmethod
    def backward(ctx, g):
        # exercise 01.1: the backward of softmax
        (out,) = ctx.saved
        return out * (g - (g * out).sum(axis=ctx.axis, keepdims=True)), None
        # end exercise


class CausalSoftmax(Softmax):
    """softmax(scores + causal mask) along the last axis in one op, as in Megatron's fused kernel: query
    i of the (..., T, T) scores sees keys 0..i. The plain form, two ops:
        mask = triu(full((T, T), -inf), k=1);  softmax(scores + mask)
    Here the mask is never added: the row maximum and the exponential skip the masked entries (NumPy's
    `where=`), which are set to 0, what exp(-inf) gives; the backward is softmax's. The same bits
    (tests/core/test_speed_forms.py). What it saves: the mask's addition, a pass over the scores, and
    in fp64 NumPy's slow path for exponentials that underflow (`exp(-inf)` costs several times a finite
    one). CuPy's max has no `where=`: on a GPU the plain form runs. Lesson: lessons/01_autograd.md."""

    @staticmethod
    def forward(ctx, scores):  # type: ignore[override]  # no axis to choose: the mask is (T, T), the last two
        xp, T = xp_of(scores), scores.shape[-1]
        if xp is not numpy:
            return Softmax.forward(ctx, scores + xp.triu(xp.full((T, T), -xp.inf, scores.dtype), k=1))
        keep = xp.tri(T, dtype=bool)  # query i, key j <= i
        out = scores - scores.max(axis=-1, keepdims=True, where=keep, initial=-xp.inf)
        xp.exp(out, out=out, where=keep)
        xp.copyto(out, 0.0, where=~keep)
        out /= out.sum(axis=-1, keepdims=True)
        ctx.save_for_backward(out)
        ctx.axis = -1
        return out


class LogSoftmax(Function):
    @staticmethod
    def forward(ctx, a, axis=-1):
        xp = xp_of(a)
        shifted = a - a.max(axis=axis, keepdims=True)
        out = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))
        ctx.save_for_backward(out)
        ctx.axis = axis
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        return g - xp_of(out).exp(out) * g.sum(axis=ctx.axis, keepdims=True), None


class CrossEntropy(Function):
    """Cross-entropy of logits (N, C) against integer targets (N,): 'mean' or 'sum' over N."""

    @staticmethod
    def forward(ctx, logits, targets, reduction="mean"):
        xp = xp_of(logits)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        exp = xp.exp(shifted)
        sum_exp = exp.sum(axis=-1, keepdims=True)
        rows = xp.arange(len(targets))
        losses = xp.log(sum_exp[:, 0]) - shifted[rows, targets]
        ctx.save_for_backward(exp / sum_exp, _own(targets))
        ctx.reduction = reduction
        total = losses.sum()
        return total / len(targets) if reduction == "mean" else total

    @staticmethod
    def backward(ctx, g):
        probs, targets = ctx.saved
        grad = probs.copy()
        grad[xp_of(grad).arange(len(targets)), targets] -= 1
        scale = g / len(targets) if ctx.reduction == "mean" else g
        return grad * scale, None, None


class LayerNorm(Function):
    reads_in_backward = (1,)  # the weight, its data read in backward (ZeRO-3 re-gathers it)

    @staticmethod
    def forward(ctx, x, weight, bias, eps=1e-5):
        xp = xp_of(x)
        mu = x.mean(axis=-1, keepdims=True)
        xhat = x - mu  # centred, then scaled in place: (x - mu) * rstd
        rstd = 1.0 / xp.sqrt((xhat * xhat).mean(axis=-1, keepdims=True) + eps)
        xhat *= rstd
        ctx.save_for_backward(xhat, rstd)
        out = xhat * weight
        out += bias
        return out

    @staticmethod
    def backward(ctx, g):
        # exercise 01.2: the backward of layer norm
        xhat, rstd = ctx.saved
        weight = _data(ctx.inputs[1])
        lead = tuple(range(g.ndim - 1))
        gw = (g * xhat).sum(axis=lead) if ctx.needs_input_grad[1] else None
        gb = g.sum(axis=lead) if ctx.needs_input_grad[2] else None
        # rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat)), in place on gxhat, our own array,
        # in the dtype the plain expression would end in (the same bits when all dtypes agree)
        gxhat = (g * weight).astype(xp_of(g).result_type(g, weight, xhat, rstd), copy=False)
        along_xhat = xhat * (gxhat * xhat).mean(axis=-1, keepdims=True)
        gxhat -= gxhat.mean(axis=-1, keepdims=True)
        gxhat -= along_xhat
        gxhat *= rstd
        return gxhat, gw, gb, None
        # end exercise


def _own(indices):
    """The indices as an array of their own: a view of a larger batch (a micro-batch's rows, the ids
    beside the targets) would keep the whole batch alive until backward, and the meter would count
    it; the copy is the sb indices backward reads, allocated by this forward."""
    return indices.copy() if getattr(indices, "base", None) is not None else indices


class Embedding(Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(_own(ids))
        ctx.weight_shape = weight.shape
        return weight[ids]

    @staticmethod
    def backward(ctx, g):
        xp = xp_of(g)
        grad = xp.zeros(ctx.weight_shape, dtype=g.dtype)
        (ids,) = ctx.saved
        xp.add.at(grad, ids.reshape(-1), g.reshape(-1, g.shape[-1]))
        return None, grad


class Dropout(Function):
    @staticmethod
    def forward(ctx, x, p, generator):
        keep = generator.random(x.shape) >= p
        scale = 1.0 / (1.0 - p)
        mask = xp_of(x).asarray(keep, dtype=x.dtype) * scale
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved[0], None, None


def softmax(a, axis=-1):
    return Softmax.apply(a, axis)


def causal_softmax(scores):
    """softmax(scores + causal mask) over the last axis of (..., T, T) scores (CausalSoftmax)."""
    return CausalSoftmax.apply(scores)


def log_softmax(a, axis=-1):
    return LogSoftmax.apply(a, axis)


def cross_entropy(logits, targets, reduction="mean"):
    """Like F.cross_entropy: logits (N, C), integer targets (N,)."""
    return CrossEntropy.apply(logits, targets, reduction)


def mse_loss(prediction, target, reduction="mean"):
    diff = sub(prediction, target)
    total = sum(mul(diff, diff))
    return mul(total, 1.0 / _data(prediction).size) if reduction == "mean" else total


def layer_norm(x, weight, bias, eps=1e-5):
    return LayerNorm.apply(x, weight, bias, eps)


def embedding(ids, weight):
    """Rows of `weight` (num_embeddings, dim) picked by the integer array `ids`."""
    return Embedding.apply(ids, weight)


def dropout(x, p, generator, training=True):
    """Zero each element with probability p, scaling the rest; randomness only from `generator`."""
    if not training or p == 0.0:
        return x
    return Dropout.apply(x, p, generator)
