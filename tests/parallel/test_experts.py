"""Mixture of experts (`--model moe`, core/moe.py): routing, capacity, dropped tokens and the aux loss
against a reference written here with loops; gradients against finite differences; data-parallel and
ZeRO layouts of the MoE GPT equal to one process; bad input is one line.

    python -m pytest tests/parallel/test_experts.py -m "not mpi"
    mpiexec -n K python -m pytest -m mpi tests/parallel/test_experts.py     # K = 2, 4
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
from fractions import Fraction

import hypothesis.strategies as st
import numpy as np
import pytest
from mpi4py import MPI
from mpi_harness import at_world_size, mpi_given, needs_world_size
from one_process import assert_trains_like_one_process

from minipar.core.autograd import Tensor
from minipar.core.moe import AttachAuxLoss, MoEConfig, MoEGPT, MoELayer, RoutingStats, route
from minipar.core.nn import GPTConfig
from minipar.distributed.collectives import all_to_all
from minipar.distributed.communicator import Comm
from minipar.trainer.config import TrainConfig
from minipar.trainer.loop import Trainer
from minipar.trainer.validate import validate

WORLD = MPI.COMM_WORLD


def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def reference_moe(x, params, E, k, capacity_factor):
    """The MoE layer by its definition, one token at a time: softmax router, the k most probable
    experts (ties to the lower index), each sequence's assignments admitted in position order while
    the expert has room (C = ceil(factor*T*k/E), exactly, on the decimal typed: `Fraction(repr(factor))`),
    outputs weighted by the router's probabilities.
    Returns the output, the summed per-sequence aux loss E * sum_e f_e P_e and the kept counts."""
    B, T, D = x.shape
    C = max(1, math.ceil(Fraction(repr(capacity_factor)) * T * k / E))
    out, aux, kept_counts = np.zeros_like(x), 0.0, np.zeros(E, dtype=int)
    for b in range(B):
        room, chosen = [C] * E, np.zeros(E)
        probs = []
        for t in range(T):
            logits = params["router"] @ x[b, t]
            p = np.exp(logits - logits.max())
            p /= p.sum()
            probs.append(p)
            for e in sorted(range(E), key=lambda e: (-p[e], e))[:k]:
                chosen[e] += 1
                if room[e] == 0:
                    continue  # dropped: over capacity
                room[e] -= 1
                kept_counts[e] += 1
                w1, b1, w2, b2 = params["experts"][e]
                out[b, t] += p[e] * (w2 @ gelu(w1 @ x[b, t] + b1) + b2)
        f, P = chosen / (T * k), np.mean(probs, axis=0)
        aux += E * float(f @ P)
    return out, aux, kept_counts


def layer_params(layer: MoELayer) -> dict:
    return {"router": layer.router.weight.data,
            "experts": [(m.fc.weight.data, m.fc.bias.data, m.proj.weight.data, m.proj.bias.data)
                        for m in layer.experts]}


def randomised_layer(E, k, factor, D=8, seed=0):
    layer = MoELayer(GPTConfig(d_model=D), MoEConfig(E, k, factor)).init_parameters(seed)
    rng = np.random.default_rng(seed + 1)
    for p in layer.parameters():  # biases start at 0 and the router near it: give both a scale
        p.data[...] = rng.normal(0.0, 0.5, p.data.shape)
    return layer


@pytest.mark.parametrize("E,k,factor", [(4, 1, 1.0), (4, 2, 0.5), (3, 2, 0.75), (2, 1, 0.25), (4, 3, 2.0)])
def test_layer_matches_the_reference_written_with_loops(E, k, factor):
    layer = randomised_layer(E, k, factor)
    x = np.random.default_rng(7).normal(size=(3, 8, 8))
    out = layer(Tensor(x)).data
    ref_out, ref_aux, ref_kept = reference_moe(x, layer_params(layer), E, k, factor)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-14)
    assert layer.aux_loss.item() == pytest.approx(ref_aux, rel=1e-12)
    assert layer.tokens_per_expert == list(ref_kept)


def test_over_capacity_tokens_are_dropped_in_position_order():
    """Every token prefers expert 0 (its router row dominates): with C = 2 of 8 positions, only the
    first two positions of each sequence get an MoE output, and the rest pass through as 0."""
    layer = randomised_layer(4, 1, 1.0)
    layer.router.weight.data[...] = 0.0
    x = np.abs(np.random.default_rng(3).normal(size=(2, 8, 8))) + 0.1
    layer.router.weight.data[0] = 1.0  # logit of expert 0 = sum(x) > 0 = the others'
    out = layer(Tensor(x)).data
    assert MoEConfig(4, 1, 1.0).capacity(8) == 2
    assert np.all(np.abs(out[:, :2]).sum(-1) > 0)
    assert np.all(out[:, 2:] == 0.0)
    assert layer.tokens_per_expert == [4, 0, 0, 0]


@pytest.mark.parametrize("factor,T,k,E,expected", [
    (1.1, 25, 2, 5, 11),    # 1.1*25*2/5 = 11 exactly; in floating point 11.000000000000002, so 12
    (0.07, 50, 2, 7, 1),    # 7/7 = 1 (float: 1.0000000000000002)
    (0.28, 50, 1, 7, 2),    # 14/7 = 2 (float: 2.0000000000000004)
    (2.2, 50, 1, 5, 22),    # 110/5 = 22 (float: 22.000000000000004)
    (1.11, 50, 2, 3, 37),   # 111/3 = 37 (float: 37.00000000000001)
    (1.25, 32, 2, 8, 10),   # lesson 15's question: 80/8 = 10
    (1.1, 10, 1, 4, 3),     # 11/4 = 2.75, up to 3
    (0.75, 6, 2, 3, 3),     # 9/3 = 3
    (0.01, 8, 1, 4, 1),     # 0.02: at least one slot
    (2, 7, 3, 4, 11),       # an int factor: 42/4 = 10.5, up to 11
])
def test_capacity_is_the_ceiling_of_the_exact_decimal(factor, T, k, E, expected):
    """C = ceil(factor * T * k / E) on the decimal the user typed, worked out by hand in the comments:
    floating point overshoots exact integers (and `Fraction(1.1)`, the float's binary value, is above
    1.1 too), which gives an expert one slot more than the definition."""
    assert MoEConfig(E, k, factor).capacity(T) == expected


def test_an_exact_integer_capacity_keeps_exactly_that_many_tokens():
    """Every token of 25 prefers expert 0, then expert 1 (their router rows dominate positive inputs):
    at factor 1.1, k 2, E 5 each expert has 11 slots (not the 12 of floating point), so of each sequence
    the first 11 positions get outputs from both, the other 14 from neither."""
    layer = randomised_layer(5, 2, 1.1)
    layer.router.weight.data[...] = 0.0
    layer.router.weight.data[0] = 1.0
    layer.router.weight.data[1] = 0.5
    x = np.abs(np.random.default_rng(4).normal(size=(2, 25, 8))) + 0.1
    out = layer(Tensor(x)).data
    assert layer.tokens_per_expert == [22, 22, 0, 0, 0]
    assert np.all(np.abs(out[:, :11]).sum(-1) > 0)
    assert np.all(out[:, 11:] == 0.0)
    ref_out, _, ref_kept = reference_moe(x, layer_params(layer), 5, 2, 1.1)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-14)
    assert list(ref_kept) == [22, 22, 0, 0, 0]


ROUTED = np.array([[0.5, 0.3, 0.2],    # t0: experts 0, 1
                   [0.2, 0.2, 0.6],    # t1: 2, then 0 (0 and 1 tie: the lower index)
                   [0.6, 0.1, 0.3],    # t2: 0, 2
                   [0.4, 0.4, 0.2]])   # t3: 0 and 1 tie: 0, then 1


def test_route_worked_by_hand():
    """route (lesson 15's excerpt) on the table above, k 2, capacity 2, two sequences alike. Each
    sequence's queue is taken in position order, a token's first choice before its second: expert 0
    receives t0, t1, t2, t3 (slots 0-3, the last two over capacity), expert 1 t0, t3, expert 2 t1, t2.
    The second sequence starts its queues afresh."""
    choice, kept, counts, slot = route(np.stack([ROUTED, ROUTED]), top_k=2, capacity=2)
    for b in range(2):
        assert choice[b].tolist() == [[0, 1], [2, 0], [0, 2], [0, 1]]
        assert slot[b].tolist() == [[0, 0], [0, 1], [2, 1], [3, 1]]
        assert kept[b].tolist() == [[True, True], [True, True], [False, True], [False, True]]
        assert counts[b].tolist() == [4, 2, 2]  # before dropping


@pytest.mark.parametrize("B,T,E,k,capacity", [(2, 7, 4, 2, 3), (1, 9, 3, 3, 2), (3, 5, 5, 1, 1)])
def test_route_equals_a_loop_over_positions(B, T, E, k, capacity):
    """Against the definition, one assignment at a time; probabilities drawn from a few values, so ties
    are common."""
    probs = np.random.default_rng(B * T + E).choice([0.1, 0.2, 0.3, 0.4], size=(B, T, E))
    choice, kept, counts, slot = route(probs, k, capacity)
    for b in range(B):
        queue = [0] * E
        for t in range(T):
            best = sorted(range(E), key=lambda e: (-probs[b, t, e], e))[:k]
            assert choice[b, t].tolist() == best
            for j, e in enumerate(best):
                assert (slot[b, t, j], kept[b, t, j]) == (queue[e], queue[e] < capacity)
                queue[e] += 1
        assert counts[b].tolist() == queue


def test_attach_aux_loss_is_the_identity_and_gives_the_aux_loss_its_gradient():
    """AttachAuxLoss (lesson 15's excerpt): forward hands x on unchanged; backward passes x's gradient
    on and gives the aux loss `routing.aux_grad` (coef / sequences), whatever the output's gradient."""
    x = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    aux = Tensor(np.array(0.7), requires_grad=True)
    routing = RoutingStats(3)
    routing.aux_grad = 0.125
    out = AttachAuxLoss.apply(x, aux, routing)
    np.testing.assert_array_equal(out.data, x.data)
    weights = np.array([[1.0, -2.0, 3.0], [0.5, 0.0, -1.5]])
    (out * Tensor(weights)).sum().backward()
    np.testing.assert_array_equal(x.grad, weights)
    assert aux.grad.shape == () and float(aux.grad) == 0.125


def small_moe(seed=0, k=2, factor=0.75, coef=0.5):
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=8)
    model = MoEGPT(cfg, MoEConfig(3, k, factor, coef), seed=seed)
    rng = np.random.default_rng(seed)
    for block in model.blocks:  # a router far from uniform, so the aux loss has a gradient to check
        block.mlp.router.weight.data[...] = rng.normal(0.0, 1.0, block.mlp.router.weight.data.shape)
    ids = rng.integers(0, 13, size=(2, 6))
    targets = rng.integers(0, 13, size=(2, 6))
    return model, ids, targets


def test_gradients_match_finite_differences():
    """The gates, the combine (IndexAdd) and the aux loss's backward, checked on the whole model's
    loss by central differences of entries of the routers, the experts and the embedding."""
    model, ids, targets = small_moe()

    def loss_value():
        return model.loss(model(ids), targets, targets.size).item()

    model.zero_grad()
    model.loss(model(ids), targets, targets.size).backward()
    params = dict(model.named_parameters())
    rng = np.random.default_rng(0)
    for name in ("blocks.0.mlp.router.weight", "blocks.1.mlp.router.weight",
                 "blocks.0.mlp.experts.1.fc.weight", "blocks.1.mlp.experts.2.proj.bias", "embed.wte.weight"):
        p = params[name]
        for flat in rng.choice(p.data.size, 3, replace=False):
            i = np.unravel_index(flat, p.data.shape)
            saved, h = p.data[i], 1e-6
            p.data[i] = saved + h
            up = loss_value()
            p.data[i] = saved - h
            down = loss_value()
            p.data[i] = saved
            assert p.grad[i] == pytest.approx((up - down) / (2 * h), rel=1e-5, abs=1e-10), name


def test_aux_loss_is_the_coefficient_times_the_mean_over_sequences():
    model, ids, targets = small_moe(coef=0.5)
    total = model.loss(model(ids), targets, targets.size).item()
    per_block = [b.mlp.aux_loss.item() for b in model.blocks]
    aux, kept = model.take_routing_stats(ids.shape[0])
    assert aux == pytest.approx(0.5 * sum(per_block) / ids.shape[0], rel=1e-13)
    assert kept == [b.mlp.tokens_per_expert for b in model.blocks]
    assert model.take_routing_stats(ids.shape[0])[0] == 0.0  # taken once
    model.moe.aux_loss_coef = 0.0
    assert model.loss(model(ids), targets, targets.size).item() < total


def tiny(**changes) -> TrainConfig:
    base = TrainConfig(model="moe", precision="fp64", n_layer=2, n_head=2, d_model=8, seq_len=8,
                       batch_size=8, steps=2, n_experts=4, top_k=2, capacity_factor=0.75, quiet=True)
    return base.replace(**changes)


@pytest.mark.parametrize("changes,message", [
    ({"n_experts": 0}, "--n-experts must be at least 1 (got 0)"),
    ({"top_k": 5}, "--top-k must be between 1 and --n-experts 4 (got 5)"),
    ({"capacity_factor": 0.0}, "--capacity-factor must be a positive number (got 0.0)"),
    ({"aux_loss_coef": -1.0}, "--aux-loss-coef must be a non-negative number (got -1.0)"),
    ({"cp": 2, "dp": 1}, "--model moe does not support --cp > 1 yet"),
])
def test_bad_moe_options_are_one_line(changes, message):
    errors = validate(tiny(**changes), 1)
    assert any(e.startswith(message) for e in errors), errors


def test_full_recomputation_trains_like_no_recomputation():
    """--recompute full reruns each block in backward: the aux loss's gradient comes from the rerun's
    graph, the routing statistics are counted once (one process; the reference does not recompute)."""
    cfg = tiny(dp=1, recompute="full", aux_loss_coef=0.5)
    trainer = Trainer(cfg, MPI.COMM_SELF)
    records = trainer.run()
    assert_trains_like_one_process(cfg, records, trainer.full_state())
    alone = Trainer(cfg.single_process(), MPI.COMM_SELF).run()
    assert [r["tokens_per_expert"] for r in records] == [r["tokens_per_expert"] for r in alone]
    assert [r["aux_loss"] for r in records] == pytest.approx([r["aux_loss"] for r in alone], rel=1e-12)


def test_logged_aux_loss_is_without_the_fp16_loss_scale():
    """fp16 scales the loss (and so the aux loss's gradient) by 2^16; the logged aux_loss is the
    loss's part, unscaled: the fp32 run's within 16-bit rounding (it was 65536 times that)."""
    fp32 = Trainer(tiny(dp=1, precision="fp32", aux_loss_coef=0.5), MPI.COMM_SELF).run()
    fp16 = Trainer(tiny(dp=1, precision="fp16", aux_loss_coef=0.5), MPI.COMM_SELF).run()
    assert fp16[0]["loss_scaling"]["loss_scale"] > 1
    for low, full in zip(fp16, fp32):
        assert low["aux_loss"] == pytest.approx(full["aux_loss"], rel=1e-2)


def test_bad_option_exits_2_with_one_line():
    run = subprocess.run([sys.executable, "-m", "minipar", "train", "--model", "moe", "--top-k", "9"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "minipar train: error: --top-k must be between 1 and --n-experts 4 (got 9)"]


def trains_like_one_process(cfg) -> list[dict]:
    """Train `cfg` on every rank; rank 0 checks losses and weights against one process (fp64, 1e-9)."""
    assert validate(cfg, WORLD.size) == []
    trainer = Trainer(cfg, WORLD)
    records = trainer.run()
    full = trainer.full_state()
    if WORLD.rank == 0:
        assert_trains_like_one_process(cfg, records, full)
    return records


@needs_world_size(2, 4)
@mpi_given(max_examples=3, tp=st.sampled_from([1, 2]), zero=st.sampled_from([0, 1, 2, 3]),
           top_k=st.sampled_from([1, 2]),
           capacity_factor=st.sampled_from([0.5, 1.0, 1.5]), microbatches=st.sampled_from([1, 2]),
           seed=st.integers(0, 2**16))
def test_data_parallel_moe_trains_like_one_process(tp, zero, top_k, capacity_factor, microbatches, seed):
    """MoE with dp (and tp, the MoE layers replicated over it) and ZeRO 0-3."""
    cfg = tiny(dp=WORLD.size // tp, tp=tp, zero=zero, top_k=top_k, capacity_factor=capacity_factor,
               microbatches=microbatches, seed=seed)
    records = trains_like_one_process(cfg)
    if WORLD.rank == 0:
        alone = Trainer(cfg.single_process(), MPI.COMM_SELF).run()  # the log's routing stats: summed over dp
        for mine, ref in zip(records, alone):
            assert mine["tokens_per_expert"] == ref["tokens_per_expert"]
            assert mine["aux_loss"] == pytest.approx(ref["aux_loss"], rel=1e-9)
            assert np.sum(ref["tokens_per_expert"]) <= cfg.n_layer * cfg.batch_size * cfg.seq_len * top_k


# (dp, tp, pp, ep): every dp x tp of this world with ep > 1 dividing dp (MoE layers replicated over tp),
# and pipelines of 2 stages: with ep inside dp, or alone at 2 ranks (the aux loss on every stage)
EP_LAYOUTS = [(WORLD.size // tp, tp, 1, ep) for tp in (1, 2) for ep in (2, 4)
              if WORLD.size % tp == 0 and (WORLD.size // tp) % ep == 0]
PP_LAYOUTS = [(WORLD.size // 2, 1, 2, 1 if WORLD.size == 2 else 2)] if WORLD.size in (2, 4) else []


@needs_world_size(2, 4)
@mpi_given(max_examples=3, layout=st.sampled_from(EP_LAYOUTS + PP_LAYOUTS or [(2, 1, 1, 2)]),
           top_k=st.sampled_from([1, 2]), capacity_factor=st.sampled_from([0.5, 1.0, 1.5]),
           microbatches=st.sampled_from([1, 2]), zero=st.sampled_from([0, 1, 2, 3]),
           recompute=st.sampled_from(["none", "full"]), seed=st.integers(0, 2**16),
           examples=[at_world_size((4,), layout=(4, 1, 1, 2), top_k=2, capacity_factor=0.5, microbatches=2,
                                   zero=1, recompute="none", seed=1),
                     at_world_size((4,), layout=(2, 2, 1, 2), top_k=1, capacity_factor=1.0, microbatches=1,
                                   zero=1, recompute="full", seed=2),
                     at_world_size((2,), layout=(1, 1, 2, 1), top_k=2, capacity_factor=0.5, microbatches=2,
                                   zero=0, recompute="full", seed=3),
                     at_world_size((4,), layout=(2, 1, 2, 2), top_k=2, capacity_factor=1.0, microbatches=2,
                                   zero=3, recompute="full", seed=4),
                     at_world_size((4,), layout=(4, 1, 1, 2), top_k=1, capacity_factor=1.5, microbatches=2,
                                   zero=2, recompute="none", seed=5)])
def test_expert_parallel_trains_like_one_process(layout, top_k, capacity_factor, microbatches, zero,
                                                 recompute, seed):
    """Experts split over ep ranks inside dp (with tp or pp too, ZeRO 0-3 over edp and dp), and MoE
    on a pipeline: losses, weights and the routing stats of one process (the aux loss's gradient
    reaches every stage, its value summed over stages; with --recompute full, from the rerun block's
    graph, the routing counted once), and the all-to-all bytes of every step equal their formula,
    from the ledger."""
    dp, tp, pp, ep = layout
    cfg = tiny(dp=dp, tp=tp, pp=pp, ep=ep, top_k=top_k, capacity_factor=capacity_factor,
               microbatches=microbatches, zero=zero, recompute=recompute, seed=seed, aux_loss_coef=0.5)
    records = trains_like_one_process(cfg)
    if WORLD.rank == 0:
        alone = Trainer(cfg.single_process(), MPI.COMM_SELF).run()
        assert [r["tokens_per_expert"] for r in records] == [r["tokens_per_expert"] for r in alone]
        for mine, ref in zip(records, alone):
            assert mine["aux_loss"] == pytest.approx(ref["aux_loss"], rel=1e-9)
        if ep == 1:
            return
        # 4 all-to-alls per layer of this stage and micro-batch (dispatch and combine, forward and
        # backward; 6 when backward reruns the forward), each sending ep-1 of its ep blocks: (E, b, C, d)
        # fp64 elements, b this rank's sequences
        layers = cfg.n_layer // pp  # 2 blocks on 2 stages: one each (embedding and head are lighter)
        C = math.ceil(Fraction(repr(capacity_factor)) * cfg.seq_len * top_k / cfg.n_experts)
        b = cfg.batch_size // dp // microbatches
        per_layer = 6 if recompute == "full" else 4
        block = (cfg.n_experts // ep) * b * C * cfg.d_model * 8
        expected = per_layer * layers * microbatches * (ep - 1) * block
        for r in records:
            assert r["comm"]["by_dim_op"]["ep"]["all_to_all"] == expected, r["comm"]
        if zero and dp // ep > 1:  # experts' states sharded over edp: reduce-scatter + all-gather
            assert set(records[-1]["comm"]["by_dim_op"]["edp"]) == {"reduce_scatter", "all_gather"}


@needs_world_size(2, 4)
@mpi_given(max_examples=2, block=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_all_to_all_sends_block_s_to_rank_s_and_charges_what_it_sends(block, seed):
    comm = Comm(WORLD, "a2a")
    n, me = comm.size, comm.rank
    rng = np.random.default_rng(seed)  # the same draw on every rank: rank r's buffer is sent[r]
    sent = rng.normal(size=(n, n, block))
    received = all_to_all(comm, sent[me])
    np.testing.assert_array_equal(received, sent[:, me])  # block r of the result: rank r's block `me`
    assert comm.ledger.total_report()["by_op"]["all_to_all"] == (n - 1) * block * 8
    assert comm.ledger.total_report()["messages"] == n - 1


@pytest.mark.parametrize("changes,message", [
    ({"ep": 2, "model": "gpt"}, "--ep 2 needs --model moe (experts to split)"),
    ({"ep": 4, "dp": 2}, "--ep 4 does not divide dp=2 (ep groups are blocks of ep dp ranks)"),
    ({"ep": 3, "dp": 3, "n_experts": 4}, "--n-experts 4 is not divisible by --ep 3"),
    ({"ep": 2, "dp": 2, "zero": 3, "chunk_mb": 1.0}, "--ep 2 with chunked ZeRO-3 (--offload, --chunk-mb, "
                                                     "--device-mem-mb) is not built yet"),
    ({"tp": 2, "dp": 1, "sp": True}, "--model moe does not support --sp"),
])
def test_bad_expert_parallel_layouts_are_one_line(changes, message):
    cfg = tiny(**changes)
    world = (cfg.dp or 1) * cfg.tp
    errors = validate(cfg, world)
    assert any(e.startswith(message) for e in errors), errors


def test_single_process_reference_resets_ep():
    assert tiny(ep=2, dp=2).single_process().ep == 1


@needs_world_size(2, 4)
@mpi_given(max_examples=1, seed=st.integers(0, 2**16))
def test_a_checkpoint_saved_with_ep_resumes_in_another_ep(seed):
    """Saved at ep = world (each rank writes its own experts), resumed at ep 1 (every rank holds every
    expert) in the same world: the run continues as one process would have, step for step."""
    folder = WORLD.bcast(tempfile.mkdtemp() if WORLD.rank == 0 else None)
    saved = tiny(dp=WORLD.size, ep=WORLD.size, seed=seed, steps=2, save=f"{folder}/ck")
    Trainer(saved, WORLD).run()
    resumed = tiny(dp=WORLD.size, ep=1, seed=seed, steps=4, resume=f"{folder}/ck")
    assert validate(resumed, WORLD.size) == []
    trainer = Trainer(resumed, WORLD)
    records = trainer.run()
    full = trainer.full_state()
    if WORLD.rank == 0:
        assert [r["step"] for r in records] == [2, 3]
        assert_trains_like_one_process(resumed.replace(resume=None), records, full)


def test_a_checkpoint_of_other_experts_is_refused(tmp_path):
    Trainer(tiny(dp=1, steps=1, save=str(tmp_path / "ck")), MPI.COMM_SELF).run()
    errors = validate(tiny(dp=1, steps=2, n_experts=2, resume=str(tmp_path / "ck")), 1)
    assert len(errors) == 1, errors
    assert "a checkpoint of another model (n_experts 4 there, 2 here)" in errors[0], errors
