"""`bench autograd`'s PyTorch comparison times the same computation: PyTorch (an independent
implementation) trains the same GPT to the same losses from minipar's weights, and the same MLP to the
same gradients. Skipped where PyTorch is not installed (CI); there the bench says so in one line."""

import numpy as np
import pytest

from minipar.core import kernels, nn
from minipar.core.autograd import Tensor
from minipar.trainer.tasks import AdditionTask
from minipar_lab.bench import autograd, torch_gpt


def test_without_pytorch_the_bench_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch_gpt, "unavailable", lambda: "PyTorch is not installed")
    assert autograd.main(["--batch", "4", "--width", "8", "--layers", "2", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "PyTorch" in line] == [
        "PyTorch comparison skipped: PyTorch is not installed"]


def test_pytorch_trains_the_same_gpt_to_the_same_losses():
    pytest.importorskip("torch")
    cfg = nn.GPTConfig(n_layer=2, dtype="float64")
    tokens, targets = AdditionTask(cfg.block_size, 0).global_batch(0, 4)
    mine = torch_gpt.MiniparGPTStep(cfg, tokens, targets)
    theirs = torch_gpt.TorchGPTStep(mine.model, tokens, targets)
    for _ in range(3):  # the second and third losses also check AdamW's update
        a, b = mine(), theirs()
        assert abs(a - b) <= 1e-9 * abs(b)


def test_pytorch_computes_the_same_mlp_gradients():
    pytest.importorskip("torch")
    model = nn.MLPNet(nn.MLPConfig(d_in=8, d_hidden=8, d_out=8, n_layer=3), seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((5, 8)), rng.standard_normal((5, 8))
    weights = [(layer.linear.weight.data, layer.linear.bias.data) for layer in model.layers]
    hand = autograd.hand_written_mlp_step(weights, x, y)[::-1]  # it returns them last layer first
    step = torch_gpt.TorchMLPStep(model, x, y)
    step()
    for (gw, gb), (w, b) in zip(hand, step.layers):
        np.testing.assert_allclose(w.grad.numpy(), gw, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(b.grad.numpy(), gb, rtol=1e-9, atol=1e-12)


def test_the_shallowspeed_mlp_has_its_train_pys_shape_and_both_works_the_same_gradients(monkeypatch):
    # github.com/siboehm/ShallowSpeed train.py: layer_sizes = [784, 128, 127, 126, 125, 124, 123, 10],
    # GLOBAL_BATCH_SIZE = 128, float32 data: seven Linear layers, the hidden widths made one (128)
    built, mlp_net = [], nn.MLPNet  # the model minipar's work trains, to read its gradients
    monkeypatch.setattr(autograd.nn, "MLPNet", lambda *a, **k: built.append(mlp_net(*a, **k)) or built[-1])
    works = autograd.mlp_works(autograd.SHALLOWSPEED_MLP, autograd.SHALLOWSPEED_BATCH, with_torch=False)
    seen = {}  # what the two works really compute on
    hand, loss = autograd.hand_written_mlp_step, autograd.F.mse_loss
    monkeypatch.setattr(autograd, "hand_written_mlp_step",
                        lambda weights, x, y: seen.update(hand=(weights, x, y)) or hand(weights, x, y))
    monkeypatch.setattr(autograd.F, "mse_loss",
                        lambda prediction, y, reduction: seen.update(minipar=prediction) or
                        loss(prediction, y, reduction))
    hand_grads = works["hand"]()[::-1]  # last layer first
    works["minipar"]()
    works["minipar"]()  # twice: a step starts from no gradients, so they do not add up
    for (gw, gb), layer in zip(hand_grads, built[0].layers, strict=True):  # the same products, bits too
        np.testing.assert_array_equal(layer.linear.weight.grad, gw)
        np.testing.assert_array_equal(layer.linear.bias.grad, gb)
    weights, x, y = seen["hand"]
    assert [w.shape for w, _ in weights] == [(128, 784)] + [(128, 128)] * 5 + [(10, 128)]
    assert x.shape == (128, 784) and y.shape == (128, 10) and x.dtype == y.dtype == np.float32
    assert seen["minipar"].shape == (128, 10) and seen["minipar"].dtype == np.float32
    model = nn.MLPNet(autograd.SHALLOWSPEED_MLP, seed=0)
    shapes = [layer.linear.weight.shape for layer in model.layers]
    assert shapes == [(128, 784)] + [(128, 128)] * 5 + [(10, 128)]
    assert autograd.SHALLOWSPEED_BATCH == 128 and model.layers[0].linear.weight.data.dtype == np.float32
    assert set(works) == {"hand", "minipar"}


def test_mlp_ratios_are_medians_of_per_round_ratios():
    times = {"hand": np.array([1.0, 2.0, 4.0]), "minipar": np.array([1.5, 2.0, 4.4]),
             "torch": np.array([3.0, 1.0, 4.0])}
    f = autograd.mlp_figures(times)
    assert f["hand_ratio"] == pytest.approx(1.1)  # rounds 1.5, 1.0, 1.1: the median, not 2.0 / 2.0
    assert f["torch_ratio"] == pytest.approx(1.1)  # rounds 0.5, 2.0, 1.1
    assert f["minipar_s"] == 2.0


def recorded_products() -> tuple[list, object]:
    """Every product through Linear's kernel (core/kernels.py's "matmul", `tensor_ops.linear_product`)
    while the handle returned is in place, as (a, b, a @ b), in order (a copy of the product: Linear
    adds its bias into the very array)."""
    calls, matmul = [], kernels.chosen("matmul", lambda a, b: a @ b)

    def recording(a, b):
        product = matmul(a, b)
        calls.append((a, b, product.copy()))
        return product

    return calls, kernels.install("matmul", recording)


def layout(a) -> tuple:
    """What BLAS is handed: shape, dtype and strides (w.T is w's buffer read transposed, another call)."""
    return a.shape, a.dtype, a.strides


def test_linear_products_are_the_models_linear_products():
    """The bench times LinearProducts as the BLAS library's share of a step, so they must be the very
    products the model's Linear layers run: per layer x W^T forward, g W and g^T x backward, on operands
    in the same layouts (a transposed operand is another BLAS call, at another speed). The layers'
    own forward and backward on the same x, W, g are the reference; the values are written out in
    float64 NumPy from the definition. Runs without PyTorch too (as in CI), but for PyTorch's side."""
    cfg = nn.GPTConfig(n_layer=2, dtype="float32")
    model = nn.GPT(cfg, seed=0)
    products = torch_gpt.LinearProducts(model, tokens=5)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(products.layers) == len(linears) == 2 * 6 + 1  # q, k, v, proj, fc, proj; and the head
    for (x, w, g), linear in zip(products.layers, linears):
        assert w is linear.weight.data and x.shape == (5, w.shape[1]) and g.shape == (5, w.shape[0])
        assert x.dtype == g.dtype == np.float32
    if torch_gpt.unavailable() is None:
        products.torch()  # runs (PyTorch's products are its own: no linear_product)
    calls, recording = recorded_products()
    with recording:
        products.minipar()
        bench = calls.copy()
        calls.clear()
        for (x, _, g), linear in zip(products.layers, linears):
            linear(Tensor(x, requires_grad=True)).backward(g)  # y, then gx and gW: three products
    reference = calls
    assert len(bench) == len(reference) == 3 * len(linears)
    for i, (x, w, g) in enumerate(products.layers):
        x64, w64, g64 = (a.astype(np.float64) for a in (x, w, g))
        by_hand = (x64 @ w64.T, g64 @ w64, g64.T @ x64)  # y = x W^T, gx = g W, gW = g^T x
        for (a, b, out), (ref_a, ref_b, ref_out), expected in zip(bench[3 * i:3 * i + 3],
                                                                   reference[3 * i:3 * i + 3], by_hand):
            assert (layout(a), layout(b)) == (layout(ref_a), layout(ref_b)), i
            np.testing.assert_array_equal(out, ref_out)  # the same call: the same bits
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_pytorchs_linear_products_are_the_same_products_on_the_same_layouts():
    """LinearProducts.torch() is the other half of the bench's BLAS share: it must run the same three
    products per layer as minipar() does, on operands laid out the same way (a transposed operand is
    another kernel), with the right values. Every PyTorch call it makes is recorded through
    torch.overrides (PyTorch's own hook for this)."""
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    class Recording(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.products = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "matmul" in getattr(func, "__name__", ""):
                self.products.append((args[0], args[1], out))
            return out

    model = nn.GPT(nn.GPTConfig(n_layer=2, dtype="float32"), seed=0)
    products = torch_gpt.LinearProducts(model, tokens=5)
    products.torch()  # the first call makes the tensors
    with Recording() as recording:
        products.torch()
    assert len(recording.products) == 3 * len(products.layers) == 39
    for i, (x, w, g) in enumerate(products.layers):
        x64, w64, g64 = (a.astype(np.float64) for a in (x, w, g))
        expected = ((x, w.T, x64 @ w64.T), (g, w, g64 @ w64), (g.T, x, g64.T @ x64))
        for (a, b, out), (want_a, want_b, value) in zip(recording.products[3 * i:3 * i + 3], expected):
            for tensor, array in ((a, want_a), (b, want_b)):  # the very buffer, read the same way
                assert tensor.data_ptr() == array.ctypes.data and tensor.shape == array.shape, i
                assert tuple(s * array.itemsize for s in tensor.stride()) == array.strides, i
            assert out.dtype == torch.float32
            np.testing.assert_allclose(out.numpy(), value, rtol=1e-5, atol=1e-5 * np.abs(value).max())


@pytest.mark.parametrize("max_norm", [0.05, 1e6])  # clipped, and left alone (the coefficient is 1)
def test_clipping_scales_as_pytorchs_clip_grad_norm(max_norm):
    """--clip-grad-norm's transform (parallel/clipping.py) on one rank's gradients against PyTorch's
    `clip_grad_norm_` on the same gradients: the norm it logs and every clipped value."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from minipar.core.functional import mse_loss
    from minipar.parallel.api import GradientPiece
    from minipar.parallel.clipping import GradientClipping

    model = nn.MLPNet(nn.MLPConfig(d_in=8, d_hidden=8, d_out=8, n_layer=3), seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((5, 8)), rng.standard_normal((5, 8))
    mse_loss(model(x), y, "sum").backward()
    named = list(model.named_parameters())
    pieces = [GradientPiece(name, p, p.grad.reshape(-1).copy()) for name, p in named]
    one_rank = SimpleNamespace(size=1)
    grid = SimpleNamespace(tp_rank=0, dp_cp=one_rank, tp=one_rank, pp=one_rank)
    clipping = GradientClipping(max_norm, grid)
    clipping(lambda: pieces)

    theirs = [torch.nn.Parameter(torch.from_numpy(p.data.copy())) for _, p in named]
    for tensor, (_, p) in zip(theirs, named):
        tensor.grad = torch.from_numpy(p.grad.copy())
    norm = float(torch.nn.utils.clip_grad_norm_(theirs, max_norm))
    assert clipping.grad_norm == pytest.approx(norm, rel=1e-12)
    for tensor, piece in zip(theirs, pieces):
        np.testing.assert_allclose(piece.grad, tensor.grad.numpy().reshape(-1), rtol=1e-12, atol=0)
    if max_norm < norm:  # the clipped case really clipped
        assert np.linalg.norm(np.concatenate([piece.grad for piece in pieces])) == pytest.approx(max_norm)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_pytorchs_recomputed_gpt_trains_to_the_same_losses(recompute):
    """The checkpointed PyTorch GPT (`bench saved`'s mirror of --recompute) recomputes exactly: three
    steps, each loss and the updates between them those of minipar's GPT without recomputation."""
    pytest.importorskip("torch")
    cfg = nn.GPTConfig(n_layer=2, dtype="float64")
    tokens, targets = AdditionTask(cfg.block_size, 0).global_batch(0, 4)
    mine = torch_gpt.MiniparGPTStep(cfg, tokens, targets)
    theirs = torch_gpt.TorchGPTStep(mine.model, tokens, targets, recompute=recompute)
    for _ in range(3):
        a, b = mine(), theirs()
        assert abs(a - b) <= 1e-9 * abs(b)
