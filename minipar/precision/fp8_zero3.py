"""ZeRO-3's parameter all-gather in FP8: each rank quantizes its shard of every FP8 weight before the
gather, and the gather moves 1 byte a value plus the scales.

The idea (torchao's float8 all-gather for FSDP2; Transformer Engine's FP8 weights under FSDP): ZeRO-3
(parallel/zero3.py) gathers a unit's parameters before its forward and again before its backward,
and the FP8 Linear (fp8.py) then quantizes the weight it is given. Once the scale is known,
quantizing is elementwise, so each rank quantizes its own shard with the scale of the whole weight and
the gather sends FP8 bytes: the bits that quantizing the gathered weight would give. The FP8 Linear
takes the gathered weight as it came, quantized (`fp8.Prequantized`), so training is unchanged.

Who knows a scale (the rule):
- delayed: every rank, from the amax history, agreed already. Each rank records its shard's amax of
  the weight (0 where it holds none of it) as the step's, and the max all-reduce after the step
  (fp8.FP8Runner) makes it the whole weight's amax. Nothing more travels.
- current and block: a scale group (a weight for current, an n x n block of it for block) whose values
  all lie in one rank's shard is scaled by that rank, and its scale travels in the all-gather after its
  values. A group cut by a shard boundary is scaled after one max all-reduce over the data-parallel
  ranks of the shards' amaxes (0 where a rank holds none), once per update for every such group of the
  model together (torchao's one amax all-reduce after the optimizer step); every rank then knows it.
A scale travels as 8 bytes, an fp64: the value the one-process run computes, whatever the run's dtype.

A rank's message for a unit is its shard in order: each FP8 weight's elements as 1-byte E4M3
patterns, every other element (biases, LayerNorm, embeddings, the head, the padding) in the run's
dtype as ZeRO-3 sends it, then its own groups' scales. The messages differ in size between ranks; each
rank computes every rank's size from the layout, so the gather exchanges none, and the ledger charges
the ring's bytes for them: the others' messages but its successor's.

What it saves: on the FP8 weights, half of bf16's all-gather bytes and a quarter of fp32's, at both of
a step's gathers, for 8 bytes a scale (one per weight with current, one per n x n block with block).
What it costs: for current and block, a small all-reduce per step; the rank keeps its master shard
(optimizer state) and its message (params) between steps, as 16-bit ZeRO-3 keeps its working copy.
Lesson: lessons/09b_fp8.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minipar.core.shards import padded_bounds
from minipar.parallel.flat_units import unit_tensors
from minipar.parallel.zero3 import ZeroStage3
from minipar.precision.formats import E4M3, from_fp8_bits, to_fp8_bits
from minipar.precision.fp8 import FP8Products, Prequantized, block_scales, quantize, scale_for

SCALE_BYTES = 8  # a scale on the wire: an fp64


@dataclass
class Weight:
    """An FP8 weight of a unit: where it lies in the unit's flat buffer, its scale groups (`group`: each
    element's, row-major) and which rank holds each group whole (`owner`; -1: cut by a shard boundary)."""
    layer: int
    offset: int
    shape: tuple
    group: np.ndarray
    owner: np.ndarray


@dataclass
class Plan:
    """A unit's all-gather in FP8: its FP8 weights, and per rank the pieces of its shard (offset in the
    buffer, elements, the FP8 weight they belong to or None) and the groups whose scales it sends."""
    weights: list[Weight]
    pieces: list[list[tuple]] = field(default_factory=list)
    sent_scales: list[list[tuple]] = field(default_factory=list)  # per rank: (weight index, group)
    counts: list[int] = field(default_factory=list)  # per rank: the bytes of its message


def scale_groups(shape: tuple, block: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each element's group (row-major) and each group's first and last element: one group (per
    tensor) or the n x n blocks of fp8.block_quantize, numbered row by row."""
    rows, cols = shape
    if block is None:
        return np.zeros(rows * cols, dtype=np.int64), np.array([0]), np.array([rows * cols - 1])
    r, c = np.divmod(np.arange(rows * cols), cols)
    group = (r // block) * (cols // block) + c // block
    bi, bj = np.divmod(np.arange(group.max() + 1), cols // block)
    first = bi * block * cols + bj * block
    return group, first, first + (block - 1) * cols + block - 1


def plan_unit(unit, layer_of: dict, size: int, itemsize: int, recipe: str, block: int) -> Plan:
    """Every rank's message layout for `unit` over `size` ranks (the same on every rank)."""
    bounds = [padded_bounds(unit.numel, size, rank) for rank in range(size)]
    weights, cuts = [], []  # cuts: (offset, numel, weight index or None) of the buffer, in order
    for _, param, offset, numel in unit_tensors(unit):
        layer = layer_of.get(id(param))
        if layer is None:
            cuts.append((offset, numel, None))
            continue
        group, first, last = scale_groups(param.shape, block if recipe == "block" else None)
        owner = np.full(first.size, -1)
        for rank, (start, stop) in enumerate(bounds):
            owner[(offset + first >= start) & (offset + last < stop)] = rank
        cuts.append((offset, numel, len(weights)))
        weights.append(Weight(layer, offset, tuple(param.shape), group, owner))
    cuts.append((unit.numel, unit.padded - unit.numel, None))  # the padding travels as ZeRO-3 sends it
    plan = Plan(weights)
    for rank, (start, stop) in enumerate(bounds):
        pieces = [(max(o, start), min(o + n, stop) - max(o, start), w) for o, n, w in cuts
                  if max(o, start) < min(o + n, stop)]
        sent = [] if recipe == "delayed" else [(w, int(g)) for w, weight in enumerate(weights)
                                                 for g in np.flatnonzero(weight.owner == rank)]
        plan.pieces.append(pieces)
        plan.sent_scales.append(sent)
        plan.counts.append(sum(n if w is not None else n * itemsize for _, n, w in pieces)
                           + SCALE_BYTES * len(sent))
    return plan


class FP8ZeroStage3(ZeroStage3):
    """ZeRO-3 whose all-gathers send the FP8 weights quantized (1 byte a value) and the rest as it is,
    and hand the FP8 Linear layers their weights quantized (`products.prequantized`)."""

    def __init__(self, model, optimizer, comm, products: FP8Products, prefetch: bool = False):
        self.products, self.plans = products, {}
        self.messages: dict[int, np.ndarray] = {}  # unit index -> this rank's message (uint8)
        self.scales: dict[tuple, np.ndarray] = {}  # (unit, weight) -> its groups' scales known here
        super().__init__(model, optimizer, comm, prefetch=prefetch)
        self.encode_shards()

    def plan(self, unit) -> Plan:
        index = self.units.index(unit)
        if index not in self.plans:
            self.plans[index] = plan_unit(unit, self.products.layer_of, self.comm.size, unit.dtype.itemsize,
                                          self.products.recipe, self.products.block)
        return self.plans[index]

    # ---- after every update: agree the scales, quantize this rank's shards, write its messages ----

    def round_shard(self, unit) -> None:
        """Nothing per unit: `encode_shards` quantizes every unit's shard at once, after one agreement."""

    def apply_optimizer(self):
        super().apply_optimizer()
        self.encode_shards()

    def load_logical(self, state) -> None:
        super().load_logical(state)
        self.encode_shards()

    def encode_shards(self) -> None:
        """Each FP8 weight's amax per group over this rank's shard; for the groups no rank holds whole
        one max all-reduce (current, block), for delayed the step's record; then the messages."""
        partial = {}
        for u, unit in enumerate(self.units):
            for w, weight in enumerate(self.plan(unit).weights):
                partial[u, w] = self.shard_amax(unit, weight)
        delayed = self.products.recipe == "delayed"
        cut = [(key, g) for key, amax in partial.items() for g in range(amax.size)
               if self.plans[key[0]].weights[key[1]].owner[g] < 0]
        if cut and not delayed:  # the same list on every rank: all take part, or none
            agreed = self.comm.all_reduce(np.array([partial[key][g] for key, g in cut], dtype=np.float64),
                                          op="max")
            for ((key, g), amax) in zip(cut, agreed):
                partial[key][g] = amax
        for (u, w), amax in partial.items():
            unit, weight = self.units[u], self.plans[u].weights[w]
            key = (weight.layer, "weight")
            if delayed:
                self.products.scaling.record(key, float(amax[0]))  # this rank's part; FP8Runner agrees it
                scales = np.array([self.products.scaling.history_scale(key, E4M3)])
            elif self.products.recipe == "current":
                scales = np.array([scale_for(float(amax[0]), E4M3)])  # what a rank holding it all computes
            else:  # an amax is a value of the dtype: back in it, the scale is block_quantize's
                scales = block_scales(amax.astype(unit.dtype), E4M3, unit.dtype)
            mine = (weight.owner == self.comm.rank) | (weight.owner < 0) | delayed
            self.scales[u, w] = np.where(mine, scales, np.nan)  # the others' arrive with their values
        for u, unit in enumerate(self.units):
            self.messages[u] = self.encode(u, unit)

    def shard_amax(self, unit, weight: Weight) -> np.ndarray:
        """The amax of each of the weight's groups over the elements in this rank's shard (0: none)."""
        size = int(np.prod(weight.shape))
        lo, hi = max(weight.offset, unit.start), min(weight.offset + size, unit.stop)
        amax = np.zeros(weight.owner.size, dtype=np.float64)
        if lo < hi:
            values = np.abs(unit.param_shard[lo - unit.start : hi - unit.start]).astype(np.float64)
            np.maximum.at(amax, weight.group[lo - weight.offset : hi - weight.offset], values)
        return amax

    def encode(self, u: int, unit) -> np.ndarray:
        """This rank's message for unit u: its shard's pieces (FP8 patterns or raw bytes), its scales."""
        plan, parts = self.plans[u], []
        for start, numel, w in plan.pieces[self.comm.rank]:
            values = unit.param_shard[start - unit.start : start - unit.start + numel]
            if w is None:
                parts.append(np.ascontiguousarray(values).view(np.uint8))
                continue
            weight = plan.weights[w]
            within = weight.group[start - weight.offset : start - weight.offset + numel]
            known = self.scales[u, w]
            scale = known[within] if self.products.recipe == "block" else float(known[0])
            parts.append(to_fp8_bits(quantize(values, scale, E4M3), E4M3))
        scales = [self.scales[u, w][g] for w, g in plan.sent_scales[self.comm.rank]]
        parts.append(np.array(scales, dtype=np.float64).view(np.uint8))
        return np.concatenate(parts)

    # ---- the gather: what is sent, and what the model computes with ----

    def gathered_shard(self, unit):
        return self.messages[self.units.index(unit)]

    def gathered_counts(self, unit) -> list[int]:
        return self.plan(unit).counts

    def gathered_nbytes(self, unit) -> int:
        return sum(self.plan(unit).counts)

    def whole(self, gathered, unit):
        """The unit's flat parameters (each FP8 weight as its quantized values divided by their scales:
        what the FP8 Linear computes with) from every rank's message; the FP8 weights, quantized, go
        to the FP8 Linear layers."""
        u, plan = self.units.index(unit), self.plan(unit)
        flat = unit.xp.zeros(unit.padded, dtype=unit.dtype)
        values = [np.zeros(int(np.prod(weight.shape)), dtype=unit.dtype) for weight in plan.weights]
        scales = [self.scales[u, w].copy() for w in range(len(plan.weights))]
        at = 0
        for rank in range(self.comm.size):
            for start, numel, w in plan.pieces[rank]:
                if w is None:
                    nbytes = numel * unit.dtype.itemsize
                    flat[start : start + numel] = gathered[at : at + nbytes].view(unit.dtype)
                else:
                    offset = start - plan.weights[w].offset
                    patterns = gathered[at : at + numel]
                    values[w][offset : offset + numel] = from_fp8_bits(patterns, E4M3, unit.dtype)
                    nbytes = numel
                at += nbytes
            for w, g in plan.sent_scales[rank]:
                scales[w][g] = gathered[at : at + SCALE_BYTES].view(np.float64)[0]
                at += SCALE_BYTES
        for weight, q, scale in zip(plan.weights, values, scales):
            size = q.size
            if self.products.recipe == "block":
                inverse = 1.0 / scale.astype(unit.dtype)  # block_quantize's 1/scale, in the dtype
                given = Prequantized(q.reshape(weight.shape), inverse=inverse.reshape(
                    weight.shape[0] // self.products.block, weight.shape[1] // self.products.block))
                flat[weight.offset : weight.offset + size] = q * inverse[weight.group]
            else:
                given = Prequantized(q.reshape(weight.shape), scale=float(scale[0]))
                flat[weight.offset : weight.offset + size] = q * (1.0 / given.scale)
            self.products.prequantized[weight.layer] = given
        return flat

    def release_params(self, unit):
        """Drop the unit's whole parameters, and its FP8 weights handed to the Linear layers with them."""
        for weight in self.plan(unit).weights:
            self.products.prequantized.pop(weight.layer, None)
        super().release_params(unit)

    # ---- memory: the master shard is optimizer state, the message the parameters kept ----

    def memory(self) -> dict:
        held = super().memory()
        held["optimizer"] += sum(u.param_shard.nbytes for u in self.units)
        return held

    def params_bytes(self) -> int:
        return sum(message.nbytes for message in self.messages.values())
