"""Build the engine of one rank for any layout: TP inside a stage, PP across stages, DP (or ZeRO)
across replicas of the pipeline. The one place that composes a layout.

The process grid (distributed/grid.py's ProcessGrid) puts tp fastest-varying, so tensor-parallel ranks are
neighbours ("TP inside a node"), then pp, then dp. Each part of the engine is chosen by the config in
a function of its own, from the techniques in minipar/parallel:

    build_model      the parameters this rank holds: tensor_gpt.py's layers, pipeline.py's stage,
                     with context.py's ring attention under --cp
    build_optimizer  SGD or AdamW (fused or not)
    build_runner     pipeline.py's schedule over stages, or api.py's micro-batch loop (on this rank's
                     positions of the sequence under --cp: context.py)
    build_updater    how gradients are combined across replicas: ddp.py, zero.py, zero3.py,
                     zero_chunked.py, or api.py's plain step; and what runs where they are final
                     (fp16's loss scaling, the options that declare a gradient transform)
    build_engine     the three, wrapped by precision/mixed.py for bf16 and fp16, precision/fp8.py for fp8

Lesson: lessons/07_3d.md.
"""

from __future__ import annotations

from functools import partial

from minipar.core import optim
from minipar.core.moe import MoEConfig, MoEGPT, MoELayer, routing_of
from minipar.core.nn import GPT, GPTConfig, MLPConfig, MLPNet, causal_attention
from minipar.fusion import training as fused_training
from minipar.parallel import context, experts, fsdp, pipeline, schedules
from minipar.parallel.api import LocalUpdater, MicrobatchRunner
from minipar.parallel.ddp import DistributedDataParallel
from minipar.parallel.sequence import SequenceParallelGPT
from minipar.parallel.tensor_gpt import TensorParallelGPT
from minipar.parallel.zero import ZeroStage1, ZeroStage2
from minipar.parallel.zero3 import ZeroStage3
from minipar.parallel.zero_chunked import build_chunked_zero3
from minipar.precision import fp8
from minipar.precision import mixed as mixed_precision
from minipar.precision.fp8_zero3 import FP8ZeroStage3
from minipar.trainer.config import gradient_transforms
from minipar.trainer.engine import Engine
from minipar.trainer.tasks import AdditionTask


def moe_config(cfg) -> MoEConfig:
    return MoEConfig(cfg.n_experts, cfg.top_k, cfg.capacity_factor, cfg.aux_loss_coef)


def model_config(cfg):
    """The architecture `cfg` asks for (core/nn.py's GPTConfig or MLPConfig)."""
    if cfg.is_gpt:
        return GPTConfig(vocab_size=AdditionTask.vocab_size, block_size=cfg.seq_len, n_layer=cfg.n_layer,
                         n_head=cfg.n_head, d_model=cfg.d_model, dtype=cfg.dtype)
    return MLPConfig(d_hidden=cfg.d_model, n_layer=cfg.n_layer, dtype=cfg.dtype)


def build_model(cfg, grid):
    """The parameters this rank holds, initialised from (seed, name) whatever the layout."""
    mcfg = model_config(cfg)
    # --cp: the sequence split over grid.cp, attention as a ring (parallel/context.py)
    attention = context.RingAttentionOver(grid.cp) if cfg.cp > 1 else causal_attention
    if cfg.sp:  # the replicated regions of tensor parallelism cut along the sequence
        model = SequenceParallelGPT(mcfg, grid.tp, seed=None, recompute=cfg.recompute)
    elif cfg.model == "moe":  # a GPT whose MLPs are experts behind a router (core/moe.py)
        layer = MoELayer
        if cfg.ep > 1:  # --ep: each rank holds its share of the experts (parallel/experts.py)
            groups = experts.ExpertGroups(grid, cfg.ep)
            layer = partial(experts.ExpertParallelMoELayer, groups=groups)
        if cfg.tp > 1:  # attention split over tp, the MoE layers replicated over it
            model = experts.TensorParallelMoEGPT(mcfg, moe_config(cfg), grid.tp, seed=None,
                                                 recompute=cfg.recompute, layer=layer)
        else:
            model = MoEGPT(mcfg, moe_config(cfg), seed=None, recompute=cfg.recompute, attention=attention,
                           layer=layer)
    elif cfg.tp > 1:  # Megatron tensor parallelism, GPT only (trainer/validate.py)
        model = TensorParallelGPT(mcfg, grid.tp, seed=None, recompute=cfg.recompute, attention=attention)
    elif cfg.model == "gpt":  # --recompute: which activations backward recomputes (core/recompute.py)
        model = GPT(mcfg, seed=None, recompute=cfg.recompute, attention=attention)
    else:
        model = MLPNet(mcfg, seed=None, recompute=cfg.recompute)
    if cfg.pp > 1:  # keep this stage's units only, under their global names
        model = pipeline.build_stage(model, grid.pp.size, grid.pp_rank,
                                     schedules.chunks_of(cfg.schedule, cfg.virtual_stages),
                                     schedules.placement_of(cfg.schedule))
    if cfg.fused:
        fused_training.use_fused_gelu(model)
    return model.init_parameters(cfg.seed)


def build_optimizer(cfg, params):
    if cfg.optimizer == "sgd":
        return optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    # --fused: the same arithmetic, as three fused kernels (fusion/training.py)
    update_rule = fused_training.adamw_update if cfg.fused else optim.adamw_update
    return optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, update_rule=update_rule)


def build_runner(cfg, grid, model):
    """Forward and backward: through the pipeline's stages (--pp > 1), or micro-batch after micro-batch;
    on this rank's positions of the sequence with --cp."""
    if cfg.pp > 1:
        runner = pipeline.PipelineRunner(model, grid.pp, cfg.schedule, cfg.microbatches, cfg.d_model,
                                         cfg.dtype, cfg.virtual_stages,
                                         sequence_pieces=cfg.tp if cfg.sp else 1,
                                         early_receives=not cfg.no_overlap)
    else:
        runner = MicrobatchRunner(model, cfg.microbatches)
    if cfg.cp > 1:
        positions = context.zigzag_positions(cfg.seq_len, grid.cp.size, grid.cp_rank)
        runner = context.ContextParallelRunner(runner, model, positions)
    routing = routing_of(model) if cfg.model == "moe" else None
    if routing is not None:  # the MoE layers' aux-loss gradient, on every stage that holds one (experts.py)
        runner = experts.AuxLossRunner(runner, routing, cfg.aux_loss_coef)
    return runner


def build_updater(cfg, grid, model, scaler=None, fp8_products=None):
    """The step across data-parallel replicas, with the transforms at its gradients-ready point
    (parallel/api.py), in PyTorch AMP's order: fp16's unscale and overflow verdict (`scaler`, or
    PyTorch's defaults), then each option that declares a `gradient_transform` (config.py), in the
    order of TrainConfig's fields. `fp8_products`: the FP8 Linear layers (fp8.py), which ZeRO-3 hands
    the weights it gathers in FP8."""
    updater = synchronising_updater(cfg, grid, model, fp8_products)
    mixed_precision.attach_loss_scaling(cfg, updater, grid.world, scaler)
    for transform in gradient_transforms():
        transform.attach(cfg, grid, updater)
    return updater


def synchronising_updater(cfg, grid, model, fp8_products=None):
    """How gradients are made final and applied: chunked ZeRO-3, ZeRO 1-3, DDP, or a plain step (dp=1).
    With --cp the replicas of the parameters are the dp x cp ranks (grid.dp_cp)."""

    def optimizer_of(params):
        return build_optimizer(cfg, params)

    if cfg.chunked:  # --offload, --chunk-mb or --device-mem-mb (zero_chunked.py's ChunkedOptions)
        return build_chunked_zero3(cfg, grid, model, optimizer_of([]),  # parallel/zero_chunked.py
                                   mixed_precision.parameter_wire(cfg.precision))
    if cfg.ep > 1:  # experts summed over the ranks that hold them, the rest over dp (experts.py)
        groups = experts.ExpertGroups(grid, cfg.ep)  # the same communicators as the model's (reused)
        if cfg.zero:  # expert states (and gradients, parameters) sharded over edp, the rest over dp
            return experts.ExpertParallelZero(model, optimizer_of, grid.dp, groups, cfg.zero,
                                              prefetch=not cfg.no_overlap,
                                              working=mixed_precision.parameter_wire(cfg.precision))
        return experts.ExpertParallelUpdater(model, optimizer_of(model.parameters()), grid.dp, groups)
    if cfg.fsdp:  # each parameter sharded on dim 0 over dp (or dp_shard, hybrid): parallel/fsdp.py
        return fsdp.build(cfg, grid, model, optimizer_of([]), prefetch=not cfg.no_overlap,
                          working=mixed_precision.parameter_wire(cfg.precision))  # bf16, fp16: as ZeRO-3
    if cfg.zero:  # ZeRO partitions the model states over the data-parallel ranks (zero.py, zero3.py)
        if cfg.zero == 3 and fp8_products is not None:  # the FP8 weights gathered in FP8 (fp8_zero3.py)
            return FP8ZeroStage3(model, optimizer_of([]), grid.dp_cp, fp8_products,
                                 prefetch=not cfg.no_overlap)
        if cfg.zero == 3:  # prefetching the next unit's parameters unless --no-overlap
            working = mixed_precision.parameter_wire(cfg.precision)  # bf16, fp16: gather the 16-bit copy
            return ZeroStage3(model, optimizer_of([]), grid.dp_cp, prefetch=not cfg.no_overlap,
                              working=working)
        stage = {1: ZeroStage1, 2: ZeroStage2}[cfg.zero]
        return stage(model, optimizer_of([]), grid.dp_cp)
    if cfg.zero == 0 and grid.dp_cp.size > 1:
        optimizer = optimizer_of(model.parameters())
        return DistributedDataParallel(model, optimizer, grid.dp_cp, cfg.bucket_mb,
                                       mixed_precision.gradient_all_reduce(cfg.precision, grid.dp_cp),
                                       overlap=not cfg.no_overlap, microbatches=cfg.microbatches)
    return LocalUpdater(model, optimizer_of(model.parameters()))


def build_engine(cfg, grid) -> Engine:
    model = build_model(cfg, grid)
    products = fp8.products_of(cfg, cfg.precision, model)  # fp8: the Linear layers' products
    runner, updater = build_runner(cfg, grid, model), build_updater(cfg, grid, model, fp8_products=products)
    # bf16/fp16: 16-bit working weights and activations over the fp32 masters (and, for fp16, the loss
    # scaled by the scale of the loss scaling at the updater's gradients-ready point)
    runner = mixed_precision.wrap_runner(cfg, model, runner, updater)
    # fp8: the Linear layers' products in FP8, the delayed recipe's amaxes agreed over dp x cp and tp
    runner = fp8.wrap_runner(products, runner, [grid.dp_cp, grid.tp])
    return Engine(cfg, grid, model, runner, updater, loss_scaler_of(updater),
                  routing=routing_of(model) if cfg.model == "moe" else None)


def loss_scaler_of(updater):
    """The fp16 dynamic loss scaler at the updater's gradients-ready point (the checkpoint saves it)."""
    loss_scaling = mixed_precision.loss_scaling_of(updater)
    return loss_scaling.scaler if loss_scaling is not None else None
