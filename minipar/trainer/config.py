"""TrainConfig: every option of `minipar train`, each declared once, with its command-line help.

A field's default, its help and its choices live here; the choices themselves are declared by the
technique that owns them (the schedules in parallel/schedules.py, the formats in precision/formats.py,
...). `cli.train_parser()` is generated from these fields, so the command line cannot drift from the
dataclass. The checks of a configuration are in validate.py. Lesson: lessons/12_reliability.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minipar.core.backend import BACKEND_ENV, BACKEND_NAMES
from minipar.core.nn import MODELS
from minipar.core.optim import OPTIMIZERS
from minipar.core.recompute import RECOMPUTE_MODES
from minipar.memory.offload import OFFLOADS, POLICIES
from minipar.memory.tracer import budget_mb
from minipar.parallel import clipping
from minipar.parallel.schedules import SCHEDULES
from minipar.parallel.zero import STAGES
from minipar.precision.formats import PRECISIONS

_KEEP = object()  # single_process: the reference run keeps this field's value


def option(default, help: str, choices=None, *, command_line: bool = True, env: str | None = None,
           single_process=_KEEP, parse=None, gradient_transform=None):
    """A TrainConfig field with its command-line metadata.

    `choices`: the allowed values (argparse's choices, and validate's). `command_line=False`: a field
    set from Python only, with no flag. `env`: an environment variable the flag falls back to.
    `single_process`: the value the single-process reference run uses instead (a layout option, or
    one about this run's files and output); fields without it (the model, the data, the optimizer,
    the precision) are what the reference must share with the run. `parse`: the function that reads
    the flag's text, where the field's type cannot (a number or a word). `gradient_transform`: the
    module of a transform at the updater's gradients-ready point (parallel/api.py) that this option
    turns on; it has `config_errors(cfg)`, which validate.py gathers, and `attach(cfg, grid, updater)`,
    which build.py calls, so declaring the field is the transform's one registration line.
    """
    metadata = {"help": help, "command_line": command_line}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if env is not None:
        metadata["env"] = env
    if single_process is not _KEEP:
        metadata["single_process"] = single_process
    if parse is not None:
        metadata["parse"] = parse
    if gradient_transform is not None:
        metadata["gradient_transform"] = gradient_transform
    return dataclasses.field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    model: str = option("gpt", "the model: a GPT on digit addition, or an MLP on regression", MODELS)
    dp: int | None = option(None, "data-parallel size (default: world / (tp*pp))", single_process=1)
    tp: int = option(1, "tensor-parallel size", single_process=1)
    pp: int = option(1, "pipeline stages", single_process=1)
    cp: int = option(1, "context-parallel size: the sequence split over cp ranks, attention as a ring "
                     "(parallel/context.py); --dp then defaults to world / (tp*pp*cp)", single_process=1)
    zero: int = option(0, "ZeRO stage", STAGES, single_process=0)
    sp: bool = option(False, "sequence parallelism inside --tp (needs --tp > 1)", single_process=False)
    microbatches: int = option(1, "micro-batches per replica's batch (gradients accumulate over them)",
                               single_process=1)
    schedule: str = option("1f1b", "pipeline schedule (with --pp > 1)", SCHEDULES)
    virtual_stages: int = option(1, "model chunks per pipeline rank (--schedule interleaved: at least 2)",
                                 single_process=1)
    precision: str = option("fp32", "number format of the arithmetic (bf16, fp16: mixed precision)",
                            PRECISIONS)
    loss_scaling: bool = option(True, "fp16: a dynamic loss scaler (precision/mixed.py); False trains "
                                "without (Python only: no flag)", command_line=False)
    offload: str = option("none", "where chunked ZeRO-3 puts blocks past the device budget", OFFLOADS,
                          single_process="none")
    device_mem_mb: float | str | None = option(None, "device budget in MiB for chunked ZeRO-3 (with "
                                               "--offload), or auto: the least the warm-up step needs",
                                               single_process=None, parse=budget_mb)
    chunk_mb: float | None = option(None, "chunk size in MiB for chunked ZeRO-3 (default: least padding)",
                                    single_process=None)
    eviction: str = option("opt", "offload's eviction policy", POLICIES)
    static_placement: bool = option(False, "chunked ZeRO-3: place blocks by the budget alone, without "
                                    "the warm-up step's memory trace", single_process=False)
    offload_dir: str | None = option(None, "folder of --offload disk's files (default: the system's "
                                     "temporary folder); its free space is checked up front",
                                     single_process=None)
    steps: int = option(60, "total steps (a resumed run continues to it)")
    batch_size: int = option(16, "global batch (sequences)")
    seq_len: int = option(32, "tokens per sequence (the GPT's context)")
    lr: float = option(1.5e-3, "learning rate")
    weight_decay: float = option(0.0, "decoupled weight decay (AdamW), L2 penalty (SGD)")
    optimizer: str = option("adamw", "the optimizer", OPTIMIZERS)
    momentum: float = option(0.9, "SGD's momentum (with --optimizer sgd)")
    clip_grad_norm: float | None = option(None, "clip the gradients' global L2 norm to MAX before the step "
                                          "(clip_grad_norm_; logs grad_norm)", gradient_transform=clipping)
    seed: int = option(0, "seed of the initial weights and of the data")
    backend: str = option("numpy", "array backend", BACKEND_NAMES, env=BACKEND_ENV)
    n_layer: int = option(4, "transformer blocks (GPT) or layers (MLP)")
    n_head: int = option(4, "attention heads per block")
    d_model: int = option(64, "width of the residual stream (GPT) or of the hidden layers (MLP)")
    n_experts: int = option(4, "--model moe: experts per block (core/moe.py)")
    top_k: int = option(1, "--model moe: experts each token is routed to")
    capacity_factor: float = option(1.0, "--model moe: an expert takes at most ceil(factor*T*k/E) "
                                    "tokens of each sequence; the rest are dropped in position order")
    aux_loss_coef: float = option(0.01, "--model moe: weight of the load-balancing loss")
    ep: int = option(1, "--model moe: expert parallelism, the experts split over blocks of ep dp ranks "
                     "(parallel/experts.py)", single_process=1)
    bucket_mb: float = option(0.25, "DDP gradient bucket size")
    no_overlap: bool = option(False, "DDP sums each bucket blocking at the step, instead of starting its "
                              "all-reduce in backward as soon as it is ready (parallel/ddp.py), and "
                              "ZeRO-3 gathers each unit when it needs it, without prefetching the next")
    recompute: str = option("none", "activations recomputed in backward instead of kept: the attention "
                            "cores (selective) or whole blocks (full)", RECOMPUTE_MODES,
                            single_process="none")
    fused: bool = option(False, "AdamW and GELU through the fusion interpreter")
    log: str | None = option(None, "JSON-lines log written by rank 0", single_process=None)
    save: str | None = option(None, "checkpoint directory written at the end", single_process=None)
    save_every: int | None = option(None, "with --save: also save after every N-th step",
                                    single_process=None)
    keep_last: int | None = option(None, "with --save: keep the K newest checkpoints (default: 1)",
                                   single_process=None)
    resume: str | None = option(None, "checkpoint directory to continue from", single_process=None)
    allow_changes: bool = option(False, "--resume with another --lr, --weight-decay, --batch-size, "
                                 "--momentum (sgd) or --aux-loss-coef (moe) "
                                 "than the checkpoint's (logged)", single_process=False)
    collective_timeout: float | None = option(None, "seconds a rank may wait in one collective or "
                                              "pipeline receive before the job ends (the watchdog; "
                                              "default: $MINIPAR_COLLECTIVE_TIMEOUT if set, else 600)",
                                              single_process=None)
    check_reference: bool = option(False, "also train on one process (rank 0) and compare: PASS or FAIL "
                                   "(exit 1) over steps 1..min(20, steps), then the drift",
                                   single_process=False)
    quiet: bool = option(False, "no progress lines or summary from rank 0 (errors still print)",
                         single_process=True)

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def single_process(self) -> TrainConfig:
        """The same training on one process (--check-reference's reference run): every field that
        declares a `single_process` value takes it; the model, data, optimizer and precision stay."""
        return self.replace(**{f.name: f.metadata["single_process"] for f in dataclasses.fields(self)
                               if "single_process" in f.metadata})

    def resolved(self, world_size: int) -> TrainConfig:
        """Fill in dp (world size / (tp * pp * cp)) when it was left out."""
        if self.dp is not None:
            return self
        return self.replace(dp=max(1, world_size // max(1, self.tp * self.pp * self.cp)))

    @property
    def dtype(self) -> str:
        return "float64" if self.precision == "fp64" else "float32"

    def n_units(self) -> int:
        """Pipeline units of the model: embedding + blocks + head for the GPT, layers for the MLP."""
        return self.n_layer + 2 if self.is_gpt else self.n_layer

    @property
    def is_gpt(self) -> bool:
        """A GPT on token data: dense (gpt) or mixture of experts (moe)."""
        return self.model in ("gpt", "moe")


def gradient_transforms() -> list:
    """The modules of the options that declare a gradient transform, in the order of the fields."""
    return [f.metadata["gradient_transform"] for f in dataclasses.fields(TrainConfig)
            if "gradient_transform" in f.metadata]
