"""Shape operations with backward rules: reshape, transpose, indexing and slicing, concatenate.

Part of `minipar.core.functional` (imported as F). Each backward puts the gradient back where the value came
from: the inverse permutation for a transpose, a scatter-add into zeros for indexing (repeated indices
add up), slices for a concatenation. Lesson: lessons/01_autograd.md.
"""

from __future__ import annotations

from minipar.core.autograd import Function
from minipar.core.backend import xp_of


class Reshape(Function):
    moves_values_only = True

    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape), None


class Transpose(Function):
    moves_values_only = True

    @staticmethod
    def forward(ctx, a, axes=None):
        ctx.axes = axes
        return a.transpose(axes)

    @staticmethod
    def backward(ctx, g):
        if ctx.axes is None:
            return g.transpose(), None
        axes = [ax % g.ndim for ax in ctx.axes]  # -1 and ndim-1 name the same axis
        return g.transpose(tuple(sorted(range(g.ndim), key=axes.__getitem__))), None  # the inverse


class GetItem(Function):
    """Slicing and indexing; backward scatters (and adds, for repeated indices) into zeros."""

    moves_values_only = True

    @staticmethod
    def forward(ctx, a, index):
        ctx.shape, ctx.dtype = a.shape, a.dtype
        ctx.save_for_backward(index)  # an index array is an activation like any other
        return a[index]

    @staticmethod
    def backward(ctx, g):
        xp = xp_of(g)
        grad = xp.zeros(ctx.shape, dtype=g.dtype)
        xp.add.at(grad, ctx.saved[0], g)
        return grad, None


class Concatenate(Function):
    moves_values_only = True

    @staticmethod
    def forward(ctx, axis, *arrays):
        ctx.axis, ctx.sizes = axis, [a.shape[axis] for a in arrays]
        return xp_of(arrays[0]).concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, g):
        bounds = [0]
        for n in ctx.sizes:
            bounds.append(bounds[-1] + n)
        index = [slice(None)] * g.ndim
        grads = []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            index[ctx.axis] = slice(start, stop)
            grads.append(g[tuple(index)])
        return (None, *grads)


def reshape(a, shape):
    return Reshape.apply(a, tuple(shape))


def transpose(a, axes=None):
    return Transpose.apply(a, None if axes is None else tuple(axes))


def getitem(a, index):
    return GetItem.apply(a, index)


def concatenate(tensors, axis=0):
    return Concatenate.apply(axis, *tensors)
