"""A split backward (ZB-H1's B and W): the input gradient now, the weight gradients later, same result.

The oracle is the plain backward of the same graph: B then every deferred call must leave exactly its
gradients, B alone must leave the parameters without any, and a module's full backward hook (ZeRO-2's
reduce-scatter) must wait for W.
"""

import numpy as np
import pytest

from minipar.core.autograd import Tensor, activation_meter
from minipar.core.module import Parameter
from minipar.core.nn import GPT, GPTConfig, MLPConfig, MLPNet


def gpt():
    cfg = GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, d_model=8, dtype="float64")
    return GPT(cfg, seed=3)


def mlp():
    return MLPNet(MLPConfig(d_hidden=8, n_layer=3, dtype="float64"), seed=3)


def stage_input(model, rng):
    """A stage's received activation: a leaf that requires grad and is not a parameter."""
    if isinstance(model, GPT):
        return Tensor(rng.integers(0, 11, size=(3, 6))), False
    return Tensor(rng.standard_normal((5, model.config.d_in)), requires_grad=True), True


def loss_of(model, x):
    out = model(x)
    return (out * out).sum()


@pytest.mark.parametrize("make", [gpt, mlp])
def test_b_then_w_gives_the_plain_gradients(make):
    rng = np.random.default_rng(0)
    plain, split = make(), make()
    x, differentiable = stage_input(plain, rng)
    x_split = Tensor(x.data, requires_grad=differentiable)
    loss_of(plain, x).backward()
    deferred: list = []
    loss_of(split, x_split).backward(defer_weight_grads=deferred)
    assert all(p.grad is None for p in split.parameters())  # B computed no weight gradient
    if differentiable:
        assert np.array_equal(x_split.grad, x.grad)  # ... but the input's, which the stage sends on
    assert deferred
    for work in deferred:
        work()
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        assert np.array_equal(p.grad, q.grad), name


def test_full_backward_hook_fires_in_w_after_the_weight_gradients():
    model, seen = mlp(), []
    layer = model.layers[1]
    layer.register_full_backward_hook(lambda m: seen.append([p.grad is not None for p in m.parameters()]))
    x = Tensor(np.random.default_rng(1).standard_normal((4, model.config.d_in)), requires_grad=True)
    deferred: list = []
    loss_of(model, x).backward(defer_weight_grads=deferred)
    assert seen == []  # not after B
    for work in deferred:
        work()
    assert seen == [[True, True]]  # once, with both of its parameters' gradients there


def test_saved_activations_live_until_w():
    model = mlp()
    x = Tensor(np.random.default_rng(2).standard_normal((4, model.config.d_in)), requires_grad=True)
    before = activation_meter.current
    deferred: list = []
    loss_of(model, x).backward(defer_weight_grads=deferred)
    assert activation_meter.current > before  # Linear keeps its input for the weight gradient
    for work in deferred:
        work()
    assert activation_meter.current == before


def test_an_op_that_ignores_needs_input_grad_gives_its_weight_gradient_once():
    # Add returns both gradients whatever it is asked (a bias added after a row-parallel sum): B must
    # drop the parameter's, or W would count it a second time
    rng = np.random.default_rng(4)
    grads = []
    for split in (False, True):
        w, b = Parameter((3, 2), ("normal", 1.0)), Parameter((2,), ("normal", 1.0))
        w.data[...], b.data[...] = rng.standard_normal((3, 2)), rng.standard_normal(2)
        rng = np.random.default_rng(4)
        x = Tensor(np.ones((4, 3)), requires_grad=True)
        loss = ((x @ w + b) * (x @ w + b)).sum()
        deferred: list = []
        loss.backward(defer_weight_grads=deferred if split else None)
        for work in deferred:
            work()
        grads.append((w.grad, b.grad, x.grad))
    for plain, split in zip(*grads):
        assert np.array_equal(plain, split)
