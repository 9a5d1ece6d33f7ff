"""GPU presets: peak matmul FLOP/s, one achieved-efficiency constant each, memory, and the links.

Sources: A100 (NVIDIA A100 datasheet, 2020): 312 TFLOP/s dense bf16/fp16, 40 or 80 GB; NVLink 3
through NVSwitch, 600 GB/s per GPU both ways (300 GB/s each way). H100 SXM (NVIDIA H100 datasheet,
2022): 989 TFLOP/s dense bf16, 80 GB, NVLink 4 at 900 GB/s both ways (450 each way). Between
nodes: one 200 Gb/s HDR InfiniBand adapter per GPU (Selene, the DGX A100 SuperPOD of Narayanan et
al. 2021: 25 GB/s each way per GPU); NDR 400 Gb/s for H100 (50 GB/s). Latencies: a few
microseconds per message (NCCL on NVLink ~5 µs, on InfiniBand ~10 µs): rough, they matter only for
small messages.

`matmul_efficiency` is the one calibrated constant per GPU type: the share of peak the matmuls
reach. A100 (0.4762): calibrated on the first row of Narayanan et al.'s Table 1 (1.7B parameters on 32
GPUs, no model parallelism, 137 TFLOP/s published), see presets.calibrate; every other row is a
prediction. H100 has no published point here: the A100 value is reused (an assumption, said so).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Machine:
    name: str
    peak_flops: float          # dense half-precision matmul FLOP/s of one GPU
    matmul_efficiency: float   # achieved share of peak (calibrated, see the module docstring)
    memory_bytes: int
    gpus_per_node: int = 8
    intra_bandwidth: float = 300e9   # bytes/s each way per GPU inside a node (NVLink)
    inter_bandwidth: float = 25e9    # bytes/s each way per GPU between nodes (InfiniBand)
    intra_latency: float = 5e-6      # seconds per message
    inter_latency: float = 10e-6
    cores: int | None = None         # a CPU: ranks beyond its cores time-share them (None: a GPU each)
    block_overhead: float = 0.0      # seconds per block and forward whatever its size (a CPU's Python)

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.matmul_efficiency


A100_EFFICIENCY = 0.4762  # presets.calibrate("megatron-1.7b") on a100-80gb, rounded to 4 digits

GPUS = {
    "a100-40gb": Machine("a100-40gb", 312e12, A100_EFFICIENCY, 40 * 10**9),
    "a100-80gb": Machine("a100-80gb", 312e12, A100_EFFICIENCY, 80 * 10**9),
    "h100-80gb": Machine("h100-80gb", 989e12, A100_EFFICIENCY, 80 * 10**9, intra_bandwidth=450e9,
                         inter_bandwidth=50e9),
}


def machine(name: str, **overrides) -> Machine:
    """A preset with some fields replaced (None leaves a field as it is)."""
    return replace(GPUS[name], **{k: v for k, v in overrides.items() if v is not None})
