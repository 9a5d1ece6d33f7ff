"""The training loop: TrainConfig -> engine for this rank's layout -> steps -> JSON-lines log.

Every rank runs this same loop on the same global batch (a pure function of seed and step); the
engine decides what share of the work this rank does. Rank 0 writes one JSON object per step (loss,
tokens/s, its own memory and communication for that step) and prints progress and a summary.
Lesson: lessons/00_overview.md.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np

from minipar.checkpoint import sharded as checkpoint
from minipar.core import backend
from minipar.distributed.communicator import Comm, node_local_rank
from minipar.distributed.faults import fault_nudge, inject_fault
from minipar.distributed.grid import ProcessGrid
from minipar.distributed.watchdog import set_collective_timeout, watching
from minipar.memory.ledger import MemoryLedger
from minipar.speed.install import speed_forms
from minipar.trainer import build, reference, report
from minipar.trainer.config import TrainConfig
from minipar.trainer.engine import assemble_full_state
from minipar.trainer.tasks import AdditionTask, RegressionTask
from minipar.trainer.trace import Trace


def make_task(cfg: TrainConfig):
    if cfg.is_gpt:
        return AdditionTask(cfg.seq_len, cfg.seed)
    mcfg = build.model_config(cfg)
    return RegressionTask(mcfg.d_in, mcfg.d_out, cfg.seed, cfg.dtype)  # batches in the model's dtype


LOADING = "loading the checkpoint (every rank reads its pieces, then a barrier)"  # the watchdog's line


class RunStopped(Exception):
    """The run ended early for a reason one line says (a loss that is not finite, a log that could
    not be written); `minipar train` prints it on rank 0 and exits 1."""


def strict_json(value):
    """The record as strict JSON can hold it: a number that is not finite becomes null."""
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Trainer:
    """Owns the engine, the ledgers and the log for one rank."""

    def __init__(self, cfg: TrainConfig, world):
        # One rank per GPU: the device follows the rank's index on its node (a lone process keeps
        # CUDA's current device).
        local_rank = node_local_rank(world) if cfg.backend == "cupy" and world.Get_size() > 1 else None
        backend.set_backend(cfg.backend, local_rank=local_rank)
        self.cfg = cfg
        if cfg.collective_timeout is not None:
            set_collective_timeout(cfg.collective_timeout)
        self.world = Comm(world)
        self.grid = ProcessGrid(self.world, cfg.dp, cfg.pp, cfg.tp, cfg.cp)
        self.memory = MemoryLedger()
        self.engine = build.build_engine(cfg, self.grid)
        if self.is_rank0 and not cfg.quiet and self.world.size > 1:
            print(self.grid.describe(), flush=True)
        self.task = make_task(cfg)
        # --resume: the state of step N from a checkpoint of any layout; the run continues at step N
        self.start_step = self.load(cfg.resume) if cfg.resume else 0
        self.records: list[dict] = []
        # --allow-changes: what the resumed run changes (lr, weight decay, batch), in its first record
        self.changes = checkpoint.changes_on_resume(cfg.resume, cfg) if cfg.resume else {}
        if self.changes and self.is_rank0 and not cfg.quiet:
            changed = ", ".join(f"{key} {saved} -> {now}" for key, (saved, now) in self.changes.items())
            print(f"resumed with changes: {changed}", flush=True)
        self.log_error: str | None = None  # a failed write to --log: reported once the run is saved
        self.pending_save = None  # --save-async: the save whose files a thread is writing
        # --check-reference: every weight after step min(20, steps), before training amplifies roundoff
        self.snapshot_at = reference.horizon(cfg.steps) if cfg.check_reference else None
        self.snapshot: dict | None = None
        # --trace DIR: the timeline's recorder listens from here on (trainer/trace.py)
        self.trace = Trace(cfg.trace, self.world, self.grid, self.memory, self.engine) if cfg.trace else None

    def load(self, directory: str) -> int:
        """The checkpoint's state into the engine, under the watchdog: a rank stuck reading its files
        leaves the others in the barrier after the load, which the watchdog ends in the timeout."""
        world = self.world  # one watched wait, not charged to the ledger's wait time: most of it is reading
        with watching(LOADING, world.name, world.world_ranks, world.world_ranks[world.rank]):
            inject_fault(world.rank, "while loading the checkpoint", startup="load")  # tests
            step = checkpoint.load(directory, self.engine)
            world.mpi.Barrier()
        return step

    @property
    def is_rank0(self) -> bool:
        return self.world.rank == 0

    def step(self, step: int) -> dict:
        inject_fault(self.world.rank, f"at step {step}", step=step)  # MINIPAR_FAULT: tests that a job aborts
        nudge = fault_nudge(self.world.rank, step)  # MINIPAR_FAULT=...,nudge:X: tests --check-reference
        if nudge is not None:
            first = self.engine.model.parameters()[0]  # this rank's copy (a layout that holds it whole)
            first.data *= 1 + nudge
        cfg, traffic = self.cfg, self.world.ledger
        inputs, targets = self.task.global_batch(step, cfg.batch_size)
        traffic.start_step()
        self.memory.reset_peaks()
        backend.current().sync()
        started = time.perf_counter()
        with speed_forms():  # the speed layer's forms (the same bits) unless MINIPAR_KERNELS=plain
            loss = self.engine.train_step(inputs, targets, self.task.answer_positions(inputs, targets))
        backend.current().sync()
        elapsed = time.perf_counter() - started
        if self.trace is not None:
            self.trace.span(f"step {step}", started, started + elapsed, {"step": step})
        for category, held in self.engine.updater.memory().items():
            for tier, nbytes in (held.items() if isinstance(held, dict) else [("device", held)]):
                self.memory.set(category, nbytes, tier)  # {tier: bytes} where model states are offloaded
        record = {
            "step": step,
            "loss": float(loss),
            **({"accuracy": self.engine.accuracy} if self.engine.accuracy is not None else {}),
            "tokens_per_s": float((targets.size if cfg.is_gpt else len(targets)) / elapsed),
            "time_s": elapsed,
            "mem": self.memory.report(),
            "comm": {**traffic.step_report(), **traffic.step_links()},  # by_link: intra-/inter-node
        }
        if self.world.size > 1:  # blocked in MPI calls and waits (Comm.watch); one process never is
            record["comm_wait_s"] = traffic.step_wait_s
        optional = {  # in the log only where the layout has them
            "pipeline": self.engine.runner.timing(),  # busy/idle time of the stages, bubble (pipeline.py)
            "offload": self.engine.updater.tier_traffic(),  # bytes device <-> cpu <-> disk (zero_chunked.py)
            "loss_scaling": self.engine.runner.log_record(),  # fp16: the scale, whether skipped (mixed.py)
        }
        record.update((key, value) for key, value in optional.items() if value)
        record.update(self.engine.routing or {})  # moe: aux_loss (a part of "loss"), tokens_per_expert
        record.update(self.engine.updater.log_record())  # the gradients-ready point's (parallel/api.py)
        return record

    def run(self) -> list[dict]:
        """Train from start_step to cfg.steps, save, and with --trace write the timeline (a collective)."""
        try:
            records = self.train_and_save()
        except BaseException:
            if self.trace is not None:
                self.trace.stop()  # no timeline: the run stopped; its hooks leave with it
            raise
        if self.trace is not None:
            self.trace.finish(records)
        return records

    def train_and_save(self) -> list[dict]:
        """Train from start_step to cfg.steps; save every --save-every steps and at the end.

        A loss that is not finite (the same on every rank: it is the global loss) stops every rank
        at that step, without saving; a failed log write stops the log, not the run. The log is
        opened after the first step: a run refused after its warm-up step (memory/tracer.py) writes
        nothing."""
        log, log_opened = None, False
        try:
            for step in range(self.start_step, self.cfg.steps):
                record = self.step(step)
                if self.changes and step == self.start_step:
                    record["changed_on_resume"] = self.changes
                self.records.append(record)
                if not log_opened:
                    log, log_opened = self.open_log(), True
                log = self.write(log, record)
                if not math.isfinite(record["loss"]):
                    raise RunStopped(f"loss is not finite at step {step} ({record['loss']})")
                if step == self.start_step:
                    self.say_budget(record)
                self.progress(record)
                done = step + 1
                if done == self.snapshot_at:
                    self.snapshot = self.full_state()  # a collective, like the final one
                if self.cfg.save_async:  # commit the save in flight if every rank's writer is done
                    self.pending_save = self.settle(self.pending_save)
                if self.cfg.save and self.cfg.save_every and done % self.cfg.save_every == 0 \
                        and done < self.cfg.steps:
                    self.save(done, in_background=self.cfg.save_async)
        finally:
            self.close_log(log)
        if self.cfg.save:
            self.save(self.cfg.steps)
        return self.records

    def say_budget(self, record: dict):
        """--device-mem-mb auto: which budget the warm-up step chose (zero_chunked.py)."""
        if self.is_rank0 and not self.cfg.quiet and self.cfg.device_mem_mb == "auto":
            print(f"--device-mem-mb auto: {record['offload']['budget_bytes'] / 2**20:.4f} MiB, the least "
                  "the warm-up step needs", flush=True)

    def save(self, step: int, in_background: bool = False) -> None:
        """Save after `step` steps; --save-async: the last save in flight is committed first (at most one
        in flight), and this one's files are written by a thread (checkpoint/sharded.py start_save)."""
        keep = self.cfg.keep_last or 1
        started = time.perf_counter()
        try:
            self.pending_save = checkpoint.finish_save(self.pending_save, self.engine, wait=True)
            if in_background:
                self.pending_save = checkpoint.start_save(self.cfg.save, self.engine, step, keep=keep)
            else:
                checkpoint.save(self.cfg.save, self.engine, step, keep=keep)
        except checkpoint.SaveFailed as failure:  # every rank, together: one line, like a failed log write
            raise RunStopped(str(failure)) from None
        if self.trace is not None:
            self.trace.span(f"checkpoint save (step {step})", started, time.perf_counter(),
                            {"step": step, "in_background": in_background})

    def settle(self, pending):
        try:
            return checkpoint.finish_save(pending, self.engine)
        except checkpoint.SaveFailed as failure:  # the writer's error, at the next step boundary
            raise RunStopped(str(failure)) from None

    def open_log(self):
        if not (self.cfg.log and self.is_rank0):
            return None
        try:
            return open(self.cfg.log, "a" if self.cfg.resume else "w")
        except OSError as error:
            self.log_error = f"--log {self.cfg.log}: cannot open it ({error.strerror}); trained without a log"
            return None

    def write(self, log, record: dict):
        """One strict-JSON line (json.dumps would write a bare NaN); on failure, the log is closed."""
        if log is None:
            return None
        try:
            log.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
            log.flush()
            return log
        except OSError as error:
            step = record["step"]
            self.log_error = (f"--log {self.cfg.log}: writing step {step} failed ({error.strerror}); "
                              "training went on, and the log ends before that step")
            self.close_log(log)
            return None

    def close_log(self, log) -> None:
        if log is None:
            return
        try:
            log.close()
        except OSError as error:  # the last buffered bytes did not reach the file
            self.log_error = self.log_error or f"--log {self.cfg.log}: closing it failed ({error.strerror})"

    def progress(self, record: dict):
        every, step = max(1, self.cfg.steps // 10), record["step"]
        if self.is_rank0 and not self.cfg.quiet and (step % every == 0 or step == self.cfg.steps - 1):
            print(f"step {record['step']:4d}  loss {record['loss']:.4f}  "
                  f"{record['tokens_per_s']:9.0f} tokens/s  sent {record['comm']['sent_bytes']:>10d} B",
                  flush=True)

    def full_state(self) -> dict | None:
        """Every logical parameter reassembled from the shards on all ranks (on rank 0; None elsewhere)."""
        pieces = self.world.gather_obj(self.engine.updater.local_state(), root=0)  # collective under ZeRO-3
        return assemble_full_state(pieces) if self.is_rank0 else None


def reference_trainer(cfg: TrainConfig, snapshot: bool = False) -> Trainer:
    """The single-process run of the same steps, trained on this rank (with `snapshot`, it keeps the
    weights of step min(20, steps) as --check-reference's run does)."""
    from mpi4py import MPI

    trainer = Trainer(cfg.single_process().replace(check_reference=snapshot), MPI.COMM_SELF)
    trainer.run()
    trainer.memory.close()
    return trainer


def reference_run(cfg: TrainConfig):
    """The single-process run of the same steps: losses and final weights, computed on this rank."""
    trainer = reference_trainer(cfg)
    return [r["loss"] for r in trainer.records], trainer.engine.updater.local_state()


def relative_deviation(value, reference) -> float:
    """max |value - reference| / max |reference|: relative to the tensor's scale, so a weight that
    happens to sit near zero is not judged by its own tiny magnitude."""
    scale = float(np.max(np.abs(reference))) if reference.size else 0.0
    largest_error = float(np.max(np.abs(value - reference), initial=0.0))
    return largest_error / scale if scale else largest_error


def compare_with_reference(cfg: TrainConfig, records: list[dict], full: dict) -> dict:
    losses, ref_state = reference_run(cfg)
    loss_dev = reference.loss_deviation(records, losses, cfg.steps)  # every step the run recorded
    weight_dev = max(relative_deviation(full[name], ref) for name, (_, ref) in ref_state.items())
    return {"max_rel_loss_deviation": loss_dev, "max_rel_weight_deviation": weight_dev}


def check_against_reference(cfg: TrainConfig, records: list[dict], snapshot: dict | None, full: dict) -> dict:
    """--check-reference: the verdict up to step min(20, steps) and the drift after it (reference.py)."""
    single = reference_trainer(cfg, snapshot=True)
    losses = [r["loss"] for r in single.records]
    final = {name: array for name, (_, array) in single.engine.updater.local_state().items()}
    # fp8 is compared only with fp64 accumulation (validate.py): the correctness contract's 1e-9
    precision = "fp64" if cfg.precision == "fp8" else cfg.precision
    return reference.verdict(precision, records, losses, snapshot, single.snapshot, full, final, cfg.steps)


def decoded_predictions(cfg: TrainConfig, full: dict, task, count: int = 4) -> list[str]:
    """A few answers of the trained model (its full weights, on one process) to the batch after the
    last step, which it has not trained on ("123+456=579, predicted 579")."""
    from mpi4py import MPI

    from minipar.core.autograd import no_grad

    one = cfg.single_process()
    model = build.build_model(one, ProcessGrid(Comm(MPI.COMM_SELF), 1, 1, 1, 1))
    be = backend.current()
    for name, parameter in model.named_parameters():
        parameter.data[...] = be.from_host(full[name])
    inputs, targets = task.global_batch(cfg.steps, cfg.batch_size)
    with no_grad():
        predicted = np.asarray(be.to_host(model(be.from_host(inputs)).data)).argmax(axis=-1)
    return task.decoded_problems(inputs, targets, predicted)[:count]


def train(cfg: TrainConfig, world=None) -> list[dict]:
    """Train under `world` (default COMM_WORLD) and return rank 0's records (other ranks: their own)."""
    from mpi4py import MPI

    world = world or MPI.COMM_WORLD
    cfg = cfg.resolved(world.Get_size())
    trainer = Trainer(cfg, world)
    records = trainer.run()
    trainer.memory.close()  # its records are made: the reference run below keeps a ledger of its own
    full = trainer.full_state() if cfg.check_reference else None
    rank_rows = trainer.world.gather_obj({"rank": trainer.world.rank, "coords": trainer.grid.coords_of(
        trainer.world.rank), "mem": records[-1]["mem"] if records else {}})
    # the other ranks are done: rank 0 alone runs the single-process reference
    check = check_against_reference(cfg, records, trainer.snapshot, full) \
        if trainer.is_rank0 and cfg.check_reference else None
    if trainer.is_rank0 and not cfg.quiet and records:
        samples = decoded_predictions(cfg, full, trainer.task) if full is not None and cfg.is_gpt else []
        print(report.summary(cfg, records, rank_rows, check, samples), flush=True)
    if trainer.log_error:  # rank 0 only: after the checkpoint and the other ranks' last collective
        raise RunStopped(trainer.log_error)
    if check and not check["passed"]:  # rank 0 only, like the log's failure: exit 1
        raise RunStopped(f"--check-reference: FAIL, the layout deviates from one process by more than "
                         f"{check['tolerance']:.1e} {cfg.precision} allows over steps 1..{check['horizon']}")
    return records
