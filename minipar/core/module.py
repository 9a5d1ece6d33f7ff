"""The module system: Module, ModuleList, Parameter, and where initial weights come from.

Names and methods follow torch.nn.Module (`named_parameters`, `state_dict`, `zero_grad`, `train`).
Initial weights depend only on (seed, parameter name): each parameter is drawn on its full shape from a
generator seeded by both, then cut to the shard this rank holds (`Parameter.shard`), so every parallel
layout starts from the same model.

Hooks, with PyTorch's names, let techniques act around a module's forward and backward without
touching its methods: forward pre-hooks and forward hooks around `forward`, and two backward hooks
made of an identity autograd Function (`BackwardHook`) placed on the module's output (the gradient
arrives: its backward is about to run) and on its input (the gradient leaves: its backward is done).
ZeRO-3 gathers a unit's parameters in the first and ZeRO-2 reduce-scatters its gradients in the second.
Lesson: lessons/01_autograd.md.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

from minipar.core.autograd import Function, Tensor
from minipar.core.backend import current as current_backend
from minipar.core.hooks import HookList, RemovableHandle
from minipar.core.shards import Shard, shard_of


class Parameter(Tensor):
    """A leaf tensor that requires grad, with the rule that initialises it and the shard it holds."""

    is_parameter = True

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



class BackwardHook(Function):
    """Identity in forward; calls `hook()` when the gradient passes back through, in backward."""

    @staticmethod
    def forward(ctx, x, hook):
        ctx.hook = hook
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return grad, None


class FullBackwardHook(BackwardHook):
    """The hook on a module's input: it fires once the module's backward is done, so a split backward
    (ZB-H1) holds it back until the weight gradients it waits for exist."""

    runs_after_weight_grads = True


class Module:
    """Holds parameters and submodules in attribute order, like torch.nn.Module."""

    # Set in __init__ with object.__setattr__, past the registration in __setattr__ below.
    _params: dict[str, Parameter]  # this module's own parameters, by attribute name
    _children: dict[str, Module]  # its direct submodules, by attribute name (or add_module's name)
    training: bool  # set by train() and eval()
    _forward_pre_hooks: HookList
    _forward_hooks: HookList
    _backward_pre_hooks: HookList
    _backward_hooks: HookList
    _ever_hooked = False  # set by the first register_*_hook: the hook lists are looked at from then on
    # Each subclass defines it with its own signature (a ModuleList has none): torch.nn.Module's declaration.
    forward: Callable[..., object]

    def __init__(self):
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_params", {})
        object.__setattr__(self, "training", True)
        for hooks in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
            object.__setattr__(self, hooks, HookList())

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
        """`forward`, with the hooks around it: forward pre-hooks, the input's backward hook, forward,
        forward hooks, the output's backward hook (PyTorch's order)."""
        if not self._ever_hooked:  # the common case, one check: straight to forward
            return self.forward(*args, **kwargs)
        for hook in self._forward_pre_hooks:
            replaced = hook(self, args)
            if replaced is not None:
                args = replaced if isinstance(replaced, tuple) else (replaced,)
        if self._backward_hooks:
            args = self._hook_first_grad_input(args)
        output = self.forward(*args, **kwargs)
        for hook in self._forward_hooks:
            replaced = hook(self, args, output)
            if replaced is not None:
                output = replaced
        if self._backward_pre_hooks and isinstance(output, Tensor) and output.requires_grad:
            output = BackwardHook.apply(output, lambda: self._backward_pre_hooks.call_all(self))
        return output

    def _hook_first_grad_input(self, args: tuple) -> tuple:
        """Put the full backward hooks on the first positional Tensor that requires grad."""
        for i, x in enumerate(args):
            if isinstance(x, Tensor) and x.requires_grad:
                hooked = FullBackwardHook.apply(x, lambda: self._backward_hooks.call_all(self))
                return (*args[:i], hooked, *args[i + 1:])
        return args

    # ---- hooks: each returns a RemovableHandle; hooks of one kind run in registration order ----
    def _hook_list(self, name: str) -> HookList:
        object.__setattr__(self, "_ever_hooked", True)
        return getattr(self, name)

    def register_forward_pre_hook(self, hook) -> RemovableHandle:
        """`hook(module, args)` before every forward; a non-None result replaces the positional
        arguments (a tuple, or a single value). Keyword arguments are not shown to it."""
        return self._hook_list("_forward_pre_hooks").add(hook)

    def register_forward_hook(self, hook) -> RemovableHandle:
        """`hook(module, args, output)` after every forward; a non-None result replaces the output."""
        return self._hook_list("_forward_hooks").add(hook)

    def register_full_backward_pre_hook(self, hook) -> RemovableHandle:
        """`hook(module)` when the gradient reaches the module's output, before any of its backward
        operations run (none of its parameters has this backward's gradient yet). Unlike PyTorch's,
        it is not shown the gradient and cannot replace it. Only a Tensor output is hooked."""
        return self._hook_list("_backward_pre_hooks").add(hook)

    def register_full_backward_hook(self, hook) -> RemovableHandle:
        """`hook(module)` once backward has gone through all of the module's operations: when the
        gradient reaches its first positional Tensor input that requires grad (autograd accumulates a
        leaf's gradient at once, so every parameter used on that input has its gradient by then).
        Unlike PyTorch's, it is shown no gradients. It does NOT fire when no input requires grad
        (token ids into an embedding): whoever relies on it must catch that case (ZeRO's step does)."""
        return self._hook_list("_backward_hooks").add(hook)

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
