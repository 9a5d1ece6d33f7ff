"""ZeRO-3's all-gather in FP8 (precision/fp8_zero3.py): each rank quantizes its shard of the FP8 Linear
weights before the gather. The gathered weights are the bits ml_dtypes gives for the whole weight
(current and block scales from the whole weight's amax, per tensor or per n x n block), the FP8 Linear
computes with the weight it is handed, the bytes on the ledger are the formula's (1 byte a weight
value, the rest in the run's dtype, 8 bytes a scale sent), and training equals one process (1e-9).

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python -m pytest -m mpi -q tests/precision/test_fp8_zero3.py
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from mpi_harness import mpi_test, needs_world_size
from one_process import assert_trains_like_one_process

from minipar.core import kernels
from minipar.core.autograd import Tensor
from minipar.core.nn import GPT, GPTConfig
from minipar.precision import fp8
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig

WORLD = MPI.COMM_WORLD
E4M3_MAX = 448.0
# the Linear layers the recipes quantize: every block's six (not the embeddings, LayerNorm or the head)
FP8_WEIGHTS = ("attn.query.weight", "attn.key.weight", "attn.value.weight", "attn.proj.weight",
               "mlp.fc.weight", "mlp.proj.weight")
N = 16  # --fp8-block


def cast(x):
    """ml_dtypes' saturating E4M3 cast (np.clip first), in x's dtype."""
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(x.dtype)


def tiny(recipe: str, accumulate: str = "fp64", steps: int = 2, seed: int = 0) -> TrainConfig:
    """dp 2, ZeRO-3: a block's 12,672 values cut at 6,336: rank 0 holds ln_1, query, key, value, proj,
    ln_2 (4,320 values) and the first 2,016 of mlp.fc.weight (128 x 32), rows 0-62. So block scaling
    (N = 16) has blocks held whole and blocks cut (rows 48-63), and current scaling weights held whole
    by rank 0 (query, key, value, proj) and by rank 1 (mlp.proj) and one cut (mlp.fc)."""
    return TrainConfig(model="gpt", precision="fp8", fp8_accumulate=accumulate, fp8_recipe=recipe,
                       fp8_block=N,
                       n_layer=2, n_head=2, d_model=32, seq_len=8, batch_size=4, steps=steps, quiet=True,
                       seed=seed, dp=2, zero=3)


# ---- the FP8 Linear computes with the weight it is handed ----


def test_the_fp8_linear_computes_with_the_weight_it_is_handed_quantized():
    """A weight handed to the FP8 products (as ZeRO-3 hands the gathered one) replaces the layer's own:
    per tensor, x's current scale with the handed values and scale; block, with the handed 1/scales."""
    rng = np.random.default_rng(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=32, dtype="float64"), seed=0)
    fc = model.blocks[0].mlp.fc  # 32 -> 128
    x = rng.standard_normal((16, 32))
    handed = cast(rng.standard_normal((128, 32)) * 100)  # E4M3 values, not fc's weight
    for recipe in ("current", "block"):
        products = fp8.FP8Products(model, TrainConfig(fp8_recipe=recipe, fp8_block=N))
        layer = products.layer_of[id(fc.weight)]
        inverse = rng.uniform(1, 2, (128 // N, 32 // N))
        products.prequantized[layer] = fp8.Prequantized(handed, scale=3.0, inverse=inverse)
        with kernels.install("linear", products):
            out = fc(Tensor(x)).data - fc.bias.data
        if recipe == "current":
            sa = E4M3_MAX / np.abs(x).max()
            expected = (cast(x * sa) @ handed.T) * (1.0 / sa) * (1.0 / 3.0)
        else:  # x in 1 x N tiles; each K-slice's product promoted with both scales
            expected = np.zeros((16, 128))
            for k in range(32 // N):
                cut = slice(k * N, (k + 1) * N)
                sa = E4M3_MAX / np.abs(x[:, cut]).max(axis=1, keepdims=True)
                promoted = np.repeat(inverse[:, k], N)[None, :]  # after 1/sa, as fp8.block_product
                expected += (cast(x[:, cut] * sa) @ handed[:, cut].T) * (1.0 / sa) * promoted
        np.testing.assert_allclose(out, expected, rtol=1e-13, atol=1e-15)


# ---- on two ranks: the gathered bits, the bytes, the training ----


def expected_quantized(w, recipe):
    """The whole weight (out, in) quantized by the recipe's definition: its values and its scale
    (current) or each n x n block's scale (block), in w's dtype."""
    if recipe == "current":
        scale = E4M3_MAX / float(np.abs(w).max())
        return cast(w * scale), scale
    rows, cols = w.shape
    amax = np.abs(w).reshape(rows // N, N, cols // N, N).max(axis=(1, 3))
    scale = (w.dtype.type(E4M3_MAX) / amax).astype(w.dtype)
    return cast(w * np.repeat(np.repeat(scale, N, axis=0), N, axis=1)), scale


@needs_world_size(2)
@mpi_test
@pytest.mark.parametrize("recipe", ["current", "block"])
def test_each_gathered_fp8_weight_is_the_whole_weight_quantized(recipe):
    """After a step (the shards updated and quantized again), gather each unit: every FP8 weight handed
    to the Linear layers is the whole master weight quantized with the whole weight's scales (ml_dtypes),
    and the parameter the model holds is those values divided by their scales."""
    trainer = train.Trainer(tiny(recipe, accumulate="fp32", steps=1), WORLD)
    trainer.run()
    updater, products = trainer.engine.updater, trainer.engine.runner.products
    masters = updater.local_state()  # a collective: the whole master weights
    checked = 0
    for unit in updater.units:
        updater.gather_params(unit)
        for name, param in zip(unit.names, unit.params):
            if not name.endswith(FP8_WEIGHTS):
                continue
            given = products.prequantized[products.layer_of[id(param)]]
            values, scale = expected_quantized(masters[name][1], recipe)
            np.testing.assert_array_equal(given.values, values)
            if recipe == "current":
                assert given.scale == scale
                np.testing.assert_array_equal(param.data, values * (1.0 / scale))
            else:
                np.testing.assert_array_equal(given.inverse, 1.0 / scale)
                per_value = np.repeat(np.repeat(1.0 / scale, N, axis=0), N, axis=1)
                np.testing.assert_array_equal(param.data, values * per_value)
            checked += 1
        updater.release_params(unit)
    assert checked == 12 and products.prequantized == {}


def groups(shape, offset: int, recipe: str) -> list[tuple[int, int]]:
    """The first and last element (in the unit's buffer) of each scale group of a weight at `offset`:
    current, the weight; block, each N x N block (rows of `cols` apart); delayed, none is sent."""
    rows, cols = shape
    if recipe == "current":
        return [(offset, offset + rows * cols - 1)]
    if recipe == "block":
        firsts = [offset + bi * N * cols + bj * N for bi in range(rows // N) for bj in range(cols // N)]
        return [(first, first + (N - 1) * cols + N - 1) for first in firsts]
    return []


def unit_layout(params: list[tuple], recipe: str, itemsize: int, size: int,
                weight_bytes: int = 1) -> tuple[list[int], int]:
    """A unit of `params` (name, shape), in order, on `size` ranks: each rank's message, its shard of
    the flat buffer (padded to a multiple of `size`) at `weight_bytes` an FP8 weight value and
    `itemsize` any other, plus 8 bytes a scale group it holds whole; and the number of groups no rank
    holds whole."""
    numel = sum(int(np.prod(shape)) for _, shape in params)
    per_rank = -(-numel // size)
    bounds = [(rank * per_rank, (rank + 1) * per_rank) for rank in range(size)]
    fp8_values, whole, cut, offset = [0] * size, [0] * size, 0, 0
    for name, shape in params:
        numel_here = int(np.prod(shape))
        if name.endswith(FP8_WEIGHTS):
            for rank, (start, stop) in enumerate(bounds):
                fp8_values[rank] += max(0, min(offset + numel_here, stop) - max(offset, start))
            for first, last in groups(shape, offset, recipe):
                holders = [r for r, (start, stop) in enumerate(bounds) if start <= first and last < stop]
                cut += not holders
                for rank in holders:
                    whole[rank] += 1
        offset += numel_here
    messages = [v * weight_bytes + (per_rank - v) * itemsize + 8 * w for v, w in zip(fp8_values, whole)]
    return messages, cut


@needs_world_size(2)
@mpi_test
@pytest.mark.parametrize("recipe, accumulate", [("delayed", "fp64"), ("current", "fp32"), ("block", "fp64"),
                                                ("block", "fp32")])
def test_the_all_gather_sends_a_byte_a_fp8_weight_value_plus_the_scales(recipe, accumulate):
    """Every step gathers each unit twice (forward, backward), and rank 0 sends in the ring all the
    messages but its successor's: its own and, passed on, none other on 2 ranks. The FP8 weights' part
    is half of what bf16 sends for them (2 bytes a value). Current and block add one all-reduce of the
    cut groups' amaxes (2 ranks: 8 bytes each); delayed one of 36 amaxes after the step (fp8.py)."""
    cfg = tiny(recipe, accumulate)
    trainer = train.Trainer(cfg, WORLD)
    records = trainer.run()
    itemsize = 8 if accumulate == "fp64" else 4
    units = [list(zip(unit.names, unit.shapes)) for unit in trainer.engine.updater.units]
    layouts = [unit_layout(u, recipe, itemsize, 2) for u in units]
    gathered = sum(2 * (sum(messages) - messages[1]) for messages, _ in layouts)
    cut = sum(cuts for _, cuts in layouts)
    fp8_values = sum(int(np.prod(s)) for u in units for n, s in u if n.endswith(FP8_WEIGHTS))
    if WORLD.rank == 0:
        assert fp8_values == 2 * (4 * 32 * 32 + 2 * 32 * 128)  # 2 blocks: 4 of 32 x 32, 2 of 32 x 128
        if recipe != "delayed":
            assert 0 < cut < (12 if recipe == "current" else fp8_values // N**2)  # some groups cut, not all
        for record in records:
            assert record["comm"]["by_op"]["all_gather"] == gathered, (record["comm"], gathered)
            assert record["comm"]["by_op"]["all_reduce"] == (36 * 8 if recipe == "delayed" else cut * 8)


@needs_world_size(2)
@mpi_test
def test_bf16_zero3_sends_two_bytes_a_value_by_the_same_count():
    """The count above, every value at 2 bytes and no scale, is bf16 ZeRO-3's ledger: so the FP8
    weights' bytes in an FP8 gather (1 a value) are half of what bf16 sends for the same weights."""
    cfg = tiny("delayed", steps=1).replace(precision="bf16")
    trainer = train.Trainer(cfg, WORLD)
    records = trainer.run()
    units = [list(zip(unit.names, unit.shapes)) for unit in trainer.engine.updater.units]
    bf16 = sum(2 * m[0] for m, _ in (unit_layout(u, "delayed", 2, 2, weight_bytes=2) for u in units))
    fp8_part = sum(2 * (m[0] - n[0]) for (m, _), (n, _) in
                   ((unit_layout(u, "delayed", 2, 2, weight_bytes=2), unit_layout(u, "delayed", 2, 2, 0))
                    for u in units))
    if WORLD.rank == 0:
        assert records[0]["comm"]["by_op"]["all_gather"] == bf16
        assert fp8_part == 2 * 2 * 2 * (4 * 1024 + 2016)  # rank 0's shards: see tiny()


@needs_world_size(2)
@mpi_test
@pytest.mark.parametrize("recipe, seed", [("delayed", 5), ("block", 7)])
def test_zero3_gathering_fp8_trains_like_one_process(recipe, seed):
    """The gathered weights are the bits one process quantizes, so with fp64 sums the run equals one
    process's to 1e-9 (current scaling cannot: each rank scales its own micro-batches' activations)."""
    cfg = tiny(recipe, steps=3, seed=seed)
    trainer = train.Trainer(cfg, WORLD)
    records = trainer.run()
    full = trainer.full_state()
    if WORLD.rank == 0:
        assert_trains_like_one_process(cfg, records, full)
