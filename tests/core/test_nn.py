"""Modules: GPT and MLPNet forward and backward, layout-free initialisation, shards, state_dict."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_functional import numeric_derivative

from minipar.core import functional as F
from minipar.core import nn
from minipar.core.autograd import Tensor, no_grad
from minipar.core.shards import Shard, shard_of

TINY = nn.GPTConfig(vocab_size=13, block_size=4, n_layer=2, n_head=2, d_model=8)


def tokens(seed, batch=2, seq=4, vocab=13):
    rng = np.random.default_rng([seed, 7])
    return rng.integers(0, vocab, (batch, seq)), rng.integers(0, vocab, (batch, seq))


def randomise(model, seed, scale=0.5):
    """Weights far from the small initial ones, so that every nonlinearity bends under the stencil."""
    rng = np.random.default_rng([seed, 8])
    for p in model.parameters():
        p.data[...] = rng.standard_normal(p.shape) * scale + (1.0 if p.init[0] == "ones" else 0.0)


def check_parameter_gradients(model, loss_of_model, seed, per_parameter=2):
    """Backward's gradient of a few random elements of every parameter against finite differences."""
    model.zero_grad()
    loss_of_model().backward()

    def loss():
        with no_grad():
            return loss_of_model().item()

    rng = np.random.default_rng([seed, 9])
    for name, p in model.named_parameters():
        for _ in range(per_parameter):
            index = tuple(int(rng.integers(0, n)) for n in p.shape)
            numeric = numeric_derivative(loss, p.data, index)
            analytic = p.grad[index]
            error = abs(analytic - numeric) / max(abs(analytic), abs(numeric), 1e-4)
            assert error <= 1e-6, f"{name}{list(index)}: analytic {analytic}, numeric {numeric}"


# ---- GPT --------------------------------------------------------------------------------------------


def test_gpt_forward_shapes_and_units():
    model = nn.GPT(TINY, seed=0)
    ids, _ = tokens(0, batch=3)
    assert model(ids).shape == (3, 4, 13)
    assert [name for name, _ in model.units()] == ["embed", "blocks.0", "blocks.1", "head"]
    names = dict(model.named_parameters())
    assert names["embed.wte.weight"].shape == (13, 8)
    assert names["embed.wpe.weight"].shape == (4, 8)
    assert names["blocks.1.mlp.fc.weight"].shape == (32, 8)  # Linear weight is (out, in), as in PyTorch
    assert names["head.lm_head.weight"].shape == (13, 8) and "head.lm_head.bias" not in names
    assert len(names) == 2 + 2 * 15 + 3  # 15 per block: the key projection has no bias
    assert "blocks.0.attn.key.bias" not in names


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_gpt_backward_against_finite_differences(seed):
    model = nn.GPT(TINY, seed=0)
    randomise(model, seed)
    ids, targets = tokens(seed)
    check_parameter_gradients(model, lambda: model.loss(model(ids), targets, targets.size), seed)


def test_gpt_loss_is_summed_cross_entropy_over_the_global_count():
    model = nn.GPT(TINY, seed=3)
    ids, targets = tokens(3)
    logits = model(ids).data.reshape(-1, 13)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    summed = -log_probs[np.arange(8), targets.reshape(-1)].sum()
    normaliser = 32  # e.g. the global batch has 4x the tokens this rank sees
    loss = model.loss(model(ids), targets, normaliser)
    np.testing.assert_allclose(loss.item(), summed / normaliser, rtol=1e-13)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), position=st.integers(0, 3))
def test_gpt_is_causal(seed, position):
    """Changing tokens after position t leaves the logits up to t unchanged (and those at t+1 change)."""
    model = nn.GPT(TINY, seed=0)
    randomise(model, seed)
    ids, _ = tokens(seed, batch=1)
    changed = ids.copy()
    changed[0, position + 1:] = (changed[0, position + 1:] + 1) % 13
    before, after = model(ids).data, model(changed).data
    np.testing.assert_array_equal(before[:, : position + 1], after[:, : position + 1])
    if position < 3:
        assert not np.allclose(before[:, position + 1], after[:, position + 1])


def gpt_parameters(n_layer, seed):
    cfg = nn.GPTConfig(vocab_size=13, block_size=4, n_layer=n_layer, n_head=2, d_model=8)
    return dict(nn.GPT(cfg, seed=seed).named_parameters())


def test_initial_weights_depend_only_on_seed_and_name():
    two, three = gpt_parameters(2, seed=5), gpt_parameters(3, seed=5)
    assert set(two) < set(three)
    for name, p in two.items():
        if name.endswith("proj.weight"):
            # the same draw; GPT-2 scales residual projections by 1/sqrt(2 n_layer)
            np.testing.assert_allclose(p.data * np.sqrt(2 * 2), three[name].data * np.sqrt(2 * 3), rtol=1e-14)
        else:
            np.testing.assert_array_equal(p.data, three[name].data, err_msg=name)
    other_seed = gpt_parameters(2, seed=6)
    name = "blocks.0.attn.query.weight"
    assert not np.array_equal(other_seed[name].data, two[name].data)
    drawn = nn.initial_value(5, "blocks.1.mlp.fc.weight", (32, 8), ("normal", 0.02))
    np.testing.assert_array_equal(two["blocks.1.mlp.fc.weight"].data, drawn)


def test_a_stage_with_global_names_gets_the_same_weights():
    """A pipeline stage registers blocks under dotted global names and so draws the same values."""
    full = nn.GPT(TINY, seed=11)
    stage = nn.Module()
    stage.add_module("blocks.1", nn.Block(TINY))
    stage.init_parameters(11)
    mine = dict(stage.named_parameters())
    assert set(mine) == {n for n, _ in full.named_parameters() if n.startswith("blocks.1.")}
    for name, p in full.named_parameters():
        if name in mine:
            np.testing.assert_array_equal(mine[name].data, p.data)


@pytest.mark.parametrize("axis", [0, 1])
def test_shards_are_cuts_of_the_full_tensor_padded_with_zeros(axis):
    full_shape = (5, 3) if axis == 0 else (3, 5)
    full = nn.initial_value(1, "w", full_shape, ("normal", 1.0))
    pieces = []
    for start in (0, 3):  # two shards of 3 along `axis`: the second runs one past the end (padding)
        shard = Shard(full_shape, axis, start, start + 3)
        module = nn.Module()
        module.w = nn.Parameter((3, 3), ("normal", 1.0), shard=shard)
        module.init_parameters(1)
        assert module.w.full_shape == full_shape
        np.testing.assert_array_equal(module.w.data, shard_of(full, shard))
        pieces.append(module.w.data)
    joined = np.concatenate(pieces, axis=axis)
    np.testing.assert_array_equal(np.take(joined, range(5), axis=axis), full)
    np.testing.assert_array_equal(np.take(joined, [5], axis=axis), 0.0)
    assert shard_of(full, None) is full


# ---- state_dict, grads, modes -------------------------------------------------------------------------


def test_state_dict_round_trip():
    source, target = nn.GPT(TINY, seed=1), nn.GPT(TINY, seed=2)
    ids, _ = tokens(1)
    state = source.state_dict()
    assert list(state) == [name for name, _ in source.named_parameters()]
    target.load_state_dict(state)
    np.testing.assert_array_equal(target(ids).data, source(ids).data)
    state["embed.wte.weight"][...] = 0.0  # a copy: changing it leaves the model alone
    assert np.any(source.embed.wte.weight.data != 0.0)


def test_load_state_dict_errors():
    model = nn.GPT(TINY, seed=1)
    state = model.state_dict()
    missing = dict(state)
    del missing["head.ln_f.bias"]
    with pytest.raises(KeyError, match="missing.*head.ln_f.bias"):
        model.load_state_dict(missing)
    with pytest.raises(KeyError, match="unexpected.*nope"):
        model.load_state_dict({**state, "nope": np.zeros(1)})
    with pytest.raises(ValueError, match="embed.wpe.weight"):
        model.load_state_dict({**state, "embed.wpe.weight": np.zeros((5, 8))})


def test_zero_grad_and_train_eval():
    model = nn.MLPNet(nn.MLPConfig(d_in=3, d_hidden=4, d_out=2, n_layer=2), seed=0)
    F.sum(model(np.ones((2, 3)))).backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert model.eval() is model and not any(m.training for m in model.modules())
    assert all(m.training for m in model.train().modules())


# ---- MLPNet -------------------------------------------------------------------------------------------


def test_mlp_forward_units_and_loss():
    cfg = nn.MLPConfig(d_in=3, d_hidden=5, d_out=2, n_layer=3)
    model = nn.MLPNet(cfg, seed=0)
    x = np.random.default_rng(0).standard_normal((4, 3))
    y = np.random.default_rng(1).standard_normal((4, 2))
    assert model(x).shape == (4, 2)
    assert [n for n, _ in model.units()] == ["layers.0", "layers.1", "layers.2"]
    expected = np.sum((model(x).data - y) ** 2) / 16
    np.testing.assert_allclose(model.loss(model(x), y, 16).item(), expected, rtol=1e-14)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_mlp_backward_against_finite_differences(seed):
    model = nn.MLPNet(nn.MLPConfig(d_in=3, d_hidden=5, d_out=2, n_layer=3), seed=seed % 100)
    x = Tensor(np.random.default_rng([seed, 1]).standard_normal((4, 3)))
    y = np.random.default_rng([seed, 2]).standard_normal((4, 2))
    check_parameter_gradients(model, lambda: model.loss(model(x), y, 4), seed, per_parameter=3)


# ---- attention against a hand-written loop ----


def attention_by_loops(q, k, v, n_head):
    """Each head and query by hand: weights softmax(q·k / sqrt(head_dim)) over the keys at or before it."""
    B, T, C = q.shape
    hd = C // n_head
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(n_head):
            cols = slice(h * hd, (h + 1) * hd)
            for t in range(T):
                scores = np.array([q[b, t, cols] @ k[b, j, cols] / np.sqrt(hd) for j in range(t + 1)])
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[b, t, cols] = sum(w * v[b, j, cols] for j, w in enumerate(weights))
    return out


@given(seed=st.integers(0, 2**16), n_head=st.sampled_from([1, 2, 4]))
@settings(max_examples=10, deadline=None)
def test_causal_attention_is_the_scaled_softmax_written_out(seed, n_head):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 5, 8)) * 3 for _ in range(3))
    got = nn.causal_attention(Tensor(q), Tensor(k), Tensor(v), n_head).data
    np.testing.assert_allclose(got, attention_by_loops(q, k, v, n_head), rtol=1e-12, atol=1e-12)
