"""Published runs beyond Megatron 2021's Table 1, each with its publisher's settings and FLOP formula.

The idea: a cost model calibrated on one row is only as good as its predictions of runs it was not
tuned to. Each entry below is data, with its source: the model's shape, the cluster, the layout, what
overlapped, the publisher's own FLOP formula and the figure it reported. Nothing is fitted per run:
every run is simulated with the A100's one scalar of presets.calibrate(). What it costs: where a
publisher left a setting out, one stated rule per publisher fills it (said at each source below).
Lesson: lessons/14_simulate.md, "Published against predicted: other runs".

Sources, each checked here against the text named:
- Megatron 2022 (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", arXiv 2205.05198, read in a full-text conversion of the arXiv PDF; no second copy of its
  body was found). Table 3, "Model configurations used during evaluation" (heads, width, blocks, tp,
  pp, GPUs, global batch, micro-batch): 22B 64, 6144, 48, 8, 1, 8, 4, 4; 175B 96, 12288, 96, 8, 8, 64,
  64, 1; 530B 128, 20480, 105, 8, 35, 280, 280, 1; 1T 160, 25600, 128, 8, 64, 512, 512, 1. Section 6:
  "We use the interleaving schedule with three interleaving stages (m = 3) for the 175B and 530B
  models", s = 2048, v = 51200, "no data parallelism", Selene's A100-80GB. Table 5 (iteration times
  1.10, 13.75, 37.83, 71.49 s): model FLOPs utilization 41.5, 51.4, 56.0, 56.3%, the same figures as
  NVIDIA's Megatron-LM README gave them (the table "Model FLOPs Utilization", README.md at the parent
  of commit f2e5db402c of github.com/NVIDIA/Megatron-LM); its eq. 7 over those times and Table 3's
  shapes gives 41.6, 51.4, 56.0, 56.3, which checks the shapes. Selective recomputation with
  sequence parallelism, bf16. Nothing overlapped across dp (dp 1; section 6.3: "we do not use any
  overlapping of gradient all-reduces"); section 6.2 names one tp overlap, the backward's all-reduce
  under the weight-gradient GEMM, which Layout.overlap's "tp" (forward and backward) does not
  express: not modelled. MFU = 72·B·s·L·h²(1 + s/6h + V/12Lh) / (time x GPUs x 312 TFLOP/s).
- Megatron-Core on H100 (the Megatron-LM README since commit f2e5db402c, July 2024: images/
  model_table.png, its nine rows; the text beside it): vocabulary 131072, sequence 4096, data-,
  tensor- and pipeline-parallel communication overlapped with compute (`--overlap-grad-reduce
  --overlap-param-gather`, `--tp-comm-overlap`, pipeline by default). Per-GPU TFLOP/s by
  Megatron's num_floating_point_operations, which for this GPT (4h MLP, no GQA, no SwiGLU) is the
  72 form. Rules for what the README leaves out: bf16; the distributed optimizer (ZeRO-1, which
  --overlap-param-gather needs); sequence parallelism where tp > 1 (which --tp-comm-overlap needs);
  Transformer Engine's fused attention (`flash_attention`); no recomputation; micro-batch 1; 1F1B.
- BLOOM (BigScience, train/tr11-176B-ml/chronicles-prequel.md of github.com/bigscience-workshop/
  bigscience, section "Rebalancing layers", runs of 2022-02-28, the layouts the final BLOOM-176B
  was chosen from; its tr11-176B-ml.slurm for the rest): 48 nodes of 8 A100-80GB on Jean Zay
  (4 Omni-Path links of 100 Gb/s per node, train/tr11-176B-ml/README.md), global batch 2048,
  sequence 2048, vocabulary padded to 250880, bf16 with its own ZeRO-1, full recomputation,
  Megatron-DeepSpeed with nothing overlapped, the pipeline cut by `--pp-partition-method
  'type:transformer|embedding'` (L + 2 slots, each embedding one: the first and last stages hold one
  block fewer). TFLOP/s by eq. 3 of Narayanan et al. (the 96 form; math/README.md of the same
  repository, "Calculate TFLOPs").
- GPT-NeoX-20B (Black et al. 2022, arXiv 2204.06745, read in its arXiv LaTeX source, mirrored at
  dataset/train/2204.06745v1/2204.06745v1.tex of github.com/jd-coderepos/sota, commit aa5c9e4f35).
  Section 3: "we found that the most efficient way to distribute the model given our hardware setup
  was to set a tensor parallel size of 2, and a pipeline parallel size of 4 [...] In this fashion, we
  were able to achieve and maintain an efficiency of 117 teraFLOPS per GPU." Section 2.3: twelve
  servers of eight A100-SXM4-40GB, four ConnectX-6 HCAs (HDR InfiniBand) per node. Appendix B's
  configuration table: model-parallel-size 2, pipe-parallel-size 4, train-micro-batch-size-per-gpu
  4, gradient-accumulation-steps 32, zero-optimization.stage 1, fp16, checkpoint-activations,
  train-iters 150000 (the paper's text says 1538 contexts a batch; the configuration makes 4 x 32 x
  12 = 1536, used here). 117 TFLOP/s in get_flops is a step of 1536 sequences in 43.85 s, 150,000
  steps in 1,827 hours; a secondary summary of the paper (nl2code.github.io) gives 1,830 hours of
  training (the paper's number is in math mode, blanked in the mirror). Shape and layout from
  configs/20B.yml at tag v1.0 of github.com/EleutherAI/gpt-neox, checked: tp 2, pp 4, micro-batch 4,
  32 micro-batches, full recomputation, fp16, ZeRO-1. Its FLOP formula (megatron/logging.py's
  get_flops at v1.0, checked):
  `train_batch_size * seq_length * (total_params * 6 + seq_length * hidden_size * num_layers * 60)
  / (iter_time_s * world_size)` with N = 20,556,201,984 parameters (the model card). Nothing
  overlapped: with pipe-parallel-size >= 1 GPT-NeoX runs DeepSpeed's PipelineEngine
  (arguments.py: `is_pipe_parallel = pipe_parallel_size >= 1`), whose TrainSchedule issues
  ReduceGrads after the last micro-batch, an all-reduce (`buffered_allreduce_fallback`,
  deepspeed/runtime/pipe/ of github.com/EleutherAI/DeeperSpeed at v1.0); `overlap_comm` acts at
  ZeRO-2 only. Not modelled: ZeRO-1's all-gather of the updated parameters after it.
- Pythia 2.8B, 6.9B and 12B (Biderman et al. 2023, arXiv 2304.01373, trained with GPT-NeoX v1.0:
  the gpt-neox README), read in its arXiv LaTeX source (v2, mirrored at dataset/train/
  2304.01373v2/2304.01373v2.tex of github.com/jd-coderepos/sota, commit aa5c9e4f35): Appendix D,
  "Training Hardware and GPU hours", Table 5 rows "2.8 B & 64 & 14,240", "6.9 B & 128 & 33,500",
  "12 B & 256 & 72,300" (total 136,070; x 2 data sets x 2 trainings = the 544,280 A100-hours the
  appendix states), caption: "the total number of GPU hours, calculated via (iteration time (s)
  [x] number of iterations [x] number of GPUs [/] 3600 s/hour). All GPUs are A100s with 40GB of
  memory." So a step took GPU-hours x 3600 / (143,000 x GPUs) s: 143,000 iterations of 1024
  sequences of 2048 (train-iters and the layout in models/<size>/pythia-<size>.yml of
  github.com/EleutherAI/pythia; Appendix E, Table 6: pipe-parallel-size 1, zero-optimization.stage
  1, fp16, checkpoint-activations, flash attention, "the 6.9b models were trained with
  model-parallel-size = 2 and the 12b models [...] = 4"): tp 1, 2, 4, pp 1, micro-batch 16, 8, 8
  with 1, 2, 2 accumulation steps. The figure is that step time put in get_flops (the error is the
  step times' ratio whatever the formula), N = Table 1's non-embedding parameters + the untied
  embedding and head, 2·V·h, V padded to 50304, 50432, 50688 (multiples of 128·tp): 2,775,208,960,
  6,857,302,016 and 11,846,072,320. Nothing overlapped (pipe-parallel-size 1: the PipelineEngine, as
  above). The cluster is not named; rule: AWS p4d.24xlarge, because the configs read from `/fsx/`
  (Amazon FSx for Lustre) and the paper's acknowledgments read "We are grateful to Stability AI for
  providing the compute required to train these models". Its network: "8 x 40 GB NVIDIA Tesla A100
  GPUs with NVSwitch and 400 Gbps Elastic Fabric Adapter (EFA) enabled networking" (AWS, "Amazon EC2
  P4d instances deep dive", aws.amazon.com/blogs/compute/amazon-ec2-p4d-instances-deep-dive/, read in
  a syndicated copy). With the 20B cluster's network instead, pythia-12b would be +21.3%.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from minipar.simulate.machines import Machine, machine
from minipar.simulate.model import ModelShape, hardware_flops, model_flops
from minipar.simulate.step import Layout, simulate_step

# the clusters: a GPU preset and what differs from it. Jean Zay: 4 Omni-Path links of 100 Gb/s per
# node of 8 GPUs, 6.25 GB/s each way per GPU, taken at the 86% NCCL reaches on InfiniBand
# (machines.py): 5.375. The GPT-NeoX cluster: 4 HDR adapters (200 Gb/s) per node of 8, 12.5 GB/s per
# GPU, at 86%: 10.75. AWS p4d: 400 Gb/s of EFA per node of 8, 6.25 GB/s per GPU, at the same 86%: 5.375.
CLUSTERS: dict[str, Callable[[], Machine]] = {
    "selene": lambda: machine("a100-80gb"),
    "jean-zay": lambda: machine("a100-80gb", inter_bandwidth=5.375e9),
    "neox": lambda: machine("a100-40gb", inter_bandwidth=10.75e9),
    "p4d": lambda: machine("a100-40gb", inter_bandwidth=5.375e9),
    "h100": lambda: machine("h100-80gb"),
}


@dataclass(frozen=True)
class PublishedRun:
    name: str
    kind: str                                    # the publisher: one of KINDS
    shape: ModelShape
    layout: Layout
    cluster: str                                 # a key of CLUSTERS
    published: float                             # TFLOP/s per GPU, or MFU in % (metric)
    metric: str                                  # "tflops" or "mfu"
    flops: Callable[[ModelShape, int], float]    # the publisher's FLOPs of one step of B sequences


KINDS = ("megatron-2022", "megatron-core", "bloom", "gpt-neox")


def neox_flops_of(parameters: int) -> Callable[[ModelShape, int], float]:
    """GPT-NeoX v1.0's get_flops for a model of N = `parameters`: B·s·(6N + 60·s·h·L)."""
    def flops(m: ModelShape, sequences: int) -> float:
        return sequences * m.seq_len * (6 * parameters + 60 * m.seq_len * m.d_model * m.n_layer)
    return flops


neox_flops = neox_flops_of(20_556_201_984)  # GPT-NeoX-20B's (the model card)
PYTHIA_STEPS = 143_000  # train-iters of every Pythia config


def megatron_2021_flops(m: ModelShape, sequences: int) -> float:
    """Eq. 3 of Narayanan et al. 2021, what Megatron-DeepSpeed reports with recomputation."""
    return hardware_flops(m, sequences, "full")


def _megatron_2022(name, heads, h, layers, pp, gpus, batch, microbatch, chunks, mfu) -> PublishedRun:
    shape = ModelShape(layers, h, heads, 2048, 51200)
    layout = Layout(batch, microbatches=batch // microbatch, dp=1, tp=8, pp=pp, recompute="selective",
                    sp=True, precision="bf16", schedule="interleaved" if chunks > 1 else "1f1b",
                    virtual_stages=chunks)
    assert layout.gpus == gpus
    return PublishedRun(name, "megatron-2022", shape, layout, "selene", mfu, "mfu", model_flops)


def _megatron_core(name, heads, h, layers, tp, pp, batch, tflops) -> PublishedRun:
    dp = 48
    layout = Layout(batch, microbatches=batch // dp, dp=dp, tp=tp, pp=pp, zero=1, sp=tp > 1,
                    precision="bf16", overlap=("dp", "tp", "pp"), flash_attention=True)
    return PublishedRun(name, "megatron-core", ModelShape(layers, h, heads, 4096, 131072), layout, "h100",
                        tflops, "tflops", model_flops)


def _bloom(name, h, layers, heads, dp, tp, microbatch, tflops) -> PublishedRun:
    pp, slots = 12, (layers + 2) // 12  # 'type:transformer|embedding': each embedding takes a slot
    stages = (slots - 1,) + (slots,) * (pp - 2) + (slots - 1,)
    layout = Layout(2048, microbatches=2048 // (dp * microbatch), dp=dp, tp=tp, pp=pp, zero=1,
                    recompute="full", precision="bf16", stage_layers=stages)
    return PublishedRun(name, "bloom", ModelShape(layers, h, heads, 2048, 250880), layout, "jean-zay",
                        tflops, "tflops", megatron_2021_flops)


def _pythia(name, layers, h, heads, vocab, tp, accumulation, gpus, gpu_hours, parameters) -> PublishedRun:
    dp = gpus // tp
    layout = Layout(1024, microbatches=accumulation, dp=dp, tp=tp, zero=1, recompute="full",
                    precision="fp16", flash_attention=True)
    shape, flops = ModelShape(layers, h, heads, 2048, vocab), neox_flops_of(parameters)
    step_s = gpu_hours * 3600 / (PYTHIA_STEPS * gpus)  # Table 5's GPU-hours, back to one iteration
    tflops = flops(shape, layout.batch_size) / (step_s * gpus) / 1e12
    return PublishedRun(name, "gpt-neox", shape, layout, "p4d", tflops, "tflops", flops)


RUNS = [
    # Megatron 2022: (heads, width, blocks, pp, GPUs, batch, micro-batch, chunks a stage, MFU %): Tables 3, 5
    _megatron_2022("mlm22-22b", 64, 6144, 48, 1, 8, 4, 4, 1, 41.5),
    _megatron_2022("mlm22-175b", 96, 12288, 96, 8, 64, 64, 1, 3, 51.4),
    _megatron_2022("mlm22-530b", 128, 20480, 105, 35, 280, 280, 1, 3, 56.0),
    _megatron_2022("mlm22-1t", 160, 25600, 128, 64, 512, 512, 1, 1, 56.3),
    # Megatron-Core: (heads, width, blocks, tp, pp, batch, TFLOP/s per GPU); dp 48 on every row
    _megatron_core("mcore-1.7b", 16, 2048, 24, 1, 1, 192, 408.8),
    _megatron_core("mcore-7.1b", 32, 4096, 30, 2, 1, 192, 465.9),
    _megatron_core("mcore-16b", 48, 6144, 32, 4, 1, 192, 489.1),
    _megatron_core("mcore-32b", 56, 7168, 48, 8, 1, 192, 459.6),
    _megatron_core("mcore-70b", 64, 8192, 84, 8, 2, 384, 419.7),
    _megatron_core("mcore-119b", 80, 10240, 92, 8, 4, 768, 420.5),
    _megatron_core("mcore-177b", 96, 12288, 96, 8, 6, 1152, 432.8),
    _megatron_core("mcore-314b", 128, 16384, 96, 8, 8, 1536, 474.4),
    _megatron_core("mcore-462b", 144, 18432, 112, 8, 16, 3072, 459.9),
    # BLOOM: (width, blocks, heads, dp, tp, micro-batch, TFLOP/s per GPU); pp 12 on every row
    _bloom("bloom-176b", 14336, 70, 112, 8, 4, 2, 150.05),
    _bloom("bloom-176b-a64", 14336, 70, 64, 8, 4, 2, 153.68),
    _bloom("bloom-176b-tp8", 14336, 70, 64, 4, 8, 2, 128.92),
    _bloom("bloom-176b-b4", 14336, 70, 64, 8, 4, 4, 153.33),
    _bloom("bloom-178b", 13312, 82, 64, 8, 4, 2, 151.71),
    _bloom("bloom-195b", 12288, 106, 96, 8, 4, 2, 146.90),
    PublishedRun("neox-20b", "gpt-neox", ModelShape(44, 6144, 64, 2048, 50432),
                 Layout(1536, microbatches=32, dp=12, tp=2, pp=4, zero=1, recompute="full", precision="fp16"),
                 "neox", 117.0, "tflops", neox_flops),
    # Pythia: (blocks, width, heads, padded vocabulary, tp, accumulation, GPUs, GPU-hours, N)
    _pythia("pythia-2.8b", 32, 2560, 32, 50304, 1, 1, 64, 14_240, 2_775_208_960),
    _pythia("pythia-6.9b", 32, 4096, 32, 50432, 2, 2, 128, 33_500, 6_857_302_016),
    _pythia("pythia-12b", 36, 5120, 40, 50688, 4, 2, 256, 72_300, 11_846_072_320),
]


def predict(run: PublishedRun) -> dict:
    """The simulated step of a run, and its figure in the publisher's own formula."""
    mach = CLUSTERS[run.cluster]()
    result = simulate_step(run.shape, run.layout, mach)
    rate = run.flops(run.shape, run.layout.batch_size) / result["step_s"] / run.layout.gpus
    predicted = rate / 1e12 if run.metric == "tflops" else 100 * rate / mach.peak_flops
    return {"name": run.name, "kind": run.kind, "gpus": run.layout.gpus, "tp": run.layout.tp,
            "pp": run.layout.pp, "dp": run.layout.dp, "metric": run.metric, "published": run.published,
            "predicted": predicted, "error": predicted / run.published - 1,
            "bubble_fraction": result["bubble_fraction"], "memory_gb": result["memory"]["total"] / 1e9,
            "fits": result["memory"]["fits"]}


def table() -> list[dict]:
    """Every published run: published against predicted, in the publisher's own formula."""
    return [predict(run) for run in RUNS]


def median_abs_error(rows: list[dict]) -> float:
    return statistics.median(abs(r["error"]) for r in rows)
