"""The cost model of minipar/simulate/: each formula against one derived by hand, its memory against a
real run's ledger, its pipeline against the bubble formula, and Megatron-LM's Table 1. Serial (1 rank)."""

from dataclasses import replace
from fractions import Fraction

import pytest
from mpi4py import MPI

from minipar.core.nn import GPT, GPTConfig
from minipar.distributed.ledger import ring_bytes_sent, ring_messages
from minipar.simulate import presets
from minipar.simulate.machines import GPUS
from minipar.simulate.model import ModelShape, hardware_flops, model_flops, parameter_count
from minipar.simulate.step import Layout, activation_memory, model_state_memory, ring_seconds, simulate_step
from minipar.trainer.config import TrainConfig
from minipar.trainer.loop import train
from minipar.trainer.simulate_command import simulate_main
from minipar.trainer.tasks import ALPHABET

GPT3 = ModelShape(96, 12288, 96, 2048, 51200)
# FLOPs at one rate (no kernel model) and free links: the backward is exactly 2 forwards, so the
# schedule's makespan in forwards can be written by hand
QUIET = replace(GPUS["a100-80gb"], kernels=None, intra_latency=0.0, intra_bandwidth=float("inf"))


@pytest.mark.parametrize("shape", [GPT3, ModelShape(4, 64, 4, 32, 27), ModelShape(3, 10, 2, 7, 5)])
def test_flops_are_the_papers_72_and_96_forms(shape):
    B, s, L, h, V = 3, shape.seq_len, shape.n_layer, shape.d_model, shape.vocab
    base = Fraction(B * s * L * h * h)
    assert model_flops(shape, B) == 72 * base * (1 + Fraction(s, 6 * h) + Fraction(V, 12 * L * h))
    assert hardware_flops(shape, B, "full") == 96 * base * (1 + Fraction(s, 6 * h) + Fraction(V, 16 * L * h))
    # selective recomputation reruns the attention core only: per block, the scores Q·K^T and the
    # weighted sum P·V, 2·B·s²·h FLOPs each (Korthikanti et al. 2022, section 5)
    assert hardware_flops(shape, B, "selective") == model_flops(shape, B) + L * 2 * (2 * B * s * s * h)
    assert hardware_flops(shape, B, "none") == model_flops(shape, B)


def test_parameter_count_is_the_real_models():
    shape = ModelShape(3, 24, 4, 16, 11)
    model = GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=3, n_head=4, d_model=24), seed=None)
    assert parameter_count(shape) == sum(p.data.size for p in model.parameters())


@pytest.mark.parametrize("op,n", [("all_reduce", 4), ("reduce_scatter", 8), ("all_gather", 3)])
def test_ring_time_is_comms_charge_over_the_bandwidth_plus_its_messages(op, n):
    shard, bandwidth, latency = 1000, 1e9, 1e-6
    charged = ring_bytes_sent(op, [shard] * n, 0)  # the ledger's ring algorithm, another implementation
    expected = ring_messages(op, n) * latency + charged / bandwidth
    assert ring_seconds(op, shard * n, n, bandwidth, latency) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("stages,microbatches", [(4, 8), (2, 6)])
def test_pipeline_bubble_is_the_1f1b_formula(stages, microbatches):
    # with no communication the backward is exactly 2 forwards: 1F1B's bubble is (K-1)/(M+K-1)
    shape = ModelShape(stages * 2, 64, 4, 32, 27)
    layout = Layout(microbatches, microbatches=microbatches, pp=stages)
    result = simulate_step(shape, layout, QUIET)
    assert result["bubble_fraction"] == pytest.approx((stages - 1) / (microbatches + stages - 1), rel=1e-12)


@pytest.mark.parametrize("stages,microbatches", [(4, 8), (2, 4), (3, 5)])
def test_zb_h1_step_is_its_schedules_makespan_with_the_backward_split_in_halves(stages, microbatches):
    """With no communication the backward is 2 forwards; zb-h1 splits it into B = W = 1. Each stage
    then computes 3 units per micro-batch, and the first stage's last W ends K-1 units after the
    pipeline could have: makespan 3M + K - 1 forwards (Zero Bubble's (K-1)(F+B-W) bubble), against
    1F1B's 3(M + K - 1). The ratio of the two step times is independent of the forward's seconds;
    a backward counted 1.5 times (B or W a whole backward) moves it. Bubble: (K-1)/(3M+K-1)."""
    K, M = stages, microbatches
    shape = ModelShape(stages * 2, 64, 4, 32, 0)  # no logits: the last stage is like the others
    zb = simulate_step(shape, Layout(M, microbatches=M, pp=K, schedule="zb-h1"), QUIET)
    one_f_one_b = simulate_step(shape, Layout(M, microbatches=M, pp=K, schedule="1f1b"), QUIET)
    expected = Fraction(3 * M + K - 1, 3 * (M + K - 1))
    assert zb["step_s"] / one_f_one_b["step_s"] == pytest.approx(float(expected), rel=1e-12)
    assert zb["bubble_fraction"] == pytest.approx((K - 1) / (3 * M + K - 1), rel=1e-12)


@pytest.mark.parametrize("schedule, stages, microbatches",
                         [("zb-v", 4, 8), ("zb-v", 3, 5), ("dualpipev", 2, 4)])
def test_v_step_is_its_schedules_makespan(schedule, stages, microbatches):
    """With no communication the backward is 2 forwards, split into B = W = 1; two chunks a rank, each
    half a stage. ZB-V: the last rank starts after K-1 chunk forwards (half a forward each) and then
    computes 6M chunk actions: (6M + K - 1)/2 forwards against 1F1B's 3(M + K - 1), bubble
    (K-1)/(6M+K-1). DualPipeV with an F&B costing F + B + W: the DualPipe README's (K-1)(F&B + B - 3W)
    = 2(K-1) chunk units more than the 6M of work, (3M + K - 1) forwards, ZB-H1's. Memory: the
    activations of 2K (ZB-V) or 2K+1 (DualPipeV) half-stage pairs on rank 0."""
    K, M = stages, microbatches
    shape = ModelShape(stages * 2, 64, 4, 32, 0)  # no logits; 2K blocks, one a chunk
    v = simulate_step(shape, Layout(M, microbatches=M, pp=K, schedule=schedule), QUIET)
    plain = simulate_step(shape, Layout(M, microbatches=M, pp=K, schedule="1f1b"), QUIET)
    makespan = Fraction(6 * M + K - 1, 2) if schedule == "zb-v" else Fraction(3 * M + K - 1)
    assert v["step_s"] / plain["step_s"] == pytest.approx(float(makespan / (3 * (M + K - 1))), rel=1e-12)
    bubble = Fraction(K - 1, 6 * M + K - 1) if schedule == "zb-v" else Fraction(K - 1, 3 * M + K - 1)
    assert v["bubble_fraction"] == pytest.approx(float(bubble), rel=1e-12)
    pairs = 2 * K + (schedule == "dualpipev")
    # 1F1B's rank 0 holds K micro-batches of 2 blocks, the V's rank 0 `pairs` of 1 block
    assert v["memory"]["activations"] / plain["memory"]["activations"] == pytest.approx(pairs / (2 * K))


@pytest.mark.parametrize("recompute,zero", [("none", 0), ("full", 1), ("selective", 0)])
def test_memory_equals_the_ledger_of_a_real_run(recompute, zero):
    cfg = TrainConfig(model="gpt", precision="fp64", steps=1, batch_size=4, microbatches=2, seq_len=16,
                      n_layer=2, n_head=2, d_model=16, recompute=recompute, zero=zero, quiet=True)
    measured = train(cfg, MPI.COMM_SELF)[-1]["mem"]
    shape = ModelShape(2, 16, 2, 16, len(ALPHABET))
    layout = Layout(4, microbatches=2, zero=zero, recompute=recompute, precision="fp64")
    predicted = model_state_memory(shape, layout)
    assert {k: measured[k] for k in predicted} == predicted
    assert measured["activations_peak"] == activation_memory(shape, layout, inflight=1)


def test_table1_first_row_is_the_calibration_and_the_rest_within_30_percent():
    rows = presets.table1()
    assert rows[0]["predicted"] == pytest.approx(rows[0]["published"], rel=1e-3)
    assert len(rows) == 10 and all(abs(r["error"]) < 0.30 for r in rows)


def test_precision_is_required_without_a_preset(capsys):
    # no silent fp32: a bf16 run compared with an fp32 prediction is 2x off in every byte
    assert simulate_main([]) == 2
    assert capsys.readouterr().err == ("minipar simulate: error: --precision is required without --preset "
                                       "(fp32, bf16, fp16, fp8 or fp64)\n")
    assert simulate_main(["--precision", "bf16", "--json"]) == 0
    assert simulate_main(["--preset", "megatron-1.7b", "--json"]) == 0
    capsys.readouterr()
    # and a GPU's kernel model, measured for 16-bit matmuls, refuses to time fp32 at bf16's rate
    assert simulate_main(["--precision", "fp32"]) == 2
    assert capsys.readouterr().err == ("minipar simulate: error: --precision fp32 on a100-80gb: its kernel "
                                       "model has measured bf16/fp16 matmul rates only (use bf16 or fp16)\n")
    # A100 has no FP8 tensor cores; H100 has
    assert simulate_main(["--precision", "fp8"]) == 2
    assert capsys.readouterr().err == ("minipar simulate: error: --precision fp8 on a100-80gb: it has no FP8 "
                                       "tensor cores (use --gpu h100-80gb, or bf16)\n")
    assert simulate_main(["--precision", "fp8", "--gpu", "h100-80gb", "--json"]) == 0


def test_bad_input_is_one_line_and_exit_code_2(capsys):
    assert simulate_main(["--tp", "3"]) == 2
    assert simulate_main(["--dp", "0"]) == 2
    assert simulate_main(["--batch-size", "6", "--dp", "4"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("minipar simulate: error:") for line in lines)


@pytest.mark.parametrize("zero,expected", [(0, (2, 2, 12)), (1, (2, 2, Fraction(12, 4))),
                                           (2, (2, Fraction(2, 4), Fraction(12, 4))),
                                           (3, (Fraction(2, 4), Fraction(2, 4), Fraction(12, 4)))])
def test_model_states_are_the_zero_papers_partitions(zero, expected):
    # ZeRO section 5 with dp N = 4 and tp x pp = 2 splitting the model first: bytes per parameter
    # 2 + 2 + 12 whole, the optimizer's 12 over N from stage 1, the gradients' 2 from stage 2, all from 3
    shape = ModelShape(4, 64, 4, 32, 27)
    psi = Fraction(parameter_count(shape), 2)
    memory = model_state_memory(shape, Layout(8, dp=4, tp=2, zero=zero, precision="bf16"))
    assert (memory["params"], memory["grads"], memory["optimizer"]) == tuple(
        int(psi * part) for part in expected)


def test_search_ranks_what_fits_and_says_why_the_rest_do_not():
    from minipar.simulate.search import candidates, search
    shape = ModelShape(4, 64, 4, 32, 27)
    # 2 MB: the model states of ZeRO 0 on one GPU (4 x 205,568 params x 16 bytes / 4) do not fit
    small = replace(GPUS["a100-80gb"], memory_bytes=2 * 10**6)
    found = search(shape, 4, 16, small, top=1000)
    considered = len(list(candidates(shape, 4, 16, small)))
    assert found["fitting"] + sum(found["refused"].values()) == considered
    assert found["refused"]["memory beyond the GPU's"] > 0
    steps = [row["step_s"] for row in found["ranked"]]
    assert steps == sorted(steps) and all(row["memory_gb"] <= 2e-3 for row in found["ranked"])


def test_search_tries_each_layout_once():
    """One GPU and a batch of 7: b = 1, 2, 4, 8 give 7, 3, 1 and 1 micro-batches, so b = 4 and b = 8 are
    both the one micro-batch of 7 sequences: 3 distinct layouts (3 micro-batches does not divide 7 and
    is refused) for each of 4 ZeRO stages and 3 recomputations, 36, not 48; and fitting plus refused
    counts each once."""
    from minipar.simulate.search import candidates, search
    shape = ModelShape(4, 64, 4, 32, 27)
    layouts = list(candidates(shape, 1, 7, GPUS["a100-80gb"]))
    assert len(layouts) == 3 * 4 * 3 == len(set(layouts))
    found = search(shape, 1, 7, GPUS["a100-80gb"], top=1000)
    assert found["fitting"] + sum(found["refused"].values()) == 36 and found["fitting"] == 24


def test_search_ranks_by_step_time_not_by_the_work_recomputation_adds():
    """A 7.5B-like model on 8 A100-40GB: full recomputation fits bigger micro-batches and counts its
    forward twice, so its hardware TFLOP/s top the list, yet a layout that keeps its activations
    finishes the same batch sooner: the search ranks that one first."""
    from minipar.simulate.search import search
    found = search(ModelShape(24, 4096, 32, 2048, 51200), 8, 64, GPUS["a100-40gb"], top=1000)
    best, busiest = found["ranked"][0], max(found["ranked"], key=lambda row: row["tflops_per_gpu"])
    assert busiest["recompute"] == "full" and best["recompute"] != "full"
    assert best["step_s"] == min(row["step_s"] for row in found["ranked"]) < busiest["step_s"]


def test_zero3_falls_behind_3d_parallelism_as_the_paper_found():
    # ZeRO-3 gathers the 175B parameters over InfiniBand every step, whatever the GPU count: its time
    # per GPU does not shrink, so TFLOP/s per GPU fall as GPUs double; 3D parallelism keeps them
    rows = presets.zero3_comparison()
    zero3 = [r["predicted"] for r in rows if r["scheme"] == "zero-3"]
    ptdp = [r["predicted"] for r in rows if r["scheme"] == "ptd-p"]
    assert zero3 == sorted(zero3, reverse=True) and zero3[-1] < zero3[0] / 1.9
    assert all(p > z for p, z in zip(ptdp, zero3))


def test_json_has_the_keys_the_design_names(capsys):
    import json
    assert simulate_main(["--preset", "gpt3-175b", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"step_s", "tflops_per_gpu", "mfu", "memory", "comm_s", "bubble_fraction"} <= set(report)
    assert set(report["comm_s"]) == {"tp", "pp", "dp"} and report["memory"]["fits"] is True
    assert report["memory"]["total"] == sum(report["memory"][k] for k in ("params", "grads", "optimizer",
                                                                          "activations"))
    # MFU counts the 72 form, TFLOP/s the 96 form of full recomputation: their ratio is the FLOPs'
    assert report["tflops_per_gpu"] * 1e12 / (report["mfu"] * 312e12) == pytest.approx(
        hardware_flops(GPT3, 1536, "full") / model_flops(GPT3, 1536), rel=1e-12)


# ---- bad links and sizes: one line, exit 2, at once (issue 40) -----------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--intra-bandwidth", "0"], "--intra-bandwidth must be a positive finite number of GB/s, got 0"),
    (["--inter-bandwidth", "-3"], "--inter-bandwidth must be a positive finite number of GB/s, got -3"),
    (["--inter-bandwidth", "nan"], "--inter-bandwidth must be a positive finite number of GB/s, got nan"),
    (["--intra-bandwidth", "inf"], "--intra-bandwidth must be a positive finite number of GB/s, got inf"),
    (["--intra-latency", "-1"], "--intra-latency must be a positive finite number of microseconds, got -1"),
    (["--inter-latency", "nan"], "--inter-latency must be a positive finite number of microseconds, got nan"),
    (["--inter-latency", "0"], "--inter-latency must be a positive finite number of microseconds, got 0"),
    (["--preset", "gpt3-175b", "--intra-bandwidth", "nan"], "--intra-bandwidth must be a positive finite"),
    (["--table1", "--inter-bandwidth", "inf"], "--inter-bandwidth must be a positive finite"),
    (["--search", "--gpus", "1000000000000"], "--gpus 1,000,000,000,000 is more than the 10,000,000"),
    (["--pp", "2", "--microbatches", "10000000", "--batch-size", "10000000", "--n-layer", "4"],
     "stages x micro-batches x chunks = 20,000,000 is more than the 32,768 the schedule simulator takes"),
    (["--pp", "4", "--virtual-stages", "128", "--n-layer", "512", "--microbatches", "4",
      "--schedule", "interleaved"], "stages x chunks = 512 is more than the 256"),
])
def test_links_and_sizes_out_of_range_are_one_line_and_exit_2(argv, message, capsys):
    assert simulate_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"minipar simulate: error: {message}")
    assert captured.err.count("\n") == 1, captured.err


def test_search_on_ten_million_gpus_answers():
    """The divisors of the GPU count are found up to its square root: 9,699,690 = 2·3·5·...·19 has 256."""
    from minipar.simulate.search import _divisors
    assert _divisors(9699690) == [d for d in range(1, 9699691) if 9699690 % d == 0]
    assert _divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and _divisors(1) == [1]
    assert simulate_main(["--search", "--gpus", "9699690", "--precision", "bf16", "--json"]) == 0
