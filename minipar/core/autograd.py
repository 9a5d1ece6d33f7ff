"""Reverse-mode automatic differentiation on plain arrays.

The idea: every operation is a `Function` with a `forward` (arrays in, array out) and a `backward`
(gradient of the output in, gradients of the inputs out). Applying a Function to `Tensor`s records a
node; `Tensor.backward()` walks the nodes in reverse topological order and accumulates gradients into
the leaves, exactly as PyTorch's autograd does. It knows nothing of MPI: parallel techniques are written
as Functions too (the f/g operators, pipeline send/recv), which is why the shape matches PyTorch's.

What it costs: the tensors a Function saves for backward are the activation memory of training; they
are counted by `activation_meter`, the number that pipeline schedules and ZeRO trade against.
Lesson: lessons/01_autograd.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from operator import attrgetter

from minipar.core.backend import Array, xp_of
from minipar.core.hooks import HookList, RemovableHandle

_grad_enabled = True
_output_cast = None  # set by mixed precision: rounds every op's output and input-gradient


def recording_modes() -> tuple:
    """What `no_grad`, `enable_grad` and `cast_outputs` set, as one value. A part of an overlapped
    pipeline step (parallel/f_and_b.py) that hands the processor to the other part in the middle of
    its work keeps its own modes across the hand-over with this and `restore_recording_modes`."""
    return _grad_enabled, _output_cast


def restore_recording_modes(modes: tuple) -> None:
    global _grad_enabled, _output_cast
    _grad_enabled, _output_cast = modes


class ActivationMeter:
    """Bytes of tensors saved for backward: current and peak since the last reset.

    Each buffer counts once, whoever saves it and however many times (softmax's output, saved by the
    softmax and by the product after it; the input that query, key and value share): `hold` keys the
    arrays by the buffer that owns their memory, counts that buffer's `nbytes` (a saved view keeps its
    whole base alive) when its first saver holds it, and `let_go` takes it off when its last saver
    lets go. `add` and `release` count bytes as given (the buffer meter's use).

    Anyone may listen (a memory ledger, an offloading store that must make room first): autograd
    itself knows nothing of them. Listeners get the new current bytes after every change, in order."""

    def __init__(self):
        self.current = 0
        self.peak = 0
        self.listeners = HookList()
        self.savers: dict[int, list] = {}  # id(base) -> [savers, nbytes]; a saver's view keeps base alive

    def hold(self, arrays) -> tuple:
        """Count the buffers of `arrays` not held yet; returns their bases, for `let_go`."""
        bases, added, savers = [], 0, self.savers
        for a in arrays:  # a plain loop, not a generator: this runs for every op of every step
            base = getattr(a, "base", _NOT_AN_ARRAY)
            if base is _NOT_AN_ARRAY:  # None, a number, a tuple of slices: no buffer
                continue
            base = a
            while hasattr(base.base, "base") and hasattr(base.base, "nbytes"):  # an array owns it: climb
                base = base.base  # (not a memoryview or bytes an array was made from)
            entry = savers.get(id(base))
            if entry is None:
                savers[id(base)] = [1, base.nbytes]
                added += base.nbytes
            else:
                entry[0] += 1
            bases.append(base)
        if added:
            self.add(added)
        return tuple(bases)

    def let_go(self, bases: tuple):
        released, savers = 0, self.savers
        for base in bases:
            entry = savers[id(base)]
            entry[0] -= 1
            if not entry[0]:
                del savers[id(base)]
                released += entry[1]
        if released:
            self.release(released)

    def subscribe(self, listener, first: bool = False) -> RemovableHandle:
        """Call `listener(current_bytes)` on every change; `first=True` puts it ahead of the others."""
        return self.listeners.add(listener, first)

    def add(self, nbytes: int):
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
        self.listeners.call_all(self.current)

    def release(self, nbytes: int):
        self.current -= nbytes
        self.listeners.call_all(self.current)

    def reset_peak(self):
        self.peak = self.current


_NOT_AN_ARRAY = object()
activation_meter = ActivationMeter()


@contextlib.contextmanager
def no_grad():
    """Run operations without recording a graph (evaluation, optimizer updates)."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = previous


@contextlib.contextmanager
def enable_grad():
    """Record a graph even inside `no_grad` (activation recomputation records in backward)."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, True
    try:
        yield
    finally:
        _grad_enabled = previous


@contextlib.contextmanager
def cast_outputs(cast):
    """Round every Function's output and every gradient it returns with `cast` (mixed precision)."""
    global _output_cast
    previous, _output_cast = _output_cast, cast
    try:
        yield
    finally:
        _output_cast = previous


class Tensor:
    """An array with an optional gradient and the node that produced it."""

    __array_priority__ = 1000  # so `ndarray + Tensor` defers to Tensor.__radd__
    is_parameter = False  # a model's weight (nn.Parameter says True): what a split backward defers

    def __init__(self, data, requires_grad: bool = False):
        self.data = data
        self.grad: Array | None = None  # d(loss)/d(self), accumulated by backward() on leaves
        self.requires_grad = requires_grad
        # the backward node of the op that made it (non-leaf tensors); None for leaves
        self.node: Node | None = None

    # the array's, read by attrgetter (C, no Python call: ops ask for them on every step)
    shape = property(attrgetter("data.shape"))
    dtype = property(attrgetter("data.dtype"))
    ndim = property(attrgetter("data.ndim"))
    size = property(attrgetter("data.size"))

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"

    def numpy(self):
        return self.data

    def item(self) -> float:
        return float(self.data)

    def detach(self) -> Tensor:
        return Tensor(self.data)

    def backward(self, grad=None, defer_weight_grads: list | None = None):
        """Accumulate d(self)/d(leaf) into every leaf's `.grad` that requires grad.

        With `defer_weight_grads` a list (ZB-H1's split backward), only the gradients that flow on are
        computed now: an op applied to parameters (Linear, LayerNorm, an embedding) computes its other
        inputs' gradients, and appends to the list a call that computes its parameters' gradients
        later (W). A module's full backward hook waits in the same list, after its parameters' calls.
        Calling the list's entries in order then leaves the same gradients as one plain backward.
        """
        if grad is None:
            grad = xp_of(self.data).ones_like(self.data)
        root, self.node = self.node, None  # free the graph as we go, like PyTorch's retain_graph=False
        if root is None:  # a leaf: its gradient is the one given
            _accumulate(self, grad)
            return
        grads = {root: grad}  # keyed by the nodes themselves: a Node hashes by identity
        with _in_flight(grads):  # what backward_node_hooks are shown (a recomputation's backward nests)
            for node in reversed(_topological_order(root)):
                g = grads.get(node)  # in flight until the node has run: a nested backward counts it
                ctx, links = node.ctx, node.next
                if g is None or ctx is None:  # no gradient reached it, or another backward ran it
                    grads.pop(node, None)
                    continue
                node.ctx, node.next = None, ()  # its saved arrays go with its backward
                if defer_weight_grads is None:
                    input_grads = _run_backward(node.function, ctx, g)
                else:
                    input_grads = _backward_deferring_weights(node.function, ctx, g, links,
                                                              defer_weight_grads)
                # needed: the argument was a Tensor that required grad when the op ran (apply's record)
                for link, pg, needed in zip(links, input_grads, ctx.needs_input_grad):
                    if pg is None or not needed:
                        continue
                    if _output_cast is not None:
                        pg = _output_cast(pg)
                    if link.__class__ is not Node:  # a leaf: accumulate now, as PyTorch's AccumulateGrad
                        _accumulate(link, pg)  # does, so later hooks see it
                        continue
                    if link in grads:  # used by several ops: the gradients add, an op like any other
                        pg = grads[link] + pg
                        pg = _output_cast(pg) if _output_cast is not None else pg
                    grads[link] = pg
                del grads[node]
                if backward_node_hooks:  # the node's temporaries dropped first: what is alive is counted
                    g = pg = None
                    del input_grads
                    backward_node_hooks.call_all(node, [g for walk in _walks for g in walk.values()])

    # Operators call the differentiable functions of minipar.core.functional through `_operators`
    # (functional registers them: it builds on this module, so this module cannot import it).
    def __add__(self, other):
        return _operators["add"](self, other)

    def __radd__(self, other):
        return _operators["add"](other, self)

    def __sub__(self, other):
        return _operators["sub"](self, other)

    def __rsub__(self, other):
        return _operators["sub"](other, self)

    def __mul__(self, other):
        return _operators["mul"](self, other)

    def __rmul__(self, other):
        return _operators["mul"](other, self)

    def __truediv__(self, other):
        return _operators["div"](self, other)

    def __rtruediv__(self, other):
        return _operators["div"](other, self)

    def __neg__(self):
        return _operators["neg"](self)

    def __pow__(self, exponent):
        return _operators["pow"](self, exponent)

    def __matmul__(self, other):
        return _operators["matmul"](self, other)

    def __rmatmul__(self, other):
        return _operators["matmul"](other, self)

    def __getitem__(self, index):
        return _operators["getitem"](self, index)

    def sum(self, axis=None, keepdims=False):
        return _operators["sum"](self, axis, keepdims)

    def mean(self, axis=None, keepdims=False):
        return _operators["mean"](self, axis, keepdims)

    def max(self, axis=None, keepdims=False):
        return _operators["max"](self, axis, keepdims)

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        return _operators["reshape"](self, shape)

    def transpose(self, *axes):
        return _operators["transpose"](self, axes if axes else None)

    @property
    def T(self):
        return _operators["transpose"](self, None)


_operators: dict = {}  # name -> differentiable function, filled by register_tensor_operators

# Called as `hook(node, in_flight)` after each node's backward, once its gradients are handed on (into
# a leaf's .grad, or pending for the node they go to) and its own output gradient is dropped; in_flight
# lists the gradients pending for nodes not run yet, in every backward running (a recomputation's
# backward runs one inside another's node). Nothing else of the node's backward is alive then: what
# memory holds is the saved arrays of the nodes to come, the leaves' .grad and in_flight (an observer
# such as tests/memory/test_real_memory.py compares the meters with it). Add with
# `backward_node_hooks.add(hook)`, which returns a RemovableHandle.
backward_node_hooks = HookList()
_walks: list[dict] = []  # the pending gradients of each backward running now, outermost first


@contextlib.contextmanager
def _in_flight(grads: dict):
    """`grads` (a backward's gradients pending for the nodes to come) among those the hooks are shown."""
    _walks.append(grads)
    try:
        yield
    finally:
        _walks.pop()


def register_tensor_operators(**functions):
    """Give Tensor's operators (`+`, `@`, `.sum()`...) the functions they call. minipar.core.functional
    does it when imported, and importing minipar.core imports it, so the table is always filled."""
    _operators.update(functions)


def _accumulate(leaf: Tensor, grad):
    leaf.grad = grad if leaf.grad is None else leaf.grad + grad


def _run_backward(function, ctx, g) -> tuple:
    """The op's input gradients (a tuple), its saved arrays released."""
    input_grads = function.backward(ctx, g)
    ctx.release()
    return input_grads if isinstance(input_grads, tuple) else (input_grads,)


def _backward_deferring_weights(function, ctx, g, links, deferred: list) -> tuple:
    """B of a split backward: the gradients of the op's inputs that are not parameters, now; a call
    computing the parameters' gradients appended to `deferred` (it keeps the saved arrays until then)."""
    if function.runs_after_weight_grads:  # an identity whose side effect waits for the weights
        deferred.append(lambda: function.backward(ctx, g))
        return (g,)
    needs = ctx.needs_input_grad
    # a parameter that requires grad is a leaf: its link is the parameter itself
    weights = tuple(n and isinstance(x, Tensor) and x.is_parameter for n, x in zip(needs, links))
    if not any(weights):
        return _run_backward(function, ctx, g)
    ctx.needs_input_grad = tuple(n and not w for n, w in zip(needs, weights))
    input_grads: tuple = (None,) * len(links)
    if any(ctx.needs_input_grad):  # an embedding has only its weight's gradient: nothing to do now
        input_grads = function.backward(ctx, g)
        input_grads = input_grads if isinstance(input_grads, tuple) else (input_grads,)
        # an op that ignores needs_input_grad (Add: a bias added after a row-parallel sum) still
        # returns its weights' gradients: W adds them, so B must not
        input_grads = tuple(None if is_weight else pg for pg, is_weight in zip(input_grads, weights))

    def weight_grads():
        ctx.needs_input_grad = weights
        for parent, pg, is_weight in zip(links, _run_backward(function, ctx, g), weights):
            if is_weight and pg is not None:
                _accumulate(parent, _output_cast(pg) if _output_cast is not None else pg)

    deferred.append(weight_grads)
    return input_grads


def _topological_order(root: Node) -> list[Node]:
    """root and the nodes root depends on, each after every node it depends on. Leaves are left out:
    backward accumulates into a leaf as soon as it meets it, and a model's parameters are most of a
    graph's inputs."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for link in node.next:
            if link.__class__ is Node and link not in seen:
                stack.append((link, False))
    return order


class Node:
    """One op of the graph, as backward sees it (PyTorch's grad_fn): the Function, its ctx (the arrays
    it saved, the parameters it reads in backward) and, per argument, the link its gradient goes to:
    the node of the op that made the argument, the argument itself if it is a leaf that requires grad
    (the leaf is its own accumulation node: backward adds into its `.grad`), or None.

    It keeps no argument's data: an intermediate array that no node saved is freed as soon as the
    forward drops it, as in PyTorch."""

    __slots__ = ("function", "ctx", "next")

    def __init__(self, function: type[Function], ctx: Context, links: tuple):
        self.function = function
        self.ctx: Context | None = ctx
        self.next = links


class Context:
    """What forward leaves for backward. Saved arrays are counted as activation memory.

    Its fields start as these class attributes (all immutable), with no `__init__` to run: one Python
    call less for every op of every step."""

    # the arguments the Function reads as Tensors in backward (its `reads_in_backward`), None elsewhere
    inputs: tuple = ()
    saved: tuple = ()
    _held: tuple = ()  # the buffers this ctx holds in the activation meter
    needs_input_grad: tuple[bool, ...] = ()
    recording = True  # False when no graph is recorded: then nothing saved is kept or counted

    @property
    def held_buffers(self) -> tuple:
        """The buffers this ctx holds in the activation meter, each once (a saved view: its base)."""
        return self._held

    def save_for_backward(self, *arrays):
        if not self.recording:  # a forward without a graph (no_grad, a recomputed block's first pass)
            return  # must not show its arrays to the meter even for an instant: peaks are exact
        self.saved = arrays
        self._held = activation_meter.hold(arrays)

    def keep_inputs(self, args: tuple, indices: tuple[int, ...]):
        """Keep the arguments at `indices` for backward as the Tensors they are: a parameter's `.data` is
        read then (ZeRO-3 frees and re-gathers it between), as PyTorch's saved variable of a leaf. Not
        counted: a kept argument is a parameter or an identity of one (sequence parallelism's weight
        replicated on the piece), memory the ledger counts as parameters."""
        kept = [None] * len(args)
        for i in indices:
            if i < len(args):
                kept[i] = args[i]
        self.inputs = tuple(kept)

    def release(self):
        if self._held:
            activation_meter.let_go(self._held)
        self._held = ()
        self.saved = ()
        self.inputs = ()

    def __del__(self):
        # A graph dropped without backward (a forward with grad on, then the output discarded) frees
        # its saved arrays with it, as PyTorch's does: the meter must forget them too, or every later
        # reading (the memory ledger, an offload budget) would carry bytes that no longer exist.
        if self._held:
            self.release()


class Function:
    """An operation with a forward and a backward rule, applied to Tensors or arrays.

    Subclasses define `forward(ctx, *args)` on raw arrays (non-array arguments pass through) and
    `backward(ctx, grad_output)` returning one gradient per positional argument (None where there
    is none). Arrays backward needs go through `ctx.save_for_backward` (counted), never as ctx
    attributes. Parameters are read through `ctx.inputs` in backward, never copied, so ZeRO-3 may
    free and re-gather them between forward and backward: a Function names their positions in
    `reads_in_backward`, and its ctx keeps those arguments only.
    """

    # An identity whose backward has a side effect that needs the weights' gradients (a module's full
    # backward hook) says True: a split backward passes the gradient through and defers the effect.
    runs_after_weight_grads = False
    reads_in_backward: tuple[int, ...] = ()  # the arguments backward reads as Tensors (parameters)
    # A shape op (reshape, transpose, slicing) says True: its output holds its inputs' values, already
    # cast, so mixed precision's cast is skipped (rounding twice changes no bit) and a view stays a view
    moves_values_only = False
    # Each subclass defines both, as static methods: their signatures differ from one Function to the next.
    forward: Callable[..., object]
    backward: Callable[..., object]

    @classmethod
    def apply(cls, *args):
        ctx = Context()
        arrays, needs, links = [], [], []  # one pass over the arguments: this runs for every op of every step
        for a in args:
            if isinstance(a, Tensor):
                arrays.append(a.data)
                needs.append(a.requires_grad)
                links.append((a.node or a) if a.requires_grad else None)
            else:
                arrays.append(a)
                needs.append(False)
                links.append(None)
        ctx.needs_input_grad = tuple(needs)
        needs_grad = _grad_enabled and True in needs
        ctx.recording = needs_grad
        out = cls.forward(ctx, *arrays)
        if _output_cast is not None and not cls.moves_values_only:
            out = _output_cast(out)
        result = Tensor(out, needs_grad)
        if needs_grad:
            if cls.reads_in_backward:
                ctx.keep_inputs(args, cls.reads_in_backward)
            result.node = Node(cls, ctx, tuple(links))
        else:
            ctx.release()
        return result
