"""Placements and redistribute (parallel/placements.py) on 2 ranks (a 1-D mesh) and 4 (a 2x2 mesh).

Every expectation is written here by hand: torch.chunk's cut (ceil(n/N) rows, the last ones short),
the global tensor rebuilt from every rank's piece, the ring's bytes for each pair (the padded chunk
times N-1), and the gradient of <G, y> (redistribute is the identity on the global tensor, so the
gradient is G itself, placed as the input) checked by a central difference too.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import numpy
from mpi_harness import at_world_size, mpi_given, needs_world_size

from minipar.core.autograd import Tensor
from minipar.distributed.ledger import ring_bytes_sent
from minipar.parallel.placements import (
    DeviceMesh,
    Partial,
    Replicate,
    Shard,
    ShardedArray,
    chunk_bounds,
    enter_tensor_parallel,
    leave_tensor_parallel,
)

PLACEMENTS = [Shard(0), Shard(1), Replicate(), Partial()]


def test_chunks_are_torch_chunks():
    """torch.chunk(torch.arange(n), parts) by hand: ceil(n/parts) rows, the last ones short or empty."""
    assert [chunk_bounds(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [chunk_bounds(6, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 6)]
    assert [chunk_bounds(1, 2, i) for i in range(2)] == [(0, 1), (1, 1)]


def mesh_of(comm) -> tuple[DeviceMesh, list[tuple[int, ...]]]:
    """A 1-D mesh "x" on 2 ranks, a 2x2 mesh ("a" outer, "b" inner) on 4; every rank's coordinates."""
    if comm.size == 2:
        return DeviceMesh({"x": comm.split(0, comm.rank, "x", reuse=("test",))}), [(0,), (1,)]
    a, b = divmod(comm.rank, 2)
    mesh = DeviceMesh({"a": comm.split(b, a, "a", reuse=("test",)),
                       "b": comm.split(a, b, "b", reuse=("test",))})
    return mesh, [divmod(r, 2) for r in range(4)]


def chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk: ceil(n/parts) rows per chunk, the last ones shorter or empty."""
    rows = -(-n // parts)
    return min(index * rows, n), min((index + 1) * rows, n)


def cut(full, placements, coords, sizes):
    for placement, coord, size in zip(placements, coords, sizes):
        if isinstance(placement, Shard):
            index = [slice(None)] * full.ndim
            index[placement.dim] = slice(*chunk(full.shape[placement.dim], size, coord))
            full = full[tuple(index)]
    return full


def summand(seed, shape, placements, coords):
    """The summand a rank's coordinates on the Partial dimensions pick (their sum is the tensor)."""
    partial = tuple(c for p, c in zip(placements, coords) if isinstance(p, Partial))
    return numpy.random.default_rng([seed, *partial]).standard_normal(shape)


def make(seed, shape, placements, coords, sizes):
    """(the global tensor, this rank's local piece) of a random tensor with these placements."""
    ranges = [range(s) if isinstance(p, Partial) else [0] for p, s in zip(placements, sizes)]
    whole = sum(summand(seed, shape, placements, c) for c in itertools.product(*ranges))
    return whole, cut(summand(seed, shape, placements, coords), placements, coords, sizes)


def rebuild(comm, local, shape, placements, all_coords, sizes):
    """The global tensor from every rank's piece: each piece put in place, summed over the Partial
    dims, counted once over the Replicate ones."""
    whole = numpy.zeros(shape)
    for piece, coords in zip(comm.allgather_obj(local), all_coords):
        if any(isinstance(p, Replicate) and c for p, c in zip(placements, coords)):
            continue
        index = [slice(None)] * len(shape)
        for p, c, s in zip(placements, coords, sizes):
            if isinstance(p, Shard):
                index[p.dim] = slice(*chunk(shape[p.dim], s, c))
        whole[tuple(index)] += piece
    return whole


def expected_bytes(shape, now, to, coords, sizes, names) -> dict:
    """Rank's bytes per mesh dim for now -> to, one dim at a time in mesh order (padded chunks)."""
    charged, current = {}, list(now)
    for i, name in enumerate(names):
        if current[i] == to[i]:
            continue
        local = list(cut(numpy.empty(shape), current, coords, sizes).shape)
        n = sizes[i]
        per = [-(-shape[d] // n) for d in range(len(shape))]  # padded rows of each dim's chunk
        before, after = current[i], to[i]
        if isinstance(before, Shard) and isinstance(after, Replicate):
            rest = int(numpy.prod([s for d, s in enumerate(local) if d != before.dim]))
            charged[name] = (n - 1) * per[before.dim] * rest * 8
        elif isinstance(before, Partial) and isinstance(after, Replicate):
            base, extra = divmod(int(numpy.prod(local)), n)  # the ring's cut of the elements
            cut_bytes = [(base + (r < extra)) * 8 for r in range(n)]
            charged[name] = ring_bytes_sent("all_reduce", cut_bytes, coords[i])
        elif isinstance(before, Partial) and isinstance(after, Shard):
            rest = int(numpy.prod([s for d, s in enumerate(local) if d != after.dim]))
            charged[name] = (n - 1) * per[after.dim] * rest * 8
        elif isinstance(before, Shard) and isinstance(after, Shard):
            rest = int(numpy.prod([s for d, s in enumerate(local) if d not in (before.dim, after.dim)]))
            charged[name] = (n - 1) * per[before.dim] * per[after.dim] * rest * 8
        current[i] = after
    return {k: v for k, v in charged.items() if v}


def supported(placements) -> bool:
    dims = [p.dim for p in placements if isinstance(p, Shard)]
    return len(dims) == len(set(dims))


def pair_supported(now, to) -> bool:
    return all(supported(tuple(to[:i]) + tuple(now[i:])) for i in range(len(now) + 1))


def grad_default(placements):
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


@needs_world_size(2, 4)
@mpi_given(max_examples=6, examples=[  # FSDP's gather and gradient with padding; a Partial input; 2-D
    at_world_size((2,), rows=5, cols=3, seed=1, picks=[Shard(0), Replicate(), Partial(), *[Replicate()] * 3]),
    at_world_size((2,), rows=3, cols=5, seed=2, picks=[Partial(), Shard(1), Shard(1), *[Replicate()] * 3]),
    at_world_size((4,), rows=5, cols=3, seed=3,
                  picks=[Shard(0), Partial(), Replicate(), Shard(1), Partial(), Shard(1)])],
           rows=st.integers(1, 6), cols=st.integers(1, 5), seed=st.integers(0, 2**31),
           picks=st.lists(st.sampled_from(PLACEMENTS), min_size=6, max_size=6))
def test_redistribute_values_bytes_and_gradients(comm, rows, cols, seed, picks):
    mesh, all_coords = mesh_of(comm)
    k, coords, shape = len(mesh.names), all_coords[comm.rank], (rows, cols)
    sizes = [mesh.size(n) for n in mesh.names]
    now, to, grad = tuple(picks[:k]), tuple(picks[k:2 * k]), tuple(picks[2 * k:3 * k])
    if not (pair_supported(now, to) and pair_supported(grad, grad_default(now))):
        now, to, grad = (Replicate(),) * k, tuple(picks[k:2 * k]), (Replicate(),) * k
        if not pair_supported(now, to):
            to = (Replicate(),) * k
    whole, local = make(seed, shape, now, coords, sizes)
    x = ShardedArray(Tensor(local.copy(), True), shape, now, mesh)
    comm.ledger.start_step()
    y = x.redistribute(to, grad_placements=grad)
    forward = sent_by_dim(comm)
    rebuilt = rebuild(comm, y.local.data, shape, to, all_coords, sizes)
    g_whole, g_local = make(seed + 1, shape, grad, coords, sizes)  # the gradient of <G, y> is G
    comm.ledger.start_step()
    y.local.backward(g_local)
    backward = sent_by_dim(comm)
    # a central difference of L(x) = <G, y> along a random direction equals <gradient, direction>
    direction_whole, direction = make(seed + 2, shape, now, coords, sizes)
    h, values = 1e-3, []
    for sign in (1, -1):
        moved = ShardedArray(Tensor(local + sign * h * direction), shape, now, mesh).redistribute(to)
        values.append(float((g_whole * rebuild(comm, moved.local.data, shape, to, all_coords, sizes)).sum()))
    # every collective is done: now assert (a rank that failed earlier would leave the others waiting)
    assert numpy.allclose(rebuilt, whole, rtol=1e-12, atol=1e-12)  # the global tensor is unchanged
    if not any(isinstance(p, Partial) for p in to):  # and each piece is where the placements say
        assert numpy.allclose(y.local.data, cut(whole, to, coords, sizes), rtol=1e-12, atol=1e-12)
    assert forward == expected_bytes(shape, now, to, coords, sizes, mesh.names), (now, to)
    into = grad_default(now)
    assert numpy.allclose(x.local.grad, cut(g_whole, into, coords, sizes), rtol=1e-12, atol=1e-12)
    assert backward == expected_bytes(shape, grad, into, coords, sizes, mesh.names), (grad, into)
    if all(isinstance(p, Replicate) for p in grad) or grad == into:
        assert backward == {}  # a Replicate gradient is cut locally: no bytes in backward
    assert abs((values[0] - values[1]) / (2 * h) - float((g_whole * direction_whole).sum())) < 1e-8


def sent_by_dim(comm) -> dict:
    return {dim: nbytes for dim, nbytes in comm.ledger.step_report()["by_dim"].items() if nbytes}


@needs_world_size(2)
@mpi_given(max_examples=3, seed=st.integers(0, 2**16), sequence=st.booleans(),
           examples=[at_world_size((2,), seed=0, sequence=False), at_world_size((2,), seed=1, sequence=True)])
def test_enter_and_leave_tensor_parallel_by_hand(comm, seed, sequence):
    """enter_tensor_parallel and leave_tensor_parallel (lesson 04b's excerpt) against what Megatron's f
    and g do, written out from every rank's draws. Without sequence parallelism: enter is the identity
    forward and sums the ranks' gradients backward; leave sums the ranks' partial results forward and
    hands each rank's own gradient back. With it: enter gathers the (b, s/2, h) pieces along the sequence
    forward and gives each rank its positions of the summed gradient backward; leave gives each rank
    its positions of the summed partials, and gathers the pieces' gradients backward."""
    tp = comm.split(0, comm.rank, "tp", reuse=("test",))
    mesh, n, me = DeviceMesh({"tp": tp}), comm.size, comm.rank

    def draw(rank, what, shape):
        return numpy.random.default_rng([seed, rank, what]).standard_normal(shape)

    b, s, h = 2, 4, 3
    piece = (b, s // n, h) if sequence else (b, s, h)
    mine = slice(me * (s // n), (me + 1) * (s // n)) if sequence else slice(None)
    x = Tensor(draw(0 if not sequence else me, 0, piece), True)  # Replicate: rank 0's draw on every rank
    y = enter_tensor_parallel(x, mesh, sequence)
    y.backward(draw(me, 1, (b, s, h)))
    whole_x = numpy.concatenate([draw(r, 0, piece) for r in range(n)], axis=1) if sequence else x.data
    assert numpy.array_equal(y.data, whole_x)
    numpy.testing.assert_allclose(x.grad, sum(draw(r, 1, (b, s, h)) for r in range(n))[:, mine], rtol=1e-15)

    partial = Tensor(draw(me, 2, (b, s, h)), True)
    z = leave_tensor_parallel(partial, mesh, sequence)
    z.backward(draw(me, 3, piece))
    numpy.testing.assert_allclose(z.data, sum(draw(r, 2, (b, s, h)) for r in range(n))[:, mine], rtol=1e-15)
    every = [draw(r, 3, piece) for r in range(n)]
    assert numpy.array_equal(partial.grad, numpy.concatenate(every, axis=1) if sequence else every[me])


@needs_world_size(2)
@mpi_given(max_examples=5, rows=st.integers(1, 7), cols=st.integers(1, 4))
def test_gathered_weight_gradient_reduce_scattered_and_replicate_gradient_free(comm, rows, cols):
    """FSDP's pattern: Shard(0) -> Replicate with a Partial gradient is reduce-scattered back (padded
    rows: ceil(rows/2) a rank); with a Replicate gradient backward sends nothing."""
    mesh, _ = mesh_of(comm)
    weight = ShardedArray(Tensor(numpy.ones((-(-rows // 2) if comm.rank == 0 else rows // 2, cols)), True),
                          (rows, cols), (Shard(0),), mesh)
    outcomes = []
    for grad, sent in ((Partial(), -(-rows // 2) * cols * 8), (Replicate(), 0)):
        weight.local.grad = None
        whole = weight.redistribute((Replicate(),), grad_placements=(grad,))
        comm.ledger.start_step()
        whole.local.backward(numpy.full((rows, cols), 1.0 + comm.rank))
        outcomes.append((sent_by_dim(comm).get("x", 0), sent, weight.local.grad.copy(),
                         3.0 if isinstance(grad, Partial) else 1.0 + comm.rank))
    for charged, sent, got, expected in outcomes:
        assert charged == sent
        assert (got == expected).all()


def both_forms(module, forwards, x_data, upstream, comm) -> list[tuple]:
    """Each forward of `module`'s layer on the same input and upstream gradient: its output, the input's
    gradient, the parameters' gradients and the tp bytes of the step."""
    outcomes = []
    for forward in forwards:
        for p in module.parameters():
            p.grad = None
        x = Tensor(x_data.copy(), True)
        comm.ledger.start_step()
        y = forward(x)
        y.backward(upstream)
        outcomes.append((y.data, x.grad, [p.grad.copy() for p in module.parameters()],
                         comm.ledger.step_report()["by_dim_op"]))
    return outcomes

@needs_world_size(2)
@mpi_given(max_examples=2, seed=st.integers(0, 2**16))
def test_megatron_mlp_in_placements_is_tensor_py_step_for_step(comm, seed):
    """tensor.py's ParallelMLP (f, column layer, GELU, row layer, g) against the same MLP written in
    placements with its weights: the same output, gradients and tp bytes, bit for bit."""
    from minipar.core.nn import GPTConfig
    from minipar.parallel.placements import tensor_parallel_mlp
    from minipar.parallel.tensor import ParallelMLP

    tp = comm.split(0, comm.rank, "tp", reuse=("test",))
    mlp = ParallelMLP(GPTConfig(d_model=6), tp)
    rng = numpy.random.default_rng(seed)
    for p in mlp.parameters():
        p.data = rng.standard_normal(p.shape)  # the same draws on every rank, then each keeps its own
    for p in mlp.parameters():
        p.data = p.data + comm.rank * (p.shard is not None)  # shards differ between ranks
    x_data, upstream = rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
    mesh = DeviceMesh({"tp": tp})
    (y0, gx0, gp0, sent0), (y1, gx1, gp1, sent1) = both_forms(
        mlp, (mlp.forward, lambda x: tensor_parallel_mlp(x, mlp.fc, mlp.proj, mesh)), x_data, upstream, comm)
    assert numpy.array_equal(y0, y1) and numpy.array_equal(gx0, gx1)
    assert all(numpy.array_equal(a, b) for a, b in zip(gp0, gp1))
    assert sent0 == sent1 == {"tp": {"all_reduce": 2 * (3 * 6 * 8)}}  # f and g: 2(N-1)/N·S each, N = 2


def megatron_layer(name: str, tp):
    """tensor.py's or sequence.py's layer (2 heads of 3), and the same layer written in placements."""
    from minipar.core.nn import GPTConfig
    from minipar.parallel import placements, sequence, tensor

    cfg, mesh, sp = GPTConfig(d_model=6, n_head=2), DeviceMesh({"tp": tp}), name.startswith("sp ")
    if name.endswith("attention"):
        layer = (sequence.SequenceParallelAttention if sp else tensor.ParallelAttention)(cfg, tp)
        return layer, lambda x: placements.tensor_parallel_attention(x, layer, mesh, sequence=sp)
    layer = (sequence.SequenceParallelMLP if sp else tensor.ParallelMLP)(cfg, tp)
    return layer, lambda x: placements.tensor_parallel_mlp(x, layer.fc, layer.proj, mesh, sequence=sp)


@needs_world_size(2)
@mpi_given(max_examples=2, layer=st.sampled_from(["attention", "sp mlp", "sp attention"]),
           seed=st.integers(0, 2**16),
           examples=[at_world_size((2,), layer=name, seed=i) for i, name in
                     enumerate(["attention", "sp mlp", "sp attention"])])
def test_attention_and_sequence_parallelism_in_placements_are_megatrons_step_for_step(comm, layer, seed):
    """ParallelAttention, SequenceParallelMLP and SequenceParallelAttention against the same layers in
    placements: the same output, gradients and tp bytes, bit for bit. Bytes by hand, N = 2: the
    attention's f and g each an all-reduce of the (b, s, h) activation, S bytes a rank; with sequence
    parallelism a (b, s/2, h) piece of P bytes, all-gathered entering and reduce-scattered leaving, the
    other one in backward, (N-1)·P each, and the proj bias's gradient (h values, Partial over the
    ranks' positions) all-reduced: (N-1)/N·2·h·8. Megatron's sequence-parallel layers keep only the
    piece and all-gather it again for the weight gradients (lesson 05): (N-1)·P more, once per gathered
    input; the placements form keeps the gathered input whole, as any saved tensor."""
    tp = comm.split(0, comm.rank, "tp", reuse=("test",))
    module, in_placements = megatron_layer(layer, tp)
    rng = numpy.random.default_rng(seed)
    for p in module.parameters():
        p.data = rng.standard_normal(p.shape)  # the same draws on every rank, then each keeps its own
    for p in module.parameters():
        p.data = p.data + comm.rank * (p.shard is not None)  # shards differ between ranks
    sp = layer.startswith("sp ")
    shape = (2, 2 if sp else 4, 6)  # (b, s, h); with sp each rank's half of the 4 positions
    x_data = rng.standard_normal((comm.size, *shape))[comm.rank if sp else 0]  # Shard(1) or Replicate
    upstream = rng.standard_normal((comm.size, *shape))[comm.rank if sp else 0]
    (y0, gx0, gp0, sent0), (y1, gx1, gp1, sent1) = both_forms(
        module, (module.forward, in_placements), x_data, upstream, comm)
    assert y0.shape == shape and numpy.array_equal(y0, y1) and numpy.array_equal(gx0, gx1)
    assert all(numpy.array_equal(a, b) for a, b in zip(gp0, gp1))
    piece = int(numpy.prod(shape)) * 8
    expected = {"all_gather": 2 * piece, "reduce_scatter": 2 * piece,
                "all_reduce": ring_bytes_sent("all_reduce", [3 * 8, 3 * 8], comm.rank)} if sp else \
        {"all_reduce": 2 * piece}
    regathered = {**expected, "all_gather": 3 * piece} if sp else expected
    assert sent0 == {"tp": regathered} and sent1 == {"tp": expected}


@needs_world_size(4)
@mpi_given(max_examples=4, rows=st.integers(1, 9), cols=st.integers(1, 3), seed=st.integers(0, 2**16),
           examples=[at_world_size((4,), rows=7, cols=3, seed=1),  # tp chunks of 4 and 3 rows
                     at_world_size((4,), rows=1, cols=2, seed=2)])  # empty chunks at both levels
def test_strided_shard_cuts_each_tp_chunk_over_dp_tp_major(comm, rows, cols, seed):
    """(StridedShard(0), Shard(0)) on ("a", "b") = (dp, tp): rows cut over tp first, then each tp chunk's
    rows over dp (FSDP over a column-parallel weight). By hand: rank (a, b) holds rows chunk(m, 2, a)
    of tp chunk b (m rows). FSDP's gather over dp gives the tp chunk, (2-1)·ceil(m/2) rows sent, and
    its Partial gradient (each dp rank's own data) comes back summed by a reduce-scatter of as many;
    the whole tensor gathers tp after dp; cutting a Replicate tensor sends nothing; Shard(0) on both
    mesh dimensions is refused."""
    from minipar.parallel.placements import StridedShard, distribute

    mesh, all_coords = mesh_of(comm)
    a, b = all_coords[comm.rank]
    full = numpy.random.default_rng(seed).standard_normal((rows, cols))
    tp_start, tp_stop = chunk(rows, 2, b)
    m = tp_stop - tp_start
    start, stop = chunk(m, 2, a)
    strided = (StridedShard(0), Shard(0))
    comm.ledger.start_step()
    x = distribute(full, mesh, strided, requires_grad=True)
    cut_sent = sent_by_dim(comm)
    gathered = x.redistribute((Replicate(), Shard(0)), grad_placements=(Partial(), Shard(0)))
    forward = sent_by_dim(comm)
    upstream = numpy.random.default_rng([seed, a]).standard_normal((m, cols))  # dp rank a's own gradient
    comm.ledger.start_step()
    gathered.local.backward(upstream)
    backward = sent_by_dim(comm)
    comm.ledger.start_step()
    whole = x.full()
    whole_sent = sent_by_dim(comm)
    refused = ""
    try:
        distribute(full, mesh, (Shard(0), Shard(0)))
    except ValueError as error:
        refused = str(error)
    other_dp_rank = numpy.random.default_rng([seed, 1 - a]).standard_normal((m, cols))
    assert numpy.array_equal(x.local.data, full[tp_start:tp_stop][start:stop]) and cut_sent == {}
    assert numpy.array_equal(gathered.local.data, full[tp_start:tp_stop])
    assert forward == ({"a": -(-m // 2) * cols * 8} if m else {})
    assert numpy.allclose(x.local.grad, (upstream + other_dp_rank)[start:stop], rtol=1e-15, atol=0)
    assert backward == forward
    assert numpy.array_equal(whole, full)
    assert whole_sent == {k: v for k, v in {"a": -(-m // 2) * cols * 8, "b": -(-rows // 2) * cols * 8}.items()
                          if v}
    assert "Shard(0) on two mesh dimensions is not supported" in refused
