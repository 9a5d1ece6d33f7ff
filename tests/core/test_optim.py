"""SGD (momentum, weight decay) and AdamW against their formulas, written out here one scalar at a time.

The reference loops are plain Python floats, following the update rules as the PyTorch documentation
states them, and share no code with minipar.core.optim.
"""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minipar.core import optim
from minipar.core.autograd import Tensor

EXAMPLES = settings(max_examples=20, deadline=None)
SHAPE = (2, 3)


def gradients(seed, steps):
    rng = np.random.default_rng([seed, 1])
    return [rng.standard_normal(SHAPE) for _ in range(steps)]


def start(seed):
    return np.random.default_rng([seed, 2]).standard_normal(SHAPE)


def adamw_reference(theta, grads, lr, beta1, beta2, eps, weight_decay):
    """torch.optim.AdamW, one element: decoupled decay, then bias-corrected moments."""
    m = v = 0.0
    for t, g in enumerate(grads, start=1):
        theta = theta - lr * weight_decay * theta
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        theta = theta - lr * m_hat / (math.sqrt(v_hat) + eps)
    return theta


def sgd_reference(theta, grads, lr, momentum, weight_decay):
    """torch.optim.SGD, one element, dampening 0: b_1 = g_1, b_t = momentum b_{t-1} + g_t."""
    buffer = None
    for g in grads:
        g = g + weight_decay * theta
        if momentum:
            buffer = g if buffer is None else momentum * buffer + g
            g = buffer
        theta = theta - lr * g
    return theta


def run(optimizer_class, seed, steps, **hyper):
    p = Tensor(start(seed).copy(), requires_grad=True)
    opt = optimizer_class([p], **hyper)
    for g in gradients(seed, steps):
        p.grad = g
        opt.step()
    return p.data, opt


def relative(a, b):
    # values are O(1); the floor keeps an element that lands near 0 from magnifying roundoff
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-2)))


@EXAMPLES
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 5), lr=st.floats(1e-4, 0.5),
       beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999), eps=st.sampled_from([1e-8, 1e-3]),
       weight_decay=st.sampled_from([0.0, 0.01, 0.3]))
def test_adamw_matches_its_formula(seed, steps, lr, beta1, beta2, eps, weight_decay):
    data, opt = run(optim.AdamW, seed, steps, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    columns = list(zip(*[g.reshape(-1) for g in gradients(seed, steps)]))
    expected = [adamw_reference(float(t), [float(g) for g in column], lr, beta1, beta2, eps, weight_decay)
                for t, column in zip(start(seed).reshape(-1), columns)]
    assert relative(data.reshape(-1), np.array(expected)) <= 1e-12
    assert opt.state[0]["step"] == steps


@EXAMPLES
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 5), lr=st.floats(1e-4, 0.5),
       momentum=st.sampled_from([0.0, 0.5, 0.9]), weight_decay=st.sampled_from([0.0, 0.01, 0.3]))
def test_sgd_matches_its_formula(seed, steps, lr, momentum, weight_decay):
    data, _ = run(optim.SGD, seed, steps, lr=lr, momentum=momentum, weight_decay=weight_decay)
    columns = list(zip(*[g.reshape(-1) for g in gradients(seed, steps)]))
    expected = [sgd_reference(float(t), [float(g) for g in column], lr, momentum, weight_decay)
                for t, column in zip(start(seed).reshape(-1), columns)]
    assert relative(data.reshape(-1), np.array(expected)) <= 1e-12


def test_adamw_first_step_moves_each_element_by_about_lr():
    """With bias correction the first Adam step is lr * sign(g) (up to eps), whatever |g|."""
    data, _ = run(optim.AdamW, 0, 1, lr=0.1, weight_decay=0.0)
    g = gradients(0, 1)[0]
    np.testing.assert_allclose(start(0) - data, 0.1 * np.sign(g), rtol=1e-6)


@EXAMPLES
@given(seed=st.integers(0, 2**32 - 1), cut=st.integers(0, 6), steps=st.integers(1, 4))
def test_the_flat_rules_work_shard_by_shard(seed, cut, steps):
    """What ZeRO relies on: updating two slices of a flat buffer equals updating the whole buffer."""
    whole, halves = start(seed).reshape(-1).copy(), start(seed).reshape(-1).copy()
    state_whole, state_halves = [np.zeros(6), np.zeros(6)], [np.zeros(6), np.zeros(6)]
    momentum_whole, momentum_halves = np.zeros(6), np.zeros(6)
    sgd_whole, sgd_halves = whole.copy(), halves.copy()
    for step, g in enumerate(gradients(seed, steps), start=1):
        g = g.reshape(-1)
        optim.adamw_update(whole, g, *state_whole, step, 0.01, 0.9, 0.999, 1e-8, 0.1)
        optim.sgd_update(sgd_whole, g, momentum_whole, 0.01, 0.9, 0.1)
        for part in (slice(0, cut), slice(cut, 6)):
            optim.adamw_update(halves[part], g[part], state_halves[0][part], state_halves[1][part], step,
                               0.01, 0.9, 0.999, 1e-8, 0.1)
            optim.sgd_update(sgd_halves[part], g[part], momentum_halves[part], 0.01, 0.9, 0.1)
    np.testing.assert_array_equal(halves, whole)
    np.testing.assert_array_equal(sgd_halves, sgd_whole)


def test_parameters_without_gradients_are_skipped():
    a = Tensor(np.ones(3), requires_grad=True)
    b = Tensor(np.ones(3), requires_grad=True)
    opt = optim.AdamW([a, b], lr=0.1)
    a.grad = np.ones(3)
    opt.step()
    assert opt.state[1] is None and np.all(b.data == 1.0) and np.all(a.data < 1.0)
    opt.zero_grad()
    assert a.grad is None and b.grad is None


def test_state_bytes():
    p = Tensor(np.zeros(10), requires_grad=True)
    p.grad = np.ones(10)
    adam = optim.AdamW([p])
    assert adam.state_bytes() == 0
    adam.step()
    assert adam.state_bytes() == 2 * 10 * 8  # exp_avg and exp_avg_sq in float64
    for momentum, expected in ((0.9, 80), (0.0, 0)):
        sgd = optim.SGD([p], momentum=momentum)
        sgd.step()
        assert sgd.state_bytes() == expected
