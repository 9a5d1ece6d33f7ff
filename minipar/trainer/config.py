"""TrainConfig: every option of `minipar train`, and the one place where they are checked.

`validate` runs on every rank before any collective and returns the problems as one-line messages, so
a user mistake ends the job with a clear error and exit code 2 instead of a hang or a traceback.
Lesson: lessons/12_reliability.md.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from minipar.core import backend

MODELS = ("gpt", "mlp")
SCHEDULES = ("naive", "gpipe", "1f1b")
PRECISIONS = ("fp64", "fp32", "bf16", "fp16")
OFFLOADS = ("none", "cpu", "disk")
BACKENDS = ("numpy", "cupy")
EVICTIONS = ("lru", "opt")


@dataclass
class TrainConfig:
    model: str = "gpt"
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    precision: str = "fp32"
    loss_scaling: bool = True  # fp16: a dynamic loss scaler (mixed_precision.py); False trains without
    offload: str = "none"
    device_mem_mb: float | None = None
    chunk_mb: float | None = None
    eviction: str = "opt"  # which block offload evicts: "lru" or "opt" (memory/offload.py)
    steps: int = 60
    batch_size: int = 16
    seq_len: int = 32
    lr: float = 1.5e-3
    weight_decay: float = 0.0
    optimizer: str = "adamw"
    seed: int = 0
    backend: str = "numpy"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64
    bucket_mb: float = 0.25
    fused: bool = False
    log: str | None = None
    save: str | None = None
    resume: str | None = None
    check_reference: bool = False
    quiet: bool = False

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def resolved(self, world_size: int) -> TrainConfig:
        """Fill in dp (world size / (tp * pp)) when it was left out."""
        if self.dp is not None:
            return self
        return self.replace(dp=max(1, world_size // max(1, self.tp * self.pp)))

    @property
    def dtype(self) -> str:
        return "float64" if self.precision == "fp64" else "float32"

    def n_units(self) -> int:
        """Pipeline units of the model: embedding + blocks + head for the GPT, layers for the MLP."""
        return self.n_layer + 2 if self.model == "gpt" else self.n_layer


def _positive(cfg: TrainConfig) -> list[str]:
    names = ["steps", "batch_size", "seq_len", "n_layer", "n_head", "d_model", "tp", "pp", "microbatches"]
    errors = [f"--{n.replace('_', '-')} must be a positive integer, got {getattr(cfg, n)}"
              for n in names if getattr(cfg, n) < 1]
    if cfg.dp is not None and cfg.dp < 1:
        errors.append(f"--dp must be a positive integer, got {cfg.dp}")
    if cfg.lr <= 0:
        errors.append(f"--lr must be positive, got {cfg.lr}")
    if cfg.bucket_mb <= 0:
        errors.append(f"--bucket-mb must be positive, got {cfg.bucket_mb}")
    return errors


def _choices(cfg: TrainConfig) -> list[str]:
    errors = []
    for name, allowed in [("model", MODELS), ("schedule", SCHEDULES), ("precision", PRECISIONS),
                          ("offload", OFFLOADS), ("backend", BACKENDS), ("optimizer", ("adamw", "sgd")),
                          ("eviction", EVICTIONS)]:
        if getattr(cfg, name) not in allowed:
            errors.append(f"--{name} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}")
    if cfg.zero not in (0, 1, 2, 3):
        errors.append(f"--zero must be 0, 1, 2 or 3, got {cfg.zero}")
    return errors


def _layout(cfg: TrainConfig, world_size: int) -> list[str]:
    errors = []
    if cfg.dp * cfg.tp * cfg.pp != world_size:
        errors.append(f"dp*tp*pp = {cfg.dp}*{cfg.tp}*{cfg.pp} = {cfg.dp * cfg.tp * cfg.pp} "
                      f"does not match the world size {world_size} (mpiexec -n)")
    if cfg.batch_size % cfg.dp:
        errors.append(f"--batch-size {cfg.batch_size} is not divisible by dp={cfg.dp}")
    elif (cfg.batch_size // cfg.dp) % cfg.microbatches:
        errors.append(f"the per-replica batch {cfg.batch_size // cfg.dp} is not divisible by "
                      f"--microbatches {cfg.microbatches}")
    if cfg.model == "gpt":
        if cfg.d_model % cfg.n_head:
            errors.append(f"--d-model {cfg.d_model} is not divisible by --n-head {cfg.n_head}")
        if cfg.n_head % cfg.tp:
            errors.append(f"--tp {cfg.tp} does not divide --n-head {cfg.n_head}: "
                          "each tensor-parallel rank must own whole attention heads")
    elif cfg.tp > 1:
        # MLPNet's layers are separate pipeline units; Megatron's column/row pairing would leave a
        # split activation at a unit boundary, so tensor parallelism is kept to the GPT.
        errors.append(f"--tp {cfg.tp} needs --model gpt (tensor parallelism splits the GPT's layers)")
    if cfg.pp > cfg.n_units():
        blocks = f"{cfg.n_layer} layers"
        if cfg.model == "gpt":
            blocks = f"embedding, {blocks} and head"
        errors.append(f"--pp {cfg.pp} is more stages than the model's {cfg.n_units()} blocks ({blocks}); "
                      "each stage needs at least one")
    return errors


def _precision(cfg: TrainConfig) -> list[str]:
    """What mixed precision (bf16, fp16) composes with: see minipar/precision/mixed.py."""
    if cfg.precision not in ("bf16", "fp16"):
        return []
    errors = []
    if cfg.backend != "numpy":
        errors.append(f"--precision {cfg.precision} emulates the 16-bit format in NumPy: use --backend numpy")
    chunked = cfg.offload != "none" or cfg.chunk_mb is not None or cfg.device_mem_mb is not None
    if cfg.zero == 3 or chunked:
        errors.append(f"--precision {cfg.precision} does not support --zero 3 or chunked offload: they "
                      "gather the fp32 parameters during forward, after the 16-bit working copy is made")
    elif cfg.precision == "fp16" and cfg.loss_scaling and cfg.zero:
        errors.append(f"--precision fp16 with --zero {cfg.zero}: the loss scaler checks all gradients "
                      "before one optimizer step, and ZeRO updates shard by shard; use bf16 or --zero 0")
    return errors


def _backend(cfg: TrainConfig) -> list[str]:
    """--backend cupy needs CuPy and a GPU on this rank (backend.py); numpy always runs."""
    reason = backend.unavailable(cfg.backend) if cfg.backend == "cupy" else None
    return [reason] if reason else []


def validate(cfg: TrainConfig, world_size: int) -> list[str]:
    """All the problems with this configuration for this world size, as one-line messages."""
    errors = _positive(cfg) + _choices(cfg)
    if errors:
        return errors
    errors = _layout(cfg.resolved(world_size), world_size) + _precision(cfg) + _backend(cfg)
    return errors or _chunked(cfg.resolved(world_size)) or _paths(cfg)


def _chunked(cfg: TrainConfig) -> list[str]:
    """--offload / --chunk-mb / --device-mem-mb select chunked ZeRO-3; it checks them on the model's sizes."""
    if cfg.offload == "none" and cfg.chunk_mb is None and cfg.device_mem_mb is None:
        return []
    from minipar.parallel.zero_chunked import config_errors

    return config_errors(cfg)


def _paths(cfg: TrainConfig) -> list[str]:
    """--log and --save must be writable where they point; --resume must be a checkpoint of this model."""
    errors = []
    if cfg.log is not None and Path(cfg.log).is_dir():
        errors.append(f"--log {cfg.log} is a directory, not a file")
    elif cfg.log is not None:
        errors += _writable("--log", cfg.log, Path(cfg.log).parent)  # the log's folder must exist
    if cfg.save is not None and Path(cfg.save).exists() and not Path(cfg.save).is_dir():
        errors.append(f"--save {cfg.save} is a file, not a directory")
    elif cfg.save is not None:
        existing = next(p for p in [Path(cfg.save), *Path(cfg.save).absolute().parents] if p.exists())
        errors += _writable("--save", cfg.save, existing)  # missing folders are created
    if errors or cfg.resume is None:
        return errors
    from minipar.checkpoint import sharded as checkpoint
    from minipar.trainer.build import model_config

    return checkpoint.problems(cfg, model_config(cfg))


def _writable(option: str, path: str, folder: Path) -> list[str]:
    if not folder.is_dir():
        return [f"{option} {path}: the folder {folder} does not exist"]
    if not os.access(folder, os.W_OK | os.X_OK):
        return [f"{option} {path}: the folder {folder} is not writable"]
    return []
