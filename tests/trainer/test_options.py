"""Each technique is checked and built from its own options object, without a TrainConfig.

TrainConfig is composed of the techniques' options objects (trainer/config.py). The oracle here is
each technique's rule, restated by hand: a bad value of its own options gives its one-line message,
a good one none, with only that technique's options object (and the model's, where the rule is
about the model's shape) in hand. Passing the options object alone, not a TrainConfig, is the point:
a check or builder that read another technique's field would raise AttributeError.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from mpi4py import MPI

from minipar.core import moe, recompute
from minipar.core.backend import BackendOptions
from minipar.core.moe import MoEOptions
from minipar.core.nn import MLPConfig, MLPNet, ModelOptions
from minipar.core.optim import AdamW
from minipar.distributed.communicator import Comm
from minipar.distributed.grid import ProcessGrid
from minipar.parallel import clipping, context, experts, pipeline, sequence, tensor, zero_chunked
from minipar.parallel.api import LocalUpdater, MicrobatchRunner
from minipar.parallel.ddp import DataParallelOptions
from minipar.precision import mixed
from minipar.trainer.config import OPTION_GROUPS, RunOptions, TrainConfig
from minipar.trainer.validate import validate

GPT = ModelOptions(model="gpt", n_head=4, seq_len=32)
MLP = ModelOptions(model="mlp")
MOE = ModelOptions(model="moe")


def test_trainconfig_is_the_options_objects_and_nothing_else():
    own = [[f.name for f in dataclasses.fields(group)] for group in OPTION_GROUPS]
    names = [name for fields in own for name in fields]
    assert len(names) == len(set(names))  # each option declared by one object only
    assert names == [f.name for f in dataclasses.fields(TrainConfig)]  # in --help's order
    for group in OPTION_GROUPS:  # an options object holds its own fields: no base to inherit more from
        assert group.__bases__ == (object,), group
        assert isinstance(TrainConfig(), group)  # so the trainer passes itself to the technique
    assert RunOptions in OPTION_GROUPS


def test_every_config_errors_takes_an_options_object_first():
    modules = [tensor, sequence, context, pipeline, experts, zero_chunked, clipping, mixed, moe, recompute]
    for module in modules:
        first = next(iter(inspect.signature(module.config_errors).parameters.values()))
        assert str(first.annotation).endswith("Options"), module.__name__


@pytest.mark.parametrize("errors, expected", [
    (lambda: tensor.config_errors(tensor.TensorOptions(tp=3), GPT), "--tp 3 does not divide --n-head 4"),
    (lambda: tensor.config_errors(tensor.TensorOptions(tp=2), MLP), "--tp 2 needs --model gpt"),
    (lambda: sequence.config_errors(sequence.SequenceOptions(sp=True), tensor.TensorOptions(tp=1), GPT),
     "--sp needs --tp > 1, got --tp 1"),
    (lambda: sequence.config_errors(sequence.SequenceOptions(sp=True), tensor.TensorOptions(tp=3), GPT),
     "--sp: --seq-len 32 is not divisible by --tp 3"),
    (lambda: context.config_errors(context.ContextOptions(cp=3), GPT),
     "--seq-len 32 is not divisible by 2*cp = 6"),
    (lambda: context.config_errors(context.ContextOptions(cp=2), MLP), "--cp 2 needs --model gpt"),
    (lambda: pipeline.config_errors(pipeline.PipelineOptions(pp=2, schedule="interleaved", virtual_stages=2,
                                                             microbatches=3), GPT),
     "--schedule interleaved needs --microbatches 3 to be a multiple of --pp 2"),
    (lambda: pipeline.config_errors(pipeline.PipelineOptions(pp=4, schedule="interleaved", virtual_stages=2,
                                                             microbatches=4), GPT),  # 6 units, 8 chunks
     "--pp 4 x --virtual-stages 2 = 8 chunks is more than the model's 6 blocks"),
    (lambda: experts.config_errors(experts.ExpertOptions(ep=2), DataParallelOptions(dp=3), MoEOptions(), MOE),
     "--ep 2 does not divide dp=3"),
    (lambda: experts.config_errors(experts.ExpertOptions(ep=2), DataParallelOptions(dp=2),
                                   MoEOptions(n_experts=3), MOE),
     "--n-experts 3 is not divisible by --ep 2"),
    (lambda: moe.config_errors(MoEOptions(n_experts=2, top_k=3)),
     "--top-k must be between 1 and --n-experts 2"),
    (lambda: recompute.config_errors(recompute.RecomputeOptions(recompute="selective"), "mlp"),
     "--recompute selective needs --model gpt"),
    (lambda: zero_chunked.config_errors(zero_chunked.ChunkedOptions(offload="cpu")),
     "--offload cpu needs --device-mem-mb"),
    (lambda: clipping.config_errors(clipping.ClippingOptions(clip_grad_norm=0.0)),
     "--clip-grad-norm must be positive, got 0.0"),
    (lambda: mixed.config_errors(mixed.PrecisionOptions(precision="bf16"), BackendOptions(backend="cupy")),
     "--precision bf16 emulates the 16-bit format in NumPy"),
])
def test_a_techniques_own_rule_is_checked_from_its_own_options(errors, expected):
    found = errors()
    assert len(found) == 1 and found[0].startswith(expected), found


def test_good_options_pass_their_techniques_checks():
    assert tensor.config_errors(tensor.TensorOptions(tp=2), GPT) == []
    assert sequence.config_errors(sequence.SequenceOptions(sp=True), tensor.TensorOptions(tp=2), GPT) == []
    assert context.config_errors(context.ContextOptions(cp=2), GPT) == []
    assert pipeline.config_errors(pipeline.PipelineOptions(pp=2, schedule="interleaved", virtual_stages=3,
                                                           microbatches=4), GPT) == []
    ep = experts.ExpertOptions(ep=2)
    assert experts.config_errors(ep, DataParallelOptions(dp=4), MoEOptions(), MOE) == []
    assert moe.config_errors(MoEOptions()) == []
    assert zero_chunked.config_errors(zero_chunked.ChunkedOptions(offload="disk", device_mem_mb=1.0)) == []
    assert clipping.config_errors(clipping.ClippingOptions(clip_grad_norm=1.0)) == []
    assert mixed.config_errors(mixed.PrecisionOptions(precision="fp16"), BackendOptions()) == []


def one_rank():
    grid = ProcessGrid(Comm(MPI.COMM_SELF), 1, 1, 1)
    model = MLPNet(MLPConfig(d_hidden=8, n_layer=2, dtype="float32"), seed=None).init_parameters(0)
    return grid, model


def test_the_builders_take_their_own_options():
    grid, model = one_rank()
    updater = LocalUpdater(model, AdamW(model.parameters()))
    assert clipping.attach(clipping.ClippingOptions(), grid, updater) is None
    assert clipping.attach(clipping.ClippingOptions(clip_grad_norm=1.0), grid, updater) is not None
    assert mixed.attach_loss_scaling(mixed.PrecisionOptions(precision="fp16", loss_scaling=False), updater,
                                     grid.world) is None
    loss_scaling = mixed.attach_loss_scaling(mixed.PrecisionOptions(precision="fp16"), updater, grid.world)
    assert list(updater.gradient_transforms)[0] is loss_scaling  # first: unscaled before clipping
    runner = MicrobatchRunner(model, 1)
    assert mixed.wrap_runner(mixed.PrecisionOptions(precision="fp32"), model, runner, updater) is runner
    assert isinstance(mixed.wrap_runner(mixed.PrecisionOptions(precision="bf16"), model, runner, updater),
                      mixed.MixedPrecisionRunner)


def test_chunked_zero3_is_sized_and_built_from_its_options():
    grid, model = one_rank()
    options = zero_chunked.ChunkedOptions(chunk_mb=2**-10)  # 1 KiB: 256 fp32 elements
    assert options.chunked and not zero_chunked.ChunkedOptions().chunked
    assert zero_chunked.chunk_numel_for(options, model, 1) == 256
    assert zero_chunked.size_errors(options, 1, model, AdamW([])) == []  # the largest tensor is 8x8
    engine = zero_chunked.build_chunked_zero3(options, grid, model, AdamW([]))
    assert engine.shard == 256 and {chunk.numel for chunk in engine.chunks} == {256}


@pytest.mark.parametrize("changes, world, message", [
    ({"cp": 2, "sp": True, "tp": 2, "seq_len": 32}, 4,
     "--cp 2 with --sp: sequence parallelism cuts the sequence"),
    ({"model": "moe", "sp": True, "tp": 2}, 2, "--model moe does not support --sp"),
    ({"model": "moe", "cp": 2}, 2, "--model moe does not support --cp > 1 yet"),
    ({"model": "moe", "ep": 2, "dp": 2, "zero": 3, "offload": "cpu", "device_mem_mb": 8.0}, 2,
     "--ep 2 with chunked ZeRO-3"),
    ({"pp": 2, "schedule": "zb-h1", "zero": 3, "dp": 2, "batch_size": 8}, 4,
     "--schedule zb-h1 runs with --zero 0"),
    ({"pp": 2, "schedule": "zb-h1", "offload": "cpu", "device_mem_mb": 8.0}, 2,
     "--schedule zb-h1 runs with --zero 0"),
    ({"pp": 2, "schedule": "zb-h1", "recompute": "full"}, 2, "--schedule zb-h1 with --recompute full"),
])
def test_two_techniques_that_are_not_built_together_are_one_line(changes, world, message):
    """The trainer's own rules (validate.py's _combinations), each pair refused in its one line."""
    found = validate(TrainConfig(**changes), world)
    assert any(line.startswith(message) for line in found), found


def test_zb_h1_with_zero_1_and_2_is_built():
    for zero in (1, 2):
        assert validate(TrainConfig(pp=2, schedule="zb-h1", zero=zero, dp=2, batch_size=8), 4) == []
