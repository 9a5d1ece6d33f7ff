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

In bf16 or fp16 (`working`: precision/mixed.py's `parameter_wire`) each rank keeps its fp32 master
shard and, beside it, that shard rounded to the 16-bit format (2-byte patterns), made again after every
update; the gathers send those, so the parameter all-gathers cost half of fp32's bytes, and the unit
made whole is the 16-bit working copy (DeepSpeed's bf16 ZeRO-3). Rounding is elementwise, so rounding
each shard and then gathering gives the bits that gathering and then rounding would (the working copy
of the single-process run). The gradients are reduce-scattered in fp32, as at stages 1 and 2. Per
parameter a rank holds 2/N bytes of 16-bit shard, 4/N of fp32 gradients and 4/N + K/N of master and
optimizer states (the planner's formula with p = 2, g = 4 and the master counted in K), and the ledger
counts a gathered unit at 2 bytes per value: what came over the wire, and what a device would hold
(NumPy computes from its decoding into float32 arrays, as it holds every 16-bit value).
In FP8 (precision/fp8_zero3.py, a subclass) the FP8 Linear weights travel as 1-byte values plus their
scales, each rank's message a different size (`gathered_counts`).
Lesson: lessons/04_zero.md.
"""

from __future__ import annotations

from minipar.core.backend import Array
from minipar.core.backend import current as current_backend
from minipar.core.shards import shard_sizes
from minipar.distributed.collectives import Wire
from minipar.distributed.communicator import PendingCollective
from minipar.memory.ledger import buffer_meter
from minipar.parallel.flat_units import unflatten
from minipar.parallel.zero import ZeroStage2


class ZeroStage3(ZeroStage2):
    """Updater and model wrapper: parameters, gradients and optimizer states all partitioned."""

    gathers_parameters = True

    def __init__(self, model, optimizer, comm, prefetch: bool = False, working: Wire | None = None):
        """working: how a shard becomes the 16-bit working copy that is gathered (encode, to 2-byte
        patterns) and back (decode); None: the parameters themselves are gathered."""
        self.prefetch, self.working = prefetch, working
        self.prefetched: dict[int, PendingCollective] = {}  # unit index -> its all-gather, started
        self.working_shards: dict[int, Array] = {}  # unit index -> its rounded shard (16-bit only)
        super().__init__(model, optimizer, comm)
        for unit in self.units:
            unit.param_shard = unit.param_shard.copy()  # this rank's shard outlives the full buffer
            unit.freed = unit.xp.empty(0, dtype=unit.dtype)
            self.round_shard(unit)
            assert unit.flat is not None  # stage 1's constructor made every unit's buffer whole
            buffer_meter.add(self.gathered_nbytes(unit))  # the full parameters built here count as
            self.release_params(unit)  # gathered, and go at once

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

    def round_shard(self, unit) -> None:
        """In 16 bits, this rank's shard as the working copy is made of: its master shard rounded, on
        the rank that owns it, once per update (rounding is elementwise: the same bits as rounding the
        gathered parameters)."""
        if self.working is not None:
            self.working_shards[self.units.index(unit)] = self.working.encode(unit.param_shard)

    def gathered_shard(self, unit):
        """What this rank sends when a unit is gathered: its 16-bit shard, or its parameter shard."""
        if self.working is None:
            return unit.param_shard
        return self.working_shards[self.units.index(unit)]

    def gathered_nbytes(self, unit) -> int:
        """The bytes of a unit made whole: the elements times the gathered format's bytes."""
        return unit.padded * self.gathered_shard(unit).itemsize

    def gathered_counts(self, unit) -> list[int]:
        """Every rank's number of elements in the unit's all-gather: its shard's (precision/fp8_zero3.py:
        the bytes of its shard's message, which differ by rank)."""
        return shard_sizes(unit.padded, self.comm.size)

    def whole(self, gathered, unit):
        """The unit's flat parameters the model computes with, from what the all-gather brought."""
        return gathered if self.working is None else self.working.decode(gathered)

    def gather_params(self, unit):
        """Make the unit's parameters whole: all-gather every rank's shard into a new flat buffer (or
        wait for the all-gather a prefetch started; its buffer was counted then)."""
        # exercise 04.3: ZeRO-3: gather a unit's parameters, release them
        if unit.flat is not None:
            return  # still whole: the first unit between its backward and the step
        pending = self.prefetched.pop(self.units.index(unit), None)
        if pending is not None:
            unit.flat = self.whole(pending.wait(), unit)
        else:
            gathered = self.comm.all_gather(self.gathered_shard(unit), counts=self.gathered_counts(unit))
            unit.flat = self.whole(gathered, unit)
            buffer_meter.add(self.gathered_nbytes(unit))
        unit.point_params_at(unit.flat)
        # end exercise

    def prefetch_unit(self, index: int) -> None:
        """Start gathering unit `index` (when it exists, is not whole, and is not already coming)."""
        if not self.prefetch or not 0 <= index < len(self.units) or index in self.prefetched:
            return
        unit = self.units[index]
        if unit.flat is None:
            self.prefetched[index] = self.comm.iall_gather(self.gathered_shard(unit),
                                                           counts=self.gathered_counts(unit))
            buffer_meter.add(self.gathered_nbytes(unit))

    def release_params(self, unit):
        """Drop the full parameters: each becomes an empty array (using one by mistake fails loudly)."""
        # exercise 04.3: ZeRO-3: gather a unit's parameters, release them
        if unit.flat is None:
            return
        buffer_meter.release(self.gathered_nbytes(unit))
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
            buffer_meter.release(self.gathered_nbytes(self.units[index]))
        for unit in self.units:
            self.release_params(unit)

    def apply_optimizer(self):
        """Each rank updates its own shards; nothing is gathered until the next forward needs it."""
        for unit in self.units:
            self.update(unit, unit.grad_shard)
            self.round_shard(unit)

    def load_logical(self, state) -> None:
        super().load_logical(state)
        for unit in self.units:
            self.round_shard(unit)

    def memory(self) -> dict:
        """In 16 bits the fp32 master shards are optimizer state, as in the ZeRO paper's K = 4 + 8 for
        Adam, and the parameters this rank keeps are its 16-bit shards (`params_bytes`)."""
        held = super().memory()
        if self.working is not None:
            held["optimizer"] += sum(u.param_shard.nbytes for u in self.units)
        return held

    def params_bytes(self) -> int:
        if self.working is not None:
            return sum(shard.nbytes for shard in self.working_shards.values())
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
