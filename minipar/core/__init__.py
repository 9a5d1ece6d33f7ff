"""The single-process core: autograd, the differentiable operations, modules, layers, optimizers.

Importing it imports `functional`, which gives Tensor its operators (autograd.register_tensor_operators).
"""

from minipar.core import functional  # noqa: F401
