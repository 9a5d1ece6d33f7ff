"""The meters against real memory: what NumPy allocates over a forward is what the meters count.

The oracle is tracemalloc, which NumPy tells of every data buffer it allocates and frees (in its own
domain, `np.lib.tracemalloc_domain`), started before the model is built. Over one micro-batch's
forward, the growth of the NumPy bytes alive must equal the growth of the activation meter (the
buffers saved for backward, each once), plus the buffer meter's (none on one process), plus the
forward's output still referenced (the loss): an array the graph held without counting it (an
intermediate kept by a graph of tensors, an index kept as a ctx attribute) or a buffer counted twice
would break it. PyTorch's graph of backward nodes holds what its nodes saved and nothing else; so must
minipar's (core/autograd.py)."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

from minipar.core import nn
from minipar.core.autograd import activation_meter
from minipar.memory.ledger import buffer_meter
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
