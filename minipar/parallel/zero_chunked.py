"""ZeRO-3 over Gemini chunks, with each chunk's shard of the model states offloaded to CPU or disk.

The idea: zero3.py gathers one flat buffer per unit of the model. Here the buffers are fixed-size
chunks (memory/chunks.py), packed with the parameters in execution order. A chunk is all-gathered
once before the first of its tensors is used and released after its last unit's forward; backward
gathers it again, writes each unit's gradients into it in place of the parameters as the unit's
backward ends, and reduce-scatters it as one message once every tensor in it is READY_FOR_REDUCE
(each of these moments is a hook on the unit: module.py).
What a rank keeps of a chunk between uses, its shard of the parameters, of the gradients and of each
optimizer state, are blocks of a TieredStore (memory/offload.py): on the device while the budget
`--device-mem-mb` allows, else in CPU memory or on disk (`--offload`), each fetched when used: a
gather fetches the parameters, a reduce-scatter the gradients, the optimizer step all of them.

Placement follows Gemini: the first step is a warm-up that traces the non-model memory (activations,
gathered chunks: memory/tracer.py) and the least budget the step needs, combined over the ranks; a
budget below it is refused after the warm-up (BudgetTooSmall, one line, exit code 2), `--device-mem-mb
auto` takes it, and later steps evict and prefetch by the trace (`--static-placement`: by the budget
alone, as before; a budget too small for the activations then fails mid-run).

What it saves: device memory: only the gathered chunks of one unit, a chunk's blocks and the
activations must fit. Gathered buffers all have the one chunk size, and messages are sized by
`--chunk-mb`, not by the model's modules. What it costs: zero3's 3(N-1)/N of the model's bytes per
step plus the chunks' padding, and, with offload, the blocks' traffic between tiers.

In bf16 or fp16 (`working`, as in zero3.py) a chunk has one block more, its shard of the 16-bit
working copy (2-byte patterns, "params"; the fp32 master block counts as optimizer state), written
by the optimizer step; a gather fetches and sends it, so a gathered chunk is half of fp32's bytes
until backward writes the unit's fp32 gradients into it (they are reduce-scattered in fp32): then it
widens to 4 bytes a value. The tracer and `--device-mem-mb auto` see those smaller chunks.
Lesson: lessons/08_memory.md.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from minipar.core import autograd
from minipar.core.backend import current as current_backend
from minipar.core.hooks import RemovableHandle
from minipar.core.options import option
from minipar.core.shards import shard_of
from minipar.distributed.collectives import Wire
from minipar.memory.chunks import TensorState, pack_in_chunks, search_chunk_size
from minipar.memory.ledger import buffer_meter, tier_meter
from minipar.memory.offload import OFFLOADS, POLICIES, MiB, TieredStore
from minipar.memory.tracer import AUTO, MemoryTracer, budget_mb, settled_budget
from minipar.parallel.api import Updater
from minipar.parallel.flat_units import check_replicas_identical, shard_pieces, units_of
from minipar.parallel.logical_state import flat_pieces


@dataclass
class ChunkedOptions:
    """Chunked ZeRO-3 with offload (parallel/zero_chunked.py, memory/)."""
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

    @property
    def chunked(self) -> bool:
        """Is chunked ZeRO-3 on? Each of --offload, --chunk-mb and --device-mem-mb selects it."""
        return self.offload != "none" or self.chunk_mb is not None or self.device_mem_mb is not None

S = TensorState


class ChunkedZero3(Updater):
    """Updater and model wrapper: ZeRO-3 whose unit of communication and of offload is the chunk."""

    gathers_parameters = True

    def __init__(self, model, optimizer, comm, chunk_numel: int, budget_bytes: float | str | None = None,
                 offload: str = "none", eviction: str = "opt", traced: bool = True, least_bytes: int = 0,
                 disk_folder: str | None = None, working: Wire | None = None):
        """budget_bytes: a number, None (no budget) or AUTO (the least the warm-up needs); traced: place
        by the warm-up's memory trace (Gemini), else by the budget alone; least_bytes: a floor for the
        least budget (the up-front estimate of size_errors, so that the figure it names passes it);
        working: the 16-bit working copy's format in bf16 or fp16 (encode, decode), else None."""
        check_replicas_identical(model, comm)
        super().__init__(model, optimizer)
        self.comm, self.gradients_zeroed, self.working = comm, False, working
        self.gathered_key = "param" if working is None else "working"  # the block a gather sends
        self.held: dict[int, int] = {}  # chunk index -> bytes its gathered buffer is counted at
        self.units = units_of(model, comm)
        self.chunks = pack_in_chunks([(name, p, i) for i, unit in enumerate(self.units)
                                      for name, p in zip(unit.names, unit.params)], chunk_numel)
        self.shard = chunk_numel // comm.size
        self.start = comm.rank * self.shard
        self.xp = self.units[0].xp
        self.freed = self.xp.empty(0, dtype=self.chunks[0].dtype)
        self.scalars, blocks = [], {}
        for chunk in self.chunks:  # this rank's shard of the chunk: one block per kind of model state
            state = optimizer.init_state(self.shard, chunk.dtype, self.xp)
            self.state_names = [k for k, v in state.items() if hasattr(v, "shape")]
            self.scalars.append({k: v for k, v in state.items() if k not in self.state_names})
            full = chunk.flatten([t.param.data for t in chunk.tensors])
            master = full[self.start : self.start + self.shard].copy()
            blocks[chunk.index, "param"] = (master, "params" if working is None else "optimizer")
            if working is not None:  # the master's 16-bit rounding, what the gathers send
                blocks[chunk.index, "working"] = (working.encode(master), "params")
            blocks[chunk.index, "grad"] = (self.xp.zeros(self.shard, dtype=chunk.dtype), "grads")
            for name in self.state_names:
                blocks[chunk.index, name] = (state[name], "optimizer")
        lower = None if offload == "none" else offload
        self.auto, self.least_bytes = budget_bytes == AUTO, least_bytes
        self.tracer = MemoryTracer() if traced and budget_bytes is not None else None
        budget = 0 if budget_bytes == AUTO else budget_bytes  # auto's warm-up: no room to spare
        assert not isinstance(budget, str), f"a budget in bytes, None or {AUTO!r}, not {budget!r}"
        self.store = TieredStore(blocks, budget, lower, eviction,
                                 others=lambda: autograd.activation_meter.current + buffer_meter.current,
                                 report=tier_meter.set, tracer=self.tracer, disk_folder=disk_folder)
        for chunk in self.chunks:
            for tensor in chunk.tensors:
                tensor.param.data = self.freed
        # the handles of the hooks on the model's units (removing them detaches the engine)
        self.hooks: list[RemovableHandle] = []
        for i, unit in enumerate(self.units):
            self.hook_unit(i, unit)
        # their handles: `.remove()` stops them
        self.relief, self.buffer_relief = (relieve_when_others_grow(self.store, meter)
                                           for meter in (autograd.activation_meter, buffer_meter))

    # ---- the chunks of a unit ----
    def chunks_of(self, unit: int) -> list:
        return [c for c in self.chunks if unit in c.units]

    def tensors_of(self, unit: int):
        return [(chunk, t) for chunk in self.chunks_of(unit) for t in chunk.tensors_of(unit)]

    def hook_unit(self, i: int, unit):
        """The unit's chunks gathered for its forward and its backward; its gradients into them after."""

        def start_forward(module, args):
            if i == 0:
                self.finish_backward()  # the previous micro-batch's first unit: no input hook caught it
            self.start_unit(i)

        def finish_forward(module, args, output):
            self.end_forward(i)

        def start_backward(module):  # the gradient reached the unit's output: backward needs them back
            self.start_unit(i)

        def finish_backward(module):  # the gradient reached the unit's input: its gradients are done
            self.end_backward(i)

        module = unit.module
        self.hooks += [module.register_forward_pre_hook(start_forward),
                       module.register_forward_hook(finish_forward),
                       module.register_full_backward_pre_hook(start_backward),
                       module.register_full_backward_hook(finish_backward)]

    def start_unit(self, i: int):
        """Gather the unit's chunks (those not gathered yet) and mark its tensors COMPUTE."""
        for chunk in self.chunks_of(i):
            self.gather(chunk)
        for chunk, tensor in self.tensors_of(i):
            chunk.transition(tensor, S.COMPUTE)

    def end_forward(self, i: int):
        """Its tensors are HOLD again; a chunk whose last unit this is goes until backward."""
        for chunk, tensor in self.tensors_of(i):
            chunk.transition(tensor, S.HOLD)
        for chunk in self.chunks_of(i):
            if chunk.units[-1] == i and chunk.all_in(S.HOLD):
                self.release(chunk)

    def end_backward(self, i: int):
        """The unit's gradients are complete: write them into their chunks, reduce the chunks now full."""
        pairs = self.tensors_of(i)
        nbytes = sum(t.param.grad.nbytes for _, t in pairs if t.param.grad is not None)
        self.store.make_room(nbytes)
        buffer_meter.add(nbytes)  # the unit's full gradients, until copied into the chunks
        for chunk in self.chunks_of(i):
            self.widen(chunk)
        for chunk, tensor in pairs:
            chunk.transition(tensor, S.HOLD_AFTER_BWD)
            if tensor.param.grad is not None:
                chunk.view(chunk.payload, tensor)[...] = tensor.param.grad
            else:  # no gradient reached it: zero, as the single-process step sees it
                chunk.view(chunk.payload, tensor)[...] = 0
            tensor.param.grad = None
            chunk.transition(tensor, S.READY_FOR_REDUCE)
        buffer_meter.release(nbytes)
        for chunk in self.chunks_of(i):
            if chunk.all_in(S.READY_FOR_REDUCE):
                self.reduce(chunk)

    def finish_backward(self):
        """Units still COMPUTE after a backward (the first: its input carries no gradient) end it now."""
        for i in range(len(self.units)):
            if any(t.state is S.COMPUTE for _, t in self.tensors_of(i)):
                self.end_backward(i)

    # ---- one message per chunk ----
    def gather(self, chunk):
        if chunk.payload is not None:
            return
        with self.store.use((chunk.index, self.gathered_key)) as (shard,):
            self.held[chunk.index] = chunk.numel * shard.itemsize  # 2 bytes a value in bf16 and fp16
            self.store.make_room(self.held[chunk.index])
            gathered = self.comm.all_gather(shard, numel=chunk.numel)
            chunk.payload = gathered if self.working is None else self.working.decode(gathered)
            buffer_meter.add(self.held[chunk.index])  # before the store may prefetch into the room made
        for tensor in chunk.tensors:
            chunk.transition(tensor, S.HOLD)
            tensor.param.data = chunk.view(chunk.payload, tensor)

    def reduce(self, chunk):
        """Sum the chunk's gradients over the ranks; add this rank's shard to its block."""
        grad_shard = self.comm.reduce_scatter(chunk.payload)
        self.release(chunk)
        with self.store.use((chunk.index, "grad")) as (grad,):
            grad += grad_shard

    def widen(self, chunk):
        """A 16-bit chunk about to hold fp32 gradients is counted at their bytes from now on."""
        extra = chunk.nbytes - self.held[chunk.index]
        if extra > 0:
            self.store.make_room(extra)
            buffer_meter.add(extra)
            self.held[chunk.index] = chunk.nbytes

    def release(self, chunk):
        for tensor in chunk.tensors:
            chunk.transition(tensor, S.FREE)
            tensor.param.data = self.freed
        buffer_meter.release(self.held.pop(chunk.index))
        chunk.payload = None

    # ---- updater protocol ----
    def synchronize_gradients(self):
        self.finish_backward()

    def ready_gradients(self):
        """This rank's shard of every chunk's summed gradients, each block fetched for the pass."""
        for chunk in self.chunks:
            with self.store.use((chunk.index, "grad")) as (grad,):
                tensors = [(t.name, t.param, t.offset, t.numel) for t in chunk.tensors]
                yield from shard_pieces(tensors, grad, self.start)

    def apply_optimizer(self):
        """Each rank updates its shard of every chunk where the chunk's block is brought to."""
        for i, scalars in enumerate(self.scalars):
            keys = [(i, "param"), (i, "grad")] + [(i, name) for name in self.state_names]
            with self.store.use(*keys) as (param, grad, *arrays):
                state = {**scalars, **dict(zip(self.state_names, arrays))}
                with autograd.no_grad():
                    self.optimizer.update(param, grad, state)
                self.scalars[i] = {k: v for k, v in state.items() if k not in self.state_names}
                grad[...] = 0  # for the next step, while the block is here
            if self.working is not None:  # apart, so that the step's blocks are not all in use with it
                with self.store.use((i, "param"), (i, "working")) as (param, working):
                    working[...] = self.working.encode(param)  # the new master, rounded
        self.gradients_zeroed = True

    def release_gradients(self):
        """Zero the gradient blocks where a skipped step left them, then end the step."""
        for i in range(len(self.chunks)) if not self.gradients_zeroed else []:
            with self.store.use((i, "grad")) as (grad,):
                grad[...] = 0
        self.gradients_zeroed = False
        warm_up = self.store.warming_up()
        self.store.end_step()
        if warm_up:
            self.settle_budget()

    def settle_budget(self):
        """After the warm-up: the least budget any rank needed (a collective, so every rank reaches the
        same verdict and none is left waiting); `auto` takes it, a smaller budget is refused."""
        assert self.tracer is not None
        least = self.comm.allreduce_obj(max(self.tracer.minimum, self.least_bytes), op="max")
        self.store.budget = settled_budget(least, self.store.budget, self.auto)

    def memory(self) -> dict:
        """{category: {tier: bytes}} of the blocks after the step (gathered chunks are buffers, live)."""
        return self.store.placement()

    def tier_traffic(self) -> dict | None:
        """The last step's bytes moved between tiers (the train log's "offload"), and the budget."""
        if self.store.last_step is None:
            return None
        return {**self.store.last_step, "budget_bytes": self.store.budget,
                "placement": "static" if self.tracer is None else "traced"}

    def checkpoint_pieces(self) -> dict:
        """{name: {kind: (Piece, array)}}: this rank's shard of each chunk's parameters and their states."""
        pieces = {}
        for chunk, scalars in zip(self.chunks, self.scalars):
            shards = {kind: self.store.read((chunk.index, kind)) for kind in ["param", *self.state_names]}
            tensors = [(t.name, t.param, t.shape, t.offset) for t in chunk.tensors]
            pieces.update(flat_pieces(tensors, self.start, self.start + self.shard, {**shards, **scalars}))
        return pieces

    def load_logical(self, state) -> None:
        """Cut this rank's shard of every chunk from a checkpoint's logical tensors
        (checkpoint/sharded.py)."""
        for chunk, scalars in zip(self.chunks, self.scalars):
            for kind in ["param", *self.state_names]:
                full = chunk.flatten([shard_of(state[t.name][kind], t.param.shard) for t in chunk.tensors])
                self.store.write((chunk.index, kind), full[self.start : self.start + self.shard])
            if self.working is not None:
                self.store.write((chunk.index, "working"), self.working.encode(self.store.read((chunk.index,
                                                                                                "param"))))
            scalars.update({k: int(state[chunk.tensors[0].name][k]) for k in scalars})

    def local_state(self) -> dict:
        """{name: (None, full array)} for Trainer.full_state: a collective, every chunk all-gathered once."""
        to_host = current_backend().to_host
        state = {}
        for chunk in self.chunks:
            full = self.comm.all_gather(self.store.read((chunk.index, "param")), numel=chunk.numel)
            for tensor in chunk.tensors:
                state[tensor.name] = (tensor.param.shard, to_host(chunk.view(full, tensor)).copy())
        return state


def relieve_when_others_grow(store, meter) -> RemovableHandle:
    """Activations and temporary buffers share the device budget: as one of their meters grows during
    a step, the store evicts blocks first (ahead of every other listener of the meter, so the memory
    ledger never sees the budget exceeded), and its tracer observes the change. The listener holds
    the store weakly, and leaves the meter once the store (the engine) is gone."""
    store_ref = weakref.ref(store)

    def relieve(nbytes):
        alive = store_ref()
        if alive is not None:
            alive.relieve()

    handle = meter.subscribe(relieve, first=True)
    weakref.finalize(store, handle.remove)
    return handle


# ---- sizes and up-front checks ----

def tensor_sizes(model) -> list[int]:
    return [p.size for _, unit in model.units() for p in unit.parameters()]


def chunk_numel_for(options: ChunkedOptions, model, parts: int) -> int:
    """--chunk-mb rounded up to a multiple of the ranks, or the size with the least padding."""
    if options.chunk_mb is not None:
        itemsize = model.parameters()[0].data.itemsize
        return -(-int(options.chunk_mb * MiB / itemsize) // parts) * parts
    return search_chunk_size(tensor_sizes(model), parts)[0]


def device_bytes_needed(model, chunk_numel: int, parts: int, rows: int, offload: str,
                        working_itemsize: int | None = None) -> int:
    """The least device memory the engine needs, activations aside: the chunks one unit spans, all
    gathered, with one block or the unit's gradients (while they are copied in); or, for the step,
    the `rows` blocks (parameters, gradients, optimizer states) of one chunk; without offload, every
    block of every chunk besides. `working_itemsize` (2 in bf16 and fp16): a gathered chunk and its
    block are the working copy's, and each chunk has that block besides the `rows` (written after the
    step, beside the master alone)."""
    units = [unit.parameters() for _, unit in model.units()]
    chunks = pack_in_chunks([(f"{u}.{j}", p, u) for u, params in enumerate(units)
                             for j, p in enumerate(params)], chunk_numel)
    spanned = max(sum(1 for c in chunks if u in c.units) for u in range(len(units)))
    largest_unit = max(sum(p.size for p in params) for params in units)
    shard, itemsize = chunk_numel // parts, chunks[0].dtype.itemsize
    gathered = working_itemsize or itemsize  # bytes a value of a gathered chunk and of its block
    row_bytes = rows * itemsize + (working_itemsize or 0)  # one shard element of every block of a chunk
    if offload == "none":
        return len(chunks) * row_bytes * shard + (spanned * chunk_numel + largest_unit) * gathered
    step_bytes = max(rows * itemsize, itemsize + (working_itemsize or 0))  # blocks in use at once
    return max(spanned * chunk_numel * gathered + max(shard * gathered, largest_unit * itemsize),
               step_bytes * shard)


def config_errors(options: ChunkedOptions) -> list[str]:
    """What --offload / --chunk-mb / --device-mem-mb need of each other (trainer/validate.py, which also
    checks what they need of the other options). When these pass, `size_errors` checks them on the
    model's sizes."""
    errors = [f"--offload {options.offload} needs --device-mem-mb: the device budget that pushes blocks out"
              ] if options.offload != "none" and options.device_mem_mb is None else []
    errors += [f"--{name.replace('_', '-')} must be positive, got {value}"
               for name, value in (("chunk_mb", options.chunk_mb), ("device_mem_mb", options.device_mem_mb))
               if value is not None and value != AUTO and not (isinstance(value, float | int) and value > 0)]
    if options.device_mem_mb == AUTO and options.static_placement:
        errors.append("--device-mem-mb auto takes the least budget the warm-up step's trace needs: "
                      "it cannot go with --static-placement")
    return errors


def working_itemsize(working: Wire | None) -> int | None:
    """Bytes a value of the gathered working copy: 2 when it travels on precision/mixed.py's 16-bit
    `parameter_wire` (bf16, fp16), None (the parameters' own) without one."""
    return None if working is None else 2


def size_errors(options: ChunkedOptions, parts: int, model, optimizer,
                working: Wire | None = None) -> list[str]:
    """--chunk-mb and --device-mem-mb against the real sizes, sharded over `parts` ranks: `model` is the
    whole model (one rank's, before sharding) and `optimizer` the one it trains with, whose state rows
    count; `working`: the 16-bit working copy's wire in bf16 and fp16 (as build_chunked_zero3's)."""
    chunk_numel, largest = chunk_numel_for(options, model, parts), max(tensor_sizes(model))
    if chunk_numel < largest:
        return [f"--chunk-mb {options.chunk_mb} holds {chunk_numel} elements, fewer than the largest "
                f"parameter's {largest}: a tensor never straddles two chunks"]
    needed = device_bytes_needed(model, chunk_numel, parts, state_rows(optimizer), options.offload,
                                 working_itemsize(working))
    budget = options.device_mem_mb
    if isinstance(budget, float | int) and budget * MiB < needed:  # None and auto: no figure to check
        return [f"--device-mem-mb {options.device_mem_mb} is too small: chunked ZeRO-3 with --offload "
                f"{options.offload} needs {needed / MiB:.4f} MiB on the device before activations "
                f"(chunks of {chunk_numel} elements); --device-mem-mb auto measures the least that works"]
    return []


def state_rows(optimizer) -> int:
    """Blocks per chunk: its parameters, its gradients and each array state of the optimizer."""
    state = optimizer.init_state(1, "float64", current_backend().xp)
    return 2 + sum(hasattr(v, "shape") for v in state.values())


def build_chunked_zero3(options: ChunkedOptions, grid, model, optimizer,
                        working: Wire | None = None) -> ChunkedZero3:
    """trainer/build.py's branch: the engine for --offload / --chunk-mb / --device-mem-mb; `working`:
    precision/mixed.py's `parameter_wire` in bf16 and fp16 (its values travel in 2 bytes)."""
    budget = options.device_mem_mb if options.device_mem_mb in (None, AUTO) else options.device_mem_mb * MiB
    chunk_numel = chunk_numel_for(options, model, grid.dp_cp.size)
    least = device_bytes_needed(model, chunk_numel, grid.dp_cp.size, state_rows(optimizer), options.offload,
                                working_itemsize(working))
    return ChunkedZero3(model, optimizer, grid.dp_cp, chunk_numel, budget, options.offload, options.eviction,
                        traced=not options.static_placement, least_bytes=least,
                        disk_folder=options.offload_dir, working=working)
