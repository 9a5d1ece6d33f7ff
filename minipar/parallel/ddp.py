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

The loss each rank differentiates is already divided by the *global* count (trainer/engine.py), so the
gradients are summed, not averaged: the sum is exactly the single-process gradient, and equals
PyTorch's average of per-rank means when all slices are the same size.
Lesson: lessons/03_data_parallel.md.
"""

from __future__ import annotations

from minipar.core.backend import xp_of
from minipar.core.module import Parameter
from minipar.memory.offload import MiB
from minipar.parallel.api import LocalUpdater
from minipar.parallel.flat_units import check_replicas_identical, unflatten


def plan_buckets(params, bucket_bytes: int) -> list[list[Parameter]]:
    """Group parameters, last first, into buckets of at most `bucket_bytes` and one dtype each.

    A parameter larger than a bucket gets a bucket of its own (as in PyTorch).
    """
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

    def __init__(self, model, optimizer, comm, bucket_mb: float, all_reduce=None):
        super().__init__(model, optimizer)
        check_replicas_identical(model, comm)
        self.comm = comm
        # How a bucket is summed: Comm's all-reduce, or mixed precision's ring on a 16-bit wire.
        self.all_reduce = all_reduce or comm.all_reduce
        self.buckets = plan_buckets(model.parameters(), int(bucket_mb * MiB))
        self.names = {id(p): name for name, p in model.named_parameters()}

    def step(self):
        self.all_reduce_gradients()
        super().step()

    def all_reduce_gradients(self):
        """Replace every gradient by its sum over the replicas, one all-reduce per bucket.

        The summed gradients stay as views into the all-reduced flat buffer (as PyTorch's gradients
        are views into its buckets); the old gradients are dropped before the call so that only one
        bucket's worth of extra memory is ever held.
        """
        for bucket in self.buckets:
            missing = [p for p in bucket if p.grad is None]
            if missing:  # the same on every replica: the graph does not depend on the data
                raise RuntimeError("DistributedDataParallel needs a gradient for every parameter, and "
                                   f"{self.names[id(missing[0])]} got none this step")
            shapes = [p.shape for p in bucket]  # each gradient has its parameter's shape
            flat = flatten([p.grad for p in bucket])
            for p in bucket:
                p.grad = None
            for p, grad in zip(bucket, unflatten(self.all_reduce(flat), shapes)):
                p.grad = grad

    def memory(self) -> dict:
        """LocalUpdater's bytes, plus the one flat bucket copy alive during the all-reduce."""
        largest_bucket = max((sum(p.data.nbytes for p in b) for b in self.buckets), default=0)
        return {**super().memory(), "buffers": largest_bucket}
