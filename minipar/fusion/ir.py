"""The lazy array language: nodes that record operations instead of running them.

`fx.array(A)` wraps an array in a leaf; Python operators and `fx.exp`, `fx.maximum`, ... build a
graph of nodes. Each node knows its shape and dtype (NumPy's broadcasting and type rules, worked out
on empty arrays) but holds no data, so nothing touches memory until `fx.run` hands the whole graph to
an interpreter. Seeing the whole chain before running any of it is what lets the fusion pass
(fuse.py) put many operations into one kernel. `apply` at the bottom says what each operation
does to real arrays, for every interpreter. Lesson: lessons/10_fusion.md.
"""

from __future__ import annotations

import numpy as np

UNARY = ("negative", "exp", "log", "tanh", "sqrt")
BINARY = ("add", "subtract", "multiply", "divide", "power", "maximum", "minimum")
COMPARISONS = ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal")
REDUCTIONS = ("sum", "max")
SCALAR_TYPES = (bool, int, float, np.bool_, np.integer, np.floating)


def _operator(op: str, reflected: bool = False):
    """A Python operator method building an `op` node (reflected: for 2 * x, the node is second)."""

    def method(self, other) -> Node:
        return elementwise(op, other, self) if reflected else elementwise(op, self, other)

    return method


class Node:
    """One value of a lazy expression: a leaf ("array"), a constant ("scalar"), or an operation.

    `args` are the input nodes; `value` is the wrapped array (leaf) or Python number (scalar);
    `axis` and `keepdims` belong to reductions, `name` to leaves (it shows in printouts and in
    generated CUDA source).
    """

    __array_ufunc__ = None  # makes NumPy defer to our reflected operators: ndarray + Node -> Node
    __hash__ = object.__hash__  # __eq__ builds a node, so graphs key their dicts on identity

    def __init__(self, op, args=(), *, shape, dtype, value=None, axis=None, keepdims=False, name=None):
        self.op, self.args = op, tuple(args)
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.value, self.axis, self.keepdims, self.name = value, axis, keepdims, name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_leaf(self) -> bool:
        return self.op == "array"

    @property
    def is_scalar(self) -> bool:
        return self.op == "scalar"

    @property
    def is_reduction(self) -> bool:
        return self.op in REDUCTIONS

    def __bool__(self):
        raise TypeError("a lazy array has no truth value until it is run: use fx.run(expr) first")

    def __repr__(self) -> str:
        if self.is_leaf:
            return self.name or f"array({self.dtype}, {self.shape})"
        if self.is_scalar:
            return repr(self.value)
        args = ", ".join(repr(a) for a in self.args)
        if self.op == "astype":
            return f"astype({args}, {self.dtype})"
        if self.is_reduction:
            return f"{self.op}({args}, axis={self.axis}{', keepdims=True' if self.keepdims else ''})"
        return f"{self.op}({args})"

    __add__, __radd__ = _operator("add"), _operator("add", reflected=True)
    __sub__, __rsub__ = _operator("subtract"), _operator("subtract", reflected=True)
    __mul__, __rmul__ = _operator("multiply"), _operator("multiply", reflected=True)
    __truediv__, __rtruediv__ = _operator("divide"), _operator("divide", reflected=True)
    __pow__, __rpow__ = _operator("power"), _operator("power", reflected=True)
    __lt__, __le__ = _operator("less"), _operator("less_equal")
    __gt__, __ge__ = _operator("greater"), _operator("greater_equal")
    __eq__, __ne__ = _operator("equal"), _operator("not_equal")

    def __neg__(self) -> Node:
        return elementwise("negative", self)

    def sum(self, axis, keepdims=False) -> Node:
        return reduction("sum", self, axis, keepdims)

    def max(self, axis, keepdims=False) -> Node:
        return reduction("max", self, axis, keepdims)

    def astype(self, dtype) -> Node:
        return Node("astype", (self,), shape=self.shape, dtype=dtype)


def array(data, name: str | None = None) -> Node:
    """A leaf wrapping `data` without copying it (NumPy or CuPy array; anything else via np.asarray)."""
    if not (hasattr(data, "shape") and hasattr(data, "dtype")):
        data = np.asarray(data)
    return Node("array", shape=data.shape, dtype=data.dtype, value=data, name=name)


def as_node(x) -> Node:
    """x as a node: nodes pass through, Python and NumPy numbers become constants, arrays leaves."""
    if isinstance(x, Node):
        return x
    if isinstance(x, SCALAR_TYPES):
        return Node("scalar", shape=(), dtype=np.asarray(x).dtype, value=x)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return array(x)
    raise TypeError(f"cannot use a {type(x).__name__} in a lazy expression")


def _stand_in(node: Node):
    """What NumPy's type rules see for a node: the number itself for a constant (Python numbers are
    'weak', NEP 50: float32 array * 0.5 stays float32), an empty array of its dtype otherwise."""
    return node.value if node.is_scalar else np.empty(0, node.dtype)


def elementwise(op: str, *args) -> Node:
    """A node applying NumPy's `op` elementwise, with NumPy's broadcasting and result dtype."""
    nodes = [as_node(a) for a in args]
    shape = np.broadcast_shapes(*(n.shape for n in nodes))
    dtype = getattr(np, op)(*map(_stand_in, nodes)).dtype
    return Node(op, nodes, shape=shape, dtype=dtype)


def reduction(op: str, x, axis: int, keepdims: bool = False) -> Node:
    """A node reducing x with NumPy's `op` ("sum" or "max") over one axis."""
    x = as_node(x)
    if not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{op} needs one axis in [-{x.ndim}, {x.ndim}) for shape {x.shape}, got {axis!r}")
    axis = int(axis) % x.ndim
    shape = x.shape[:axis] + ((1,) if keepdims else ()) + x.shape[axis + 1 :]
    dtype = np.sum(np.empty(1, x.dtype)).dtype if op == "sum" else x.dtype
    return Node(op, (x,), shape=shape, dtype=dtype, axis=axis, keepdims=keepdims)


def _unary(op):
    def build(x) -> Node:
        return elementwise(op, x)

    build.__name__ = build.__qualname__ = op
    build.__doc__ = f"Lazy numpy.{op}."
    return build


def _binary(op):
    def build(x, y) -> Node:
        return elementwise(op, x, y)

    build.__name__ = build.__qualname__ = op
    build.__doc__ = f"Lazy numpy.{op}, broadcasting."
    return build


negative, exp, log, tanh, sqrt = map(_unary, UNARY)
add, subtract, multiply, divide, power, maximum, minimum = map(_binary, BINARY)
less, less_equal, greater, greater_equal, equal, not_equal = map(_binary, COMPARISONS)


def where(condition, x, y) -> Node:
    """Lazy numpy.where: x where condition holds, else y."""
    return elementwise("where", condition, x, y)


def astype(x, dtype) -> Node:
    """Lazy cast, like ndarray.astype."""
    return as_node(x).astype(dtype)


def sum(x, axis: int, keepdims: bool = False) -> Node:  # noqa: A001 - numpy's name
    """Lazy numpy.sum over one axis."""
    return reduction("sum", x, axis, keepdims)


def max(x, axis: int, keepdims: bool = False) -> Node:  # noqa: A001 - numpy's name
    """Lazy numpy.max over one axis (fx.maximum is the elementwise one)."""
    return reduction("max", x, axis, keepdims)


def apply(xp, node: Node, args: list, out) -> None:
    """Compute one node from its arguments' values (arrays, or numbers for constants) into out."""
    if node.op == "where":  # numpy.where has no out= argument
        xp.copyto(out, xp.where(*args), casting="unsafe")
    elif node.op == "astype":
        xp.copyto(out, args[0], casting="unsafe")
    elif node.op == "sum":
        xp.sum(args[0], axis=node.axis, keepdims=node.keepdims, dtype=node.dtype, out=out)
    elif node.op == "max":
        xp.max(args[0], axis=node.axis, keepdims=node.keepdims, out=out)
    else:
        getattr(xp, node.op)(*args, out=out)
