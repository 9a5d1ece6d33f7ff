"""The meters against real memory: what NumPy allocates over a forward is what the meters count.

The oracle is tracemalloc, which NumPy tells of every data buffer it allocates and frees (in its own
domain, `np.lib.tracemalloc_domain`), started before the model is built. Over one micro-batch's
forward, the growth of the NumPy bytes alive must equal the growth of the activation meter (the
buffers saved for backward, each once), plus the buffer meter's (none on one process), plus the
forward's output still referenced (the loss): an array the graph held without counting it (an
intermediate kept by a graph of tensors, an index kept as a ctx attribute) or a buffer counted twice
would break it. PyTorch's graph of backward nodes holds what its nodes saved and nothing else; so must
minipar's (core/autograd.py).

On two ranks the same check runs on every rank of each layout alone: tp 2, sequence parallelism, ZeRO-3
with its prefetch (the gathered units are the buffer meter's: the unit being computed and the next one,
whose all-gather is already in flight) and cp 2.

    python -m pytest -q tests/memory/test_real_memory.py                            # one process
    mpiexec -n 2 python -m pytest -m mpi -q tests/memory/test_real_memory.py        # the layouts
"""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest
from mpi_harness import mpi_test, needs_world_size

from minipar.core import autograd, nn
from minipar.core.autograd import activation_meter
from minipar.distributed.grid import ProcessGrid
from minipar.memory.ledger import buffer_meter
from minipar.parallel import context
from minipar.trainer import build
from minipar.trainer.config import TrainConfig
from minipar.trainer.tasks import AdditionTask

NUMPY_ONLY = [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)]
# (config, batch): the default GPT's width and the wide one's, few blocks and rows to stay fast
MODELS = {"default": (nn.GPTConfig(n_layer=2), 2),
          "wide": (nn.GPTConfig(block_size=64, d_model=256, n_layer=1), 1)}


def numpy_bytes() -> int:
    """Bytes of NumPy data buffers alive now, as tracemalloc saw them allocated."""
    return sum(trace.size for trace in tracemalloc.take_snapshot().filter_traces(NUMPY_ONLY).traces)


@pytest.fixture
def traced():
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_a_forward_grows_numpy_memory_by_what_the_meters_count(traced, model_name, dtype, recompute):
    cfg, batch = MODELS[model_name]
    model = nn.GPT(dataclasses.replace(cfg, dtype=dtype), seed=0, recompute=recompute)
    ids, targets = AdditionTask(cfg.block_size, seed=0).global_batch(0, batch)
    for _ in range(2):  # the second micro-batch starts from what the first one's backward left
        activations, buffers, real = activation_meter.current, buffer_meter.current, numpy_bytes()
        loss = model.loss(model(ids), targets, targets.size)
        grown = numpy_bytes() - real
        counted = activation_meter.current - activations + buffer_meter.current - buffers + loss.data.nbytes
        assert abs(grown - counted) <= 0.02 * counted, (grown, counted)
        loss.backward()
        del loss


# ---- multi-rank: each layout alone at 2 ranks --------------------------------------------------------

# (name, the layout's options): tp 2, sequence parallelism over tp 2, ZeRO-3 over dp 2 (with prefetch, the
# default: the next unit's gather is in flight at a unit's end, its buffer counted when it starts), cp 2
LAYOUTS = {"tp": {"dp": 1, "tp": 2}, "sp": {"dp": 1, "tp": 2, "sp": True}, "zero3": {"dp": 2, "zero": 3},
           "cp": {"dp": 1, "cp": 2}}
# (the model's options, rows per rank): the serial test's two GPTs
TRAIN_MODELS = {"default": ({"n_layer": 2}, 2), "wide": ({"seq_len": 64, "d_model": 256, "n_layer": 1}, 1)}


def forward_growth(model, ids, targets, normaliser: int) -> tuple[int, int]:
    """NumPy bytes grown over one micro-batch's forward and loss, and what the meters say grew (plus the
    forward's outputs still referenced: the loss and where it found the prediction right)."""
    activations, buffers, real = activation_meter.current, buffer_meter.current, numpy_bytes()
    loss, correct = model.loss_and_correct(model(ids), targets, normaliser)
    grown = numpy_bytes() - real
    counted = (activation_meter.current - activations + buffer_meter.current - buffers + loss.data.nbytes
               + correct.nbytes)
    loss.backward()
    return grown, counted


# each layout with both GPTs and both formats, the pairs halved to keep the launch short: the format only
# changes the item size, so the default GPT runs in fp64 and the wide one in fp32 (all 16 pass alike)
CASES = [(layout, "default", "fp64") for layout in sorted(LAYOUTS)] + [(layout, "wide", "fp32")
                                                                       for layout in sorted(LAYOUTS)]


@needs_world_size(2)
@pytest.mark.parametrize(("layout", "model_name", "precision"), CASES)
@mpi_test
def test_a_forward_on_a_layout_grows_numpy_memory_by_what_the_meters_count(comm, layout, model_name,
                                                                           precision):
    """Every rank's NumPy bytes, the same check as one process's, on each layout of two ranks. The
    expectation is independent of the layout's code: what tracemalloc saw NumPy allocate."""
    options, rows = TRAIN_MODELS[model_name]
    cfg = TrainConfig(precision=precision, quiet=True, **options, **LAYOUTS[layout])
    cfg = cfg.replace(batch_size=rows * cfg.dp)
    tracemalloc.start()  # before the model is built: its parameters are the baseline, not the growth
    try:
        grid = ProcessGrid(comm, cfg.dp, cfg.pp, cfg.tp, cfg.cp)
        engine = build.build_engine(cfg, grid)
        ids, targets = AdditionTask(cfg.seq_len, seed=comm.rank).global_batch(0, rows)
        if cfg.cp > 1:  # this rank's positions of the sequence, as ContextParallelRunner gives them
            mine = context.zigzag_positions(cfg.seq_len, cfg.cp, grid.cp_rank)
            ids, targets = ids[:, mine].copy(), targets[:, mine].copy()
        figures = [forward_growth(engine.model, ids, targets, targets.size) for _ in range(2)]
        engine.updater.synchronize_gradients()  # ZeRO-3: its last reduce-scatters, every unit released
    finally:
        tracemalloc.stop()
    for grown, counted in figures:  # the second micro-batch starts from what the first one's backward left
        assert abs(grown - counted) <= 0.02 * counted, (layout, model_name, precision, figures)


# ---- between backward nodes ----------------------------------------------------------------------------


def buffers_bytes(arrays) -> int:
    """The bytes of the buffers behind `arrays`, each once (Add hands the same gradient to both its
    inputs; a view keeps its whole base)."""
    bases = {}
    for a in arrays:
        while isinstance(a.base, np.ndarray):
            a = a.base
        bases[id(a)] = a.nbytes
    return sum(bases.values())


def parameter_gradient_bytes(model) -> int:
    return sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_between_backward_nodes_numpy_memory_is_what_the_ledger_counts(traced, recompute):
    """After each backward node, the NumPy bytes grown since before the forward are the activations
    still saved, the parameters' .grad arrays, the buffers, and the gradients in flight (pending for the
    nodes to come, given by autograd's backward_node_hooks). Full recomputation's nested backward also
    holds its block's recomputed output and, once reached, its input's gradient (a leaf's .grad inside
    the rerun, not a parameter's): at most two arrays of the block input's bytes more, never fewer."""
    cfg, batch = MODELS["default"]
    model = nn.GPT(cfg, seed=0, recompute=recompute)
    ids, targets = AdditionTask(cfg.block_size, seed=0).global_batch(0, batch)
    block_input = batch * cfg.block_size * cfg.d_model * 8  # fp64
    before = numpy_bytes() - activation_meter.current - buffer_meter.current - parameter_gradient_bytes(model)
    loss = model.loss(model(ids), targets, targets.size)
    figures = []

    def compare(node, in_flight):
        counted = (activation_meter.current + parameter_gradient_bytes(model) + buffer_meter.current
                   + buffers_bytes(in_flight) + loss.data.nbytes)
        figures.append((node.function.__name__, numpy_bytes() - before, counted))

    with autograd.backward_node_hooks.add(compare):
        loss.backward()
    assert len(figures) > 20
    rerun = 2 * block_input if recompute == "full" else 0  # the bound of the docstring
    for name, grown, counted in figures:
        assert -0.02 * counted <= grown - counted <= rerun + 0.02 * counted, (name, grown, counted)


@needs_world_size(2)
@mpi_test
def test_between_backward_nodes_with_sp_the_gathered_again_input_is_a_counted_buffer(comm):
    """Sequence parallelism keeps each gathered input as this rank's piece and all-gathers it again in
    backward, once for query, key and value together: that (b, s, h) copy lives from the first of them
    to the last, and is the buffer meter's. After each backward node every rank's NumPy bytes are, as on
    one process, the activations still saved + the parameters' .grad + the buffers + the gradients in
    flight (+ the loss and its correct-mask); an uncounted copy is 2 b s h values over that, beyond the
    tolerance."""
    cfg = TrainConfig(precision="fp64", quiet=True, n_layer=2, **LAYOUTS["sp"]).replace(batch_size=2)
    tracemalloc.start()
    try:
        grid = ProcessGrid(comm, cfg.dp, cfg.pp, cfg.tp, cfg.cp)
        model = build.build_engine(cfg, grid).model
        ids, targets = AdditionTask(cfg.seq_len, seed=comm.rank).global_batch(0, 2)
        before = (numpy_bytes() - activation_meter.current - buffer_meter.current
                  - parameter_gradient_bytes(model))
        loss, correct = model.loss_and_correct(model(ids), targets, targets.size)
        figures, buffers_seen = [], []

        def compare(node, in_flight):
            counted = (activation_meter.current + parameter_gradient_bytes(model) + buffer_meter.current
                       + buffers_bytes(in_flight) + loss.data.nbytes + correct.nbytes)
            figures.append((node.function.__name__, numpy_bytes() - before, counted))
            buffers_seen.append(buffer_meter.current)

        with autograd.backward_node_hooks.add(compare):
            loss.backward()
    finally:
        tracemalloc.stop()
    whole = 2 * cfg.seq_len * cfg.d_model * 8  # one gathered (b, s, h) input in fp64
    assert max(buffers_seen) == whole  # QKV's copy between its first reader and its last, never two
    assert len(figures) > 20
    for name, grown, counted in figures:
        assert abs(grown - counted) <= 0.02 * counted, (name, grown, counted)
