"""DistributedDataParallel: replicate the model, split the batch, sum the gradients in buckets.

The idea: every data-parallel rank holds the whole model (checked identical at the start, not
assumed), runs forward and backward on its own fixed slice of the global batch, and then the ranks
all-reduce their gradients, so that each holds the gradient of the whole batch. Every rank then
takes the same optimizer step and the replicas stay identical without ever sending a weight.
Gradients are flattened into buckets of at most `bucket_mb` MiB, filled in reverse parameter order
(the order backward produces them, as in PyTorch's DDP), one all-reduce per bucket: fewer, larger
messages, each paying the per-message latency once instead of once per parameter.

What it saves: time. Each rank computes 1/N of the batch.
What it costs: memory and communication. Every rank keeps a full copy of params, grads and optimizer
state, and sends 2(N-1)/N x the gradient bytes per step (ring all-reduce), however many
micro-batches it accumulates first: the all-reduce runs once, after the last one.

Overlap (the default; `--no-overlap` turns it off): a bucket's all-reduce starts, non-blocking, as
soon as backward has produced the bucket's final gradients (the full backward hooks of the model's
units, on the last micro-batch), so the rest of backward computes while it travels; the step waits
once for all of them. MPI makes progress only inside MPI calls, so every unit's hook also polls the
buckets in flight (Test()); MPICH's own progress thread (MPIR_CVAR_ASYNC_PROGRESS=1) is the other
way, measured in lesson 03. Same bytes, same messages, same sums: only the waiting changes (the log's
`comm_wait_s`). A bucket whose gradients changed after it started (a parameter used again later) is
summed again, blocking, at the step: exact whatever the graph.

The loss each rank differentiates is already divided by the *global* count (trainer/engine.py), so the
gradients are summed, not averaged: the sum is exactly the single-process gradient, and equals
PyTorch's average of per-rank means when all slices are the same size.
Lesson: lessons/03_data_parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minipar.core.backend import xp_of
from minipar.core.hooks import RemovableHandle
from minipar.core.module import Parameter
from minipar.core.options import option
from minipar.distributed.communicator import PendingCollective
from minipar.memory.offload import MiB
from minipar.parallel.api import LocalUpdater
from minipar.parallel.flat_units import check_replicas_identical, unflatten


@dataclass
class DataParallelOptions:
    """Data parallelism (parallel/ddp.py) and overlap."""
    dp: int | None = option(None, "data-parallel size (default: world / (tp*pp))", single_process=1)
    bucket_mb: float = option(0.25, "DDP gradient bucket size")
    no_overlap: bool = option(False, "DDP sums each bucket blocking at the step, instead of starting its "
                              "all-reduce in backward as soon as it is ready (parallel/ddp.py), and "
                              "ZeRO-3 gathers each unit when it needs it, without prefetching the next")


def plan_buckets(params, bucket_bytes: int) -> list[list[Parameter]]:
    """Group parameters, last first, into buckets of at most `bucket_bytes` and one dtype each.

    A parameter larger than a bucket gets a bucket of its own (as in PyTorch).
    """
    # exercise 03.1: buckets: parameters grouped last first under a cap
    buckets: list[list[Parameter]] = []
    current: list[Parameter] = []  # the bucket being filled
    current_bytes = 0
    for p in reversed(list(params)):
        full = current_bytes + p.data.nbytes > bucket_bytes
        if current and (full or p.data.dtype != current[0].data.dtype):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += p.data.nbytes
    if current:
        buckets.append(current)
    return buckets
    # end exercise


def named_units(model) -> list:
    """(name, module) of the model's units in execution order (the GPT's embedding, blocks and head;
    the MLP's layers; a pipeline stage's own): backward is done with a unit at its full backward hook."""
    return model.units()


def flatten(arrays):
    """One contiguous 1-D array holding the arrays one after another."""
    return xp_of(arrays[0]).concatenate([a.reshape(-1) for a in arrays])


class DistributedDataParallel(LocalUpdater):
    """Updater: sum the gradients over `comm` (the dp communicator) bucket by bucket, then step.

    PyTorch's DDP wraps the module and starts each bucket's all-reduce from backward hooks; here the
    engine runs forward and backward (over all micro-batches) and this class does the rest. It works
    on whatever parameters this rank's model holds, so it composes with tensor and pipeline
    parallelism: each (pp, tp) position all-reduces its own parameters with its dp replicas.
    """

    def __init__(self, model, optimizer, comm, bucket_mb: float, all_reduce=None, overlap: bool = False,
                 microbatches: int = 1):
        super().__init__(model, optimizer)
        check_replicas_identical(model, comm)
        self.comm = comm
        # How a bucket is summed: Comm's all-reduce, or mixed precision's ring on a 16-bit wire.
        self.all_reduce = all_reduce or comm.all_reduce
        self.buckets = plan_buckets(model.parameters(), int(bucket_mb * MiB))
        self.names = {id(p): name for name, p in model.named_parameters()}
        # the 16-bit ring is a sequence of blocking sendrecvs: nothing to start early
        self.overlap = overlap and all_reduce is None
        self.hooks: list[RemovableHandle] = []  # removing them detaches the overlap
        self.in_flight: dict[int, PendingCollective] = {}  # bucket index -> its all-reduce, started
        self.started_in_backward = 0  # buckets of the last step whose all-reduce backward started
        if self.overlap:
            self.hook_units(microbatches)

    def hook_units(self, microbatches: int) -> None:
        """A full backward hook on every unit: on the unit's `microbatches`-th backward of the step its
        gradients are final; every bucket whose units are all final then starts its all-reduce."""
        unit_of = {id(p): name for name, unit in named_units(self.model) for p in unit.parameters()}
        self.bucket_units = [{unit_of.get(id(p)) for p in bucket} for bucket in self.buckets]
        self.backwards: dict[str, int] = {}  # unit -> backwards seen this step
        self.final: set[str | None] = set()
        self.microbatches = microbatches
        for name, unit in named_units(self.model):
            self.hooks.append(unit.register_full_backward_hook(self.unit_done_hook(name)))

    def unit_done_hook(self, name: str):
        def unit_done(module):
            self.backwards[name] = self.backwards.get(name, 0) + 1
            if self.backwards[name] == self.microbatches:
                self.final.add(name)
                self.start_ready_buckets()
            for pending in self.in_flight.values():  # progress for the buckets already travelling
                pending.test()
        return unit_done

    def start_ready_buckets(self) -> None:
        """Start the all-reduce of every bucket not yet started whose units are all final, in bucket
        order (the same on every replica: the graph does not depend on the data). The gradients are
        dropped once flattened, as in the blocking sum, so the flat copy takes their place."""
        for index, bucket in enumerate(self.buckets):
            if index not in self.in_flight and self.bucket_units[index] <= self.final:
                if any(p.grad is None for p in bucket):
                    # A parameter used through a Function of its own (sequence parallelism's
                    # replicated LayerNorm weights) may get its gradient after the unit's input hook:
                    # the step sums that bucket. The graph is the same on every replica, so is this.
                    continue
                flat = flatten(self.gradients_of(bucket))
                for p in bucket:
                    p.grad = None
                self.in_flight[index] = self.comm.iall_reduce(flat)

    def synchronize_gradients(self):
        if self.overlap:
            self.finish_overlapped()
        else:
            self.all_reduce_gradients()

    def ready_gradients(self):
        """Every replica holds the same summed gradients: dp rank 0's count (GradientPiece.counted)."""
        return [replace(piece, counted=self.comm.rank == 0) for piece in super().ready_gradients()]

    def gradients_of(self, bucket) -> list:
        missing = [p for p in bucket if p.grad is None]
        if missing:  # the same on every replica: the graph does not depend on the data
            raise RuntimeError("DistributedDataParallel needs a gradient for every parameter, and "
                               f"{self.names[id(missing[0])]} got none this step")
        return [p.grad for p in bucket]

    def finish_overlapped(self) -> None:
        """Wait once for the buckets in flight; sum the rest (units no hook caught, such as the first,
        whose input needs no gradient) now, blocking."""
        self.started_in_backward = len(self.in_flight)
        for index, bucket in enumerate(self.buckets):
            pending = self.in_flight.pop(index, None)
            if pending is None:
                self.all_reduce_bucket(bucket)
                continue
            summed = pending.wait()
            if any(p.grad is not None for p in bucket):  # a gradient grew after the start: add its sum
                late = [p.grad if p.grad is not None else xp_of(summed).zeros(p.shape, summed.dtype)
                        for p in bucket]
                summed = summed + self.all_reduce(flatten(late))
            for p, grad in zip(bucket, unflatten(summed, [p.shape for p in bucket])):
                p.grad = grad
        self.backwards.clear()
        self.final.clear()

    def all_reduce_gradients(self):
        """Replace every gradient by its sum over the replicas, one all-reduce per bucket.

        The summed gradients stay as views into the all-reduced flat buffer (as PyTorch's gradients
        are views into its buckets); the old gradients are dropped before the call so that only one
        bucket's worth of extra memory is ever held.
        """
        for bucket in self.buckets:
            self.all_reduce_bucket(bucket)

    def all_reduce_bucket(self, bucket) -> None:
        # exercise 03.2: the bucketed all-reduce of the gradients
        shapes = [p.shape for p in bucket]  # each gradient has its parameter's shape
        flat = flatten(self.gradients_of(bucket))
        for p in bucket:
            p.grad = None
        for p, grad in zip(bucket, unflatten(self.all_reduce(flat), shapes)):
            p.grad = grad
        # end exercise

    def memory(self) -> dict:
        """LocalUpdater's bytes, plus the flat bucket copies alive during the all-reduces: the largest
        one when blocking, every one when they overlap backward (all may be in flight at the step)."""
        sizes = [sum(p.data.nbytes for p in b) for b in self.buckets]
        return {**super().memory(), "buffers": sum(sizes) if self.overlap else max(sizes, default=0)}
