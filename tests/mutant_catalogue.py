"""The mutants `make mutants` runs (tests/mutants.py): plausible bugs, each a one-place change of
behaviour in minipar/, none a syntax error.

A mutant: a `name`; the `file`; `old`, a text that occurs exactly once in it, and `new`, what replaces
it. `tests`: the tests to run, by default the touched package's, tests/<package>/ (name files where a
module's tests live elsewhere, as core/moe.py's do, or where a package's multi-rank tests take long);
`ranks`: world sizes to run their multi-rank tests on too, the smallest that shows the bug (a ring's
successor and predecessor differ only from 3 ranks: 4 makes a group of 3); `equivalent`: for a mutant
that no test can catch because it changes no behaviour, the reason.

To measure a new module's tests: add its mutants here, written before looking at the tests, and run
`.venv/bin/python tests/mutants.py --only <a common part of their names>`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    equivalent: str = ""


COMM_TESTS = ("tests/distributed/test_comm.py", "tests/distributed/test_collectives.py")

MUTANTS = [
    # ---- issue 41: the bugs the third round's new tests were written to catch ----
    Mutant("moe-capacity-float", "minipar/core/moe.py",
           "factor = Fraction(repr(float(self.capacity_factor)))", "factor = self.capacity_factor",
           tests=("tests/parallel/test_experts.py",)),
    Mutant("moe-capacity-binary-fraction", "minipar/core/moe.py",
           "factor = Fraction(repr(float(self.capacity_factor)))",
           "factor = Fraction(float(self.capacity_factor))",
           tests=("tests/parallel/test_experts.py",)),
    Mutant("checkpoint-cover-holes-only", "minipar/checkpoint/sharded.py",
           "    if (seen != 1).any():", "    if (seen == 0).any():"),
    Mutant("fusion-consumers-per-argument", "minipar/fusion/fuse.py",
           "        for arg in set(node.args):", "        for arg in node.args:"),
    Mutant("ddp-late-gradient-all", "minipar/parallel/ddp.py",
           "if any(p.grad is not None for p in bucket):", "if all(p.grad is not None for p in bucket):",
           tests=("tests/parallel/test_overlap.py",), ranks=(2,)),
    Mutant("causal-softmax-max-over-whole-row", "minipar/core/layer_ops.py",
           "scores.max(axis=-1, keepdims=True, where=keep, initial=-xp.inf)",
           "scores.max(axis=-1, keepdims=True)"),
    Mutant("causal-softmax-no-max", "minipar/core/layer_ops.py",
           "out = scores - scores.max(axis=-1, keepdims=True, where=keep, initial=-xp.inf)",
           "out = scores + 0.0"),
    Mutant("zb-h1-weight-a-whole-backward", "minipar/simulate/step.py",
           'weight = ratio / 2 if name == "zb-h1" else 1', 'weight = ratio if name == "zb-h1" else 1'),
    Mutant("zb-h1-input-grad-a-whole-backward", "minipar/simulate/step.py",
           'backward = ratio / 2 if name == "zb-h1" else ratio', 'backward = ratio'),
    Mutant("watchdog-clock-backwards", "minipar/distributed/watchdog.py",
           "time.monotonic() - current[3] > self.timeout_s", "current[3] - time.monotonic() > self.timeout_s",
           tests=("tests/distributed/test_watchdog.py",)),
    Mutant("watchdog-wall-clock-start", "minipar/distributed/watchdog.py",
           "WATCHDOG.current = (op, name, ranks, time.monotonic())",
           "WATCHDOG.current = (op, name, ranks, time.time())",
           tests=("tests/distributed/test_watchdog.py",)),
    Mutant("watchdog-wait-never-ends", "minipar/distributed/watchdog.py",
           "    finally:\n        WATCHDOG.current = None", "    finally:\n        pass",
           tests=("tests/distributed/test_watchdog.py",)),
    Mutant("link-always-intra", "minipar/distributed/communicator.py",
           "self.nodes[peer] == self.nodes[self.rank]", "self.nodes[peer] == self.nodes[peer]",
           tests=COMM_TESTS, ranks=(2,)),
    Mutant("link-ring-charged-to-predecessor", "minipar/distributed/communicator.py",
           "ring_messages(op, self.size), link=self.link_to(self.successor))",
           "ring_messages(op, self.size), link=self.link_to((self.rank - 1) % self.size))",
           tests=COMM_TESTS, ranks=(4,)),
    Mutant("link-sendrecv-charged-to-source", "minipar/distributed/communicator.py",
           'self.ledger.charge(self.name, "send", send.nbytes, link=self.link_to(dest))\n        return',
           'self.ledger.charge(self.name, "send", send.nbytes, link=self.link_to(source))\n        return',
           tests=COMM_TESTS, ranks=(4,)),
    Mutant("link-ring-collectives-to-left", "minipar/distributed/collectives.py",
           "link=self.comm.link_to(self.right))", "link=self.comm.link_to(self.left))",
           tests=COMM_TESTS, ranks=(4,)),
    Mutant("link-all-to-all-to-itself", "minipar/distributed/collectives.py",
           "link=comm.link_to(dest))", "link=comm.link_to(comm.rank))",
           tests=COMM_TESTS, ranks=(2,)),
    # ---- issue 41, the catalogue grown to every package: written before looking at the tests ----
    Mutant("zero3-prefetch-two-ahead", "minipar/parallel/zero3.py",
           "self.prefetch_unit(index + 1)  # forward", "self.prefetch_unit(index + 2)  # forward",
           tests=("tests/parallel/test_overlap.py",), ranks=(2,)),
    Mutant("zero3-prefetch-the-current-unit", "minipar/parallel/zero3.py",
           "self.prefetch_unit(index + 1)  # forward", "self.prefetch_unit(index)  # forward",
           tests=("tests/parallel/test_overlap.py",), ranks=(2,)),
    # core
    Mutant("shard-bounds-extra-to-the-last", "minipar/core/shards.py",
           "start = index * base + min(index, extra)",
           "start = index * base + max(0, index - (parts - extra))",
           tests=("tests/core",)),
    Mutant("padded-numel-floor", "minipar/core/shards.py",
           "return -(-numel // parts) * parts", "return (numel // parts) * parts",
           tests=("tests/core", "tests/parallel/test_zero.py"), ranks=(2,)),
    Mutant("getitem-backward-overwrites-repeats", "minipar/core/shape_ops.py",
           "xp.add.at(grad, ctx.index, g)", "grad[ctx.index] = g", tests=("tests/core",)),
    Mutant("concatenate-backward-off-by-one", "minipar/core/shape_ops.py",
           "bounds.append(bounds[-1] + n)", "bounds.append(bounds[-1] + n - (n > 1))", tests=("tests/core",)),
    Mutant("transpose-backward-not-inverted", "minipar/core/shape_ops.py",
           "tuple(sorted(range(g.ndim), key=axes.__getitem__))", "tuple(axes)", tests=("tests/core",)),
    Mutant("autograd-shared-input-grad-replaced", "minipar/core/autograd.py",
           "                    pg = grads[parent] + pg\n",
           "                    pg = pg\n", tests=("tests/core",)),
    Mutant("attention-scale-by-d-model", "minipar/core/nn.py",
           "* (1.0 / math.sqrt(hd))", "* (1.0 / math.sqrt(hd * 2))", tests=("tests/core",)),
    Mutant("residual-std-without-layers", "minipar/core/nn.py",
           "return 0.02 / math.sqrt(2 * self.n_layer)", "return 0.02 / math.sqrt(2)",
           tests=("tests/core",)),
    Mutant("layernorm-variance-without-eps", "minipar/core/layer_ops.py",
           "keepdims=True) + eps)", "keepdims=True))", tests=("tests/core",)),
    # distributed
    Mutant("grid-cp-before-pp", "minipar/distributed/grid.py",
           "        pp_rank, rest = divmod(rest, self.cp_size * self.tp_size)\n"
           "        cp_rank, tp_rank = divmod(rest, self.tp_size)",
           "        cp_rank, rest = divmod(rest, self.pp_size * self.tp_size)\n"
           "        pp_rank, tp_rank = divmod(rest, self.tp_size)",
           tests=("tests/distributed", "tests/parallel/test_context.py"), ranks=(4,)),
    Mutant("grid-dp-cp-key-cp-major", "minipar/distributed/grid.py",
           "color=p * tp + t, key=d * cp + c,", "color=p * tp + t, key=c * dp + d,",
           tests=("tests/distributed", "tests/parallel/test_context.py"), ranks=(4,)),
    Mutant("ring-reduce-scatter-chunk-one-early", "minipar/distributed/collectives.py",
           "arriving = (ring.rank - step - 2) % ring.size", "arriving = (ring.rank - step - 1) % ring.size",
           tests=COMM_TESTS, ranks=(2, 4)),
    Mutant("ring-all-gather-chunk-one-late", "minipar/distributed/collectives.py",
           "arriving = (ring.rank - step - 1) % ring.size", "arriving = (ring.rank - step - 2) % ring.size",
           tests=COMM_TESTS, ranks=(2, 4)),
    Mutant("all-to-all-source-is-destination", "minipar/distributed/collectives.py",
           "dest, source = (comm.rank + step) % comm.size, (comm.rank - step) % comm.size",
           "dest, source = (comm.rank + step) % comm.size, (comm.rank + step) % comm.size",
           tests=COMM_TESTS, ranks=(4,)),
    # memory
    Mutant("ledger-peak-never-raised", "minipar/memory/ledger.py",
           "        if nbytes > self.peak[key]:\n            self.peak[key] = nbytes\n",
           "        if nbytes > self.peak[key] and tier != \"device\":\n"
           "            self.peak[key] = nbytes\n"),
    Mutant("ledger-device-total-counts-every-tier", "minipar/memory/ledger.py",
           "        if tier == \"device\":\n            self._device_total += nbytes - self.current[key]",
           "        if True:\n            self._device_total += nbytes - self.current[key]"),
    Mutant("ledger-buffer-allocations-count-releases", "minipar/memory/ledger.py",
           "        if grown > 0:  # one buffer_meter.add", "        if grown != 0:  # one buffer_meter.add"),
    Mutant("ledger-reset-keeps-old-peaks", "minipar/memory/ledger.py",
           "        self.peak = dict(self.current)\n        self.held_peak = {",
           "        self.peak = dict(self.peak)\n        self.held_peak = {"),
    Mutant("offload-opt-nearest-next-use", "minipar/memory/offload.py",
           "return max(candidates, key=lambda b: (self.next_use(b.key), -self.last_used.get(b.key, 0)))",
           "return min(candidates, key=lambda b: (self.next_use(b.key), -self.last_used.get(b.key, 0)))"),
    # fusion
    Mutant("fusion-shared-node-not-materialised", "minipar/fusion/fuse.py",
           "n in outputs or consumers[n] > 1)}", "n in outputs or consumers[n] > 2)}"),
    Mutant("fusion-reduction-not-materialised", "minipar/fusion/fuse.py",
           "n.is_leaf or n.is_reduction or n in outputs", "n.is_leaf or n in outputs"),
    Mutant("fusion-kernel-inputs-unordered", "minipar/fusion/fuse.py",
           "[n for n in order if n in members], [n for n in order if n in inputs]",
           "[n for n in order if n in members], sorted(inputs, key=id)"),
    # parallel
    Mutant("1f1b-one-warmup-too-few", "minipar/parallel/schedules.py",
           "warmup = min(stages - stage - 1, microbatches)",
           "warmup = min(max(stages - stage - 2, 0), microbatches)",
           tests=("tests/parallel/test_schedules.py", "tests/parallel/test_pipeline_schedules.py")),
    Mutant("interleaved-warmup-without-chunks", "minipar/parallel/schedules.py",
           "warmup = min(2 * (stages - stage - 1) + (virtual_stages - 1) * stages, total)",
           "warmup = min(2 * (stages - stage - 1), total)",
           tests=("tests/parallel/test_schedules.py", "tests/parallel/test_pipeline_schedules.py")),
    Mutant("copy-to-tp-backward-no-sum", "minipar/parallel/mappings.py",
           "        return ctx.comm.all_reduce(grad), None\n        # end exercise\n\n\nclass ReduceFrom",
           "        return grad, None\n        # end exercise\n\n\nclass ReduceFrom",
           tests=("tests/parallel/test_tensor_parallel.py",), ranks=(2,)),
    Mutant("sequence-gather-backward-all-gathers", "minipar/parallel/mappings.py",
           "        return reduce_scatter_sequence(grad, ctx.comm), None",
           "        return grad[:, : grad.shape[1] // ctx.comm.size], None",
           tests=("tests/parallel/test_sequence.py",), ranks=(2,)),
    Mutant("zigzag-mirror-chunk-off-by-one", "minipar/parallel/context.py",
           "return rank, 2 * cp - 1 - rank", "return rank, 2 * cp - 2 - rank + (rank == 0)",
           tests=("tests/parallel/test_context.py",), ranks=(2, 4)),
    Mutant("clipping-tp-replicas-counted-on-every-rank", "minipar/parallel/clipping.py",
           "if piece.counted and (piece.param.shard is not None or tp_rank == 0):",
           "if piece.counted:", tests=("tests/parallel/test_clipping.py",), ranks=(2, 4)),
    Mutant("partition-costliest-stage-last", "minipar/parallel/pipeline.py",
           "(tuple(sorted(best[k - 1, i] + (int(prefix[j] - prefix[i]),), reverse=True)), i)",
           "(tuple(sorted(best[k - 1, i] + (int(prefix[j] - prefix[i]),))), i)",
           tests=("tests/parallel/test_pipeline.py",)),
    # precision
    Mutant("bf16-round-half-up", "minipar/precision/formats.py",
           "rounded = ((bits + np.uint32(0x7FFF) + odd) >> 16)",
           "rounded = ((bits + np.uint32(0x8000)) >> 16)",
           tests=("tests/precision/test_precision.py",)),
    Mutant("bf16-truncate", "minipar/precision/formats.py",
           "rounded = ((bits + np.uint32(0x7FFF) + odd) >> 16)", "rounded = ((bits + odd * 0) >> 16)",
           tests=("tests/precision/test_precision.py",)),
    Mutant("scaler-overflow-keeps-growth-count", "minipar/precision/formats.py",
           "            self._scale *= self._backoff_factor\n            self._growth_tracker = 0\n",
           "            self._scale *= self._backoff_factor\n",
           tests=("tests/precision/test_precision_scaler.py",)),
    Mutant("scaler-grows-past-fp32", "minipar/precision/formats.py",
           "            if grown <= float(np.finfo(np.float32).max):\n                self._scale = grown",
           "            if True:\n                self._scale = grown",
           tests=("tests/precision/test_precision_scaler.py",)),
    Mutant("scaler-grows-one-step-early", "minipar/precision/formats.py",
           "if self._growth_tracker == self._growth_interval:",
           "if self._growth_tracker == self._growth_interval - 1:",
           tests=("tests/precision/test_precision_scaler.py",)),
    # simulate
    Mutant("params-tied-head", "minipar/simulate/model.py",
           "return embeddings + m.n_layer * block + 2 * h + h * m.vocab",
           "return embeddings + m.n_layer * block + 2 * h", tests=("tests/simulate",)),
    Mutant("flops-without-attention-scores", "minipar/simulate/model.py",
           "return sequences * (24 * s * h * h + 4 * s * s * h)", "return sequences * (24 * s * h * h)",
           tests=("tests/simulate",)),
    Mutant("selective-recompute-costs-nothing", "minipar/simulate/model.py",
           "        extra = m.n_layer * 4 * sequences * m.seq_len ** 2 * m.d_model\n",
           "        extra = 0\n", tests=("tests/simulate",)),
    # trainer
    Mutant("local-slice-of-rank-zero", "minipar/trainer/tasks.py",
           "return slice(*shard_bounds(batch_size, parts, index))",
           "return slice(*shard_bounds(batch_size, parts, 0))",
           tests=("tests/trainer/test_oracles.py", "tests/parallel/test_data_parallel.py"), ranks=(2,)),
    Mutant("resolved-dp-ignores-cp", "minipar/trainer/config.py",
           "world_size // max(1, self.tp * self.pp * self.cp)", "world_size // max(1, self.tp * self.pp)",
           tests=("tests/trainer/test_config.py", "tests/trainer/test_train_cli.py")),
    Mutant("validate-batch-not-per-microbatch", "minipar/trainer/validate.py",
           "    elif (cfg.batch_size // cfg.dp) % cfg.microbatches:",
           "    elif cfg.batch_size % cfg.microbatches:",
           tests=("tests/trainer",)),
    Mutant("validate-zb-h1-with-zero3", "minipar/trainer/validate.py",
           "(cfg.schedule == \"zb-h1\" and cfg.pp > 1 and (cfg.zero == 3 or cfg.chunked),",
           "(cfg.schedule == \"zb-h1\" and cfg.pp > 1 and cfg.chunked,", tests=("tests/trainer",)),
    Mutant("single-process-keeps-layout", "minipar/trainer/config.py",
           "if \"single_process\" in f.metadata})",
           "if \"single_process\" in f.metadata and f.name != \"tp\"})",
           tests=("tests/trainer/test_config.py", "tests/trainer/test_reference_check.py")),
]
