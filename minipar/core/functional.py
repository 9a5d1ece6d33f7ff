"""Differentiable operations, imported as `F` like torch.nn.functional.

Three files hold them, each operation a `Function` with its forward and backward rule in array code:
tensor_ops.py  the algebra: add, sub, mul, div, neg, pow, matmul, linear, sum, mean, max, exp, log,
               tanh, relu;
shape_ops.py   reshape, transpose, indexing and slicing, concatenate;
layer_ops.py   what layers need: gelu, softmax, causal_softmax, log_softmax, cross_entropy, mse_loss,
               layer_norm, embedding, dropout.
Lesson: lessons/01_autograd.md.
"""

from minipar.core.autograd import register_tensor_operators
from minipar.core.layer_ops import (  # noqa: F401
    GELU,
    GELU_C,
    CausalSoftmax,
    CrossEntropy,
    Dropout,
    Embedding,
    LayerNorm,
    LogSoftmax,
    Softmax,
    causal_softmax,
    cross_entropy,
    dropout,
    embedding,
    gelu,
    gelu_backward,
    gelu_forward,
    layer_norm,
    log_softmax,
    mse_loss,
    softmax,
)
from minipar.core.shape_ops import (  # noqa: F401
    Concatenate,
    GetItem,
    Reshape,
    Transpose,
    concatenate,
    getitem,
    reshape,
    transpose,
)
from minipar.core.tensor_ops import (  # noqa: F401
    Add,
    Div,
    Exp,
    Linear,
    Log,
    MatMul,
    Max,
    Mul,
    Neg,
    Pow,
    ReLU,
    Sub,
    Sum,
    Tanh,
    add,
    div,
    exp,
    linear,
    log,
    matmul,
    max,
    mean,
    mul,
    neg,
    pow,
    relu,
    sub,
    sum,
    tanh,
    unbroadcast,
)

# Tensor's operators (`t + u`, `t @ w`, `t.sum()`, `t[i]`...) are these functions: autograd.py defines
# Tensor below this module, so it is given them here rather than importing them.
register_tensor_operators(add=add, sub=sub, mul=mul, div=div, neg=neg, pow=pow, matmul=matmul,
                          getitem=getitem, sum=sum, mean=mean, max=max, reshape=reshape,
                          transpose=transpose)
