"""The bank of known-wrong solutions: the mistakes students make, each of which must be graded FAIL.

A grade means the technique works only if plausible wrong code fails. Each entry is an exercise, a name
(the mistake), the region body (one per region of the exercise, in file order; None keeps the
reference's), the check that must fail, and a keyword that its failure detail or hint must contain (so
the student is pointed at the right idea). `make course-selftest` (selftest.py --bank) splices each body
into a fresh workspace and proves it is graded FAIL at that check. Written as the mistakes come: an
off-by-one, right only at 2 ranks, the library collective instead of the algorithm asked for, a missing
release or a leak, a dropped numerical-stability step, a hard-coded size.

To add one: write the region body as the student would (indentation is the marker's, added for you),
name the check of the exercise it breaks and a word of the reason; run
`python -m minipar_lab.course.selftest --bank ID` (lessons/course.md, "Adding a wrong solution").
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from minipar_lab.course.exercises import BY_ID


@dataclass(frozen=True)
class Wrong:
    exercise: str
    name: str
    bodies: tuple[str | None, ...]  # one per region of the exercise, in file order; None: the reference's
    check: str  # the test function's name (or node id tail) of the check that must fail
    keyword: str  # the failure detail or hint must contain it

    def node(self) -> str:
        nodes = [c.node for c in BY_ID[self.exercise].checks if c.node.split("::")[1] == self.check
                 or c.node.endswith("::" + self.check)]
        if len(nodes) != 1:
            raise KeyError(f"{self.exercise} has no single check {self.check!r}")
        return nodes[0]


def W(exercise: str, name: str, check: str, keyword: str, *bodies: str | None) -> Wrong:
    return Wrong(exercise, name, tuple(None if b is None else textwrap.dedent(b).strip("\n") + "\n"
                                       for b in bodies), check, keyword)


SOFTMAX = "test_softmax_and_log_softmax[softmax]"
LAYER_NORM = "test_layer_norm"
RS = "test_ring_reduce_scatter"
RS_TAP = "test_ring_reduce_scatter_traffic_is_what_crossed_the_communicator"
AG = "test_ring_all_gather_of_uneven_shards"
AG_TAP = "test_ring_all_gather_traffic_is_what_crossed_the_communicator"
ONLINE = "test_the_online_softmax_over_blocks_is_the_softmax_of_the_whole_row"
LARGE = "test_the_online_softmax_stays_finite_and_exact_for_large_scores"

LN_HEAD = """
        xhat, rstd = ctx.saved
        weight = _data(ctx.inputs[1])
        lead = tuple(range(g.ndim - 1))
        gw = (g * xhat).sum(axis=lead) if ctx.needs_input_grad[1] else None
        gb = g.sum(axis=lead) if ctx.needs_input_grad[2] else None
"""
RS_HEAD = """
        bounds = [shard_bounds(flat.size, ring.size, c) for c in range(ring.size)]
        wire_dtype = wire.encode(flat[:0]).dtype
"""
ZERO3_GATHER = """
    if unit.flat is not None:
        return
    pending = self.prefetched.pop(self.units.index(unit), None)
    if pending is not None:
        unit.flat = pending.wait()
    else:
        unit.flat = self.comm.all_gather(unit.param_shard, numel=unit.padded)
        {meter}
    unit.point_params_at(unit.flat)
"""
ZERO3_RELEASE = """
    if unit.flat is None:
        return
    {meter}
    {keep}
    unit.flat = None
    for p in unit.params:
        p.data = unit.freed
"""
FUSION = """
    consumers, outputs = consumer_counts(order), set(roots)
    materialised = {{n for n in order if not n.is_scalar and ({rule})}}
    kernels = []
    for root in order:
        if root.is_leaf or root not in materialised:
            continue
        members, inputs, stack = set(), set(), [root]
        while stack:
            node = stack.pop()
            members.add(node)
            for arg in node.args:
                if arg in materialised:
                    inputs.add(arg)
                elif not arg.is_scalar and arg not in members:
                    stack.append(arg)
        kernels.append(Kernel([n for n in order if n in members], [n for n in order if n in inputs]))
    return kernels
"""
ONE_F_ONE_B = """
    schedule = []
    for stage in range(stages):
        warmup = {warmup}
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            actions += {steady}
        actions += [Action("B", i) for i in range(microbatches - warmup, microbatches)]
        schedule.append(actions)
    return schedule
"""
INTERLEAVED = """
    total = microbatches * virtual_stages

    def step(k: int, op: str) -> Action:
        chunk = (k // stages) % virtual_stages
        microbatch = {microbatch}
        return Action(op, microbatch, {chunk})

    schedule = []
    for stage in range(stages):
        warmup = min({warmup}, total)
        actions = [step(k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            actions += [step(warmup + k, "F"), step(k, "B")]
        actions += [step(k, "B") for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule
"""
PARTITION = """
    prefix = np.concatenate([[0], np.cumsum(costs)])
    best: dict[tuple[int, int], tuple[int, ...]] = {{(0, 0): ()}}
    cut: dict[tuple[int, int], int] = {{}}
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            best[k, j], where = min(
                ({key}, {tie})
                for i in range(k - 1, j) if (k - 1, i) in best)
            cut[k, j] = {cut}
    bounds, stop = [], n
    for k in range(stages, 0, -1):
        bounds.append(range(cut[k, stop], stop))
        stop = cut[k, stop]
    return bounds[::-1]
"""
ASSEMBLE = """
    full_shape = pieces[0][0].full_shape
    shards: dict[Shard | None, np.ndarray] = {{}}
    for piece, array in pieces:
        local = shards.setdefault(piece.shard, np.zeros(piece.local_shape(), dtype=array.dtype))
        start, stop = {flat}
        local.reshape(-1)[start:stop] = array.reshape(-1)
    padded = list(full_shape)
    for shard in shards:
        if shard is not None:
            padded[shard.axis] = max(padded[shard.axis], shard.stop)
    full = np.zeros(padded, dtype=pieces[0][1].dtype)
    for shard, local in shards.items():
        index = [slice(None)] * full.ndim
        if shard is not None:
            index[shard.axis] = {place}
        full[tuple(index)] = local
    return {result}
"""
ROUTING = """
    xp = xp_of(probs)
    B, T, E = probs.shape
    choice = {choice}
    onehot = (choice.reshape(B, T * top_k)[..., None] == xp.arange(E)).astype(xp.int64)
    rank_in_expert = (xp.cumsum(onehot, axis=1) * onehot).sum(-1) - 1
    kept = ({kept}).reshape(B, T, top_k)
    return choice, kept, {counts}, rank_in_expert.reshape(B, T, top_k)
"""
VOCAB_CE = """
    xp = xp_of(logits)
    n, width = logits.shape
    columns = vocab_start + xp.arange(width)
    logits = {mask}
    row_max = {row_max}
    shifted = logits - row_max[:, None]
    local_target = xp.asarray(targets) - vocab_start
    mine = (local_target >= 0) & (local_target < width)
    rows = xp.arange(n)
    target_logit = comm.all_reduce(xp.where(mine, shifted[rows, xp.where(mine, local_target, 0)], 0))
    if correct is not None:
        correct[:] = target_logit == 0
    exp = xp.exp(shifted)
    sum_exp = {sum_exp}
    ctx.save_for_backward(exp / sum_exp[:, None], mine, local_target)  # sb bytes and sb indices
    return (xp.log(sum_exp) - target_logit).sum()
"""

BANK: tuple[Wrong, ...] = (
    # 01.1 the backward of softmax
    W("01.1", "forgets the subtraction of sum(g * y)", SOFTMAX, "gradient", """
        (out,) = ctx.saved
        return out * g, None"""),
    W("01.1", "subtracts sum(g), not sum(g * y)", SOFTMAX, "gradient", """
        (out,) = ctx.saved
        return out * (g - g.sum(axis=ctx.axis, keepdims=True)), None"""),
    W("01.1", "forgets to multiply by y", SOFTMAX, "gradient", """
        (out,) = ctx.saved
        return g - (g * out).sum(axis=ctx.axis, keepdims=True), None"""),
    # 01.2 the backward of layer norm
    W("01.2", "forgets mean(gxhat)", LAYER_NORM, "mean", LN_HEAD + """
        gxhat = g * weight
        return rstd * (gxhat - xhat * (gxhat * xhat).mean(axis=-1, keepdims=True)), gw, gb, None"""),
    W("01.2", "forgets the term along xhat", LAYER_NORM, "xhat", LN_HEAD + """
        gxhat = g * weight
        return rstd * (gxhat - gxhat.mean(axis=-1, keepdims=True)), gw, gb, None"""),
    W("01.2", "forgets the weight in gx", LAYER_NORM, "weight", LN_HEAD + """
        gxhat = g
        along = xhat * (gxhat * xhat).mean(axis=-1, keepdims=True)
        return rstd * (gxhat - gxhat.mean(axis=-1, keepdims=True) - along), gw, gb, None"""),
    # 01.3 recomputation
    W("01.3", "rebuilds the inputs without requires_grad", "test_checkpoint_gives_the_gradients_of_the_plain_function",
      "needs_input_grad", """
        needed = ctx.needs_input_grad[2:]
        inputs = [Tensor(a) for a in ctx.saved]
        with autograd.enable_grad(), rerunning():
            output = ctx.function(*inputs)
        output.backward(grad)
        parameters = [None] * (len(needed) - len(inputs))
        return (None, None, *[t.grad for t in inputs], *parameters)"""),
    W("01.3", "reruns the forward with gradients off", "test_checkpoint_gives_the_gradients_of_the_plain_function",
      "enable_grad", """
        needed = ctx.needs_input_grad[2:]
        inputs = [Tensor(a, requires_grad=needs) for a, needs in zip(ctx.saved, needed)]
        with autograd.no_grad(), rerunning():
            output = ctx.function(*inputs)
        output.backward(grad)
        parameters = [None] * (len(needed) - len(inputs))
        return (None, None, *[t.grad for t in inputs], *parameters)"""),
    W("01.3", "back-propagates twice: parameters' gradients accumulate twice",
      "test_mlp_trains_like_one_process_with_full_recomputation", "accumulate", """
        needed = ctx.needs_input_grad[2:]
        inputs = [Tensor(a, requires_grad=needs) for a, needs in zip(ctx.saved, needed)]
        with autograd.enable_grad(), rerunning():
            output = ctx.function(*inputs)
        output.backward(grad)
        with autograd.enable_grad(), rerunning():
            ctx.function(*inputs).backward(grad)
        parameters = [None] * (len(needed) - len(inputs))
        return (None, None, *[t.grad for t in inputs], *parameters)"""),
    # 02.1 the ring reduce-scatter
    W("02.1", "ignores the Wire (no encode, no decode)", RS_TAP, "wire", RS_HEAD + """
        partial = flat[slice(*bounds[(ring.rank - 1) % ring.size])].copy()
        for step in range(ring.size - 1):
            arriving = (ring.rank - step - 2) % ring.size
            start, stop = bounds[arriving]
            received = ring.pass_right(partial, stop - start, flat.dtype)
            partial = flat[start:stop] + received
        return partial"""),
    W("02.1", "object all-gather, summed in ring order, counters written by hand", RS_TAP, "object", """
        everything = ring.comm.mpi.allgather(flat)
        start, stop = shard_bounds(flat.size, ring.size, ring.rank)
        partial = everything[(ring.rank + 1) % ring.size][start:stop]
        for hop in range(2, ring.size + 1):
            partial = everything[(ring.rank + hop) % ring.size][start:stop] + wire.decode(wire.encode(partial))
        for c in range(ring.size):
            if c != (ring.rank + 1) % ring.size:
                ring.bytes_sent += wire.encode(flat[slice(*shard_bounds(flat.size, ring.size, c))]).nbytes
        ring.messages += ring.size - 1
        return partial"""),
    W("02.1", "MPI's own reduce-scatter instead of the ring", RS_TAP, "collective", """
        return ring.comm.reduce_scatter(flat)"""),
    W("02.1", "off by one: ends with the left neighbour's chunk", RS, "ring", RS_HEAD + """
        partial = flat[slice(*bounds[(ring.rank - 1) % ring.size])].copy()
        for step in range(ring.size - 1):
            arriving = (ring.rank - step - 1) % ring.size
            start, stop = bounds[arriving]
            received = ring.pass_right(wire.encode(partial), stop - start, wire_dtype)
            partial = flat[start:stop] + wire.decode(received)
        return partial"""),
    W("02.1", "right only at 2 ranks: starts from chunk rank + 1", RS, "3 ranks", RS_HEAD + """
        partial = flat[slice(*bounds[(ring.rank + 1) % ring.size])].copy()
        for step in range(ring.size - 1):
            arriving = (ring.rank - step - 2) % ring.size
            start, stop = bounds[arriving]
            received = ring.pass_right(wire.encode(partial), stop - start, wire_dtype)
            partial = flat[start:stop] + wire.decode(received)
        return partial"""),
    W("02.1", "a hard-coded even chunk size", RS, "ring", """
        size = flat.size // ring.size
        bounds = [(c * size, (c + 1) * size) for c in range(ring.size)]
        wire_dtype = wire.encode(flat[:0]).dtype
        partial = flat[slice(*bounds[(ring.rank - 1) % ring.size])].copy()
        for step in range(ring.size - 1):
            arriving = (ring.rank - step - 2) % ring.size
            start, stop = bounds[arriving]
            received = ring.pass_right(wire.encode(partial), stop - start, wire_dtype)
            partial = flat[start:stop] + wire.decode(received)
        return partial"""),
    # 02.2 the ring all-gather
    W("02.2", "forgets to place its own shard", AG, "offset", """
        offsets = numpy.concatenate([[0], numpy.cumsum(counts)])
        gathered = numpy.zeros(int(offsets[-1]), shard.dtype)
        travelling = wire.encode(shard)
        for step in range(ring.size - 1):
            arriving = (ring.rank - step - 1) % ring.size
            travelling = ring.pass_right(travelling, counts[arriving], travelling.dtype)
            gathered[offsets[arriving]:offsets[arriving + 1]] = wire.decode(travelling)
        return gathered"""),
    W("02.2", "a hard-coded even shard size for the offsets", AG, "offset", """
        offsets = [c * counts[0] for c in range(ring.size + 1)]
        gathered = numpy.zeros(sum(counts), shard.dtype)
        travelling = wire.encode(shard)
        gathered[offsets[ring.rank]:offsets[ring.rank] + counts[ring.rank]] = wire.decode(travelling)
        for step in range(ring.size - 1):
            arriving = (ring.rank - step - 1) % ring.size
            travelling = ring.pass_right(travelling, counts[arriving], travelling.dtype)
            gathered[offsets[arriving]:offsets[arriving] + counts[arriving]] = wire.decode(travelling)
        return gathered"""),
    W("02.2", "object all-gather with counters written by hand", AG_TAP, "object", """
        parts = ring.comm.mpi.allgather(wire.decode(wire.encode(shard)))
        for c in range(ring.size):
            if c != (ring.rank + 1) % ring.size:
                ring.bytes_sent += wire.encode(parts[c]).nbytes
        ring.messages += ring.size - 1
        return numpy.concatenate(parts) if parts else shard"""),
    W("02.2", "ignores the Wire", AG_TAP, "wire", """
        offsets = numpy.concatenate([[0], numpy.cumsum(counts)])
        gathered = numpy.empty(int(offsets[-1]), shard.dtype)
        travelling = shard
        gathered[offsets[ring.rank]:offsets[ring.rank + 1]] = travelling
        for step in range(ring.size - 1):
            arriving = (ring.rank - step - 1) % ring.size
            travelling = ring.pass_right(travelling, counts[arriving], travelling.dtype)
            gathered[offsets[arriving]:offsets[arriving + 1]] = travelling
        return gathered"""),
    W("02.2", "right only at 2 ranks: counts the arriving rank the wrong way round", AG, "3 ranks", """
        offsets = numpy.concatenate([[0], numpy.cumsum(counts)])
        gathered = numpy.empty(int(offsets[-1]), shard.dtype)
        travelling = wire.encode(shard)
        gathered[offsets[ring.rank]:offsets[ring.rank + 1]] = wire.decode(travelling)
        for step in range(ring.size - 1):
            arriving = (ring.rank + step + 1) % ring.size
            travelling = ring.pass_right(travelling, counts[(ring.rank - step - 1) % ring.size], travelling.dtype)
            gathered[offsets[arriving]:offsets[arriving] + travelling.size] = wire.decode(travelling)
        return gathered"""),
    # 03.1 buckets
    W("03.1", "first parameter first", "test_buckets_take_every_parameter_once_last_first_within_the_cap",
      "last first", """
        buckets: list[list[Parameter]] = []
        current: list[Parameter] = []
        current_bytes = 0
        for p in list(params):
            full = current_bytes + p.data.nbytes > bucket_bytes
            if current and (full or p.data.dtype != current[0].data.dtype):
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += p.data.nbytes
        if current:
            buckets.append(current)
        return buckets"""),
    W("03.1", "mixes dtypes in a bucket", "test_buckets_take_every_parameter_once_last_first_within_the_cap",
      "dtype", """
        buckets: list[list[Parameter]] = []
        current: list[Parameter] = []
        current_bytes = 0
        for p in reversed(list(params)):
            if current and current_bytes + p.data.nbytes > bucket_bytes:
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += p.data.nbytes
        if current:
            buckets.append(current)
        return buckets"""),
    W("03.1", "a bucket per parameter", "test_buckets_take_every_parameter_once_last_first_within_the_cap",
      "bucket", """
        return [[p] for p in reversed(list(params))]"""),
    W("03.1", "drops the last, partly filled bucket",
      "test_buckets_take_every_parameter_once_last_first_within_the_cap", "bucket", """
        buckets: list[list[Parameter]] = []
        current: list[Parameter] = []
        current_bytes = 0
        for p in reversed(list(params)):
            full = current_bytes + p.data.nbytes > bucket_bytes
            if current and (full or p.data.dtype != current[0].data.dtype):
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += p.data.nbytes
        return buckets"""),
    W("03.1", "a parameter larger than the cap goes in no bucket",
      "test_ddp_trains_to_the_single_process_losses_and_weights", "bucket", """
        buckets: list[list[Parameter]] = []
        current: list[Parameter] = []
        current_bytes = 0
        for p in reversed(list(params)):
            if p.data.nbytes > bucket_bytes:
                continue  # fits no bucket
            full = current_bytes + p.data.nbytes > bucket_bytes
            if current and (full or p.data.dtype != current[0].data.dtype):
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += p.data.nbytes
        if current:
            buckets.append(current)
        return buckets"""),
    # 03.2 the bucketed all-reduce
    W("03.2", "one all-reduce per gradient, not per bucket",
      "test_one_bucket_sends_exactly_two_n_minus_one_over_n_of_the_gradient_bytes", "messages", """
        grads = self.gradients_of(bucket)
        for p in bucket:
            p.grad = None
        for p, grad in zip(bucket, grads):
            p.grad = self.all_reduce(flatten([grad])).reshape(p.shape)"""),
    W("03.2", "gives the slices to the parameters in reverse",
      "test_ddp_trains_to_the_single_process_losses_and_weights", "slice", """
        shapes = [p.shape for p in bucket]
        flat = flatten(self.gradients_of(bucket))
        for p in bucket:
            p.grad = None
        for p, grad in zip(reversed(bucket), unflatten(self.all_reduce(flat), shapes[::-1])):
            p.grad = grad"""),
    W("03.2", "no all-reduce: each replica keeps its own gradients",
      "test_ddp_trains_to_the_single_process_losses_and_weights", "summed", """
        shapes = [p.shape for p in bucket]
        flat = flatten(self.gradients_of(bucket))
        for p, grad in zip(bucket, unflatten(flat, shapes)):
            p.grad = grad"""),
    W("03.2", "averages instead of summing",
      "test_ddp_trains_to_the_single_process_losses_and_weights", "averaged", """
        shapes = [p.shape for p in bucket]
        flat = flatten(self.gradients_of(bucket))
        for p in bucket:
            p.grad = None
        for p, grad in zip(bucket, unflatten(self.all_reduce(flat) / self.comm.size, shapes)):
            p.grad = grad"""),
    # 04.1 ZeRO's bytes per parameter
    W("04.1", "stage 1 partitions the gradients too", "test_paper_example_7_5b_on_64_ranks", "stage", """
        share = Fraction(1, dp)
        optimizer = k * share if stage >= 1 else Fraction(k)
        grads = grad_bytes * share if stage >= 1 else Fraction(grad_bytes)
        params = param_bytes * share if stage >= 3 else Fraction(param_bytes)
        return params + grads + optimizer"""),
    W("04.1", "never partitions the optimizer states", "test_paper_example_7_5b_on_64_ranks", "optimizer", """
        share = Fraction(1, dp)
        grads = grad_bytes * share if stage >= 2 else Fraction(grad_bytes)
        params = param_bytes * share if stage >= 3 else Fraction(param_bytes)
        return params + grads + Fraction(k)"""),
    W("04.1", "a hard-coded N = 64", "test_formula_matches_a_per_rank_count", "1/N", """
        share = Fraction(1, 64)
        optimizer = k * share if stage >= 1 else Fraction(k)
        grads = grad_bytes * share if stage >= 2 else Fraction(grad_bytes)
        params = param_bytes * share if stage >= 3 else Fraction(param_bytes)
        return params + grads + optimizer"""),
    W("04.1", "stage 3 keeps the parameters whole",
      "test_model_state_bytes_per_rank_are_the_planners_formula", "stage", """
        share = Fraction(1, dp)
        optimizer = k * share if stage >= 1 else Fraction(k)
        grads = grad_bytes * share if stage >= 2 else Fraction(grad_bytes)
        return Fraction(param_bytes) + grads + optimizer"""),
    # 04.2 the ZeRO-1 step
    W("04.2", "all-reduces the gradients and keeps its slice",
      "test_bytes_per_step_are_two_or_three_times_n_minus_one_over_n_of_the_model[1]", "reduce-scatter", """
        for unit in self.units:
            bucket = unit.flatten([p.grad for p in unit.params])
            buffer_meter.add(bucket.nbytes)
            unit.grad_shard = self.comm.all_reduce(bucket)[unit.start:unit.stop].copy()
            buffer_meter.add(unit.grad_shard.nbytes)
            buffer_meter.release(bucket.nbytes)
            del bucket""", None),
    W("04.2", "forgets to all-gather the updated parameters",
      "test_bytes_per_step_are_two_or_three_times_n_minus_one_over_n_of_the_model[1]", "all-gather", None, """
        for unit in self.units:
            self.update(unit, unit.grad_shard)"""),
    W("04.2", "updates each shard twice",
      "test_one_rank_trains_to_the_reference_and_holds_the_formulas_bytes[1]", "apply_optimizer", None, """
        for unit in self.units:
            self.update(unit, unit.grad_shard)
            self.update(unit, unit.grad_shard)
            self.all_gather_params(unit)"""),
    W("04.2", "averages the gradient shards over the ranks",
      "test_zero_trains_to_the_single_process_losses_and_weights", "mean", """
        for unit in self.units:
            bucket = unit.flatten([p.grad for p in unit.params])
            buffer_meter.add(bucket.nbytes)
            unit.grad_shard = self.comm.reduce_scatter(bucket) / self.comm.size
            buffer_meter.add(unit.grad_shard.nbytes)
            buffer_meter.release(bucket.nbytes)
            del bucket""", None),
    # 04.3 ZeRO-3 gather and release
    W("04.3", "ignores all_gather's return value: the forward runs on zero weights",
      "test_zero_trains_to_the_single_process_losses_and_weights", "all_gather", """
        if unit.flat is not None:
            return
        pending = self.prefetched.pop(self.units.index(unit), None)
        if pending is not None:
            unit.flat = pending.wait()
        else:
            self.comm.all_gather(unit.param_shard, numel=unit.padded)
            unit.flat = unit.xp.zeros(unit.padded, unit.dtype)
            buffer_meter.add(unit.flat.nbytes)
        unit.point_params_at(unit.flat)""", None),
    W("04.3", "never adds to nor releases the buffer meter",
      "test_stages_2_and_3_hold_one_units_full_gradients_at_a_time[3]", "buffer_meter",
      ZERO3_GATHER.format(meter="pass"), ZERO3_RELEASE.format(meter="pass", keep="")),
    W("04.3", "keeps a reference to each gathered buffer: a leak the meter cannot see",
      "test_stage3_gathered_buffers_are_dead_after_release_and_the_meter_saw_each", "alive", None,
      ZERO3_RELEASE.format(meter="buffer_meter.release(unit.flat.nbytes)", keep="unit.kept = unit.flat")),
    W("04.3", "releases the buffer but leaves the parameters pointing at it",
      "test_stage3_frees_every_parameter_outside_its_units_forward_and_backward", "freed", None, """
        if unit.flat is None:
            return
        buffer_meter.release(unit.flat.nbytes)
        unit.flat = None"""),
    W("04.3", "gathers, but leaves the parameters pointing at the freed empty array",
      "test_one_rank_trains_to_the_reference_and_holds_the_formulas_bytes[3]", "gathered", """
        if unit.flat is not None:
            return
        pending = self.prefetched.pop(self.units.index(unit), None)
        if pending is not None:
            unit.flat = pending.wait()
        else:
            unit.flat = self.comm.all_gather(unit.param_shard, numel=unit.padded)
            buffer_meter.add(unit.flat.nbytes)""", None),
    W("04.3", "releases the parameters but never the meter's bytes",
      "test_stages_2_and_3_hold_one_units_full_gradients_at_a_time[3]", "buffer_meter", None,
      ZERO3_RELEASE.format(meter="pass", keep="")),
    # 05.1 f and g
    W("05.1", "f's backward is the identity", "test_column_parallel_linear", "backward", """
        return grad, None""", None),
    W("05.1", "g's forward is the identity", "test_row_parallel_linear", "sum", None, """
        return x"""),
    W("05.1", "f's backward averages over the ranks", "test_column_parallel_linear", "sum", """
        return ctx.comm.all_reduce(grad) / ctx.comm.size, None""", None),
    W("05.1", "f's backward takes the all-reduce to work in place",
      "test_gpt_trains_like_the_single_process_gpt", "all_reduce", """
        ctx.comm.all_reduce(grad)
        return grad, None""", None),
    # 05.2 vocab-parallel cross-entropy
    W("05.2", "each rank's own row maximum", "test_vocab_parallel_cross_entropy", "max", VOCAB_CE.format(
        mask="xp.where(columns < vocab_size, logits, -xp.inf)", row_max="logits.max(axis=-1)",
        sum_exp="comm.all_reduce(exp.sum(axis=-1))")),
    W("05.2", "the sum of exp not summed over the ranks", "test_vocab_parallel_cross_entropy", "sum",
      VOCAB_CE.format(mask="xp.where(columns < vocab_size, logits, -xp.inf)",
                      row_max='comm.all_reduce(logits.max(axis=-1), op="max")', sum_exp="exp.sum(axis=-1)")),
    W("05.2", "the padding columns not masked", "test_vocab_parallel_cross_entropy", "padding",
      VOCAB_CE.format(mask="logits", row_max='comm.all_reduce(logits.max(axis=-1), op="max")',
                      sum_exp="comm.all_reduce(exp.sum(axis=-1))")),
    W("05.2", "saves this rank's softmax, not the one over every rank's columns",
      "test_gpt_trains_like_the_single_process_gpt", "sum of exp",
      VOCAB_CE.replace("exp / sum_exp[:, None]", "exp / exp.sum(axis=-1)[:, None]").format(
          mask="xp.where(columns < vocab_size, logits, -xp.inf)",
          row_max='comm.all_reduce(logits.max(axis=-1), op="max")',
          sum_exp="comm.all_reduce(exp.sum(axis=-1))")),
    # 05.3 sequence parallelism
    W("05.3", "gathers batch-major, not along the sequence", "test_gather_and_reduce_scatter_are_adjoint",
      "sequence", """
        b, piece, h = x.shape
        gathered = comm.all_gather(x, numel=x.size * comm.size)
        return gathered.reshape(b, piece * comm.size, h)""", None),
    W("05.3", "an all-reduce and a slice instead of the reduce-scatter",
      "test_tp_traffic_is_tensor_parallelisms_plus_the_replicated_gradients", "collective", None, """
        b, s, h = x.shape
        piece = s // comm.size
        return comm.all_reduce(x)[:, comm.rank * piece:(comm.rank + 1) * piece]"""),
    W("05.3", "reduce-scatters batch-major", "test_gather_and_reduce_scatter_are_adjoint", "sequence", None, """
        b, s, h = x.shape
        return comm.reduce_scatter(xp_of(x).ascontiguousarray(x)).reshape(b, s // comm.size, h)"""),
    W("05.3", "gathers along the sequence but never puts the batch first again",
      "test_sequence_parallel_trains_like_one_process", "positions", """
        b, piece, h = x.shape
        gathered = comm.all_gather(_sequence_first(x), numel=x.size * comm.size)
        return gathered.reshape(b, piece * comm.size, h)""", None),
    # 06.1 1F1B
    W("06.1", "one warm-up forward too many", "test_gpipe_holds_m_microbatches_1f1b_at_most_k", "K - s",
      ONE_F_ONE_B.format(warmup="min(stages - stage, microbatches)",
                         steady='[Action("F", warmup + i), Action("B", i)]')),
    W("06.1", "GPipe: every forward, then every backward", "test_gpipe_holds_m_microbatches_1f1b_at_most_k",
      "K - s", ONE_F_ONE_B.format(warmup="microbatches", steady="[]")),
    W("06.1", "the backward before its forward", "test_timeline_runs_each_list_in_order_after_its_inputs",
      "after its forward", ONE_F_ONE_B.format(warmup="min(stages - stage - 1, microbatches)",
                                              steady='[Action("B", warmup + i), Action("F", warmup + i)]')),
    W("06.1", "the same warm-up on every stage", "test_gpipe_holds_m_microbatches_1f1b_at_most_k", "K - s",
      ONE_F_ONE_B.format(warmup="min(stages - 1, microbatches)",
                         steady='[Action("F", warmup + i), Action("B", i)]')),
    W("06.1", "one warm-up forward too few", "test_activations_held_are_the_microbatches_in_flight",
      "warm-up", ONE_F_ONE_B.format(warmup="min(max(stages - stage - 2, 0), microbatches)",
                                    steady='[Action("F", warmup + i), Action("B", i)]')),
    W("06.1", "forgets the last backward of the cool-down",
      "test_pipeline_trains_to_the_single_process_losses_and_weights", "once", """
        schedule = []
        for stage in range(stages):
            warmup = min(stages - stage - 1, microbatches)
            actions = [Action("F", i) for i in range(warmup)]
            for i in range(microbatches - warmup):
                actions += [Action("F", warmup + i), Action("B", i)]
            actions += [Action("B", i) for i in range(microbatches - warmup, microbatches - 1)]
            schedule.append(actions)
        return schedule"""),
    # 06.2 interleaved 1F1B
    W("06.2", "the backward goes through the chunks forwards", "test_interleaved_megatron_order_k2_m2_v2",
      "Megatron", INTERLEAVED.format(microbatch="(k // (stages * virtual_stages)) * stages + k % stages",
                                     chunk="chunk", warmup="2 * (stages - stage - 1) + (virtual_stages - 1) * stages")),
    W("06.2", "half the warm-up", "test_interleaved_first_rank_holds_k_plus_k_minus_1_over_v", "warm-up",
      INTERLEAVED.format(microbatch="(k // (stages * virtual_stages)) * stages + k % stages",
                         chunk='chunk if op == "F" else virtual_stages - 1 - chunk',
                         warmup="(stages - stage - 1) + (virtual_stages - 1) * stages")),
    W("06.2", "micro-batches numbered straight through", "test_interleaved_megatron_order_k2_m2_v2", "Megatron",
      INTERLEAVED.format(microbatch="(k // virtual_stages) % microbatches",
                         chunk='chunk if op == "F" else virtual_stages - 1 - chunk',
                         warmup="2 * (stages - stage - 1) + (virtual_stages - 1) * stages")),
    W("06.2", "each micro-batch through one chunk twice", "test_schedules_train_to_the_single_process_result",
      "once", INTERLEAVED.format(microbatch="(k // virtual_stages) % microbatches",
                                 chunk='chunk if op == "F" else virtual_stages - 1 - chunk',
                                 warmup="2 * (stages - stage - 1) + (virtual_stages - 1) * stages")),
    # 06.3 balanced stages
    W("06.3", "an even split by count, whatever the costs", "test_partition_is_contiguous_nonempty_and_balanced",
      "costliest", """
        step = n // stages
        return [range(k * step, (k + 1) * step if k < stages - 1 else n) for k in range(stages)]"""),
    W("06.3", "greedy: close a stage once it reaches the average cost",
      "test_partition_is_contiguous_nonempty_and_balanced", "costliest", """
        target = sum(costs) / stages
        bounds, start, acc = [], 0, 0
        for i, c in enumerate(costs):
            acc += c
            if acc >= target and len(bounds) < stages - 1 and n - i - 1 >= stages - 1 - len(bounds):
                bounds.append(range(start, i + 1))
                start, acc = i + 1, 0
        bounds.append(range(start, n))
        return bounds"""),
    W("06.3", "compares the stage costs in stage order, not sorted",
      "test_partition_is_contiguous_nonempty_and_balanced", "costliest",
      PARTITION.format(key="best[k - 1, i] + (int(prefix[j] - prefix[i]),)", tie="i", cut="where")),
    # 06.4 the executor's send and receive
    W("06.4", "receives anew, ignoring the receive posted early",
      "test_a_pipeline_with_receives_posted_early_trains_like_one_process_and_sends_the_same", "posted", """
        return self.comm.recv(shape, self.dtype, source, tag=tag)""", None),
    W("06.4", "never counts a receive posted early",
      "test_a_pipeline_with_receives_posted_early_trains_like_one_process_and_sends_the_same", "posted", """
        posted = self.posted.pop((source, tag), None)
        if posted is None:
            return self.comm.recv(shape, self.dtype, source, tag=tag)
        return posted.wait()""", None),
    W("06.4", "sends every message with tag 0",
      "test_a_pipeline_with_receives_posted_early_trains_like_one_process_and_sends_the_same", "tag", None, """
        self.pending_sends.append(self.comm.isend(array, dest, tag=0))
        self.pending_sends = [r for r in self.pending_sends if not r.Test()]"""),
    # 07.1 the process grid
    W("07.1", "coordinates returned as (dp, pp, cp, tp)", "test_process_grid_for_every_factorisation",
      "coordinate", """
        dp_rank, rest = divmod(rank, self.pp_size * self.cp_size * self.tp_size)
        pp_rank, rest = divmod(rest, self.cp_size * self.tp_size)
        cp_rank, tp_rank = divmod(rest, self.tp_size)
        return dp_rank, pp_rank, cp_rank, tp_rank""", None),
    W("07.1", "rank_of forgets cp", "test_coordinates_of_every_rank_for_every_four_way_layout", "cp", None, """
        return (dp_rank * self.pp_size + pp_rank) * self.tp_size + tp_rank"""),
    W("07.1", "tp varies slowest", "test_process_grid_for_every_factorisation", "neighbours", """
        tp_rank, rest = divmod(rank, self.dp_size * self.pp_size * self.cp_size)
        dp_rank, rest = divmod(rest, self.pp_size * self.cp_size)
        pp_rank, cp_rank = divmod(rest, self.cp_size)
        return dp_rank, pp_rank, tp_rank, cp_rank""", """
        return ((tp_rank * self.dp_size + dp_rank) * self.pp_size + pp_rank) * self.cp_size + cp_rank"""),
    W("07.1", "coordinates returned as (dp, pp, cp, tp), in a run",
      "test_cp_with_each_dimension_trains_like_one_process", "coordinates", """
        dp_rank, rest = divmod(rank, self.pp_size * self.cp_size * self.tp_size)
        pp_rank, rest = divmod(rest, self.cp_size * self.tp_size)
        cp_rank, tp_rank = divmod(rest, self.tp_size)
        return dp_rank, pp_rank, cp_rank, tp_rank""", None),
    # 08.1 the chunk tensor's state machine
    W("08.1", "no check: every move allowed",
      "test_exactly_the_drawn_transitions_are_legal_and_any_other_is_an_error", "IllegalTransition", """
        tensor.state = state"""),
    W("08.1", "checks but never moves", "test_a_tensor_goes_round_the_whole_cycle_in_forward_and_backward",
      "state", """
        if (tensor.state, state) not in LEGAL_TRANSITIONS:
            raise IllegalTransition(f"{tensor.name}: {tensor.state.name} -> {state.name}")"""),
    W("08.1", "the wrong exception", "test_exactly_the_drawn_transitions_are_legal_and_any_other_is_an_error",
      "IllegalTransition", """
        if (tensor.state, state) not in LEGAL_TRANSITIONS:
            raise RuntimeError(f"{tensor.name}: {tensor.state.name} -> {state.name}")
        tensor.state = state"""),
    W("08.1", "checks the move after making it",
      "test_one_rank_trains_to_the_reference_and_leaves_every_tensor_free[none]", "before", """
        tensor.state = state
        if (tensor.state, state) not in LEGAL_TRANSITIONS:
            raise IllegalTransition(f"{tensor.name}: {tensor.state.name} -> {state.name}")"""),
    # 08.2 eviction
    W("08.2", "LRU evicts the most recent block",
      "test_lru_thrashes_on_a_loop_one_longer_than_the_device_and_opt_does_not", "LRU", """
        if self.policy == "opt" and self.positions:
            return max(candidates, key=lambda b: (self.next_use(b.key), -self.last_used.get(b.key, 0)))
        return max(candidates, key=lambda b: self.last_used.get(b.key, 0))"""),
    W("08.2", "OPT evicts the block needed soonest",
      "test_lru_thrashes_on_a_loop_one_longer_than_the_device_and_opt_does_not", "OPT", """
        if self.policy == "opt" and self.positions:
            return min(candidates, key=lambda b: (self.next_use(b.key), -self.last_used.get(b.key, 0)))
        return min(candidates, key=lambda b: self.last_used.get(b.key, 0))"""),
    W("08.2", "OPT is LRU", "test_lru_thrashes_on_a_loop_one_longer_than_the_device_and_opt_does_not", "OPT", """
        return min(candidates, key=lambda b: self.last_used.get(b.key, 0))"""),
    W("08.2", "OPT evicts the block needed soonest, in a run",
      "test_with_prefetch_in_training_opt_still_moves_no_more_than_lru", "OPT", """
        if self.policy == "opt" and self.positions:
            return min(candidates, key=lambda b: (self.next_use(b.key), -self.last_used.get(b.key, 0)))
        return min(candidates, key=lambda b: self.last_used.get(b.key, 0))"""),
    # 09.1 bf16
    W("09.1", "truncates", "test_bf16_named_cases", "bf16", """
        rounded = (bits >> 16).astype(np.uint16)"""),
    W("09.1", "rounds ties up", "test_bf16_matches_reference_near_ties", "even", """
        rounded = ((bits + np.uint32(0x8000)) >> 16).astype(np.uint16)"""),
    W("09.1", "rounds ties down", "test_bf16_matches_reference_near_ties", "even", """
        rounded = ((bits + np.uint32(0x7FFF)) >> 16).astype(np.uint16)"""),
    # 09.2 the loss scaler
    W("09.2", "keeps counting through an overflow", "test_update_follows_backoff_and_growth", "restart", """
        if found_inf:
            self._scale *= self._backoff_factor
            return
        self._growth_tracker += 1
        if self._growth_tracker == self._growth_interval:
            grown = self._scale * self._growth_factor
            if grown <= float(np.finfo(np.float32).max):
                self._scale = grown
            self._growth_tracker = 0"""),
    W("09.2", "grows past float32's largest value", "test_growth_stops_below_fp32_infinity", "float32", """
        if found_inf:
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker == self._growth_interval:
            self._scale = self._scale * self._growth_factor
            self._growth_tracker = 0"""),
    W("09.2", "grows on every step once the interval is reached", "test_update_follows_backoff_and_growth",
      "growth_interval", """
        if found_inf:
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker >= self._growth_interval:
            grown = self._scale * self._growth_factor
            if grown <= float(np.finfo(np.float32).max):
                self._scale = grown"""),
    W("09.2", "grows one clean step late, in an fp16 run",
      "test_the_scaler_skips_overflowing_steps_halves_and_grows_after_clean_ones", "growth_interval", """
        if found_inf:
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker > self._growth_interval:
            grown = self._scale * self._growth_factor
            if grown <= float(np.finfo(np.float32).max):
                self._scale = grown
            self._growth_tracker = 0"""),
    # 10.1 fusion
    W("10.1", "materialises every node: no fusion",
      "test_chain_of_eight_is_one_kernel_and_moves_seven_times_less", "one kernel",
      FUSION.format(rule="True")),
    W("10.1", "forgets values read by more than one node",
      "test_fusion_plan_ends_kernels_at_shared_values_roots_and_reductions", "more than one",
      FUSION.format(rule="n.is_leaf or n.is_reduction or n in outputs")),
    W("10.1", "fuses through reductions",
      "test_fusion_plan_ends_kernels_at_shared_values_roots_and_reductions", "reduction",
      FUSION.format(rule="n.is_leaf or n in outputs or consumers[n] > 1")),
    W("10.1", "forgets the roots", "test_train_fused_gives_the_same_losses_and_weights_bit_for_bit", "root",
      FUSION.format(rule="n.is_leaf or n.is_reduction or consumers[n] > 1")),
    # 12.1 resharding
    W("12.1", "ignores the flat ranges", "test_pieces_of_any_layout_assemble_to_the_full_tensor", "flat",
      ASSEMBLE.format(flat="0, array.size", place="slice(shard.start, shard.stop)",
                      result="full[tuple(slice(0, n) for n in full_shape)]")),
    W("12.1", "keeps the padding", "test_pieces_of_any_layout_assemble_to_the_full_tensor", "padding",
      ASSEMBLE.format(flat="piece.flat or (0, local.size)", place="slice(shard.start, shard.stop)",
                      result="full")),
    W("12.1", "puts every shard at the start of its axis",
      "test_pieces_of_any_layout_assemble_to_the_full_tensor", "shards",
      ASSEMBLE.format(flat="piece.flat or (0, local.size)", place="slice(0, shard.stop - shard.start)",
                      result="full[tuple(slice(0, n) for n in full_shape)]")),
    W("12.1", "cuts the padding off the front", "test_resume_in_another_layout_trains_like_one_process",
      "padding", ASSEMBLE.format(flat="piece.flat or (0, local.size)", place="slice(shard.start, shard.stop)",
                                 result="full[tuple(slice(p - n, p) for n, p in zip(full_shape, padded))]")),
    # 13.1 the online softmax
    W("13.1", "no running maximum: exp of the raw scores", LARGE, "overflow", """
        xp = xp_of(s)
        p = xp.exp(s)
        self.total = self.total + p.sum(axis=-1, keepdims=True)
        self.out = self.out + p @ v
        self.maximum = xp.zeros_like(self.maximum)"""),
    W("13.1", "each block's own maximum instead of the running one", LARGE, "overflow", """
        xp = xp_of(s)
        maximum = s.max(axis=-1, keepdims=True)
        rescale, p = xp.exp(self.maximum - maximum), xp.exp(s - maximum)
        self.total = self.total * rescale + p.sum(axis=-1, keepdims=True)
        self.out = self.out * rescale + p @ v
        self.maximum = maximum"""),
    W("13.1", "rescales the total but not the output", ONLINE, "rescale", """
        xp = xp_of(s)
        maximum = xp.maximum(self.maximum, s.max(axis=-1, keepdims=True))
        rescale, p = xp.exp(self.maximum - maximum), xp.exp(s - maximum)
        self.total = self.total * rescale + p.sum(axis=-1, keepdims=True)
        self.out = self.out + p @ v
        self.maximum = maximum"""),
    W("13.1", "forgets to remember the maximum", ONLINE, "running maximum", """
        xp = xp_of(s)
        maximum = xp.maximum(self.maximum, s.max(axis=-1, keepdims=True))
        rescale, p = xp.exp(self.maximum - maximum), xp.exp(s - maximum)
        self.total = self.total * rescale + p.sum(axis=-1, keepdims=True)
        self.out = self.out * rescale + p @ v"""),
    W("13.1", "rescales the total but not the output, in a run",
      "test_random_layouts_with_cp_train_like_one_process", "maximum", """
        xp = xp_of(s)
        maximum = xp.maximum(self.maximum, s.max(axis=-1, keepdims=True))
        rescale, p = xp.exp(self.maximum - maximum), xp.exp(s - maximum)
        self.total = self.total * rescale + p.sum(axis=-1, keepdims=True)
        self.out = self.out + p @ v
        self.maximum = maximum"""),
    # 14.1 the parameter count
    W("14.1", "gives the key a bias", "test_parameter_count_is_the_real_models", "bias", """
        h = m.d_model
        embeddings = m.vocab * h + m.seq_len * h
        block = 12 * h * h + 13 * h
        return embeddings + m.n_layer * block + 2 * h + h * m.vocab"""),
    W("14.1", "ties the lm_head to the embedding", "test_parameter_count_is_the_real_models", "lm_head", """
        h = m.d_model
        embeddings = m.vocab * h + m.seq_len * h
        block = 12 * h * h + 12 * h
        return embeddings + m.n_layer * block + 2 * h"""),
    W("14.1", "forgets the position embeddings", "test_parameter_count_is_the_real_models", "position", """
        h = m.d_model
        block = 12 * h * h + 12 * h
        return m.vocab * h + m.n_layer * block + 2 * h + h * m.vocab"""),
    W("14.1", "forgets the final LayerNorm, against a real run", "test_memory_equals_the_ledger_of_a_real_run",
      "parameter count", """
        h = m.d_model
        embeddings = m.vocab * h + m.seq_len * h
        block = 12 * h * h + 12 * h
        return embeddings + m.n_layer * block + h * m.vocab"""),
    # 14.2 the ring's time
    W("14.2", "the all-reduce charged as one pass",
      "test_ring_time_is_comms_charge_over_the_bandwidth_plus_its_messages", "2(N-1)", """
        if n == 1:
            return 0.0
        return (n - 1) * latency + (n - 1) / n * payload / bandwidth"""),
    W("14.2", "no latency", "test_ring_time_is_comms_charge_over_the_bandwidth_plus_its_messages", "latency", """
        if n == 1:
            return 0.0
        factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n}[op]
        return factor * payload / bandwidth"""),
    W("14.2", "the whole payload over the bandwidth",
      "test_ring_time_is_comms_charge_over_the_bandwidth_plus_its_messages", "bandwidth", """
        if n == 1:
            return 0.0
        messages = (2 if op == "all_reduce" else 1) * (n - 1)
        return messages * latency + payload / bandwidth"""),
    # 15.1 top-k routing
    W("15.1", "capacity off by one", "test_over_capacity_tokens_are_dropped_in_position_order", "capacity",
      ROUTING.format(choice='xp.argsort(-probs, axis=-1, kind="stable")[..., :top_k]',
                     kept="rank_in_expert <= capacity", counts="onehot.sum(axis=1)")),
    W("15.1", "counts after dropping", "test_layer_matches_the_reference_written_with_loops", "counts",
      ROUTING.format(choice='xp.argsort(-probs, axis=-1, kind="stable")[..., :top_k]',
                     kept="rank_in_expert < capacity",
                     counts="(onehot * (rank_in_expert < capacity)[..., None]).sum(axis=1)")),
    W("15.1", "the k worst experts", "test_layer_matches_the_reference_written_with_loops", "best first",
      ROUTING.format(choice='xp.argsort(probs, axis=-1, kind="stable")[..., :top_k]',
                     kept="rank_in_expert < capacity", counts="onehot.sum(axis=1)")),
    W("15.1", "counts places across the whole batch, not per sequence",
      "test_data_parallel_moe_trains_like_one_process", "sequence", """
        xp = xp_of(probs)
        B, T, E = probs.shape
        choice = xp.argsort(-probs, axis=-1, kind="stable")[..., :top_k]
        onehot = (choice.reshape(B, T * top_k)[..., None] == xp.arange(E)).astype(xp.int64)
        queue = onehot.reshape(1, B * T * top_k, E)
        rank_in_expert = (xp.cumsum(queue, axis=1) * queue).sum(-1) - 1
        kept = (rank_in_expert < capacity).reshape(B, T, top_k)
        return choice, kept, onehot.sum(axis=1), rank_in_expert.reshape(B, T, top_k)"""),
)
