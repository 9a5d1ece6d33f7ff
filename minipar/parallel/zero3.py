"""ZeRO stage 3: the parameters are partitioned too, and made whole one unit at a time.

The idea: each rank keeps only its shard of every unit's flat parameters (zero.py explains the flat
buffers and stages 1 and 2). Just before a unit's forward its parameters are all-gathered, and they
are freed as soon as the forward is done (a forward pre-hook and a forward hook on the unit).
Backward gathers them again before the unit's backward operations (a backward pre-hook: the gradient
reached the unit's output) and, once backward is through the unit (stage 2's full backward hook: the
gradient reached its input), reduce-scatters the unit's gradients and frees the parameters again.
The autograd Functions read a weight through `ctx.inputs` at backward time, never a copy, which is
what makes freeing it in between possible. At most one unit is whole at a time: the memory ledger
counts it as "buffers".

What it saves: all model states shrink with N: (p+g+K)Ψ/N bytes per rank.
What it costs: 1.5x DDP's communication. Each step gathers every unit's parameters twice (forward and
backward) and reduce-scatters its gradients once: 3(N-1)/N·Ψ·bytes instead of 2(N-1)/N·Ψ·bytes.
And what it frees it allocates again the next time: cheap only while the allocator keeps freed memory
for reuse (speed/allocator.py's keep_freed_memory; the lesson measures the page faults otherwise).

Prefetch (the default; `--no-overlap` turns it off): as a unit's forward begins, the next unit's
all-gather starts (non-blocking), and as its backward begins, the previous unit's; each is waited for
where that unit needs its parameters, so the gather travels while the current unit computes. The
same gathers, so the same bytes; it costs one more unit held whole (the ledger's "buffers").
Lesson: lessons/04_zero.md.
"""

from __future__ import annotations

from minipar.core.backend import current as current_backend
from minipar.distributed.communicator import PendingCollective
from minipar.memory.ledger import buffer_meter
from minipar.parallel.flat_units import unflatten
from minipar.parallel.zero import ZeroStage2


class ZeroStage3(ZeroStage2):
    """Updater and model wrapper: parameters, gradients and optimizer states all partitioned."""

    def __init__(self, model, optimizer, comm, prefetch: bool = False):
        self.prefetch = prefetch
        self.prefetched: dict[int, PendingCollective] = {}  # unit index -> its all-gather, started
        super().__init__(model, optimizer, comm)
        for unit in self.units:
            unit.param_shard = unit.param_shard.copy()  # this rank's shard outlives the full buffer
            unit.freed = unit.xp.empty(0, dtype=unit.dtype)
            assert unit.flat is not None  # stage 1's constructor made every unit's buffer whole
            buffer_meter.add(unit.flat.nbytes)  # the full parameters built here count as gathered ...
            self.release_params(unit)  # ... and go at once

    def hook_unit(self, unit):
        """Whole parameters for the unit's forward only, and again for its backward."""
        super().hook_unit(unit)  # stage 2's: reduce-scatter the gradients as backward leaves the unit

        index = self.units.index(unit)  # its neighbours are the units computed before and after it

        def gather_for_forward(module, args):
            self.gather_params(unit)
            self.prefetch_unit(index + 1)  # forward goes on to the next unit

        def release_after_forward(module, args, output):
            self.release_params(unit)

        def gather_for_backward(module):  # the backward operations read the weights again
            self.gather_params(unit)
            self.prefetch_unit(index - 1)  # backward goes on to the previous unit

        module = unit.module
        self.hooks += [module.register_forward_pre_hook(gather_for_forward),
                       module.register_forward_hook(release_after_forward),
                       module.register_full_backward_pre_hook(gather_for_backward)]

    def gather_params(self, unit):
        """Make the unit's parameters whole: all-gather every rank's shard into a new flat buffer (or
        wait for the all-gather a prefetch started; its buffer was counted then)."""
        # exercise 04.3: ZeRO-3: gather a unit's parameters, release them
        if unit.flat is not None:
            return  # still whole: the first unit between its backward and the step
        pending = self.prefetched.pop(self.units.index(unit), None)
        if pending is not None:
            unit.flat = pending.wait()
        else:
            unit.flat = self.comm.all_gather(unit.param_shard, numel=unit.padded)
            buffer_meter.add(unit.flat.nbytes)
        unit.point_params_at(unit.flat)
        # end exercise

    def prefetch_unit(self, index: int) -> None:
        """Start gathering unit `index` (when it exists, is not whole, and is not already coming)."""
        if not self.prefetch or not 0 <= index < len(self.units) or index in self.prefetched:
            return
        unit = self.units[index]
        if unit.flat is None:
            self.prefetched[index] = self.comm.iall_gather(unit.param_shard, numel=unit.padded)
            buffer_meter.add(unit.padded * unit.dtype.itemsize)

    def release_params(self, unit):
        """Drop the full parameters: each becomes an empty array (using one by mistake fails loudly)."""
        # exercise 04.3: ZeRO-3: gather a unit's parameters, release them
        if unit.flat is None:
            return
        buffer_meter.release(unit.flat.nbytes)
        unit.flat = None
        for p in unit.params:
            p.data = unit.freed
        # end exercise

    def reduce_scatter_grads(self, unit):
        super().reduce_scatter_grads(unit)
        self.release_params(unit)

    def synchronize_gradients(self):
        """Send the gradients no hook sent; no unit stays whole (nor is still being gathered)."""
        self.reduce_scatter_pending_grads()
        for index in list(self.prefetched):  # a gather no unit used (a schedule that went elsewhere)
            self.prefetched.pop(index).wait()
            buffer_meter.release(self.units[index].padded * self.units[index].dtype.itemsize)
        for unit in self.units:
            self.release_params(unit)

    def apply_optimizer(self):
        """Each rank updates its own shards; nothing is gathered until the next forward needs it."""
        for unit in self.units:
            self.update(unit, unit.grad_shard)

    def params_bytes(self) -> int:
        return sum(u.param_shard.nbytes for u in self.units)

    def local_state(self) -> dict:
        """{name: (tensor-parallel shard or None, full local array)} for Trainer.full_state.

        A collective over the data-parallel ranks (each unit is all-gathered once): every rank calls it.
        """
        to_host = current_backend().to_host
        state = {}
        for unit in self.units:
            flat = self.comm.all_gather(unit.param_shard, numel=unit.padded)
            for name, p, view in zip(unit.names, unit.params, unflatten(flat, unit.shapes)):
                state[name] = (p.shard, to_host(view).copy())
        return state
