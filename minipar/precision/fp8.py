"""FP8 training, emulated bit for bit: the Linear layers' matrix products take FP8 operands.

The idea (Micikevicius et al., "FP8 Formats for Deep Learning", 2022): an FP8 number has 3 or 2
mantissa bits and a range of 2^17 (E4M3: 2^-9 .. 448) or 2^32 (E5M2: 2^-16 .. 57344), too narrow for
a tensor's values as they come, so each operand is multiplied by a *scale* that puts its largest
magnitude (its amax) at the format's largest value, rounded to FP8 (formats.py, saturating), and the
product's sum, accumulated in fp32, is divided by the two scales. Who shares a scale is the recipe:
- `delayed` (Transformer Engine's DelayedScaling): one scale per tensor, from the amax of the
  previous steps (a history of 1024, its max; scale = 448 / amax / 2^margin, margin 0; 1 before any
  step), the amax of each step reduced (max) across the ranks that share the tensor after the step;
- `current`: one scale per tensor from this tensor's own amax (this rank's: not layout-exact);
- `block` (DeepSeek-V3, section 3.3): 1xN tiles for activations and gradients, NxN blocks for
  weights, every tile its own scale; each N-wide slice of the inner dimension is multiplied in FP8,
  its partial sum promoted (multiplied by its two scales) and added in fp32: the promotion every
  N_C = 128 elements DeepSeek-V3 describes.
Forward operands are E4M3; gradients E5M2 for the per-tensor recipes (HYBRID), E4M3 for `block`.
Everything else stays in the run's dtype: the master weights and optimizer (fp32, as bf16's mixed
precision keeps them), embeddings, the output head, LayerNorm, the attention core and the loss.
With `--fp8-accumulate fp64` the products add in fp64: layouts then compare with one process to 1e-9.
`--fp8-accumulate tc13` models the limited accumulation DeepSeek-V3 works around (section 3.3.2: the
H800's FP8 GEMMs keep "around 14 bits"): a 13-bit-mantissa accumulator, truncated after each product
along K, promoted to fp32 at the end of each n-wide slice under `block` (their N_C = 128 with n =
128), never under the per-tensor recipes. A model, not the hardware: its accumulator is undocumented.
Under ZeRO-3 the weights arrive quantized already (fp8_zero3.py gathers them in FP8: `Prequantized`,
the bits quantizing the gathered weight would give), and the products use them as they are.
A checkpoint keeps the amax history by layer name (`amax_history`, checkpoint/sharded.py's manifest),
so a resumed delayed run, in any layout, continues it and trains as the uninterrupted run.

What it saves: on hardware, a quarter of fp32's bytes per GEMM operand and twice bf16's matrix rate;
here the values are FP8's in fp32 arrays, so only the arithmetic's result is FP8's, not its speed.
What it costs: precision (E4M3 has 4 significant bits), the amax passes, and for `delayed` one max
all-reduce of one fp64 amax per quantized tensor per step over dp and tp (charged on the ledger).
One scale per tensor is fragile: an outlier 2^15 times the median flushes the median to zero, where
per-tile scales keep it. Lesson: lessons/09b_fp8.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from minipar.core import kernels
from minipar.core.nn import GPTHead, Linear
from minipar.core.options import option
from minipar.core.tensor_ops import matrix_product
from minipar.parallel.api import RunnerWrapper
from minipar.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from minipar.precision.formats import E4M3, E5M2, FP8Format, round_to_fp8

RECIPES = ("delayed", "current", "block")
AMAX_HISTORY = 1024  # Transformer Engine's default amax_history_len


def scale_for(amax: float, fmt: FP8Format, margin: int = 0) -> float:
    """Transformer Engine's scale: the amax lands on the format's largest value (1 when amax is 0)."""
    if not (amax > 0 and np.isfinite(amax)):
        return 1.0
    return fmt.max_finite / amax / 2.0**margin


def quantize(x, scale, fmt: FP8Format) -> np.ndarray:
    """x times its scale (a number, or an array that broadcasts), rounded to `fmt`, saturating."""
    return round_to_fp8(x * scale, fmt, saturate=True)


def per_tensor_product(a, b, a_scale: float, b_scale: float, a_fmt: FP8Format, b_fmt: FP8Format,
                       gemm=np.matmul):
    """a @ b with each operand quantized with one scale: the FP8 products summed in a's dtype, then
    divided by both scales (Transformer Engine's scale_inv times scale_inv)."""
    return descaled_product(quantize(a, a_scale, a_fmt), quantize(b, b_scale, b_fmt), a_scale, b_scale, gemm)


def descaled_product(qa, qb, a_scale: float, b_scale: float, gemm=np.matmul):
    """The product of two quantized operands (`gemm`: how the tensor cores add), divided by their scales."""
    return gemm(qa, qb) * (1.0 / a_scale) * (1.0 / b_scale)


TC_MANTISSA = 13  # DeepSeek-V3 3.3.2's "around 14 bits": 13 stored mantissa bits and the implicit one
_KEEP = np.uint64((2**64 - 1) ^ (2 ** (52 - TC_MANTISSA) - 1))  # fp64's sign, exponent and 13 top bits


def truncate_mantissa(x):
    """fp64 values cut to TC_MANTISSA mantissa bits toward zero: IEEE's sign-magnitude layout makes
    that clearing the low 39 bits of each."""
    return (np.ascontiguousarray(x, dtype=np.float64).view(np.uint64) & _KEEP).view(np.float64)


def limited_accumulation_product(qa, qb):
    """qa @ qb (FP8 values) through the modelled tensor-core accumulator: one product of the inner
    dimension at a time, added exactly (fp64 holds a 14-bit sum plus an 8-bit product), the sum then
    truncated to 13 mantissa bits. Rounding toward zero at every step biases the sum's magnitude down:
    over K steps the loss grows with K, which is why DeepSeek-V3 promotes every N_C elements."""
    a, b = qa.astype(np.float64), qb.astype(np.float64)
    acc = np.zeros((qa.shape[0], qb.shape[1]))
    for k in range(qa.shape[1]):
        acc = truncate_mantissa(acc + np.outer(a[:, k], b[k]))
    return acc.astype(qa.dtype)


def block_scales(amax, fmt: FP8Format, dtype):
    """Each tile's or block's scale from its amax (1 where the amax is 0), in the operand's dtype."""
    return np.where(amax > 0, fmt.max_finite / np.where(amax > 0, amax, 1), 1.0).astype(dtype)


def tile_quantize(a, n: int, fmt: FP8Format):
    """a (M, K) in 1 x n tiles along K: the quantized values and each tile's 1/scale, (M, K/n)."""
    rows, width = a.shape
    tiles = a.reshape(rows, width // n, n)
    scale = block_scales(np.abs(tiles).max(axis=2), fmt, a.dtype)
    return quantize(tiles, scale[:, :, None], fmt).reshape(a.shape), 1.0 / scale


def block_quantize(w, n: int, fmt: FP8Format):
    """w (R, C) in n x n blocks: the quantized values and each block's 1/scale, (R/n, C/n)."""
    rows, cols = w.shape
    blocks = w.reshape(rows // n, n, cols // n, n)
    scale = block_scales(np.abs(blocks).max(axis=(1, 3)), fmt, w.dtype)
    return quantize(blocks, scale[:, None, :, None], fmt).reshape(w.shape), 1.0 / scale


def block_product(qa, a_inv, qb, b_inv, n: int, gemm=np.matmul):
    """a @ b from quantized operands: a's 1/scales per (row, K-slice) (M, K/n), b's per (K-slice,
    column) (K/n, P). Each n-wide slice of K is one FP8 product; its partial sum is promoted (times
    its scales) and added to the running sum in order, as DeepSeek-V3's promotion to CUDA cores."""
    out = np.zeros((qa.shape[0], qb.shape[1]), dtype=qa.dtype)
    for k in range(qa.shape[1] // n):
        cut = slice(k * n, (k + 1) * n)
        out += gemm(qa[:, cut], qb[cut, :]) * a_inv[:, k:k + 1] * b_inv[k:k + 1, :]
    return out


@dataclass
class Prequantized:
    """A Linear weight (out, in) quantized before ZeRO-3 gathered it (fp8_zero3.py): its E4M3 values
    (the weight times its scale, rounded; held in the run's dtype) and its scale (per tensor) or each
    n x n block's 1/scale (block)."""
    values: np.ndarray
    scale: float = 1.0
    inverse: np.ndarray | None = None


def block_scaled_product(a, b, n: int, role: str, weight: Prequantized | None = None, gemm=np.matmul):
    """Linear's product `role` with DeepSeek-V3's scales, all E4M3. forward: x (1xn tiles) @ W^T
    (nxn blocks); input_grad: g (1xn tiles) @ W (the same blocks); weight_grad: g^T @ x, whose inner
    dimension is the tokens, so both are tiled n tokens by 1 channel (g^T's rows, x's columns).
    `weight`: W's blocks as ZeRO-3 gathered them, quantized already (the same bits)."""
    qa, a_inv = tile_quantize(a, n, E4M3)
    if role == "weight_grad":
        qbt, bt_inv = tile_quantize(b.T, n, E4M3)
        return block_product(qa, a_inv, qbt.T, bt_inv.T, n, gemm)
    if weight is not None:
        qw, w_inv = weight.values, weight.inverse
    else:
        qw, w_inv = block_quantize(b.T if role == "forward" else b, n, E4M3)  # (out, in) either way
    if role == "forward":
        return block_product(qa, a_inv, qw.T, np.repeat(w_inv.T, n, axis=1), n, gemm)
    return block_product(qa, a_inv, qw, np.repeat(w_inv, n, axis=1), n, gemm)


# ---- the recipes' scales: who shares one, and from which amax ----

# each product's operands (a, b), by the tensor whose amax scales them
OPERANDS = {"forward": ("input", "weight"), "input_grad": ("grad", "weight"),
            "weight_grad": ("grad", "input")}


class PerTensorScaling:
    """One scale per tensor (a Linear's input, weight or output gradient), keyed by (layer, tensor).

    `current`: from this array's amax. `delayed` (Transformer Engine's DelayedScaling): from the max of
    the amax history of the steps before this one (scale 1 at the first step); each use records the
    array's amax, the step's amax of a tensor is their max (over micro-batches and products), and
    `end_step` reduces those over the ranks that share the tensors before appending them."""

    def __init__(self, delayed: bool, history: int = AMAX_HISTORY, margin: int = 0):
        self.delayed, self.history_length, self.margin = delayed, history, margin
        self.history: dict[tuple, list[float]] = {}
        self.step_amax: dict[tuple, float] = {}

    def scale(self, key: tuple, array, fmt: FP8Format) -> float:
        amax = float(np.max(np.abs(array), initial=0.0))
        if not self.delayed:
            return scale_for(amax, fmt, self.margin)
        self.step_amax[key] = max(self.step_amax.get(key, 0.0), amax)
        return self.history_scale(key, fmt)

    def history_scale(self, key: tuple, fmt: FP8Format) -> float:
        """The delayed scale of `key` for this step, recording nothing (a weight quantized before it is
        gathered records its amax itself, `record`)."""
        history = self.history.get(key, [])
        return scale_for(max(history), fmt, self.margin) if history else 1.0

    def record(self, key: tuple, amax: float) -> None:
        """This step's amax of `key` is `amax`: a weight's shard, quantized once per update, records its
        own (0 for a weight it holds none of); `end_step`'s max over the ranks gives the whole's."""
        if self.delayed:
            self.step_amax[key] = amax

    def end_step(self, reduce_max) -> None:
        """Append this step's amaxes, after `reduce_max` (an fp64 array -> its max over the ranks
        that share the tensors; the identity on one process) agreed them."""
        if not self.delayed:
            return
        keys = sorted(self.step_amax)  # the same order on every rank that holds these layers
        agreed = reduce_max(np.array([self.step_amax[k] for k in keys], dtype=np.float64))
        for key, amax in zip(keys, agreed):
            past = self.history.setdefault(key, [])
            past.append(float(amax))
            del past[:-self.history_length]
        self.step_amax.clear()


def per_tensor_scaled_product(scaling: PerTensorScaling, layer: int, a, b, role: str,
                              weight: Prequantized | None = None, gemm=np.matmul):
    """One of Linear's products with one scale per operand tensor; gradients in E5M2 (HYBRID).
    weight_grad's operands are g^T and x, whose amax is g's and x's. `weight`: W quantized before
    ZeRO-3 gathered it, with its scale (the bits quantizing b would give)."""
    a_name, b_name = OPERANDS[role]
    a_fmt = E5M2 if a_name == "grad" else E4M3
    a_scale = scaling.scale((layer, a_name), a, a_fmt)
    if weight is not None and b_name == "weight":
        qw = weight.values.T if role == "forward" else weight.values
        return descaled_product(quantize(a, a_scale, a_fmt), qw, a_scale, weight.scale, gemm)
    b_scale = scaling.scale((layer, b_name), b, E4M3)
    return per_tensor_product(a, b, a_scale, b_scale, a_fmt, E4M3, gemm)


# ---- where the products run in FP8: the Linear layers' GEMMs, through core's "linear" kernel ----


def fp8_linears(model) -> list:
    """The Linear layers whose products run in FP8: every Linear (plain or tensor-parallel) but the
    output head, which the recipes keep in higher precision, as the embeddings and attention core."""
    heads = {id(m.lm_head) for m in model.modules() if isinstance(m, GPTHead)}
    kinds = (Linear, ColumnParallelLinear, RowParallelLinear)
    return [m for m in model.modules() if isinstance(m, kinds) and id(m) not in heads]


class FP8Products:
    """The "linear" kernel's form (core/kernels.py) while FP8 runs, and the module hooks that tell it
    which layer is running: a layer's forward pre-hook and backward pre-hook name it, its forward and
    backward hooks clear it. A product outside those layers (the head) runs as it would."""

    def __init__(self, model, options: FP8Options):
        self.block, self.recipe = options.fp8_block, options.fp8_recipe
        self.scaling = PerTensorScaling(delayed=options.fp8_recipe == "delayed")
        limited = options.fp8_accumulate == "tc13"  # how the emulated tensor cores add
        self.gemm = limited_accumulation_product if limited else np.matmul
        self.layer: int | None = None
        self.layer_of = {id(m.weight): i for i, m in enumerate(fp8_linears(model))}  # weight -> its layer
        named = {id(p): name for name, p in model.named_parameters()}  # the logical names of any layout
        self.names = [named[id(m.weight)].removesuffix(".weight") for m in fp8_linears(model)]
        self.prequantized: dict[int, Prequantized] = {}  # layer -> its weight as ZeRO-3 gathered it
        self.handles = []
        for index, module in enumerate(fp8_linears(model)):
            self.handles += [module.register_forward_pre_hook(partial(self._enter, index)),
                             module.register_forward_hook(self._leave),
                             module.register_full_backward_pre_hook(partial(self._enter, index)),
                             module.register_full_backward_hook(self._leave)]

    def _enter(self, index, module, *args):
        self.layer = index

    def _leave(self, module, *args):
        self.layer = None

    def __call__(self, a, b, role: str):
        if self.layer is None:
            return matrix_product(a, b)
        weight = self.prequantized.get(self.layer)
        if self.recipe == "block":
            return block_scaled_product(a, b, self.block, role, weight, self.gemm)
        return per_tensor_scaled_product(self.scaling, self.layer, a, b, role, weight, self.gemm)


class FP8Runner(RunnerWrapper):
    """Runs the inner runner with the Linear layers' products in FP8; after the step, the delayed
    recipe's amaxes are agreed (max) over `shared` (the communicators of the ranks that hold the same
    layers: dp x cp and tp) and appended to the history."""

    def __init__(self, runner, products: FP8Products, shared: list):
        self.runner, self.products, self.shared = runner, products, shared

    def forward_backward(self, inputs, targets, normaliser, scored=None) -> float:
        with kernels.install("linear", self.products):
            loss = self.runner.forward_backward(inputs, targets, normaliser, scored)
        self.products.scaling.end_step(self._reduce_max)
        return loss

    def _reduce_max(self, amax):
        for comm in self.shared:
            amax = comm.all_reduce(amax, op="max")
        return amax


def amax_history(runner) -> dict:
    """The delayed recipe's amax history for a checkpoint: {layer name: {tensor: [amax, ...]}}, the
    names the logical ones ("blocks.1.mlp.fc"), so that any layout resumes it; {} otherwise."""
    if not isinstance(runner, FP8Runner) or not runner.products.scaling.delayed:
        return {}
    names, saved = runner.products.names, {}
    for (layer, tensor), past in runner.products.scaling.history.items():
        saved.setdefault(names[layer], {})[tensor] = list(past)
    return saved


def load_amax_history(runner, saved: dict | None) -> None:
    """Continue the history a checkpoint saved, for the layers this rank holds (none saved: a new one)."""
    if not isinstance(runner, FP8Runner) or not runner.products.scaling.delayed or not saved:
        return
    runner.products.scaling.history = {(layer, tensor): [float(a) for a in past]
                                       for layer, name in enumerate(runner.products.names)
                                       for tensor, past in saved.get(name, {}).items()}


def products_of(options: FP8Options, precision: str, model) -> FP8Products | None:
    """The FP8 products of the model's Linear layers for `--precision fp8` (ZeRO-3's FP8 gather hands
    them its weights, fp8_zero3.py; the runner installs them); None for any other precision."""
    return FP8Products(model, options) if precision == "fp8" else None


def wrap_runner(products: FP8Products | None, runner, shared: list):
    """The runner for `--precision fp8` (`products`); any other precision (None): the runner itself."""
    if products is None:
        return runner
    return FP8Runner(runner, products, [c for c in shared if c.size > 1])


# ---- the options of `minipar train --precision fp8` and their checks (trainer/validate.py gathers them) ----


@dataclass
class FP8Options:
    """FP8 training (precision/fp8.py): with --precision fp8."""
    fp8_recipe: str = option("delayed", "fp8: who shares a scale: delayed (a tensor, from past steps' amax, "
                             "Transformer Engine), current (a tensor, its own amax), block (1xN tiles and "
                             "NxN weight blocks, DeepSeek-V3)", RECIPES)
    fp8_block: int = option(128, "fp8 block: the tile width N (it divides each Linear's widths per tp rank "
                            "and each micro-batch's tokens per rank)")
    fp8_accumulate: str = option("fp32", "fp8: the dtype the products add in and the run computes in "
                                 "(fp64: layouts compare with one process to 1e-9; tc13: fp32 runs, the "
                                 "tensor cores' 13-bit accumulator modelled, DeepSeek-V3 3.3.2)",
                                 ("fp32", "fp64", "tc13"))


def config_errors(options: FP8Options, precision: str, model: str, widths: list[int], tokens: int,
                  tp: int, backend: str = "numpy") -> list[str]:
    """--precision fp8 trains the GPT; block's N divides every Linear's widths per tp rank (`widths`:
    d and 4d) and `tokens`, weight_grad's inner dimension: a micro-batch's tokens per rank, or with
    cp the zig-zag chunk, so that every tile holds the tokens it holds on one process."""
    if precision != "fp8":
        return []
    if model != "gpt":
        return [f"--precision fp8 trains --model gpt (its Linear layers), not --model {model}"]
    if backend != "numpy":
        return ["--precision fp8 emulates the FP8 formats in NumPy: use --backend numpy"]
    if options.fp8_recipe != "block":
        return []
    n = options.fp8_block
    if n < 1 or any(w % (tp * n) for w in widths) or tokens % n:
        shares = ", ".join(f"{w}/{tp}" for w in widths)
        return [f"--fp8-block {n} must divide each Linear's width per tp rank ({shares}) and the {tokens} "
                "tokens of a micro-batch per rank (with --cp: of a zig-zag chunk)"]
    return []
