"""Independent oracles: checks that do not run minipar's own code on both sides of the comparison.

    pytest -m "not mpi" tests/trainer/test_oracles.py

Every "trains like one process" test compares minipar with minipar (the same model, loss and optimizer
on both sides). The tests here compare it with something written apart from it:
- a whole training step of a small GPT against a forward and backward derived by hand in NumPy in this
  file (no autograd), itself checked by finite differences;
- `compare_with_reference` against deviations planted on purpose, so a comparison of the run with
  itself (which always reports 0) fails;
- cross-entropy at logits far from zero, where a missing stabilising max overflows;
- a step the fp16 loss scaler skips, against a run that never saw that batch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from minipar.core import functional as F
from minipar.core.autograd import Tensor
from minipar.core.optim import AdamW
from minipar.parallel.api import LocalUpdater
from minipar.precision.formats import DynamicLossScaler
from minipar.precision.mixed import LossScaling
from minipar.trainer import loop
from minipar.trainer.config import TrainConfig

# ---- a GPT in plain NumPy: forward with a cache, backward derived by hand ---------------------------

GELU_C = math.sqrt(2.0 / math.pi)


def layer_norm(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    xhat = (x - mu) * rstd
    return xhat * g + b, (xhat, rstd, g)


def layer_norm_backward(dy, cache):
    """y = g*xhat + b, xhat = (x - mean) / std: the chain rule through the mean and the variance."""
    xhat, rstd, g = cache
    lead = tuple(range(dy.ndim - 1))
    dxhat = dy * g
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).sum(lead), dy.sum(lead)


def gelu(u):
    return 0.5 * u * (1.0 + np.tanh(GELU_C * (u + 0.044715 * u**3)))


def gelu_derivative(u):
    t = np.tanh(GELU_C * (u + 0.044715 * u**3))
    return 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * u * u)


def linear_backward(dy, x, w):
    """y = x w^T + b over any leading axes: (dx, dw, db)."""
    flat_dy, flat_x = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    return dy @ w, flat_dy.T @ flat_x, flat_dy.sum(0)


def attention(h, w, p, n_head):
    B, T, C = h.shape
    hd = C // n_head
    split = lambda a: a.reshape(B, T, n_head, hd).transpose(0, 2, 1, 3)  # noqa: E731
    q = split(h @ w[p + "query.weight"].T + w[p + "query.bias"])
    k = split(h @ w[p + "key.weight"].T)
    v = split(h @ w[p + "value.weight"].T + w[p + "value.bias"])
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
    scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = (probs @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    return y, (q, k, v, probs, hd)


def attention_backward(dy, cache, h, w, p, grads):
    q, k, v, probs, hd = cache
    B, H, T, _ = q.shape
    dy = dy.reshape(B, T, H, hd).transpose(0, 2, 1, 3)
    dprobs, dv = dy @ v.transpose(0, 1, 3, 2), probs.transpose(0, 1, 3, 2) @ dy
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True)) / math.sqrt(hd)  # softmax's Jacobian
    dq, dk = dscores @ k, dscores.transpose(0, 1, 3, 2) @ q
    merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, H * hd)  # noqa: E731
    dh = 0.0
    for name, d, has_bias in (("query", dq, True), ("key", dk, False), ("value", dv, True)):
        dx, grads[p + name + ".weight"], db = linear_backward(merge(d), h, w[p + name + ".weight"])
        if has_bias:
            grads[p + name + ".bias"] = db
        dh = dh + dx
    return dh


def block_forward(x, w, p, n_head):
    h1, ln1 = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"])
    y, att = attention(h1, w, p + "attn.", n_head)
    x1 = x + y @ w[p + "attn.proj.weight"].T + w[p + "attn.proj.bias"]
    h2, ln2 = layer_norm(x1, w[p + "ln_2.weight"], w[p + "ln_2.bias"])
    u = h2 @ w[p + "mlp.fc.weight"].T + w[p + "mlp.fc.bias"]
    x2 = x1 + gelu(u) @ w[p + "mlp.proj.weight"].T + w[p + "mlp.proj.bias"]
    return x2, (x, h1, ln1, y, att, h2, ln2, u)


def block_backward(dx2, cache, w, p, grads):
    x, h1, ln1, y, att, h2, ln2, u = cache
    dgelu, grads[p + "mlp.proj.weight"], grads[p + "mlp.proj.bias"] = linear_backward(
        dx2, gelu(u), w[p + "mlp.proj.weight"])
    dh2, grads[p + "mlp.fc.weight"], grads[p + "mlp.fc.bias"] = linear_backward(
        dgelu * gelu_derivative(u), h2, w[p + "mlp.fc.weight"])
    dx, grads[p + "ln_2.weight"], grads[p + "ln_2.bias"] = layer_norm_backward(dh2, ln2)
    dx1 = dx2 + dx  # the residual carries dx2 past the MLP
    dy, grads[p + "attn.proj.weight"], grads[p + "attn.proj.bias"] = linear_backward(
        dx1, y, w[p + "attn.proj.weight"])
    dh1 = attention_backward(dy, att, h1, w, p + "attn.", grads)
    dx, grads[p + "ln_1.weight"], grads[p + "ln_1.bias"] = layer_norm_backward(dh1, ln1)
    return dx1 + dx


def gpt_loss_and_grads(w: dict, ids, targets, n_layer: int, n_head: int):
    """The mean token cross-entropy of minipar's GPT (core/nn.py) and its gradient, by hand."""
    B, T = ids.shape
    x = w["embed.wte.weight"][ids] + w["embed.wpe.weight"][:T]
    caches = []
    for i in range(n_layer):
        x, cache = block_forward(x, w, f"blocks.{i}.", n_head)
        caches.append(cache)
    hf, lnf = layer_norm(x, w["head.ln_f.weight"], w["head.ln_f.bias"])
    logits = hf @ w["head.lm_head.weight"].T
    top = logits.max(-1, keepdims=True)
    log_z = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    chosen = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    loss = (log_z - chosen).sum() / targets.size

    grads: dict = {}
    dlogits = np.exp(logits - log_z[..., None])
    chosen_probs = np.take_along_axis(dlogits, targets[..., None], -1)
    np.put_along_axis(dlogits, targets[..., None], chosen_probs - 1, -1)  # softmax minus one-hot
    dlogits /= targets.size
    dhf, grads["head.lm_head.weight"], _ = linear_backward(dlogits, hf, w["head.lm_head.weight"])
    dx, grads["head.ln_f.weight"], grads["head.ln_f.bias"] = layer_norm_backward(dhf, lnf)
    for i in reversed(range(n_layer)):
        dx = block_backward(dx, caches[i], w, f"blocks.{i}.", grads)
    grads["embed.wte.weight"] = np.zeros_like(w["embed.wte.weight"])
    np.add.at(grads["embed.wte.weight"], ids.reshape(-1), dx.reshape(-1, dx.shape[-1]))
    grads["embed.wpe.weight"] = np.zeros_like(w["embed.wpe.weight"])
    grads["embed.wpe.weight"][:T] = dx.sum(0)
    return loss, grads


ORACLE_CFG = TrainConfig(model="gpt", n_layer=2, n_head=2, d_model=8, seq_len=6, batch_size=3, steps=1,
                         optimizer="sgd", momentum=0.0, lr=0.5, precision="fp64", seed=7, quiet=True, dp=1)


def initial_weights_and_batch(cfg: TrainConfig):
    trainer = loop.Trainer(cfg, MPI.COMM_SELF)
    weights = {name: p.data.copy() for name, p in trainer.engine.model.named_parameters()}
    return trainer, weights, trainer.task.global_batch(0, cfg.batch_size)


def test_the_hand_written_gradient_is_the_finite_difference_of_the_hand_written_loss():
    _, w, (ids, targets) = initial_weights_and_batch(ORACLE_CFG)
    _, grads = gpt_loss_and_grads(w, ids, targets, ORACLE_CFG.n_layer, ORACLE_CFG.n_head)
    assert set(grads) == set(w)
    rng, h = np.random.default_rng(0), 1e-5
    for name in sorted(w):
        for _ in range(2):  # two random entries of every parameter
            index = tuple(int(rng.integers(0, n)) for n in w[name].shape)
            plus, minus = dict(w), dict(w)
            plus[name], minus[name] = w[name].copy(), w[name].copy()
            plus[name][index] += h
            minus[name][index] -= h
            numeric = (gpt_loss_and_grads(plus, ids, targets, 2, 2)[0]
                       - gpt_loss_and_grads(minus, ids, targets, 2, 2)[0]) / (2 * h)
            assert abs(numeric - grads[name][index]) <= 1e-7 * max(1.0, abs(numeric)), (name, index)


def test_a_whole_training_step_matches_the_numpy_gpt_derived_by_hand():
    """minipar's loss, and its SGD step w - lr * grad, against the hand-derived NumPy GPT."""
    cfg = ORACLE_CFG
    trainer, w, (ids, targets) = initial_weights_and_batch(cfg)
    loss, grads = gpt_loss_and_grads(w, ids, targets, cfg.n_layer, cfg.n_head)
    records = trainer.run()
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-12)
    for name, p in trainer.engine.model.named_parameters():
        moved_by = (w[name] - p.data) / cfg.lr  # SGD without momentum or decay: exactly the gradient
        scale = max(np.max(np.abs(grads[name])), 1e-12)
        assert np.max(np.abs(moved_by - grads[name])) <= 1e-9 * scale, name
        assert np.max(np.abs(grads[name])) > 0 or name == "embed.wpe.weight", name


# ---- compare_with_reference: it must see deviations planted in the run --------------------------------

def small_run(**changes):
    cfg = TrainConfig(model="gpt", n_layer=1, n_head=2, d_model=8, seq_len=6, batch_size=4, steps=2,
                      precision="fp64", quiet=True, dp=1).replace(**changes)
    trainer = loop.Trainer(cfg, MPI.COMM_SELF)
    records = trainer.run()
    return cfg, records, trainer.full_state()


def test_compare_with_reference_reports_the_deviations_planted_in_the_run():
    cfg, records, full = small_run()
    clean = loop.compare_with_reference(cfg, records, full)
    assert clean == {"max_rel_loss_deviation": 0.0, "max_rel_weight_deviation": 0.0}  # one process: exact

    off_loss = [dict(r) for r in records]
    off_loss[1]["loss"] *= 1 + 1e-3
    check = loop.compare_with_reference(cfg, off_loss, full)
    assert check["max_rel_loss_deviation"] == pytest.approx(1e-3, rel=1e-9)
    assert check["max_rel_weight_deviation"] == 0.0

    name = "blocks.0.mlp.fc.weight"
    off_weight = dict(full, **{name: full[name].copy()})
    off_weight[name][1, 2] += 1e-4 * np.max(np.abs(full[name]))
    check = loop.compare_with_reference(cfg, records, off_weight)
    assert check["max_rel_weight_deviation"] == pytest.approx(1e-4, rel=1e-6)
    assert check["max_rel_loss_deviation"] == 0.0


def test_compare_with_reference_runs_the_config_it_is_given_not_the_run():
    cfg, records, full = small_run(lr=3e-3)  # trained with another learning rate than cfg says below
    check = loop.compare_with_reference(cfg.replace(lr=1.5e-3), records, full)
    assert check["max_rel_loss_deviation"] > 1e-4 and check["max_rel_weight_deviation"] > 1e-3, check


# ---- cross-entropy far from zero: the stabilising max ------------------------------------------------

def stable_cross_entropy(logits, targets):
    """Summed -log softmax(logits)[target], with log-sum-exp written out: m + log sum exp(x - m)."""
    top = logits.max(-1)
    log_z = top + np.log(np.exp(logits - top[:, None]).sum(-1))
    return (log_z - logits[np.arange(len(targets)), targets]).sum()


@pytest.mark.parametrize("offset", [800.0, -800.0])
def test_cross_entropy_of_logits_far_from_zero_is_finite_and_shift_invariant(offset):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 7)) * 30 + offset  # exp(800) overflows fp64; exp(-800) is 0
    targets = rng.integers(0, 7, size=5)
    x = Tensor(logits, requires_grad=True)
    loss = F.cross_entropy(x, targets, "sum")
    loss.backward()
    assert float(loss.data) == pytest.approx(stable_cross_entropy(logits, targets), rel=1e-12)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    probs[np.arange(5), targets] -= 1
    np.testing.assert_allclose(x.grad, probs, rtol=0, atol=1e-12)


# ---- the fp16 loss scaler: a skipped step leaves no trace in the optimizer ----------------------------

class ParameterList:
    """Bare parameters seen as a model: what an updater steps."""

    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return [(str(i), p) for i, p in enumerate(self.params)]


def adamw_on(values):
    params = [Tensor(v.copy(), requires_grad=True) for v in values]
    return params, AdamW(params, lr=1e-2, weight_decay=0.1)


def test_a_skipped_step_leaves_the_optimizer_as_a_run_that_never_saw_that_batch():
    rng = np.random.default_rng(5)
    start = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    grads = [[rng.standard_normal(a.shape) for a in start] for _ in range(4)]
    overflowing = 2  # after two clean steps, so the moments and the step count are not zero any more

    clean_params, clean = adamw_on(start)  # never sees the overflowing batch
    for step, g in enumerate(grads):
        if step != overflowing:
            for p, gi in zip(clean_params, g):
                p.grad = gi.copy()
            clean.step()

    params, adamw = adamw_on(start)
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=100)
    scaled = LossScaling(scaler)
    updater = LocalUpdater(ParameterList(params), adamw)
    updater.register_gradients_ready_hook(scaled)
    for step, g in enumerate(grads):
        scale = scaler.get_scale()  # the runner multiplied the loss, so every gradient, by the scale
        for p, gi in zip(params, g):
            p.grad = gi * scale
        if step == overflowing:
            params[1].grad[2] = np.inf
        updater.step()
        assert scaled.skipped == (step == overflowing)
    assert scaler.get_scale() == 2.0**7  # halved once, never grown
    for p, q in zip(params, clean_params):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-14, atol=0)
    for mine, theirs in zip(adamw.state, clean.state):
        assert mine["step"] == theirs["step"] == 3
        np.testing.assert_allclose(mine["exp_avg"], theirs["exp_avg"], rtol=1e-14, atol=0)
        np.testing.assert_allclose(mine["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-14, atol=0)
