"""minipar: distributed training from scratch, on NumPy and MPI, small enough to read.

    import minipar
    from minipar import Tensor
    from minipar.core import nn, optim, functional as F
"""

from minipar.core import functional, nn, optim
from minipar.core.autograd import Tensor, no_grad

__all__ = ["Tensor", "no_grad", "functional", "nn", "optim"]
__version__ = "0.1.0"
