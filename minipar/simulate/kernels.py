"""Kernel time from the kernel's shape: the GEMMs of a block on their tiles, the rest at HBM bandwidth.

The idea: one matmul efficiency for every shape cannot tell h = 2304 on one GPU from h = 25600 split
8 ways. A kernel's time is instead the larger of its math and its memory traffic,

    seconds = max(FLOPs / (achieved FLOP/s of its tiles), bytes / HBM bandwidth),

and a GEMM's math runs in tiles (NVIDIA, "Matrix Multiplication Background User's Guide", 2023,
sections 2.3 and 3): the output is cut into tm x tn tiles, one per SM at a time, so a GEMM takes
ceil(tiles / SMs) waves of whole tiles (tile and wave quantization), and cuBLAS picks, per shape, the
tile of its list (256x128 and 128x256 the most efficient, then 128x128, 256x64, 64x256, 128x64, 64x128,
64x64) that finishes first. A tile is efficient when it reuses what it loads: per step along k it
reads tm + tn values for 2·tm·tn FLOPs, so its SMs run at min(MAMF, 2·tm·tn / ((tm + tn)·bytes) x L2
bandwidth). MAMF, the ceiling, is measured, not the datasheet's peak: the maximum achievable matmul
FLOP/s of the best shape (Bekman, "Machine Learning Engineering", compute/accelerator/README.md,
"Maximum Achievable Matmul FLOPS comparison table", github.com/stas00/ml-engineering: A100 SXM 271.2
TFLOP/s bf16 of 312 (86.9%), best shape 1024x10240x5120; H100 SXM 794.5 of 989 (80.3%), best shape
2048x2048x13312; torch 2.6/2.7, CUDA 12.6). Everything else of a block (LayerNorm, bias+GELU, the
softmax, dropout, the residual adds) streams its bytes through HBM once: at 2.039 TB/s on A100-80GB,
1.555 TB/s on A100-40GB, 3.35 TB/s on H100 SXM (NVIDIA's datasheets). SMs: 108 on A100, 132 on H100
SXM (the guide; the H100 whitepaper). L2 bandwidth: A100 5120 bytes per clock at 1.41 GHz (the A100
whitepaper: 2.3x V100's); H100: the same bytes per clock and SM at 1.83 GHz, an assumption.

FP8 (`--precision fp8`, H100 only: A100 has no FP8 tensor cores). The H100 datasheet's SXM figure for
the FP8 Tensor Core, 3,958 teraFLOPS, is with sparsity; the dense rate is half. The Hopper
whitepaper's peak table gives both (SXM5, boost clock; as tabulated at
glennklockwood.com/garden/processors/h100): FP8 1978.9 TFLOP/s dense and 3957.8 sparse, against BF16's
989.4 dense. No measured FP8 MAMF is cited here, so FP8 keeps
bf16's measured share of the peak: 794.5 x 1978.9 / 989.4 = 1589.1 TFLOP/s (an assumption), and its
operands are 1 byte (the tiles' L2 traffic and the bytes bound halve). Only the Linear layers' GEMMs
(q/k/v, projection, fc, fc2, forward and both backward products) run in FP8, as the recipes of
precision/fp8.py keep them; the attention core's per-head GEMMs, the logits and the elementwise passes
stay bf16. The recipes' amax and quantize passes are not charged (Transformer Engine fuses them into
the neighbouring kernels).

What it counts (Megatron-LM's GPT, the fused kernels of 2021: scale+mask+softmax, bias+GELU,
bias+dropout+add): per block and forward, six GEMMs on a tensor-parallel rank of t (q/k/v, the
scores and the weighted sum per head, the projection, fc and fc2; their FLOPs are model.py's
24sbh²/t + 4s²bh/t exactly); backward, for each GEMM Y = XW, dX (m, k, n) and dW (k, n, m). The
elementwise passes, in values read and written per token (p = t with --sp, else 1: without sequence
parallelism every tp rank runs the LayerNorms and residual adds on the whole h):

    pass                   forward                       backward (reads dY and what was saved)
    2 LayerNorms           read x, write y: 4h/p         read x, dy, write dx: 6h/p
    2 bias+dropout+adds    read x, residual, write: 6h/p read dy, write dx: 4h/p
                           (+ a 1-byte mask, 2h/p)       (+ the mask read)
    bias+GELU              read, write 4h/t: 8h/t        read dy, x, write dx: 12h/t
    softmax                read, write as/t: 2as/t       read dy, y, write dx: 3as/t
    attention dropout      read, write: 2as/t            read dy, write dx: 2as/t
                           (+ a 1-byte mask, as/t)       (+ the mask read)

The logits: one GEMM of s·b x V/t x h (its backward's two as above) and the softmax cross-entropy,
which reads and writes the s·b·V/t logits (twice that in backward). The embedding's lookup is left
out (s·b·h values a step, no GEMM).
What it saves: the one efficiency that kept Table 1 flat. What it costs: the constants above, each
cited; the one scalar left (Machine.matmul_efficiency: launch gaps and what is not fused) is
calibrated on Table 1's first row. Lesson: lessons/14_simulate.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

# what the measured ceilings are for: 16-bit tensor-core matmuls (fp32 would be TF32 or CUDA cores)
PRECISIONS = ("bf16", "fp16", "fp8")
FP8_BYTES = 1  # an FP8 GEMM operand's bytes


def precision_error(gpu: str, precision: str) -> str:
    if precision == "fp8":
        return f"--precision fp8 on {gpu}: it has no FP8 tensor cores (use --gpu h100-80gb, or bf16)"
    return (f"--precision {precision} on {gpu}: its kernel model has measured bf16/fp16 matmul rates only "
            f"(use bf16 or fp16)")


def supports(spec: KernelSpec, precision: str) -> bool:
    """Whether the kernel model has a matmul rate for `precision` (FP8: only with an FP8 ceiling)."""
    return precision in PRECISIONS and (precision != "fp8" or spec.fp8_mamf is not None)


# cuBLAS's tile sizes (the guide, section 2.3), the most efficient first
TILES = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64), (64, 128), (64, 64))


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel's time depends on: the measured matmul ceiling, SMs, L2 and HBM bandwidth."""

    mamf: float            # maximum achievable matmul FLOP/s (measured, bf16)
    sms: int               # streaming multiprocessors: one tile each per wave
    l2_bandwidth: float    # bytes/s the tiles' loads come through
    hbm_bandwidth: float   # bytes/s of device memory, what elementwise kernels stream at
    fp8_mamf: float | None = None  # the FP8 ceiling (None: no FP8 tensor cores)


A100_L2 = 5120 * 1.41e9
A100_80GB = KernelSpec(mamf=271.2e12, sms=108, l2_bandwidth=A100_L2, hbm_bandwidth=2.039e12)
A100_40GB = KernelSpec(mamf=271.2e12, sms=108, l2_bandwidth=A100_L2, hbm_bandwidth=1.555e12)
H100_BF16_PEAK, H100_FP8_PEAK = 989.4e12, 1978.9e12  # the Hopper whitepaper, dense, SXM5
H100_SXM = KernelSpec(mamf=794.5e12, sms=132, l2_bandwidth=5120 / 108 * 132 * 1.83e9, hbm_bandwidth=3.35e12,
                      fp8_mamf=794.5e12 * H100_FP8_PEAK / H100_BF16_PEAK)


def tile_flops(spec: KernelSpec, tile: tuple[int, int], value_bytes: int = 2) -> float:
    """FLOP/s of the whole GPU running tiles of this size: MAMF, or less where the tile's loads per
    FLOP exceed what L2 delivers (small tiles reuse less)."""
    tm, tn = tile
    return min(spec.mamf, 2 * tm * tn / ((tm + tn) * value_bytes) * spec.l2_bandwidth)


@functools.lru_cache(maxsize=4096)  # a search asks for the same shapes many times
def gemm_seconds(spec: KernelSpec, m: int, n: int, k: int, batch: int = 1, value_bytes: int = 2) -> float:
    """A (batch of) m x k by k x n GEMM: the best tile's whole waves, or its bytes through HBM."""
    best = math.inf
    for tm, tn in TILES:
        waves = math.ceil(math.ceil(m / tm) * math.ceil(n / tn) * batch / spec.sms)
        best = min(best, waves * spec.sms * 2 * tm * tn * k / tile_flops(spec, (tm, tn), value_bytes))
    return max(best, batch * (m * k + k * n + m * n) * value_bytes / spec.hbm_bandwidth)


LINEAR_GEMMS = (0, 3, 4, 5)  # block_gemms' Linear layers; 1 and 2 are the attention core's, per head


def block_gemms(s: int, b: int, h: int, a: int, t: int = 1) -> list[tuple[int, int, int, int]]:
    """(m, n, k, batch) of one block's forward GEMMs on a tensor-parallel rank of t."""
    tokens, head, heads = s * b, h // a, b * a // t
    return [(tokens, 3 * h // t, h, 1),      # q, k, v (column-parallel)
            (s, s, head, heads),             # scores q·kᵀ per head
            (s, head, s, heads),             # the weighted sum of v
            (tokens, h, h // t, 1),          # the projection (row-parallel)
            (tokens, 4 * h // t, h, 1),      # fc (column-parallel)
            (tokens, h, 4 * h // t, 1)]      # fc2 (row-parallel)


def backward_gemms(gemms):
    """For each forward GEMM Y = X·W (m, n, k): dX = dY·Wᵀ (m, k, n) and dW = Xᵀ·dY (k, n, m)."""
    return [shape for m, n, k, batch in gemms for shape in ((m, k, n, batch), (k, n, m, batch))]


def block_elementwise_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            value_bytes: int = 2) -> tuple[int, int]:
    """(forward, backward) bytes one block streams through HBM outside its GEMMs, per the module
    docstring's table: values per token (times the value's bytes) and 1-byte dropout masks."""
    p = t if sp else 1
    forward_values = 10 * h // p + 8 * h // t + 4 * a * s // t
    backward_values = 10 * h // p + 12 * h // t + 5 * a * s // t
    masks = 2 * h // p + a * s // t  # written in forward, read in backward
    return (s * b * (forward_values * value_bytes + masks), s * b * (backward_values * value_bytes + masks))


def attention_core(s: int, b: int, h: int, a: int, t: int = 1, value_bytes: int = 2):
    """What selective recomputation reruns: the two per-head GEMMs, and the softmax and its dropout
    (read and write as/t values per token each, the mask as/t bytes)."""
    gemms = block_gemms(s, b, h, a, t)[1:3]
    return gemms, s * b * (4 * a * s // t * value_bytes + a * s // t)


def fp8_gemm_seconds(spec: KernelSpec, m: int, n: int, k: int, batch: int = 1) -> float:
    """A GEMM with FP8 operands: the same tiles and waves at the FP8 ceiling, 1 byte a value."""
    return gemm_seconds(replace(spec, mamf=spec.fp8_mamf), m, n, k, batch, value_bytes=FP8_BYTES)


def seconds(spec: KernelSpec, gemms, elementwise_bytes: int, value_bytes: int = 2, fp8_gemms=()) -> float:
    """GEMMs one after another, then the elementwise passes at HBM bandwidth; `fp8_gemms` run in FP8."""
    return (sum(gemm_seconds(spec, *shape, value_bytes=value_bytes) for shape in gemms)
            + sum(fp8_gemm_seconds(spec, *shape) for shape in fp8_gemms)
            + elementwise_bytes / spec.hbm_bandwidth)


def linear_gemms(s: int, b: int, h: int, a: int, t: int = 1) -> list[tuple[int, int, int, int]]:
    """The forward GEMMs of a block's Linear layers (q/k/v, projection, fc, fc2): what FP8 runs."""
    gemms = block_gemms(s, b, h, a, t)
    return [gemms[i] for i in LINEAR_GEMMS]


def flash_attention_saving(s: int, b: int, h: int, a: int, t: int = 1,
                           value_bytes: int = 2) -> tuple[int, int, list[tuple[int, int, int, int]]]:
    """What a fused attention kernel (FlashAttention, Dao et al. 2022) changes: the softmax and its
    dropout run on chip, so their s x s passes' bytes (the docstring's table: 4as/t values and the
    as/t-byte mask per token forward, 5as/t and the mask backward) leave HBM, and its backward
    recomputes the scores q·kᵀ from q and k: one more per-head GEMM. Returns (forward bytes saved,
    backward bytes saved, the extra backward GEMMs)."""
    per_token = a * s // t  # the s x s arrays' values per token on a tp rank
    forward = s * b * (4 * per_token * value_bytes + per_token)
    backward = s * b * (5 * per_token * value_bytes + per_token)
    return forward, backward, block_gemms(s, b, h, a, t)[1:2]


def block_seconds(spec: KernelSpec, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                  recompute: str = "none", value_bytes: int = 2, flash: bool = False,
                  fp8: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one block on one tensor-parallel rank; the backward includes
    what recomputation reruns (the whole forward, or the attention core). `flash`: the attention
    core fused (flash_attention_saving). `fp8`: the Linear layers' GEMMs in FP8."""
    gemms = block_gemms(s, b, h, a, t)
    forward_bytes, backward_bytes = block_elementwise_bytes(s, b, h, a, t, sp, value_bytes)
    extra_backward: list[tuple[int, int, int, int]] = []
    if flash:
        forward_saved, backward_saved, extra_backward = flash_attention_saving(s, b, h, a, t, value_bytes)
        forward_bytes, backward_bytes = forward_bytes - forward_saved, backward_bytes - backward_saved
    narrow = [g for i, g in enumerate(gemms) if fp8 and i in LINEAR_GEMMS]  # fp8: the Linear layers'
    wide = [g for i, g in enumerate(gemms) if not (fp8 and i in LINEAR_GEMMS)]
    forward = seconds(spec, wide, forward_bytes, value_bytes, narrow)
    backward = seconds(spec, backward_gemms(wide) + extra_backward, backward_bytes, value_bytes,
                       backward_gemms(narrow))
    if recompute == "full":
        backward += forward
    elif recompute == "selective":
        core_gemms, core_bytes = attention_core(s, b, h, a, t, value_bytes)
        backward += seconds(spec, core_gemms, 0 if flash else core_bytes, value_bytes)
    return forward, backward


def logit_seconds(spec: KernelSpec, s: int, b: int, h: int, vocab: int, t: int = 1,
                  value_bytes: int = 2) -> tuple[float, float]:
    """(forward, backward) of the output projection on a tp rank (V/t columns) and its softmax
    cross-entropy (read and write the s·b·V/t logits; backward twice that)."""
    gemm = [(s * b, vocab // t, h, 1)]
    softmax = 2 * s * b * vocab // t * value_bytes
    return (seconds(spec, gemm, softmax, value_bytes),
            seconds(spec, backward_gemms(gemm), 2 * softmax, value_bytes))
