"""Optimizers: SGD with momentum and AdamW, written over flat arrays.

Each update rule is a function on flat arrays (`sgd_update`, `adamw_update`) so that ZeRO can run the
same arithmetic on the shard of the flattened parameters a rank owns, with state only for that shard.
The classes wrap those rules for ordinary, unsharded parameters, with PyTorch's names and defaults.
Lesson: lessons/01_autograd.md (and 04 for the sharded use).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from minipar.core.backend import xp_of
from minipar.core.options import option
from minipar.core.tiles import update_in_cache_tiles

OPTIMIZERS = ("adamw", "sgd")  # `minipar train --optimizer`: AdamW or SGD (with momentum), below


@dataclass
class OptimizerOptions:
    """The optimizer (core/optim.py)."""
    optimizer: str = option("adamw", "the optimizer", OPTIMIZERS)
    lr: float = option(1.5e-3, "learning rate")
    weight_decay: float = option(0.0, "decoupled weight decay (AdamW), L2 penalty (SGD)")
    momentum: float = option(0.9, "SGD's momentum (with --optimizer sgd)")


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step in place, in PyTorch's order of operations (decoupled decay, bias correction).

    The plain form, one temporary array per operation:
        exp_avg = beta1 * exp_avg + (1 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
        param -= (lr / bias_correction1) * exp_avg / (sqrt(exp_avg_sq) / sqrt(bias_correction2) + eps)
    written here on three new arrays (the plain form makes eight), tile by tile over a large buffer
    (core/tiles.py): the same operations in the same order, so the same bits
    (tests/core/test_speed_forms.py)."""
    update_in_cache_tiles(_adamw_rule, param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                          beta2=beta2, eps=eps, weight_decay=weight_decay)


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


def sgd_update(param, grad, momentum_buffer, lr, momentum, weight_decay):
    """One SGD step in place: PyTorch's momentum (buffer = momentum * buffer + grad)."""
    if weight_decay:
        grad = grad + weight_decay * param
    if momentum:
        momentum_buffer *= momentum
        momentum_buffer += grad
        grad = momentum_buffer
    param -= lr * grad


class Optimizer(ABC):
    """Holds per-parameter state (flat arrays) and applies `update` to each parameter; a subclass says
    what its state is (`init_state`) and how one flat buffer steps (`update`)."""

    def __init__(self, params):
        self.params = list(params)
        self.state: list[dict | None] = [None] * len(self.params)  # None until the parameter's first step

    @abstractmethod
    def init_state(self, n: int, dtype, xp) -> dict:
        """The state of one flat buffer of `n` elements (a whole parameter, or a ZeRO shard)."""

    @abstractmethod
    def update(self, param, grad, state: dict) -> None:
        """One step for one flat buffer and its state, in place."""

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            state = self.state[i]
            if state is None:
                state = self.state[i] = self.init_state(p.data.size, p.data.dtype, xp_of(p.data))
            self.update(p.data.reshape(-1), p.grad.reshape(-1), state)

    def state_bytes(self) -> int:
        return sum(a.nbytes for s in self.state if s for a in s.values() if hasattr(a, "nbytes"))


class AdamW(Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 update_rule=adamw_update):
        """`update_rule`: a function with adamw_update's signature doing the same arithmetic
        (`train --fused` passes minipar.fusion.training.adamw_update, three fused kernels)."""
        super().__init__(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.update_rule = update_rule

    def init_state(self, n, dtype, xp):
        return {"exp_avg": xp.zeros(n, dtype=dtype), "exp_avg_sq": xp.zeros(n, dtype=dtype), "step": 0}

    def update(self, param, grad, state):
        """One step for one flat buffer (a whole parameter, or a ZeRO shard) and its state."""
        state["step"] += 1
        self.update_rule(param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], self.lr,
                         self.betas[0], self.betas[1], self.eps, self.weight_decay)


class SGD(Optimizer):
    def __init__(self, params, lr=1e-2, momentum=0.0, weight_decay=0.0):
        super().__init__(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay

    def init_state(self, n, dtype, xp):
        return {"momentum_buffer": xp.zeros(n, dtype=dtype)} if self.momentum else {}

    def update(self, param, grad, state):
        sgd_update(param, grad, state.get("momentum_buffer"), self.lr, self.momentum, self.weight_decay)
