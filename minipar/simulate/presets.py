"""Published runs to check the simulator against: Narayanan et al. 2021, Table 1.

"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21), Table 1:
GPT models from 1.7B to 1T parameters on up to 3072 A100-80GB GPUs of Selene (8 per node, NVLink
inside, 8 x 200 Gb/s HDR InfiniBand per node), sequence 2048, vocabulary 51200, mixed precision,
full activation recomputation; achieved TFLOP/s per GPU counted with the 96 form (the paper's eq. 3).
Every figure below was checked against the paper's Table 1 and against NVIDIA's copy of the table in
the Megatron-LM README of April 2021 (images/cases_april2021.png, which gives tp x pp as one
model-parallel size; the paper gives the split). Lesson 14 says where.

The paper gives no micro-batch size or schedule per row; NVIDIA's script that reruns the table does
(examples/sc21/run_table_1.sh of github.com/NVIDIA/Megatron-LM: MBS, and
--num-layers-per-virtual-pipeline-stage for the interleaved schedule of the 76B to 530B rows), and the
presets take them from it: micro-batch 16, 16, 16, 8, 4, 2, 2, 1, 1, 1; interleaved with 5, 5, 3, 1
blocks per chunk (3, 2, 2, 3 chunks per stage) for 76B, 146B, 310B, 530B, 1F1B elsewhere. The rest is
the same for every row: full recomputation, ZeRO 0, no sequence parallelism, nothing overlapped (the
script's first four rows use PyTorch's DDP, which can overlap the gradient all-reduce with the
backward; the others Megatron's own, which does not: lesson 14 shows both).
"""

from __future__ import annotations

from minipar.simulate.machines import GPUS, Machine, machine
from minipar.simulate.model import ModelShape
from minipar.simulate.step import Layout, simulate_step

SEQ, VOCAB = 2048, 51200

# name: (billions of parameters, heads, width, blocks, tp, pp, GPUs, batch, published TFLOP/s per GPU)
MEGATRON_TABLE1 = {
    "megatron-1.7b": (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    "megatron-3.6b": (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    "megatron-7.5b": (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    "megatron-18b": (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    "megatron-39b": (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    "megatron-76b": (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    "megatron-146b": (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    "megatron-310b": (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    "megatron-530b": (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    "megatron-1t": (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
}
# name: (micro-batch size, blocks per interleaved chunk or None for 1F1B): examples/sc21/run_table_1.sh
SC21_SETTINGS = {
    "megatron-1.7b": (16, None), "megatron-3.6b": (16, None), "megatron-7.5b": (16, None),
    "megatron-18b": (8, None), "megatron-39b": (4, None), "megatron-76b": (2, 5), "megatron-146b": (2, 5),
    "megatron-310b": (1, 3), "megatron-530b": (1, 1), "megatron-1t": (1, None),
}
PRESETS = {"gpt3-175b": "the GPT-3 shape (96 blocks, width 12288, 96 heads) on 1024 A100s: tp 8, pp 16"}


def preset(name: str) -> tuple[ModelShape, Layout, float | None]:
    """(model, layout, published TFLOP/s per GPU or None) of a published run."""
    if name == "gpt3-175b":
        return (ModelShape(96, 12288, 96, SEQ, VOCAB),
                Layout(1536, microbatches=1536 // 8, dp=8, tp=8, pp=16, recompute="full", precision="fp16"),
                None)
    _, heads, width, blocks, tp, pp, gpus, batch, published = MEGATRON_TABLE1[name]
    microbatch_size, per_chunk = SC21_SETTINGS[name]
    dp = gpus // (tp * pp)
    chunks = 1 if per_chunk is None else blocks // (pp * per_chunk)
    layout = Layout(batch, microbatches=batch // (dp * microbatch_size), dp=dp, tp=tp, pp=pp,
                    virtual_stages=chunks, schedule="interleaved" if chunks > 1 else "1f1b",
                    recompute="full", precision="fp16")
    return ModelShape(blocks, width, heads, SEQ, VOCAB), layout, published


def calibrate(name: str = "megatron-1.7b", gpu: str = "a100-80gb") -> float:
    """The matmul efficiency at which the simulator predicts exactly the published figure of `name`:
    TFLOP/s scale with it up to the communication time, so a few fixed-point steps converge."""
    shape, layout, published = preset(name)
    efficiency = GPUS[gpu].matmul_efficiency
    for _ in range(20):
        predicted = simulate_step(shape, layout, machine(gpu, matmul_efficiency=efficiency))["tflops_per_gpu"]
        efficiency *= published / predicted
    return efficiency


def table1(mach: Machine | None = None) -> list[dict]:
    """Every row of Table 1: published against predicted TFLOP/s per GPU, and the relative error."""
    mach = mach or GPUS["a100-80gb"]
    rows = []
    for name, row in MEGATRON_TABLE1.items():
        shape, layout, published = preset(name)
        result = simulate_step(shape, layout, mach)
        rows.append({"name": name, "params_b": row[0], "gpus": layout.gpus, "tp": layout.tp, "pp": layout.pp,
                     "dp": layout.dp, "published": published, "predicted": result["tflops_per_gpu"],
                     "error": result["tflops_per_gpu"] / published - 1,
                     "bubble_fraction": result["bubble_fraction"],
                     "memory_gb": result["memory"]["total"] / 1e9})
    return rows


# Narayanan et al. 2021, the comparison with ZeRO-3 (section 5.2), the 175B model (GPT-3's shape,
# 174.6B parameters), batch 1536: (scheme, GPUs, tp, pp, micro-batch size, published TFLOP/s per GPU).
# Checked against the paper's Table 2. It gives PTD-P's model-parallel size only as 96: tp 8 x pp 12 is
# our reading of it, not a published split. ZeRO-3 "without model parallelism" runs dp = GPUs.
ZERO3_COMPARISON = [
    ("zero-3", 384, 1, 1, 4, 144), ("zero-3", 768, 1, 1, 2, 88), ("zero-3", 1536, 1, 1, 1, 44),
    ("ptd-p", 384, 8, 12, 1, 153), ("ptd-p", 768, 8, 12, 1, 149), ("ptd-p", 1536, 8, 12, 1, 141),
]


def zero3_comparison(mach: Machine | None = None) -> list[dict]:
    """ZeRO-3 against 3D parallelism on the 175B model: published against predicted TFLOP/s per GPU."""
    mach = mach or GPUS["a100-80gb"]
    shape, batch = ModelShape(96, 12288, 96, SEQ, VOCAB), 1536
    rows = []
    for scheme, gpus, tp, pp, b, published in ZERO3_COMPARISON:
        dp = gpus // (tp * pp)
        layout = Layout(batch, microbatches=batch // (dp * b), dp=dp, tp=tp, pp=pp,
                        zero=3 if scheme == "zero-3" else 0, recompute="full")
        result = simulate_step(shape, layout, mach)
        rows.append({"scheme": scheme, "gpus": gpus, "tp": tp, "pp": pp, "dp": dp, "microbatch_size": b,
                     "published": published, "predicted": result["tflops_per_gpu"],
                     "error": result["tflops_per_gpu"] / published - 1, "comm_dp_s": result["comm_s"]["dp"],
                     "step_s": result["step_s"], "memory_gb": result["memory"]["total"] / 1e9})
    return rows
