"""ZeRO stages 1 and 2: data parallelism that partitions the model states instead of copying them.

The idea (Rajbhandari et al., "ZeRO", 2020): N data-parallel ranks need not each keep every byte.
Each unit of the model (`model.units()`: the embedding, a block, the head) keeps its parameters in
one flat buffer, padded to a multiple of N and cut into N equal shards; rank r owns shard r
(flat_units.py).

    stage 1  partitions the optimizer states. After backward the gradients are reduce-scattered, so
             each rank gets the summed gradient of its own shard, updates that shard of the flat
             parameters with its shard of Adam's moments, and the new shards are all-gathered.
    stage 2  also partitions the gradients. A unit's gradients are reduce-scattered as soon as backward
             is through with the unit (a full backward hook on the unit, module.py), and only this
             rank's shard of them is kept.
    stage 3  also partitions the parameters (zero3.py).

What it saves: model-state bytes per rank, with Ψ parameters, p and g bytes per parameter and
gradient and K bytes of optimizer state: (p+g+K)Ψ in DDP, (p+g)Ψ + KΨ/N at stage 1, pΨ + (g+K)Ψ/N
at stage 2 (memory/planner.py has the formulas).
What it costs: nothing extra on the wire: a reduce-scatter plus an all-gather is exactly what DDP's
ring all-reduce sends, 2(N-1)/N·Ψ·bytes per step (with M micro-batches stage 2 reduce-scatters every
micro-batch, as DeepSpeed does, since it keeps no full gradient to accumulate into).
Lesson: lessons/04_zero.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.core import autograd
from minipar.core.hooks import RemovableHandle
from minipar.core.options import option
from minipar.memory.ledger import buffer_meter
from minipar.memory.planner import STAGES as STAGES  # --zero's choices: 0 (DP), 1-2 here, 3 in zero3.py
from minipar.parallel.api import Updater
from minipar.parallel.flat_units import (
    FlatUnit,
    check_replicas_identical,
    shard_pieces,
    unit_tensors,
    units_of,
)
from minipar.parallel.logical_state import flat_unit_buffer, flat_unit_pieces


@dataclass
class ZeroOptions:
    """ZeRO (parallel/zero.py, parallel/zero3.py)."""
    zero: int = option(0, "ZeRO stage", STAGES, single_process=0)


class ZeroStage1(Updater):
    """Updater: optimizer states partitioned; full gradients reduce-scattered at the step."""

    unit_type: type[FlatUnit] = FlatUnit  # how a unit's parameters lie in its buffer (fsdp.py: per parameter)

    def __init__(self, model, optimizer, comm):
        check_replicas_identical(model, comm)
        super().__init__(model, optimizer)
        self.comm = comm
        self.units = units_of(model, comm, self.unit_type)
        for unit in self.units:
            unit.flat = unit.flatten([p.data for p in unit.params])
            unit.point_params_at(unit.flat)
            unit.param_shard = unit.flat[unit.start : unit.stop]  # a view: updating it updates the model
            unit.state = optimizer.init_state(unit.shard_numel, unit.dtype, unit.xp)

    def synchronize_gradients(self):
        """Reduce-scatter every unit's full gradients: this rank keeps its shard of their sum until the
        step is done (`buffer_meter` counts the shards, and each flat copy while it lives)."""
        # exercise 04.2: the ZeRO-1 step: reduce-scatter, update the shard, all-gather
        for unit in self.units:
            bucket = unit.flatten([p.grad for p in unit.params])
            buffer_meter.add(bucket.nbytes)
            unit.grad_shard = self.comm.reduce_scatter(bucket)
            buffer_meter.add(unit.grad_shard.nbytes)
            buffer_meter.release(bucket.nbytes)
            del bucket
        # end exercise

    def ready_gradients(self):
        """This rank's shard of every unit's summed gradients, parameter by parameter (views)."""
        return [piece for unit in self.units for piece in shard_pieces(unit_tensors(unit), unit.grad_shard,
                                                                        unit.start)]

    def apply_optimizer(self):
        """Update this rank's shard of every unit, then all-gather the new parameters."""
        # exercise 04.2: the ZeRO-1 step: reduce-scatter, update the shard, all-gather
        for unit in self.units:
            self.update(unit, unit.grad_shard)
            self.all_gather_params(unit)
        # end exercise

    def release_gradients(self):
        for unit in self.units:
            buffer_meter.release(unit.grad_shard.nbytes)
            unit.grad_shard = unit.xp.empty(0, dtype=unit.dtype)

    def update(self, unit, grad_shard):
        """The single-process update rule, on this rank's shard only: the same elementwise arithmetic."""
        with autograd.no_grad():
            self.optimizer.update(unit.param_shard, grad_shard, unit.state)

    def all_gather_params(self, unit):
        gathered = self.comm.all_gather(unit.param_shard, numel=unit.padded)
        buffer_meter.add(gathered.nbytes)
        unit.flat[...] = gathered
        buffer_meter.release(gathered.nbytes)

    def memory(self) -> dict:
        """Model-state bytes this rank holds after the step (temporary buffers go to `buffer_meter`)."""
        optimizer = sum(a.nbytes for u in self.units for a in u.state.values() if hasattr(a, "nbytes"))
        return {"params": self.params_bytes(), "grads": self.grads_bytes(), "optimizer": optimizer}

    def checkpoint_pieces(self) -> dict:
        """{name: {kind: (Piece, array)}}: this rank's slice of each unit's parameters and optimizer state."""
        return {name: kinds for unit in self.units
                for name, kinds in flat_unit_pieces(unit, {"param": unit.param_shard, **unit.state}).items()}

    def load_logical(self, state) -> None:
        """Cut this rank's slices from a checkpoint's logical tensors (checkpoint/sharded.py); no
        communication."""
        for unit in self.units:
            params = flat_unit_buffer(unit, state, "param")
            if unit.flat is not None:  # held whole between steps (stages 1 and 2): param_shard is a view
                unit.flat[...] = params
            unit.param_shard[...] = params[unit.start : unit.stop]
            for kind, value in unit.state.items():
                if hasattr(value, "shape"):
                    value[...] = flat_unit_buffer(unit, state, kind)[unit.start : unit.stop]
                else:  # the step count, the same for every parameter of the unit
                    unit.state[kind] = int(state[unit.names[0]][kind])

    def params_bytes(self) -> int:
        return sum(u.flat.nbytes for u in self.units if u.flat is not None)  # every unit's, at stages 1-2

    def grads_bytes(self) -> int:
        return sum(u.grads_nbytes() for u in self.units)


class ZeroStage2(ZeroStage1):
    """Updater: gradients partitioned too; each unit's are reduce-scattered as backward leaves it."""

    def __init__(self, model, optimizer, comm):
        super().__init__(model, optimizer, comm)
        # the handles of the hooks on the model's units (removing them detaches the engine)
        self.hooks: list[RemovableHandle] = []
        for unit in self.units:
            unit.grad_shard = unit.xp.zeros(unit.shard_numel, dtype=unit.dtype)
            self.hook_unit(unit)

    def hook_unit(self, unit):
        """Reduce-scatter the unit's gradients once backward has gone through it. The hook sits on the
        unit's input, so it never fires for the first unit (token ids need no gradient): the step
        sends those (reduce_scatter_pending_grads)."""

        def reduce_scatter(module):
            self.reduce_scatter_grads(unit)

        self.hooks.append(unit.module.register_full_backward_hook(reduce_scatter))

    def reduce_scatter_grads(self, unit):
        """Add this rank's shard of the unit's summed gradients to its grad_shard; drop the full ones."""
        nbytes = unit.grads_nbytes() + unit.padded * unit.dtype.itemsize
        buffer_meter.add(nbytes)  # the unit's full gradients and their flat copy, until sent
        bucket = unit.flatten([p.grad for p in unit.params])
        for p in unit.params:
            p.grad = None
        unit.grad_shard += self.comm.reduce_scatter(bucket)
        del bucket
        buffer_meter.release(nbytes)

    def synchronize_gradients(self):
        self.reduce_scatter_pending_grads()

    def release_gradients(self):
        for unit in self.units:
            unit.grad_shard[...] = 0  # the next step's micro-batches add into it

    def reduce_scatter_pending_grads(self):
        """Units that no backward hook caught (the first one) still hold full gradients: send them now."""
        for unit in self.units:
            if unit.has_grads():
                self.reduce_scatter_grads(unit)

    def grads_bytes(self) -> int:
        return sum(u.grad_shard.nbytes for u in self.units)

