"""validate(cfg, world_size): the one place that gathers every check of a TrainConfig.

It runs on every rank before any collective and returns the problems as one-line messages, so a user
mistake ends the job with a clear error and exit code 2 instead of a hang or a traceback. The checks
of one technique are that technique's `config_errors`, which takes the technique's own options
object (parallel/tensor.py's TensorOptions, ...) and the model's where it needs its shape; what is
left here concerns the options together: ranges, choices, the layout against the world size, the
combinations of two techniques that are not built (`_combinations`), and the paths.
Lesson: lessons/12_reliability.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from pathlib import Path

from minipar.checkpoint import sharded as checkpoint
from minipar.core import backend, moe, recompute
from minipar.parallel import context, experts, fsdp, pipeline, sequence, tensor, zero_chunked
from minipar.parallel.schedules import SPLIT_BACKWARD
from minipar.precision import fp8, mixed
from minipar.trainer import trace
from minipar.trainer.build import build_model, build_optimizer, model_config
from minipar.trainer.config import TrainConfig, gradient_transforms


def validate(cfg: TrainConfig, world_size: int) -> list[str]:
    """All the problems with this configuration for this world size, as one-line messages."""
    errors = (_finite(cfg) or _positive(cfg)) + _choices(cfg) + _empty_paths(cfg)
    if errors:
        return errors
    errors = _layout(cfg.resolved(world_size), world_size) + mixed.config_errors(cfg, cfg) + _backend(cfg)
    errors += _fp8(cfg.resolved(world_size)) + _combinations(cfg)
    errors += [e for transform in gradient_transforms() for e in transform.config_errors(cfg)]
    errors = errors or _memory(cfg.resolved(world_size)) or _offload_dir(cfg)
    return errors or _chunked(cfg.resolved(world_size)) or _paths(cfg)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive(cfg: TrainConfig) -> list[str]:
    names = ["steps", "batch_size", "seq_len", "n_layer", "n_head", "d_model", "tp", "pp", "cp",
             "microbatches"]
    errors = [f"{_flag(n)} must be a positive integer, got {getattr(cfg, n)}"
              for n in names if getattr(cfg, n) < 1]
    if cfg.dp is not None and cfg.dp < 1:
        errors.append(f"--dp must be a positive integer, got {cfg.dp}")
    for name in ("save_every", "keep_last"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            errors.append(f"{_flag(name)} must be a positive integer, got {getattr(cfg, name)}")
    if cfg.save_async and not (cfg.save and cfg.save_every):
        errors.append("--save-async needs --save DIR --save-every N (it writes the periodic checkpoints)")
    if cfg.collective_timeout is not None and not cfg.collective_timeout > 0:
        errors.append(f"--collective-timeout must be positive, got {cfg.collective_timeout}")
    if cfg.seed < 0:  # numpy's generators take non-negative seeds only
        errors.append(f"--seed must be a non-negative integer, got {cfg.seed}")
    if not cfg.lr > 0:  # `not >` so that nan is refused too
        errors.append(f"--lr must be positive, got {cfg.lr}")
    if not cfg.weight_decay >= 0:
        errors.append(f"--weight-decay must be at least 0, got {cfg.weight_decay}")
    if not cfg.bucket_mb > 0:
        errors.append(f"--bucket-mb must be positive, got {cfg.bucket_mb}")
    if not 0 <= cfg.momentum < 1:  # 1 and more: the buffer never forgets, and the steps grow without end
        errors.append(f"--momentum must be at least 0 and below 1, got {cfg.momentum}")
    return errors


def _finite(cfg: TrainConfig) -> list[str]:
    """Every float option is a finite number: nan passes no comparison and inf no size."""
    return [f"{_flag(field.name)} must be a finite number, got {getattr(cfg, field.name)}"
            for field in dataclasses.fields(TrainConfig)
            if isinstance(getattr(cfg, field.name), float) and not math.isfinite(getattr(cfg, field.name))]


def _empty_paths(cfg: TrainConfig) -> list[str]:
    """--save '' would save nothing and --resume '' would name the current folder: neither is meant."""
    return [f"{_flag(name)} needs a path, got an empty string" for name in PATH_OPTIONS
            if getattr(cfg, name) is not None and not str(getattr(cfg, name)).strip()]


PATH_OPTIONS = ("log", "save", "resume", "offload_dir")


def _choices(cfg: TrainConfig) -> list[str]:
    """Every field whose metadata lists its choices (config.py), for configurations built in Python."""
    errors = []
    for field in dataclasses.fields(TrainConfig):
        allowed, value = field.metadata.get("choices"), getattr(cfg, field.name)
        if allowed is None or value in allowed:
            continue
        if all(isinstance(choice, int) for choice in allowed):  # --zero must be 0, 1, 2 or 3, got 4
            listed = f"{', '.join(map(str, allowed[:-1]))} or {allowed[-1]}"
            errors.append(f"{_flag(field.name)} must be {listed}, got {value}")
        else:
            errors.append(f"{_flag(field.name)} must be one of {', '.join(allowed)}, got {value!r}")
    return errors


def _layout(cfg: TrainConfig, world_size: int) -> list[str]:
    errors = []
    if cfg.dp * cfg.tp * cfg.pp * cfg.cp != world_size:
        named = f"dp*tp*pp = {cfg.dp}*{cfg.tp}*{cfg.pp}" if cfg.cp == 1 else \
            f"dp*tp*pp*cp = {cfg.dp}*{cfg.tp}*{cfg.pp}*{cfg.cp}"
        errors.append(f"{named} = {cfg.dp * cfg.tp * cfg.pp * cfg.cp} "
                      f"does not match the world size {world_size} (mpiexec -n)")
    if cfg.batch_size % cfg.dp:
        errors.append(f"--batch-size {cfg.batch_size} is not divisible by dp={cfg.dp}")
    elif (cfg.batch_size // cfg.dp) % cfg.microbatches:
        errors.append(f"the per-replica batch {cfg.batch_size // cfg.dp} is not divisible by "
                      f"--microbatches {cfg.microbatches}")
    if cfg.is_gpt and cfg.d_model % cfg.n_head:
        errors.append(f"--d-model {cfg.d_model} is not divisible by --n-head {cfg.n_head}")
    errors += (tensor.config_errors(cfg, cfg) + recompute.config_errors(cfg, cfg.model)
               + sequence.config_errors(cfg, cfg, cfg) + context.config_errors(cfg, cfg)
               + pipeline.config_errors(cfg, cfg) + experts.config_errors(cfg, cfg, cfg, cfg)
               + fsdp.config_errors(cfg, cfg.dp * cfg.cp))
    if cfg.model == "moe":
        errors += moe.config_errors(cfg)
    if cfg.pp > cfg.n_units():
        blocks = f"{cfg.n_layer} layers"
        if cfg.is_gpt:
            blocks = f"embedding, {blocks} and head"
        errors.append(f"--pp {cfg.pp} is more stages than the model's {cfg.n_units()} blocks ({blocks}); "
                      "each stage needs at least one")
    return errors


def _fp8(cfg: TrainConfig) -> list[str]:
    """fp8.config_errors with the shapes it needs: the Linear widths and weight_grad's tokens."""
    tokens = cfg.seq_len // (2 * cfg.cp) if cfg.cp > 1 else \
        cfg.batch_size // (cfg.dp * cfg.microbatches) * cfg.seq_len
    return fp8.config_errors(cfg, cfg.precision, cfg.model, [cfg.d_model, 4 * cfg.d_model], tokens, cfg.tp,
                             cfg.backend)


def _combinations(cfg: TrainConfig) -> list[str]:
    """Two techniques together that are not built, one line each: only the trainer sees both."""
    rules = [
        (cfg.cp > 1 and cfg.sp and cfg.model == "gpt",
         f"--cp {cfg.cp} with --sp: sequence parallelism cuts the sequence over tp with attention of its "
         "own; combining the two splits is not built"),
        (cfg.model == "moe" and cfg.sp,
         "--model moe does not support --sp (routing needs whole sequences on each rank)"),
        (cfg.model == "moe" and cfg.cp > 1,
         "--model moe does not support --cp > 1 yet (experts with --cp are not built)"),
        (cfg.ep > 1 and cfg.chunked,
         f"--ep {cfg.ep} with chunked ZeRO-3 (--offload, --chunk-mb, --device-mem-mb) is not built yet "
         "(use --zero 1, 2 or 3)"),
        (cfg.schedule in SPLIT_BACKWARD and cfg.pp > 1 and (cfg.zero == 3 or cfg.chunked),
         f"--schedule {cfg.schedule} runs with --zero 0, 1 or 2 and no offload or chunks: ZeRO-3 would "
         "have to gather the parameters again for each W step"),
        (cfg.schedule in SPLIT_BACKWARD and cfg.pp > 1 and cfg.recompute == "full",
         f"--schedule {cfg.schedule} with --recompute full: a recomputed block's backward runs as one "
         "operation, so its weight gradients cannot wait for W; use --recompute selective or none"),
        (cfg.precision == "fp8" and cfg.schedule in SPLIT_BACKWARD and cfg.pp > 1,
         f"--precision fp8 with --schedule {cfg.schedule}: a weight gradient's product deferred to W "
         "would run after its layer's FP8 scope has closed; use another schedule"),
        (cfg.fsdp and cfg.zero > 0,
         f"--fsdp with --zero {cfg.zero}: both shard the model states over dp; choose one"),
        (cfg.fsdp and cfg.chunked,
         "--fsdp with --offload, --chunk-mb or --device-mem-mb is not built: FSDP gathers a module's "
         "parameters, not chunks of them; use --zero 3 with those"),
        (cfg.fsdp and cfg.ep > 1,
         f"--fsdp with --ep {cfg.ep} is not built: the experts' parameters are split over ep, and FSDP "
         "shards every parameter over all of dp; use --zero 1, 2 or 3 with --ep"),
        (cfg.fsdp and cfg.precision == "fp8",
         "--fsdp with --precision fp8 is not built: it runs in fp64, fp32, bf16 or fp16"),
        (cfg.fsdp and cfg.schedule in SPLIT_BACKWARD and cfg.pp > 1,
         f"--schedule {cfg.schedule} with --fsdp: FSDP would have to gather the parameters again for each "
         "W step"),
        (cfg.precision == "fp8" and cfg.check_reference and cfg.fp8_accumulate != "fp64",
         "--check-reference with --precision fp8 needs --fp8-accumulate fp64: with fp32 sums a layout "
         "can move a value across an FP8 rounding boundary (1/16 of it), and no tolerance is derived"),
        (cfg.precision == "fp8" and cfg.check_reference and cfg.fp8_recipe == "current",
         "--check-reference with --fp8-recipe current: each rank scales by its own tensor's amax (as "
         "Transformer Engine's current scaling), so another layout quantizes differently"),
    ]
    return [message for broken, message in rules if broken]


def estimated_bytes(cfg: TrainConfig) -> int:
    """A lower bound on the bytes one rank needs: its share of the model states (parameters, gradients
    and two optimizer rows, as if fully sharded) and one micro-batch's activations (a few (T, d) rows
    and the (T, T) attention scores per block, divided by tp). Computed from the options alone, so a
    size that would take hours to allocate is refused at once. MoE: each block's MLP (8d² weights) is
    E of them, and a router of E·d."""
    itemsize = 8 if cfg.precision == "fp64" else 4
    d, layers = cfg.d_model, cfg.n_layer
    if cfg.is_gpt:
        params = layers * 12 * d * d + (2 * 13 + cfg.seq_len) * d
        if cfg.model == "moe":
            params += layers * ((cfg.n_experts - 1) * 8 * d * d + cfg.n_experts * d)
        rows = cfg.batch_size // (cfg.dp * cfg.microbatches) * cfg.seq_len
        activations = layers * rows * (16 * d + 2 * cfg.n_head * cfg.seq_len) // (cfg.tp * cfg.pp)
    else:
        params, activations = layers * d * d, layers * cfg.batch_size * d
    return int(4 * params * itemsize // (cfg.dp * cfg.tp * cfg.pp) + activations * itemsize)


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _memory(cfg: TrainConfig) -> list[str]:
    needed, available = estimated_bytes(cfg), physical_memory_bytes()
    if needed <= available:
        return []
    experts = f" --n-experts {cfg.n_experts}" if cfg.model == "moe" else ""
    return [f"the model and batch need at least {needed / 2**30:,.1f} GiB per rank (--n-layer {cfg.n_layer} "
            f"--d-model {cfg.d_model}{experts} --seq-len {cfg.seq_len} --batch-size {cfg.batch_size}), more "
            f"than this machine's {available / 2**30:,.1f} GiB"]


def _backend(cfg: TrainConfig) -> list[str]:
    """--backend cupy needs CuPy and a GPU on this rank (backend.py); numpy always runs."""
    reason = backend.unavailable(cfg.backend) if cfg.backend == "cupy" else None
    return [reason] if reason else []


def _chunked(cfg: TrainConfig) -> list[str]:
    """--offload / --chunk-mb / --device-mem-mb select chunked ZeRO-3; it checks them on the model's sizes."""
    if not cfg.chunked:
        return []
    errors = zero_chunked.config_errors(cfg)
    if cfg.zero not in (0, 3) or cfg.tp > 1 or cfg.pp > 1:
        errors.append("--offload, --chunk-mb and --device-mem-mb run chunked ZeRO-3 over data parallelism: "
                      "they need --zero 3 (or 0), --tp 1 and --pp 1")
    if cfg.chunk_mb is not None and cfg.chunk_mb * 2**20 > physical_memory_bytes():
        errors.append(f"--chunk-mb {cfg.chunk_mb:g} is more than this machine's memory "
                      f"({physical_memory_bytes() / 2**20:,.0f} MiB)")
    if errors:
        return errors
    replicas = cfg.replace(dp=cfg.dp * cfg.cp, cp=1)  # with --cp it shards over dp x cp (grid.dp_cp)
    # the whole model one rank would gather, built as a plain single-process run builds it (no grid)
    model = build_model(replicas.replace(zero=0, offload="none", chunk_mb=None, device_mem_mb=None), None)
    working = mixed.parameter_wire(cfg.precision)  # bf16, fp16: the gathered 16-bit working copy
    return (zero_chunked.size_errors(cfg, replicas.dp, model, build_optimizer(cfg, []), working)
            or _disk_space(cfg, model))


def _offload_dir(cfg: TrainConfig) -> list[str]:
    if cfg.offload_dir is None:
        return []
    if cfg.offload != "disk":
        return [f"--offload-dir {cfg.offload_dir} needs --offload disk"]
    return _writable("--offload-dir", cfg.offload_dir, Path(cfg.offload_dir))


def _disk_space(cfg: TrainConfig, model) -> list[str]:
    """--offload disk may put every block there: the ranks together need the whole model's states
    (parameters, gradients, two optimizer rows) in the folder, which offload.py also reserves."""
    if cfg.offload != "disk":
        return []
    folder = cfg.offload_dir or tempfile.gettempdir()
    needed = 4 * sum(p.size for p in model.parameters()) * (8 if cfg.precision == "fp64" else 4)
    free = shutil.disk_usage(folder).free
    if needed <= free:
        return []
    return [f"--offload disk needs {needed / 2**20:,.1f} MiB in {folder}, which has {free / 2**20:,.1f} MiB "
            "free (choose another folder with --offload-dir)"]


def _paths(cfg: TrainConfig) -> list[str]:
    """--log, --save and --trace must be writable where they point; --resume must be a checkpoint of
    this model."""
    errors = []
    if cfg.log is not None and Path(cfg.log).is_dir():
        errors.append(f"--log {cfg.log} is a directory, not a file")
    elif cfg.log is not None:
        errors += _writable("--log", cfg.log, Path(cfg.log).parent)  # the log's folder must exist
    if cfg.save is None and (cfg.save_every is not None or cfg.keep_last is not None):
        errors.append("--save-every and --keep-last need --save DIR")
    if cfg.save is not None and Path(cfg.save).exists() and not Path(cfg.save).is_dir():
        errors.append(f"--save {cfg.save} is a file, not a directory")
    elif cfg.save is not None:
        existing = next(p for p in [Path(cfg.save), *Path(cfg.save).absolute().parents] if p.exists())
        errors += _writable("--save", cfg.save, existing)  # missing folders are created
        errors += [problem] if (problem := checkpoint.foreign_manifest(cfg.save)) else []
    errors += trace.config_errors(cfg)  # --trace DIR: writable, and never a trace.json of the user's
    if errors or cfg.resume is None:
        return errors
    return checkpoint.problems(cfg, model_config(cfg))


def _writable(option: str, path: str, folder: Path) -> list[str]:
    if not folder.is_dir():
        return [f"{option} {path}: the folder {folder} does not exist"]
    if not os.access(folder, os.W_OK | os.X_OK):
        return [f"{option} {path}: the folder {folder} is not writable"]
    return []
