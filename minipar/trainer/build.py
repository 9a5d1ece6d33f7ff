"""Build the engine of one rank for any layout: TP inside a stage, PP across stages, DP (or ZeRO)
across replicas of the pipeline.

The process grid (comm.ProcessGrid) puts tp fastest-varying, so tensor-parallel ranks are neighbours
("TP inside a node"), then pp, then dp. Each technique contributes one part of the engine:
tensor.py the layers of the model, pipeline.py which units a stage keeps and how micro-batches flow,
data.py / zero.py how gradients are combined across replicas. Lesson: lessons/07_3d.md.
"""

from __future__ import annotations

from minipar.core import optim
from minipar.core.nn import GPT, GPTConfig, MLPConfig, MLPNet
from minipar.fusion import training as fused_training
from minipar.parallel import pipeline
from minipar.parallel.ddp import DistributedDataParallel
from minipar.parallel.tensor_gpt import TensorParallelGPT
from minipar.parallel.zero import ZeroStage1, ZeroStage2
from minipar.parallel.zero3 import ZeroStage3
from minipar.parallel.zero_chunked import build_chunked_zero3
from minipar.precision import mixed as mixed_precision
from minipar.trainer.engine import Engine, LocalUpdater, MicrobatchRunner
from minipar.trainer.tasks import AdditionTask


def model_config(cfg):
    if cfg.model == "gpt":
        return GPTConfig(vocab_size=AdditionTask.vocab_size, block_size=cfg.seq_len, n_layer=cfg.n_layer,
                         n_head=cfg.n_head, d_model=cfg.d_model, dtype=cfg.dtype)
    return MLPConfig(d_hidden=cfg.d_model, n_layer=cfg.n_layer, dtype=cfg.dtype)


def build_model(cfg, grid):
    """The parameters this rank holds, initialised from (seed, name) whatever the layout."""
    mcfg = model_config(cfg)
    if cfg.tp > 1:  # Megatron tensor parallelism, GPT only (config.validate)
        model = TensorParallelGPT(mcfg, grid.tp, seed=None)
    else:
        model = GPT(mcfg, seed=None) if cfg.model == "gpt" else MLPNet(mcfg, seed=None)
    if cfg.pp > 1:  # keep this stage's units only, under their global names
        model = pipeline.build_stage(model, grid.pp.size, grid.pp_rank)
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
    if cfg.pp > 1:
        return pipeline.PipelineRunner(model, grid.pp, cfg.schedule, cfg.microbatches, cfg.d_model, cfg.dtype)
    return MicrobatchRunner(model, cfg.microbatches)


def build_updater(cfg, grid, model, scaler=None):
    def optimizer_of(params):  # fp16: inside a loss-scaling optimizer (`scaler`, or PyTorch's defaults)
        return mixed_precision.loss_scaling_optimizer(cfg, build_optimizer(cfg, params), grid.world, scaler)

    if cfg.offload != "none" or cfg.chunk_mb is not None or cfg.device_mem_mb is not None:
        return build_chunked_zero3(cfg, grid, model, optimizer_of([]))  # chunked_zero.py
    if cfg.zero:  # ZeRO partitions the model states over the data-parallel ranks (zero.py, zero3.py)
        stage = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}[cfg.zero]
        return stage(model, optimizer_of([]), grid.dp)
    if cfg.zero == 0 and grid.dp.size > 1:
        optimizer = optimizer_of(model.parameters())
        return DistributedDataParallel(model, optimizer, grid.dp, cfg.bucket_mb,
                                       mixed_precision.gradient_all_reduce(cfg.precision, grid.dp))
    return LocalUpdater(model, optimizer_of(model.parameters()))


def build_engine(cfg, grid) -> Engine:
    model = build_model(cfg, grid)
    runner, updater = build_runner(cfg, grid, model), build_updater(cfg, grid, model)
    # bf16/fp16: 16-bit working weights and activations over the fp32 masters (and, for fp16, the loss
    # scaled by the updater's loss-scaling optimizer)
    runner = mixed_precision.wrap_runner(cfg, model, runner, updater.optimizer)
    return Engine(cfg, grid, model, runner, updater)
