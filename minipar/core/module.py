"""The module system: Module, ModuleList, Parameter, and where initial weights come from.

Names and methods follow torch.nn.Module (`named_parameters`, `state_dict`, `zero_grad`, `train`).
Initial weights depend only on (seed, parameter name): each parameter is drawn on its full shape from a
generator seeded by both, then cut to the shard this rank holds (`Parameter.shard`), so every parallel
layout starts from the same model. Lesson: lessons/01_autograd.md.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from minipar.core.autograd import Tensor
from minipar.core.backend import current as current_backend


@dataclass(frozen=True)
class Shard:
    """This rank holds [start, stop) of the full tensor along `axis`; rows past the end are padding."""

    full_shape: tuple
    axis: int
    start: int
    stop: int


class Parameter(Tensor):
    """A leaf tensor that requires grad, with the rule that initialises it and the shard it holds."""

    def __init__(self, shape, init=("zeros",), dtype="float64", shard: Shard | None = None):
        super().__init__(current_backend().xp.zeros(shape, dtype=dtype), requires_grad=True)
        self.init = init
        self.shard = shard

    @property
    def full_shape(self):
        return self.shard.full_shape if self.shard else self.shape


def initial_value(seed: int, name: str, full_shape, init) -> np.ndarray:
    """The full-shape initial value of parameter `name`: the same in every layout."""
    kind = init[0]
    if kind == "zeros":
        return np.zeros(full_shape)
    if kind == "ones":
        return np.ones(full_shape)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.standard_normal(full_shape) * init[1]


def shard_of(full: np.ndarray, shard: Shard | None) -> np.ndarray:
    """Cut this rank's shard from a full tensor, padding with zeros past the end."""
    if shard is None:
        return full
    pad = max(0, shard.stop - full.shape[shard.axis])
    if pad:
        widths = [(0, 0)] * full.ndim
        widths[shard.axis] = (0, pad)
        full = np.pad(full, widths)
    index = [slice(None)] * full.ndim
    index[shard.axis] = slice(shard.start, shard.stop)
    return full[tuple(index)]


class Module:
    """Holds parameters and submodules in attribute order, like torch.nn.Module."""

    def __init__(self):
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_params", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if isinstance(value, Parameter):
            self._params[name] = value
        elif isinstance(value, Module):
            self._children[name] = value
        object.__setattr__(self, name, value)

    def add_module(self, name: str, module: Module):
        """Register a child under any name, dotted ones included ("blocks.3" in a pipeline stage)."""
        self._children[name] = module

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def named_parameters(self, prefix: str = ""):
        for name, p in self._params.items():
            yield prefix + name, p
        for name, child in self._children.items():
            yield from child.named_parameters(prefix + name + ".")

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def modules(self):
        yield self
        for child in self._children.values():
            yield from child.modules()

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    def train(self, mode: bool = True):
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self) -> dict:
        return {name: p.data.copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict):
        params = dict(self.named_parameters())
        missing = set(params) - set(state)
        unexpected = set(state) - set(params)
        if missing or unexpected:
            raise KeyError(f"state_dict mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        for name, p in params.items():
            if state[name].shape != p.shape:
                raise ValueError(f"{name}: shape {state[name].shape} does not match {p.shape}")
            p.data[...] = state[name]

    def init_parameters(self, seed: int, prefix: str = ""):
        """Draw every parameter from (seed, full name), on its full shape, then cut its shard."""
        backend = current_backend()
        for name, p in self.named_parameters(prefix):
            full = initial_value(seed, name, p.full_shape, p.init)
            p.data[...] = backend.from_host(shard_of(full, p.shard).astype(p.dtype))
        return self


class ModuleList(Module):
    def __init__(self, modules):
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), m)

    def __iter__(self):
        return iter(self._children.values())

    def __len__(self):
        return len(self._children)

    def __getitem__(self, i):
        return list(self._children.values())[i]
