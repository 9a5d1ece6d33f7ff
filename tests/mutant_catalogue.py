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


WORKING_COPY_TESTS = "tests/precision/test_zero3_working_copy.py"
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
    # ---- issue 38: the 16-bit working copy gathered by ZeRO-3 and chunked ZeRO-3 ----
    Mutant("zero3-working-copy-not-rounded-after-update", "minipar/parallel/zero3.py",
           "            self.update(unit, unit.grad_shard)\n            self.round_shard(unit)",
           "            self.update(unit, unit.grad_shard)", tests=(WORKING_COPY_TESTS,), ranks=(2,)),
    Mutant("zero3-16-bit-gathers-fp32", "minipar/trainer/build.py",
           "working=mixed_precision.parameter_wire(cfg.precision))  # 16-bit copy", "working=None)",
           tests=(WORKING_COPY_TESTS,), ranks=(2,)),
    Mutant("zero3-master-counted-as-params", "minipar/parallel/zero3.py",
           'held["optimizer"] += sum(u.param_shard.nbytes', 'held["params"] += sum(u.param_shard.nbytes',
           tests=(WORKING_COPY_TESTS,), ranks=(2,)),
    Mutant("chunked-working-block-not-rewritten", "minipar/parallel/zero_chunked.py",
           "working[...] = self.working.encode(param)", "pass", tests=(WORKING_COPY_TESTS,)),
    Mutant("chunked-gradients-do-not-widen-the-chunk", "minipar/parallel/zero_chunked.py",
           "        for chunk in self.chunks_of(i):\n            self.widen(chunk)\n", "",
           tests=(WORKING_COPY_TESTS,)),
    Mutant("chunked-gathered-chunk-counted-at-fp32", "minipar/parallel/zero_chunked.py",
           "self.held[chunk.index] = chunk.numel * shard.itemsize", "self.held[chunk.index] = chunk.nbytes",
           tests=(WORKING_COPY_TESTS,)),
]
