"""TrainConfig: every option of `minipar train`, composed of the techniques' own options objects.

Each technique declares the options it reads beside its code, as a small dataclass whose fields carry
their default, help and choices (core/options.py's `option`): TensorOptions in parallel/tensor.py,
PipelineOptions in parallel/pipeline.py, and so on. Its checks and builders take that object only, so
a technique is checked and built without the trainer. TrainConfig inherits from all of them and adds
the options of the run itself (RunOptions below): a TrainConfig *is* a TensorOptions, and the trainer
passes itself wherever a technique asks for its options. `cli.train_parser()` is generated from these
fields, one `--help` section per options object, so the command line cannot drift from the code. The
checks of a configuration are in validate.py. Lesson: lessons/12_reliability.md.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

from minipar.core.backend import BackendOptions
from minipar.core.moe import MoEOptions
from minipar.core.nn import ModelOptions
from minipar.core.optim import OptimizerOptions
from minipar.core.options import option
from minipar.core.recompute import RecomputeOptions
from minipar.fusion.training import FusionOptions
from minipar.parallel.clipping import ClippingOptions
from minipar.parallel.context import ContextOptions
from minipar.parallel.ddp import DataParallelOptions
from minipar.parallel.experts import ExpertOptions
from minipar.parallel.fsdp import FSDPOptions
from minipar.parallel.pipeline import PipelineOptions
from minipar.parallel.sequence import SequenceOptions
from minipar.parallel.tensor import TensorOptions
from minipar.parallel.zero import ZeroOptions
from minipar.parallel.zero_chunked import ChunkedOptions
from minipar.precision.fp8 import FP8Options
from minipar.precision.mixed import PrecisionOptions
from minipar.trainer.trace import TraceOptions


@dataclass
class RunOptions:
    """This run: its length, data, files and output (trainer/)."""
    steps: int = option(60, "total steps (a resumed run continues to it)")
    batch_size: int = option(16, "global batch (sequences)")
    seed: int = option(0, "seed of the initial weights and of the data")
    log: str | None = option(None, "JSON-lines log written by rank 0", single_process=None)
    save: str | None = option(None, "checkpoint directory written at the end", single_process=None)
    save_every: int | None = option(None, "with --save: also save after every N-th step",
                                    single_process=None)
    keep_last: int | None = option(None, "with --save: keep the K newest checkpoints (default: 1)",
                                   single_process=None)
    save_async: bool = option(False, "with --save-every: write each periodic checkpoint from a thread "
                              "while training goes on; committed at a later step boundary",
                              single_process=False)
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


# The options objects TrainConfig is made of, in the order `minipar train --help` lists them.
OPTION_GROUPS = (ModelOptions, MoEOptions, DataParallelOptions, TensorOptions, SequenceOptions,
                 PipelineOptions, ContextOptions, ExpertOptions, ZeroOptions, FSDPOptions, ChunkedOptions,
                 RecomputeOptions, PrecisionOptions, FP8Options, FusionOptions, OptimizerOptions,
                 ClippingOptions, BackendOptions, RunOptions, TraceOptions)


# The bases are OPTION_GROUPS backwards: a dataclass takes its bases' fields from the last base to the
# first, so the fields come in OPTION_GROUPS' order.
@dataclass
class TrainConfig(TraceOptions, RunOptions, BackendOptions, ClippingOptions, OptimizerOptions,
                  FusionOptions, FP8Options, PrecisionOptions, RecomputeOptions, ChunkedOptions,
                  FSDPOptions, ZeroOptions, ExpertOptions, ContextOptions, PipelineOptions,
                  SequenceOptions, TensorOptions, DataParallelOptions, MoEOptions, ModelOptions):
    """Every option of `minipar train`: the techniques' options objects and the run's own."""

    @property
    def dtype(self) -> str:
        """The arrays' dtype (PrecisionOptions.dtype), and float64 for fp8 accumulating in fp64."""
        fp64 = self.precision == "fp64" or (self.precision == "fp8" and self.fp8_accumulate == "fp64")
        return "float64" if fp64 else "float32"

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


def gradient_transforms() -> list:
    """The modules of the options that declare a gradient transform, in the order of the fields."""
    return [importlib.import_module(f.metadata["gradient_transform"]) for f in dataclasses.fields(TrainConfig)
            if "gradient_transform" in f.metadata]
