"""Optimizers: SGD with momentum and AdamW, written over flat arrays.

Each update rule is a function on flat arrays (`sgd_update`, `adamw_update`) so that ZeRO can run the
same arithmetic on the shard of the flattened parameters a rank owns, with state only for that shard.
The classes wrap those rules for ordinary, unsharded parameters, with PyTorch's names and defaults.
Lesson: lessons/01_autograd.md (and 04 for the sharded use).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from minipar.core import kernels
from minipar.core.backend import xp_of
from minipar.core.options import option

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
    The plain form below, or the one installed for "adamw_update" (core/kernels.py; minipar/speed:
    the same operations on fewer arrays, tile by tile, the same bits)."""
    kernels.chosen("adamw_update", adamw_update_plain)(param, grad, exp_avg, exp_avg_sq, step, lr, beta1,
                                                       beta2, eps, weight_decay)


def adamw_update_plain(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """The moments and the parameter are updated in place (they are the optimizer's state); every
    other value is a new array."""
    param *= 1 - lr * weight_decay
    exp_avg *= beta1
    exp_avg += (1 - beta1) * grad
    exp_avg_sq *= beta2
    exp_avg_sq += (1 - beta2) * grad * grad
    denom = xp_of(exp_avg_sq).sqrt(exp_avg_sq) / (1 - beta2**step) ** 0.5 + eps
    param -= (lr / (1 - beta1**step)) * exp_avg / denom


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
