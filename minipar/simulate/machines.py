"""GPU presets: peak matmul FLOP/s, a kernel model, one calibrated scalar, memory, and the links.

Sources: A100 (NVIDIA A100 datasheet, 2020): 312 TFLOP/s dense bf16/fp16, 40 or 80 GB; NVLink 3
through NVSwitch, 300 GB/s each way per GPU. H100 SXM (NVIDIA H100 datasheet, 2022): 989 TFLOP/s
dense bf16, 80 GB, NVLink 4 at 450 GB/s each way. Between nodes: one 200 Gb/s HDR InfiniBand adapter
per GPU (Selene, the DGX A100 SuperPOD of Narayanan et al. 2021: 25 GB/s each way per GPU); NDR 400
Gb/s for H100 (50 GB/s). The links are charged at what NCCL achieves, not at line rate: 8 A100s
all-reduce at a bus bandwidth of 232.5 GB/s (all_reduce_perf on one node, github.com/NVIDIA/nccl-tests
issue 175), two nodes of 4 HDR adapters at 86 of their 100 GB/s (the same issue: 86%, so 21.5 GB/s
per GPU); on H100 NCCL's protocol overhead leaves about 370 of NVLink 4's 450 GB/s (a NCCL
maintainer, nccl-tests issue 212), and NDR is taken at the same 86% (43 GB/s), an assumption.
Latencies: a few microseconds per message (NCCL on NVLink ~5 µs, on InfiniBand ~10 µs): rough, they
matter only for small messages.

A GPU preset carries a kernel model (kernels.py: the GEMMs on their tiles and waves, elementwise
passes at HBM bandwidth, each constant cited there). `matmul_efficiency` is then the one calibrated
scalar: the share of the kernel model's speed the framework reaches (launch gaps, what is not fused).
A100 (0.8006): calibrated on the first row of Narayanan et al.'s Table 1 (1.7B parameters on 32 GPUs,
no model parallelism, 137 TFLOP/s published), see presets.calibrate; every other row is a
prediction. H100 has no published point here: the A100 value is reused (an assumption, said so).
A machine without a kernel model (a CPU, `bench simulate`) runs every matmul at `matmul_efficiency`
times its peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minipar.simulate import kernels


@dataclass(frozen=True)
class Machine:
    name: str
    peak_flops: float          # dense half-precision matmul FLOP/s of one GPU
    matmul_efficiency: float   # calibrated: of the kernel model's speed, or of peak without one
    memory_bytes: int
    gpus_per_node: int = 8
    intra_bandwidth: float = 232.5e9  # bytes/s each way per GPU inside a node (NVLink, as NCCL achieves)
    inter_bandwidth: float = 21.5e9   # bytes/s each way per GPU between nodes (InfiniBand, achieved)
    intra_latency: float = 5e-6      # seconds per message
    inter_latency: float = 10e-6
    cores: int | None = None         # a CPU: ranks beyond its cores time-share them (None: a GPU each)
    block_overhead: float = 0.0      # seconds per block and forward whatever its size (a CPU's Python)
    kernels: kernels.KernelSpec | None = None  # the kernel-time model (None: FLOPs at one rate)

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.matmul_efficiency


A100_EFFICIENCY = 0.8006  # presets.calibrate("megatron-1.7b") on a100-80gb, rounded to 4 digits

GPUS = {
    "a100-40gb": Machine("a100-40gb", 312e12, A100_EFFICIENCY, 40 * 10**9, kernels=kernels.A100_40GB),
    "a100-80gb": Machine("a100-80gb", 312e12, A100_EFFICIENCY, 80 * 10**9, kernels=kernels.A100_80GB),
    "h100-80gb": Machine("h100-80gb", 989e12, A100_EFFICIENCY, 80 * 10**9, intra_bandwidth=370e9,
                         inter_bandwidth=43e9, kernels=kernels.H100_SXM),
}


def machine(name: str, **overrides) -> Machine:
    """A preset with some fields replaced (None leaves a field as it is)."""
    return replace(GPUS[name], **{k: v for k, v in overrides.items() if v is not None})
