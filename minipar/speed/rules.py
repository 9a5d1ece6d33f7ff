"""GELU's and AdamW's rules in place and tile by tile: the plain forms' operations, fewer arrays.

The idea: core writes GELU's forward and backward and AdamW's update as a student would, one new
array per operation (core/layer_ops.py, core/optim.py). Each form here runs the same operations in
the same order on the same operands, but writes them into three arrays of its own (`out=`, `*=`), and
over an array larger than a tile runs them tile by tile (tiles.py), so that each pass after the first
finds its tile in the cache. Same operations, same order, same operand dtypes: the same bits, which
tests/speed/test_rules.py checks against core's plain forms in fp64 and fp32, over several tiles.

What it saves: GELU's backward makes about twenty arrays in its plain form, each a trip through memory
and, at the wide GPT's sizes, fresh pages; here three. About half of GELU's time on the wide GPT's
(16, 64, 1024) activations; AdamW's update, memory-bound inside a step, about 5%. What it costs: a
second copy of each rule to keep equal to the first (the tests), and a Python loop step per tile.
Installed into core's kernel table by install.py. Lesson: lessons/01b_speed_appendix.md
("The speed layer").
"""

from __future__ import annotations

from minipar.core.backend import xp_of
from minipar.core.layer_ops import GELU_C
from minipar.speed.tiles import in_cache_tiles, update_in_cache_tiles


def gelu_forward(x):
    """core.layer_ops.gelu_forward_plain's bits: 0.5 x (1 + tanh(c (x + 0.044715 x^3)))."""
    return in_cache_tiles(_gelu_forward_rule, x)


def gelu_backward(x, g):
    """core.layer_ops.gelu_backward_plain's bits: g (0.5 (1 + t) + 0.5 x (1 - t t) c (1 + 3 0.044715 x x))."""
    return in_cache_tiles(_gelu_backward_rule, x, g)


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """core.optim.adamw_update_plain's bits, in place on param and the moments, three new arrays."""
    update_in_cache_tiles(_adamw_rule, param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                          beta2=beta2, eps=eps, weight_decay=weight_decay)


def _gelu_forward_rule(x):
    t = _tanh_of_inner(x)
    t += 1.0
    half_x = 0.5 * x
    half_x *= t
    return half_x


def _gelu_backward_rule(x, g):
    xp = xp_of(x)
    t = _tanh_of_inner(x)
    scratch = xp.multiply(t, t)  # 1 - t t
    xp.subtract(1.0, scratch, out=scratch)
    slope = 0.5 * x  # 0.5 x (1 - t t), then times d_inner
    slope *= scratch
    d_inner = xp.multiply(x, 3 * 0.044715, out=scratch)  # c (1 + 3 0.044715 x x), in the scratch
    d_inner *= x
    d_inner += 1.0
    d_inner *= GELU_C
    slope *= d_inner
    t += 1.0  # 0.5 (1 + t) + slope, times g
    t *= 0.5
    t += slope
    if xp.result_type(t, g) != t.dtype:  # a wider gradient widens the result, as g * (...) would
        return g * t
    t *= g
    return t


def _tanh_of_inner(x):
    """tanh(c (x + 0.044715 x x x)), computed in one new array."""
    xp = xp_of(x)
    inner = 0.044715 * x
    inner *= x
    inner *= x
    inner += x
    inner *= GELU_C
    return xp.tanh(inner, out=inner)


def _adamw_rule(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    xp = xp_of(param)
    param *= 1 - lr * weight_decay
    scratch = xp.multiply(grad, 1 - beta1)
    exp_avg *= beta1
    exp_avg += scratch
    xp.multiply(grad, 1 - beta2, out=scratch)
    scratch *= grad
    exp_avg_sq *= beta2
    exp_avg_sq += scratch
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = xp.sqrt(exp_avg_sq)  # a new array: exp_avg_sq's dtype may differ from grad's
    denom /= bias_correction2**0.5
    denom += eps
    update = xp.multiply(exp_avg, lr / bias_correction1)
    update /= denom
    param -= update
