"""AdamW and GELU through the fused interpreter: the long elementwise chains of a training step.

The AdamW update is some fifteen elementwise operations over every parameter; run one by one they
move about 33 arrays' worth of bytes, fused 10 (three kernels: exp_avg, exp_avg_sq, param). GELU's
forward is one kernel reading x and writing y. The arithmetic is written in exactly the order of
minipar.core.optim.adamw_update and minipar.core.functional.gelu_forward / gelu_backward, operation for
operation, so fused results are bitwise equal to them. `train --fused` calls these.
Lesson: lessons/10_fusion.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minipar.core.autograd import Function
from minipar.core.options import option
from minipar.fusion.interpret import run
from minipar.fusion.ir import Node, array, sqrt, tanh

GELU_C = math.sqrt(2.0 / math.pi)


@dataclass
class FusionOptions:
    """Kernel fusion (fusion/training.py)."""
    fused: bool = option(False, "AdamW and GELU through the fusion interpreter")


def adamw_expressions(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """The new (exp_avg, exp_avg_sq, param) as lazy expressions over the current arrays."""
    p, g = array(param, name="param"), array(grad, name="grad")
    m, v = array(exp_avg, name="exp_avg"), array(exp_avg_sq, name="exp_avg_sq")
    new_m = m * beta1 + (1 - beta1) * g
    new_v = v * beta2 + (1 - beta2) * g * g
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = sqrt(new_v) / bias_correction2**0.5 + eps
    new_p = p * (1 - lr * weight_decay) - (lr / bias_correction1) * new_m / denom
    return [new_m, new_v, new_p]


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                 *, fused: bool = True):
    """One AdamW step in place, bitwise equal to minipar.core.optim.adamw_update. Returns the Stats."""
    expressions = adamw_expressions(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps,
                                    weight_decay)
    _, stats = run(expressions, fused=fused, out=[exp_avg, exp_avg_sq, param])
    return stats


def gelu_expression(x: Node) -> Node:
    """GPT-2's tanh GELU, in minipar.core.functional.gelu_forward's order of operations."""
    return 0.5 * x * (1.0 + tanh(GELU_C * (x + 0.044715 * x * x * x)))


def gelu_backward_expression(x: Node, grad_out: Node) -> Node:
    """The gradient of GELU times grad_out, in minipar.core.functional.gelu_backward's order. The tanh
    has two consumers, so the fusion rule materialises it: two kernels."""
    t = tanh(GELU_C * (x + 0.044715 * x * x * x))
    d_inner = GELU_C * (1.0 + 3 * 0.044715 * x * x)
    return grad_out * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner)


def gelu(x, *, fused: bool = True):
    """GELU of an array, through the fused interpreter: one kernel, reads x and writes y."""
    return run(gelu_expression(array(x, name="x")), fused=fused)[0]


def gelu_backward(x, grad_out, *, fused: bool = True):
    """The gradient of GELU with respect to x, given the gradient of its output."""
    return run(gelu_backward_expression(array(x, name="x"), array(grad_out, name="grad_out")),
               fused=fused)[0]


class FusedGELU(Function):
    """GELU as an autograd Function whose forward and backward run through the fused interpreter."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return gelu(x)

    @staticmethod
    def backward(ctx, grad_out):
        return gelu_backward(ctx.saved[0], grad_out)


def fused_gelu(x):
    return FusedGELU.apply(x)


def use_fused_gelu(model):
    """`train --fused`: every GELU of the model runs through the fused interpreter."""
    for module in model.modules():
        if getattr(module, "activation", None) is not None:
            module.activation = fused_gelu
    return model
