"""A fake CuPy for machines without a GPU: device arrays that live in host memory.

    with fake_cupy(gpus=2) as fake:           # `import cupy` now imports this fake
        backend.set_backend("cupy")           # minipar's real CuPy backend, unchanged
        ...
        fake.copies                            # Counter: to_host, to_device, synchronize

The arrays keep their values in a private NumPy array, but at the edges behave as CuPy's do, only
stricter, so that any path that would break on a GPU breaks here:
- no `where=` nor `initial=` in max and min, which CuPy's reductions lack;
- no buffer protocol: MPI refuses them, so a collective that forgot to stage fails at once;
- no implicit conversion: numpy.asarray(a) raises TypeError, as in CuPy;
- no mixing with NumPy arrays in arithmetic or in xp functions (TypeError, as in CuPy);
- no pickling: a device array slipped into a control message would be a hidden copy.
With `cuda_array_interface=True` they expose ``__cuda_array_interface__`` pointing at their host
memory, which a host MPI reads and writes: the stand-in for a CUDA-aware MPI.
Every copy between the two memories and every stream synchronisation is counted.
Lesson: lessons/11_gpu.md.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections import Counter

import numpy
from numpy.lib.mixins import NDArrayOperatorsMixin

from minipar.core import backend

# Functions that build arrays from shapes and numbers, not from arrays.
CREATION = {"empty", "zeros", "ones", "full", "arange", "eye", "identity", "linspace", "tri"}
# NumPy arguments CuPy's reductions lack (cupy issue #6692): `a.max(where=..., initial=...)` raises there
NOT_IN_CUPY = {name: {"where", "initial"} for name in ("max", "min", "amax", "amin")}


def _refuse_what_cupy_lacks(name: str, kwargs: dict) -> None:
    missing = NOT_IN_CUPY.get(name, set()) & kwargs.keys()
    if missing:
        raise TypeError(f"fake cupy: {name} has no {', '.join(sorted(missing))} argument, as in CuPy")


class Device:
    """The state of the fake: its GPUs, the one in use, and the counters."""

    def __init__(self, gpus: int, cuda_array_interface: bool):
        self.gpus, self.cuda_array_interface = gpus, cuda_array_interface
        self.device_in_use = 0
        self.copies = Counter()


STATE = Device(1, False)


def _unwrap(value, where: str):
    """Device arrays to their memory; a host array among them is an error, as in CuPy."""
    if isinstance(value, ndarray):
        return value._memory
    if isinstance(value, numpy.ndarray):
        raise TypeError(f"Unsupported type {type(value)} in {where}: a host array met device arrays")
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, where) for v in value)
    if isinstance(value, dict):
        return {k: _unwrap(v, where) for k, v in value.items()}
    return value


def _wrap(value):
    """Results back to device arrays; a NumPy scalar becomes a 0-d array, as CuPy returns."""
    if isinstance(value, numpy.ndarray):
        return ndarray(value)
    if isinstance(value, numpy.generic):
        return ndarray(numpy.asarray(value))
    if isinstance(value, (list, tuple)):
        return type(value)(_wrap(v) for v in value)
    return value


def _index(key):
    """An index: device arrays unwrap; host arrays and lists are copied to the device (CuPy does)."""
    if isinstance(key, tuple):
        return tuple(_index(k) for k in key)
    if isinstance(key, ndarray):
        return key._memory
    if isinstance(key, (numpy.ndarray, list)):
        STATE.copies["to_device"] += 1
    return key


class ndarray(NDArrayOperatorsMixin):  # noqa: N801 - CuPy's name
    """A device array of the fake: values in `_memory`, reachable only through explicit copies."""

    __module__ = "cupy"  # minipar.core.backend.xp_of recognises CuPy arrays by their module

    def __init__(self, memory: numpy.ndarray):
        self._memory = memory

    shape = property(lambda self: self._memory.shape)
    dtype = property(lambda self: self._memory.dtype)
    ndim = property(lambda self: self._memory.ndim)
    size = property(lambda self: self._memory.size)
    nbytes = property(lambda self: self._memory.nbytes)
    itemsize = property(lambda self: self._memory.itemsize)
    strides = property(lambda self: self._memory.strides)
    T = property(lambda self: ndarray(self._memory.T))

    def get(self) -> numpy.ndarray:
        """A host copy, as cupy.ndarray.get()."""
        STATE.copies["to_host"] += 1
        return self._memory.copy()

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed (fake CuPy): copy explicitly")

    def __reduce__(self):
        raise TypeError("a fake device array does not pickle: copy it to the host first")

    @property
    def __cuda_array_interface__(self) -> dict:
        if not STATE.cuda_array_interface:
            raise AttributeError("this fake device has no CUDA array interface")
        memory = self._memory
        return {"shape": memory.shape, "typestr": memory.dtype.str, "version": 3,
                "data": (memory.__array_interface__["data"][0], False),
                "strides": None if memory.flags.c_contiguous else memory.strides}

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        where = f"{ufunc.__name__}.{method}"
        if method == "at":  # ufunc.at(a, indices, b): the indices may be anything an index may be
            inputs = (_unwrap(inputs[0], where), _index(inputs[1]), *_unwrap(inputs[2:], where))
        else:
            inputs = _unwrap(inputs, where)
        out = kwargs.get("out")
        result = getattr(ufunc, method)(*inputs, **_unwrap(kwargs, where))
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        return _wrap(func(*_unwrap(args, func.__name__), **_unwrap(kwargs, func.__name__)))

    def __getitem__(self, key):
        return _wrap(self._memory[_index(key)])

    def __setitem__(self, key, value):
        if isinstance(value, numpy.ndarray):
            STATE.copies["to_device"] += 1
        self._memory[_index(key)] = value._memory if isinstance(value, ndarray) else value

    def __getattr__(self, name):
        if name.startswith("__"):  # __array_interface__, __array_struct__, ...: the memory stays hidden
            raise AttributeError(name)
        attribute = getattr(self._memory, name)
        if not callable(attribute):
            return _wrap(attribute)

        def method(*args, **kwargs):
            _refuse_what_cupy_lacks(name, kwargs)
            return _wrap(attribute(*_unwrap(args, name), **_unwrap(kwargs, name)))

        return method

    def __iter__(self):
        return (_wrap(row) for row in self._memory)

    def __len__(self):
        return len(self._memory)

    def __float__(self):
        return float(self._memory)

    def __int__(self):
        return int(self._memory)

    def __bool__(self):
        return bool(self._memory)

    def __repr__(self):
        return f"fake_cupy.{self._memory!r}"


def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray):  # a new array only where the dtype or the order asks for one
        memory = numpy.asarray(a._memory, dtype=dtype, order=order)
        return a if memory is a._memory else ndarray(memory)
    STATE.copies["to_device"] += 1
    return ndarray(numpy.array(a, dtype=dtype, order=order or "K"))


def array(obj, dtype=None, copy=True, order="K"):
    if isinstance(obj, ndarray):
        return ndarray(numpy.array(obj._memory, dtype=dtype, order=order))
    STATE.copies["to_device"] += 1
    return ndarray(numpy.array(obj, dtype=dtype, order=order))


def asnumpy(a, stream=None, order="C"):
    return a.get() if isinstance(a, ndarray) else numpy.asarray(a, order=order)


def _numpy_function(name: str):
    """numpy.<name> on device arrays; the first argument must be one (or a sequence of them)."""
    function = getattr(numpy, name)

    def on_device(*args, **kwargs):
        _refuse_what_cupy_lacks(name, kwargs)
        if name not in CREATION:
            first = args[0] if args else None
            arrays = first if isinstance(first, (list, tuple)) else [first]
            if not arrays or not all(isinstance(a, ndarray) for a in arrays):
                raise TypeError(f"fake cupy.{name} takes device arrays, got {type(first)}")
        return _wrap(function(*_unwrap(args, name), **_unwrap(kwargs, name)))

    return on_device


class _CUDARuntimeError(RuntimeError):
    pass


class _Stream:
    def synchronize(self):
        STATE.copies["synchronize"] += 1


class _DeviceHandle:
    def __init__(self, device: int = 0):
        self.id = device

    def use(self):
        if not 0 <= self.id < STATE.gpus:
            raise _CUDARuntimeError(f"cudaErrorInvalidDevice: no device {self.id}")
        STATE.device_in_use = self.id


def _device_count() -> int:
    if STATE.gpus == 0:
        raise _CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    return STATE.gpus


def _module() -> types.ModuleType:
    """The fake as a module named cupy: the functions above, NumPy's ufuncs (which dispatch to
    ndarray.__array_ufunc__), NumPy's constants and types, and every other NumPy function wrapped."""
    fake = types.ModuleType("cupy", __doc__)
    for name in ("ndarray", "asarray", "array", "asnumpy"):
        setattr(fake, name, globals()[name])
    runtime = types.SimpleNamespace(getDeviceCount=_device_count, CUDARuntimeError=_CUDARuntimeError)
    fake.cuda = types.SimpleNamespace(runtime=runtime, Device=_DeviceHandle,
                                      get_current_stream=lambda: _Stream())
    fake.state, fake.copies = STATE, STATE.copies

    def attribute(name):
        value = getattr(numpy, name)
        if isinstance(value, (numpy.ufunc, type)) or not callable(value):
            return value
        return _numpy_function(name)

    fake.__getattr__ = attribute
    return fake


@contextlib.contextmanager
def fake_cupy(gpus: int = 1, cuda_array_interface: bool = False):
    """Install the fake as `cupy` for the block (the state is reset); afterwards restore whatever
    `cupy` was and go back to the NumPy backend."""
    STATE.__init__(gpus, cuda_array_interface)
    saved = sys.modules.get("cupy")
    sys.modules["cupy"] = fake = _module()
    try:
        yield fake
    finally:
        if saved is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved
        backend.set_backend("numpy")
