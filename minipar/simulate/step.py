"""One training step's time and memory per GPU, composed from minipar's own formulas.

Compute: kernels.py's kernel-time model on a GPU preset (each block's GEMMs in whole waves of tiles up
to the measured matmul ceiling, elementwise passes at HBM bandwidth) over the machine's one calibrated
scalar; on a machine without one (a CPU), model.py's FLOPs at one achieved rate. Per stage: its
blocks; the logits and loss on the last stage alone (Megatron's partition), which, the slowest
stage, adds M times their seconds to the step (exact for 1F1B).
Communication: the alpha-beta cost of the ring `Comm` charges (distributed/ledger.py: all-reduce sends
2(N-1)/N·S per rank in 2(N-1) messages), placed on its link: tensor-parallel groups inside a node
(NVLink), pipeline and data-parallel groups on InfiniBand once a group spans nodes; each at the
bandwidth NCCL achieves (machines.py). A pipeline send carries 1/tp of the activation across and is
all-gathered over the tp link on arrival (Megatron's scatter/gather).
Overlap (stated rules, each an option of `Layout.overlap`; none by default, as in Megatron-LM 2021,
where every byte sits on the critical path): "dp", Megatron-Core's bucketed overlap, the gradient
reduction under the last micro-batch's backward and ZeRO's parameter all-gather under the first
forward; "tp", each half all-reduce (all-gather or reduce-scatter) under the GEMM it feeds or
drains; "pp", the sends under the next micro-batch's compute. Each hides up to its window's seconds;
the rest stays exposed (`exposed_comm_s`). The optimizer step is free.
The pipeline: parallel/schedules.py's simulate() with a forward of 1 and a backward of B/F time
units (B/F rounded to eighths), its makespan scaled by the forward's seconds (1F1B in its closed
form, (M + K - 1)(1 + B/F), the same number); zb-h1, zb-v and dualpipev split the backward into
B = W = half of it, the V-shaped two (two chunks a rank) placed as a V, their messages counted as two
chunks' (the turn of the V on rank K-1, which sends none, included). Uneven stages
(`Layout.stage_layers`, as BLOOM partitions): the heaviest stage's timeline. A fused attention
(`Layout.flash_attention`): no s x s pass through HBM, no s x s array kept
(kernels.flash_attention_saving).
On a CPU (`Machine.cores`), R ranks on C < R cores compute at C/R of their speed each.
Memory: model states by the ZeRO planner's rule (memory/planner.py), activations by
memory/activations.py (one micro-batch's peak with pp = 1, exactly what the ledger measures; with pp >
1, the first stage's in-flight (micro-batch, chunk) pairs times a chunk's blocks: the interleaved
schedule's 1 + (K-1)/(VK) times 1F1B's; ZB-V's 2K half-stage pairs, 1F1B's; DualPipeV's one more).
Lesson: lessons/14_simulate.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

from minipar.memory import activations, planner
from minipar.parallel import schedules
from minipar.simulate import kernels
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
# FP8 (kernels.py: the Linear layers' GEMMs on FP8 operands) keeps bf16's bytes: weights, gradients,
# master copy and the activations a block saves are counted as bf16's (an upper bound: Transformer
# Engine may save a Linear's input in FP8).
PRECISION_BYTES = {"fp64": (8, 8, 16, 8), "fp32": (4, 4, 8, 4), "bf16": (2, 2, 12, 2), "fp16": (2, 2, 12, 2),
                   "fp8": (2, 2, 12, 2)}


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
    overlap: tuple[str, ...] = ()  # of "dp", "tp", "pp": what runs under compute (OVERLAPS)
    stage_layers: tuple[int, ...] | None = None  # blocks per stage, first to last (None: L / pp each)
    flash_attention: bool = False  # the attention core one fused kernel: no s x s array in HBM

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // (self.dp * self.microbatches)

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: `virtual_stages`, or 2 for a V-shaped schedule."""
        return schedules.chunks_of(self.schedule, self.virtual_stages)

    def blocks_per_stage(self, n_layer: int) -> tuple[int, ...]:
        """Blocks on each pipeline stage, first to last: `stage_layers`, or L / pp each."""
        return self.stage_layers or (n_layer // self.pp,) * self.pp


OVERLAPS = ("dp", "tp", "pp")


def layout_errors(m: ModelShape, lay: Layout) -> list[str]:
    """Why this layout cannot run this model (divisibility), empty when it can."""
    errors = [f"overlap {name!r} is not one of {', '.join(OVERLAPS)}" for name in lay.overlap
              if name not in OVERLAPS]
    if lay.batch_size % (lay.dp * lay.microbatches):
        errors.append(f"batch {lay.batch_size} is not divisible by dp x microbatches = "
                      f"{lay.dp * lay.microbatches}")
    if m.n_head % lay.tp or m.d_model % lay.tp:
        errors.append(f"tp {lay.tp} does not divide heads {m.n_head} and width {m.d_model}")
    if lay.stage_layers is not None:
        if len(lay.stage_layers) != lay.pp or sum(lay.stage_layers) != m.n_layer or min(lay.stage_layers) < 1:
            errors.append(f"stage layers {list(lay.stage_layers)} are not pp = {lay.pp} stages of the "
                          f"{m.n_layer} blocks, at least one each")
        if lay.chunks > 1:
            errors.append("stage layers need one chunk per stage (virtual stages 1)")
    elif m.n_layer % (lay.pp * lay.chunks):
        errors.append(f"pp x chunks per rank = {lay.pp * lay.chunks} does not divide the "
                      f"{m.n_layer} blocks")
    if lay.schedule == "interleaved" and lay.microbatches % lay.pp:
        errors.append(f"interleaved needs microbatches {lay.microbatches} to be a multiple of pp {lay.pp}")
    if lay.schedule == "dualpipev" and lay.pp > 1 and lay.microbatches < 2 * lay.pp:
        errors.append(f"dualpipev needs microbatches >= 2 x pp = {2 * lay.pp}, got {lay.microbatches}")
    if lay.sp and lay.tp == 1:
        errors.append("sp needs tp > 1")
    if lay.pp > 1:  # only a pipeline runs the schedule simulator
        errors += schedules.size_errors(lay.pp, lay.microbatches, lay.chunks)
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
    # a fused attention keeps no s x s array: what a block keeps is then selective recomputation's
    recompute = "selective" if lay.flash_attention and lay.recompute == "none" else lay.recompute
    block = activations.block_activation_values(s, b, h, a, lay.tp, recompute, lay.sp)
    if lay.pp == 1:
        if recompute != lay.recompute:  # nothing reruns: the end of the forward is the peak
            return (activations.embedding_values(s, b, h, lay.tp) + m.n_layer * block
                    + activations.head_values(s, b, h, m.vocab, lay.tp, lay.sp)) * value_bytes
        return activations.gpt_activation_peak(s, b, h, a, m.n_layer, m.vocab, lay.tp, lay.recompute,
                                               value_bytes, lay.sp)
    # `inflight` counts (micro-batch, chunk) pairs: each holds one chunk's blocks, L / (pp x chunks) or
    # the first stage's (the embedding's few values, held by chunk 0 alone, counted with each pair: an
    # overcount of sb values)
    blocks = lay.blocks_per_stage(m.n_layer)[0] // lay.chunks
    chunk = activations.embedding_values(s, b, h, lay.tp) + blocks * block
    return inflight * chunk * value_bytes


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
    if name == "1f1b":
        # equal stages (lesson 06): each is busy M(1 + B/F), the last starts K-1 forwards late and the
        # first ends K-1 backwards late; stage k holds min(K - k, M) micro-batches. The same numbers
        # as simulate()'s timeline (tests/simulate/test_published.py), without its seconds at K = 64
        makespan = (microbatches + stages - 1) * (1 + ratio)
        inflight = tuple(min(stages - k, microbatches) for k in range(stages))
        return float(makespan), (stages - 1) / (microbatches + stages - 1), inflight
    schedule = schedules.build_schedule(name, stages, microbatches, virtual_stages)
    split = name in schedules.SPLIT_BACKWARD  # B and W share the backward equally
    backward, weight = (ratio / 2, ratio / 2) if split else (ratio, 1)
    timeline = schedules.simulate(schedule, 1, backward, weight, schedules.placement_of(name))
    bubble = float(schedules.bubble_fraction(timeline))
    return float(timeline.makespan), bubble, tuple(schedules.peak_inflight(schedule))


Seconds = tuple[float, float]  # (forward, backward)


def _compute_seconds(m: ModelShape, lay: Layout, mach: Machine) -> tuple[Seconds, Seconds]:
    """((forward, backward) of one micro-batch through one stage's blocks, (forward, backward) of the
    logits and loss), recomputation in the backward. With the machine's kernel model (kernels.py):
    each GEMM and elementwise pass, over the one calibrated scalar. Without (a CPU): FLOPs at one
    achieved rate, plus a cost per block and pass, ranks beyond the cores time-sharing them."""
    b, layers_here = lay.microbatch_size, max(lay.blocks_per_stage(m.n_layer))
    if mach.kernels is not None:
        value_bytes = PRECISION_BYTES[lay.precision][3]
        if not kernels.supports(mach.kernels, lay.precision):
            raise ValueError(kernels.precision_error(mach.name, lay.precision))
        block = kernels.block_seconds(mach.kernels, m.seq_len, b, m.d_model, m.n_head, lay.tp, lay.sp,
                                      lay.recompute, value_bytes, lay.flash_attention, lay.precision == "fp8")
        logits = kernels.logit_seconds(mach.kernels, m.seq_len, b, m.d_model, m.vocab, lay.tp, value_bytes)
        scale = mach.matmul_efficiency
        return ((layers_here * block[0] / scale, layers_here * block[1] / scale),
                (logits[0] / scale, logits[1] / scale))
    # more ranks than cores: each rank computes at cores/ranks of its speed (the OS time-shares them)
    time_shared = max(1.0, lay.gpus / mach.cores) if mach.cores else 1.0
    # a fixed cost per block and pass that splitting the matmuls does not divide (0 on a GPU preset)
    forward = (layers_here * layer_forward_flops(m, b) / lay.tp / mach.achieved_flops
               + layers_here * mach.block_overhead) * time_shared
    logits = logit_forward_flops(m, b) / lay.tp / mach.achieved_flops * time_shared
    # recomputation reruns in backward what model.hardware_flops counts beyond the model's FLOPs
    recompute = (hardware_flops(m, b, lay.recompute) - model_flops(m, b)) / (lay.tp * lay.pp)
    return (forward, 2 * forward + recompute / mach.achieved_flops * time_shared), (logits, 2 * logits)


def _linear_seconds(m: ModelShape, lay: Layout, mach: Machine) -> list[float]:
    """Forward seconds of a block's q/k/v, projection, fc and fc2 GEMMs on a tp rank: the windows
    tensor-parallel communication can hide under."""
    b, h, t = lay.microbatch_size, m.d_model, lay.tp
    gemms = kernels.linear_gemms(m.seq_len, b, h, m.n_head, t)
    if mach.kernels is not None:
        value_bytes = PRECISION_BYTES[lay.precision][3]
        if lay.precision == "fp8":
            return [kernels.fp8_gemm_seconds(mach.kernels, *g) / mach.matmul_efficiency for g in gemms]
        return [kernels.gemm_seconds(mach.kernels, *g, value_bytes=value_bytes) / mach.matmul_efficiency
                for g in gemms]
    return [2 * mm * n * k / mach.achieved_flops for mm, n, k, _ in gemms]


def _dp_exposed(lay: Layout, gradients: float, forward_s: float, backward_s: float) -> float:
    """What the data-parallel traffic leaves on the critical path when it overlaps (Megatron-Core's
    bucketed overlap): gradients are final only in the last micro-batch's backward, so their reduction
    hides under that one backward; ZeRO's parameter all-gather (after the step, stages 1-2; before
    each use, stage 3) under the first micro-batch's forward. Each part: max(0, its seconds - window)."""
    if lay.zero == 0:
        parts = [(gradients, backward_s)]                               # all-reduce
    elif lay.zero in (1, 2):
        parts = [(gradients / 2, backward_s), (gradients / 2, forward_s)]  # reduce-scatter, all-gather
    else:
        parts = [(gradients, backward_s), (gradients / 2, forward_s)]  # gather + reduce-scatter; gather
    return sum(max(0.0, seconds - window) for seconds, window in parts)


def simulate_step(m: ModelShape, lay: Layout, mach: Machine) -> dict:
    """Predicted step time, throughput, memory per GPU and communication time by dimension."""
    b, s, h = lay.microbatch_size, m.seq_len, m.d_model
    value_bytes = PRECISION_BYTES[lay.precision][3]
    links = _links(lay, mach)
    per_gpu = lay.tp * lay.pp
    (forward_compute, backward_compute), logits = _compute_seconds(m, lay, mach)
    stages = lay.blocks_per_stage(m.n_layer)
    layers_here = max(stages)  # the heaviest stage's blocks set the pipeline's pace
    # two all-reduces of the s·b·h activations per block and pass (Megatron's f and g); with --sp a
    # reduce-scatter and an all-gather each instead, the same bytes (the backward's re-gather of each
    # gathered input is not charged: in every published --sp run it hides under the input-gradient GEMM)
    all_reduce = ring_seconds("all_reduce", s * b * h * value_bytes, lay.tp, *links["tp"])
    tp_pass = 2 * layers_here * all_reduce
    tp_exposed = tp_pass
    if "tp" in lay.overlap:
        # Megatron-Core's tp overlap: each half all-reduce (the all-gather before q/k/v and fc, the
        # reduce-scatter after the projection and fc2) runs under the GEMM it feeds or drains; what
        # the GEMM is too short to hide stays on the critical path
        windows = _linear_seconds(m, lay, mach)
        tp_exposed = layers_here * sum(max(0.0, all_reduce / 2 - gemm) for gemm in windows)
    p2p = 0.0
    if lay.pp > 1:
        # Megatron's scatter/gather: each tp rank sends its 1/tp of the activation across, and the
        # receiving stage all-gathers the pieces over its tp link
        bandwidth, latency = links["pp"]
        activation = s * b * h * value_bytes
        p2p = lay.chunks * (latency + activation / lay.tp / bandwidth
                                    + ring_seconds("all_gather", activation, lay.tp, *links["tp"]))
    p2p_exposed = 0.0 if "pp" in lay.overlap else p2p  # sent while the next micro-batch computes
    recompute_passes = 1 if lay.recompute == "full" else 0  # only a whole block's rerun all-reduces again
    forward_s = forward_compute + tp_exposed + p2p_exposed
    backward_s = backward_compute + (1 + recompute_passes) * tp_exposed + p2p_exposed
    if lay.pp == 1:
        forward_s, backward_s = forward_s + logits[0], backward_s + logits[1]
    pipeline_s, bubble, inflight = _pipeline(lay, forward_s, backward_s)
    # the logits sit on the last stage alone: when that makes it the slowest stage, busy for every
    # micro-batch, the step grows by M times what it takes beyond the heaviest stage's blocks (with
    # even stages, the logits' seconds; exact for 1F1B, whose last stage never waits once it is the
    # slowest; an approximation for the other schedules). Uneven stages (Layout.stage_layers, as
    # BLOOM partitions) run the timeline of the heaviest one.
    if lay.pp > 1:
        block_s = (forward_s + backward_s - 2 * p2p_exposed) / layers_here
        last_beyond = (stages[-1] - layers_here) * block_s + logits[0] + logits[1]
        pipeline_s += lay.microbatches * max(0.0, last_beyond)
    grad_bytes = Fraction(parameter_count(m), per_gpu) * PRECISION_BYTES[lay.precision][1]
    gradients = ring_seconds("all_reduce", float(grad_bytes), lay.dp, *links["dp"])
    dp_s = (1.5 if lay.zero == 3 else 1.0) * gradients  # ZeRO-3 gathers parameters again in backward
    dp_exposed = dp_s
    if "dp" in lay.overlap:
        dp_exposed = _dp_exposed(lay, gradients, forward_compute, backward_compute)
    step_s = pipeline_s + dp_exposed
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
        "exposed_comm_s": {"tp": lay.microbatches * (2 + recompute_passes) * tp_exposed,
                           "pp": lay.microbatches * 2 * p2p_exposed, "dp": dp_exposed},
        "compute_s": lay.microbatches * (forward_compute + backward_compute + logits[0] + logits[1]),
        "bubble_fraction": bubble,
    }
