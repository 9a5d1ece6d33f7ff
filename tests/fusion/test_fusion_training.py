"""Fused AdamW and GELU: bitwise equal to minipar's reference arithmetic, with the bytes they save."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fusion_run import same_bits

from minipar import fusion as fx
from minipar.core import functional as F
from minipar.core import optim
from minipar.fusion.training import adamw_expressions

hyperparameters = st.fixed_dictionaries({
    "step": st.integers(1, 2000), "lr": st.sampled_from([1e-3, 3e-4, 0.1]),
    "beta1": st.sampled_from([0.9, 0.8]), "beta2": st.sampled_from([0.999, 0.95]),
    "eps": st.sampled_from([1e-8, 1e-6]), "weight_decay": st.sampled_from([0.0, 0.01, 0.1])})


def adamw_state(size, dtype, seed):
    rng = np.random.default_rng(seed)
    param, grad, exp_avg = (rng.standard_normal(size).astype(dtype) for _ in range(3))
    return [param, grad, exp_avg, (rng.random(size) * 0.1).astype(dtype)]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3000), st.sampled_from([np.float32, np.float64]), st.integers(0, 2**31),
       hyperparameters, st.sampled_from([7, 256, 32768]))
def test_fused_adamw_is_bitwise_the_reference(size, dtype, seed, hp, tile):
    reference = adamw_state(size, dtype, seed)
    optim.adamw_update(*reference, **hp)
    through_api = adamw_state(size, dtype, seed)
    fx.adamw_update(*through_api, **hp)
    eager = adamw_state(size, dtype, seed)
    fx.adamw_update(*eager, **hp, fused=False)
    tiled = adamw_state(size, dtype, seed)
    p, g, m, v = tiled
    fx.run(adamw_expressions(p, g, m, v, **hp), out=[m, v, p], tile=tile)
    for state in (through_api, eager, tiled):
        assert all(same_bits(x, y) for x, y in zip(state, reference))


def test_adamw_moves_10_arrays_fused_and_33_eager():
    n, w = 500, 4
    fused = fx.adamw_update(*adamw_state(n, np.float32, 0), 1, 1e-3, 0.9, 0.999, 1e-8, 0.01)
    eager = fx.adamw_update(*adamw_state(n, np.float32, 0), 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, fused=False)
    assert (fused.bytes_read, fused.bytes_written, len(fused.kernels)) == (7 * n * w, 3 * n * w, 3)
    assert (eager.bytes_read, eager.bytes_written, len(eager.kernels)) == (19 * n * w, 14 * n * w, 14)


def gelu_formula(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def gelu_derivative_formula(x):
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x**3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * c * (1 + 3 * 0.044715 * x**2)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=3), st.integers(0, 2**31), st.booleans())
def test_gelu_and_its_backward(shape, seed, fused):
    rng = np.random.default_rng(seed)
    x, grad_out = rng.standard_normal(shape) * 3, rng.standard_normal(shape)
    y, grad_in = fx.gelu(x, fused=fused), fx.gelu_backward(x, grad_out, fused=fused)
    assert same_bits(y, F.gelu_forward(x)) and same_bits(grad_in, F.gelu_backward(x, grad_out))
    # x * x * x and x**3 round differently, and 1 + tanh cancels for x << 0: hence the atol
    np.testing.assert_allclose(y, gelu_formula(x), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grad_in, grad_out * gelu_derivative_formula(x), rtol=1e-12, atol=1e-14)
    x32 = x.astype(np.float32)
    assert fx.gelu(x32, fused=fused).dtype == np.float32
    assert same_bits(fx.gelu(x32, fused=fused), F.gelu_forward(x32))


def test_gelu_kernels_and_bytes():
    x = fx.array(np.ones(100))
    _, forward = fx.run(fx.training.gelu_expression(x))
    _, backward = fx.run(fx.training.gelu_backward_expression(x, fx.array(np.ones(100))))
    assert (len(forward.kernels), forward.bytes_moved) == (1, 2 * 800)
    # tanh has two consumers, so it goes to memory: kernel 1 reads x, writes t; kernel 2 reads x, g, t
    assert (len(backward.kernels), backward.bytes_moved) == (2, 2 * 800 + 4 * 800)
    assert fx.training.GELU_C == F.GELU_C


@settings(max_examples=4, deadline=None)
@given(model=st.sampled_from(["gpt", "mlp"]), seed=st.integers(0, 2**16), zero=st.sampled_from([0]))
def test_train_fused_gives_the_same_losses_and_weights_bit_for_bit(model, seed, zero):
    from mpi4py import MPI

    from minipar.trainer import loop as train
    from minipar.trainer.config import TrainConfig

    cfg = TrainConfig(model=model, precision="fp64", n_layer=2, n_head=2, d_model=16, seq_len=8,
                      batch_size=4, steps=3, seed=seed, quiet=True, dp=1)
    plain, fused = train.Trainer(cfg, MPI.COMM_SELF), train.Trainer(cfg.replace(fused=True), MPI.COMM_SELF)
    activations = {getattr(m, "activation", None) for m in fused.engine.model.modules()}
    assert fx.training.fused_gelu in activations and F.gelu not in activations
    assert fused.engine.updater.optimizer.update_rule is fx.training.adamw_update
    assert [r["loss"] for r in plain.run()] == [r["loss"] for r in fused.run()]
    fused_params = fused.engine.model.named_parameters()
    for (name, p), (_, q) in zip(plain.engine.model.named_parameters(), fused_params):
        assert same_bits(p.data, q.data), name
