"""One training step's time and memory per GPU, composed from minipar's own formulas.

Compute: model.py's FLOPs over the machine's achieved FLOP/s, split evenly over tensor and pipeline
ranks (the logits' share too: a modelling choice; Megatron's last stage carries them alone).
Communication: the alpha-beta cost of the ring `Comm` charges (distributed/ledger.py: all-reduce sends
2(N-1)/N·S per rank in 2(N-1) messages), placed on its link: tensor-parallel groups inside a node
(NVLink), pipeline and data-parallel groups on InfiniBand once a group spans nodes.
Overlap rules (stated, not measured): tensor-parallel all-reduces and pipeline sends are not
overlapped with compute (they sit on the critical path, as in Megatron-LM 2021); the data-parallel
gradient reduction runs after the pipeline drains, not overlapped; the optimizer step is free.
The pipeline: parallel/schedules.py's simulate() with a forward of 1 and a backward of B/F time
units (B/F rounded to eighths), its makespan scaled by the forward's seconds.
On a CPU (`Machine.cores`), R ranks on C < R cores compute at C/R of their speed each.
Memory: model states by the ZeRO planner's rule (memory/planner.py), activations by
memory/activations.py (one micro-batch's peak with pp = 1, exactly what the ledger measures; with pp >
1, the first stage's in-flight micro-batches times its blocks).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

from minipar.memory import activations, planner
from minipar.parallel import schedules
from minipar.simulate.machines import Machine
from minipar.simulate.model import (
    ModelShape,
    hardware_flops,
    layer_forward_flops,
    logit_forward_flops,
    model_flops,
    parameter_count,
)

# bytes per parameter, gradient, optimizer state (K) and activation value. Mixed precision as the
# ZeRO paper counts it: 2-byte weights and gradients, 12 bytes of fp32 master copy and Adam moments.
# ZeRO-3 in bf16 gathers the 2-byte weights, as `minipar train` does (parallel/zero3.py); minipar's
# own gradients stay fp32 (g = 4, reduce-scattered in fp32), where the paper's recipe sends 2 bytes.
PRECISION_BYTES = {"fp64": (8, 8, 16, 8), "fp32": (4, 4, 8, 4), "bf16": (2, 2, 12, 2), "fp16": (2, 2, 12, 2)}


@dataclass(frozen=True)
class Layout:
    """The batch and the parallel layout, named as `minipar train` names them."""

    batch_size: int
    microbatches: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"
    zero: int = 0
    recompute: str = "none"
    sp: bool = False
    precision: str = "bf16"

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // (self.dp * self.microbatches)


def layout_errors(m: ModelShape, lay: Layout) -> list[str]:
    """Why this layout cannot run this model (divisibility), empty when it can."""
    errors = []
    if lay.batch_size % (lay.dp * lay.microbatches):
        errors.append(f"batch {lay.batch_size} is not divisible by dp x microbatches = "
                      f"{lay.dp * lay.microbatches}")
    if m.n_head % lay.tp or m.d_model % lay.tp:
        errors.append(f"tp {lay.tp} does not divide heads {m.n_head} and width {m.d_model}")
    if m.n_layer % (lay.pp * lay.virtual_stages):
        errors.append(f"pp x virtual stages = {lay.pp * lay.virtual_stages} does not divide the "
                      f"{m.n_layer} blocks")
    if lay.schedule == "interleaved" and lay.microbatches % lay.pp:
        errors.append(f"interleaved needs microbatches {lay.microbatches} to be a multiple of pp {lay.pp}")
    if lay.sp and lay.tp == 1:
        errors.append("sp needs tp > 1")
    if lay.pp > 1:  # only a pipeline runs the schedule simulator
        errors += schedules.size_errors(lay.pp, lay.microbatches, lay.virtual_stages)
    return errors


def ring_seconds(op: str, payload: float, n: int, bandwidth: float, latency: float) -> float:
    """Alpha-beta time of a ring collective on n ranks: its messages times the latency, plus the bytes
    one rank sends (Comm's charge) over the link's bandwidth."""
    # exercise 14.2: the alpha-beta time of a ring collective
    if n == 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n}[op]
    messages = (2 if op == "all_reduce" else 1) * (n - 1)
    return messages * latency + factor * payload / bandwidth
    # end exercise


def _links(lay: Layout, mach: Machine) -> dict[str, tuple[float, float]]:
    """(bandwidth, latency) per dimension: a group inside one node runs on NVLink, else InfiniBand."""
    intra = (mach.intra_bandwidth, mach.intra_latency)
    inter = (mach.inter_bandwidth, mach.inter_latency)
    return {"tp": intra if lay.tp <= mach.gpus_per_node else inter,
            "pp": intra if lay.tp * lay.pp <= mach.gpus_per_node else inter,
            "dp": intra if lay.gpus <= mach.gpus_per_node else inter}


def model_state_memory(m: ModelShape, lay: Layout) -> dict[str, int]:
    """Parameters, gradients and optimizer states one GPU holds: each part split over tp x pp, and
    over dp where the ZeRO stage partitions it (memory/planner.py's rule). Exact for dp and ZeRO; with
    tp it splits the few replicated parameters too (LayerNorms, some biases, the position embedding:
    a tp-2 rank of the tests' 2-block model holds 256 values more than this), and with pp it splits the
    embeddings evenly where they sit on the first and last stages."""
    p, g, k, _ = PRECISION_BYTES[lay.precision]
    share = Fraction(parameter_count(m), lay.tp * lay.pp)
    dp = lay.dp
    parts = {"params": share * p / (dp if lay.zero >= 3 else 1),
             "grads": share * g / (dp if lay.zero >= 2 else 1),
             "optimizer": share * k / (dp if lay.zero >= 1 else 1)}
    assert sum(parts.values()) == planner.model_state_bytes(parameter_count(m), dp, lay.zero, k,
                                                            param_bytes=p, grad_bytes=g, mp=lay.tp * lay.pp)
    return {name: math.ceil(value) for name, value in parts.items()}


def activation_memory(m: ModelShape, lay: Layout, inflight: int) -> int:
    """The activation peak: memory/activations.py's formulas on one micro-batch of b sequences."""
    s, b, h, a = m.seq_len, lay.microbatch_size, m.d_model, m.n_head
    value_bytes = PRECISION_BYTES[lay.precision][3]
    if lay.pp == 1:
        return activations.gpt_activation_peak(s, b, h, a, m.n_layer, m.vocab, lay.tp, lay.recompute,
                                               value_bytes, lay.sp)
    block = activations.block_activation_values(s, b, h, a, lay.tp, lay.recompute, lay.sp)
    first_stage = activations.embedding_values(s, b, h, lay.tp) + m.n_layer // lay.pp * block
    return inflight * first_stage * value_bytes


def _pipeline(lay: Layout, forward_s: float, backward_s: float) -> tuple[float, float, list[int]]:
    """(seconds, bubble fraction, peak in-flight per stage) of the micro-batches through the stages."""
    if lay.pp == 1:
        return lay.microbatches * (forward_s + backward_s), 0.0, [1]
    ratio = Fraction(backward_s / forward_s).limit_denominator(8)
    makespan, bubble, inflight = _timeline(lay.schedule, lay.pp, lay.microbatches, lay.virtual_stages, ratio)
    return makespan * forward_s, bubble, list(inflight)


@functools.lru_cache(maxsize=256)
def _timeline(name: str, stages: int, microbatches: int, virtual_stages: int, ratio: Fraction):
    """(makespan in forwards, bubble fraction, peak in-flight) of a schedule; a search asks often."""
    schedule = schedules.build_schedule(name, stages, microbatches, virtual_stages)
    backward = ratio / 2 if name == "zb-h1" else ratio  # zb-h1: B and W share the backward equally
    weight = ratio / 2 if name == "zb-h1" else 1
    timeline = schedules.simulate(schedule, 1, backward, weight)
    bubble = float(schedules.bubble_fraction(timeline))
    return float(timeline.makespan), bubble, tuple(schedules.peak_inflight(schedule))


def data_parallel_seconds(m: ModelShape, lay: Layout, bandwidth: float, latency: float) -> float:
    """The gradients' all-reduce over dp; ZeRO-3 instead gathers the p-byte parameters twice (forward
    and backward) and reduce-scatters the g-byte gradients: 1.5x the all-reduce when p = g."""
    p, g, _, _ = PRECISION_BYTES[lay.precision]
    values = Fraction(parameter_count(m), lay.tp * lay.pp)
    if lay.zero == 3:
        return (2 * ring_seconds("all_gather", float(values * p), lay.dp, bandwidth, latency)
                + ring_seconds("reduce_scatter", float(values * g), lay.dp, bandwidth, latency))
    return ring_seconds("all_reduce", float(values * g), lay.dp, bandwidth, latency)


def simulate_step(m: ModelShape, lay: Layout, mach: Machine) -> dict:
    """Predicted step time, throughput, memory per GPU and communication time by dimension."""
    b, s, h = lay.microbatch_size, m.seq_len, m.d_model
    value_bytes = PRECISION_BYTES[lay.precision][3]
    links = _links(lay, mach)
    per_gpu = lay.tp * lay.pp
    forward_compute = (m.n_layer * layer_forward_flops(m, b) + logit_forward_flops(m, b)) / per_gpu
    # more ranks than cores: each rank computes at cores/ranks of its speed (the OS time-shares them)
    time_shared = max(1.0, lay.gpus / mach.cores) if mach.cores else 1.0
    # a fixed cost per block and pass that splitting the matmuls does not divide (0 on a GPU preset)
    forward_compute = (forward_compute / mach.achieved_flops + m.n_layer // lay.pp * mach.block_overhead)
    forward_compute *= time_shared
    layers_here = m.n_layer // lay.pp
    # two all-reduces of the s·b·h activations per block and pass (Megatron's f and g); with --sp a
    # reduce-scatter and an all-gather each instead, the same bytes
    tp_pass = 2 * layers_here * ring_seconds("all_reduce", s * b * h * value_bytes, lay.tp, *links["tp"])
    p2p = 0.0
    if lay.pp > 1:
        bandwidth, latency = links["pp"]
        p2p = lay.virtual_stages * (latency + s * b * h * value_bytes / bandwidth)
    # recomputation reruns in backward what model.hardware_flops counts beyond the model's FLOPs
    recompute_s = (hardware_flops(m, b, lay.recompute) - model_flops(m, b)) / per_gpu / mach.achieved_flops
    recompute_s *= time_shared
    recompute_passes = 1 if lay.recompute == "full" else 0  # only a whole block's rerun all-reduces again
    forward_s = forward_compute + tp_pass + p2p
    backward_s = 2 * forward_compute + recompute_s + (1 + recompute_passes) * tp_pass + p2p
    pipeline_s, bubble, inflight = _pipeline(lay, forward_s, backward_s)
    dp_s = data_parallel_seconds(m, lay, *links["dp"])
    step_s = pipeline_s + dp_s
    gpus = lay.gpus
    memory = model_state_memory(m, lay)
    memory["activations"] = activation_memory(m, lay, inflight[0])
    memory["total"] = sum(memory.values())
    return {
        "step_s": step_s,
        "tflops_per_gpu": hardware_flops(m, lay.batch_size, lay.recompute) / step_s / gpus / 1e12,
        "mfu": model_flops(m, lay.batch_size) / step_s / gpus / mach.peak_flops,
        "gpus": gpus,
        "parameters": parameter_count(m),
        "memory": {**memory, "capacity": mach.memory_bytes, "fits": memory["total"] <= mach.memory_bytes},
        "comm_s": {"tp": lay.microbatches * (2 + recompute_passes) * tp_pass,
                   "pp": lay.microbatches * 2 * p2p, "dp": dp_s},
        "compute_s": lay.microbatches * (3 * forward_compute + recompute_s),
        "bubble_fraction": bubble,
    }
