"""`minipar launch`: restart a job that lost a rank, from its newest valid checkpoint.

The idea (torchrun's elastic agent, Horovod Elastic): a long job will lose a node, and an MPI job cannot
lose a rank and go on, so a supervisor outside MPI runs the job, and when it ends by a lost rank it
starts it again with `--resume` from the last committed checkpoint. Only what a restart can cure is
restarted: a rank killed by a signal (Hydra's mpiexec exits with the signal's number) or a collective
that stalled (the watchdog's own exit code, STALL_EXIT); never bad input (2), Ctrl-C (130) or a run that
stopped by itself (1: a loss not finite, a `--check-reference` FAIL, a rank that raised), which would
fail the same way again.

    python -m minipar launch --max-restarts N [--min-ranks M] [--hostfile FILE] -- \\
        mpiexec -n 4 python -m minipar train ... --save DIR --save-every K

What it saves: the steps since the last checkpoint are all a lost rank costs (at most K), with no one
watching. What it costs: the checkpoints themselves (`--save-every`), a relaunch (start-up, reading the
checkpoint), and the steps after the checkpoint done twice; the log keeps both, the later record counts.

How, step by step (`Supervisor.run`): the command runs in its own process group, Ctrl-C and SIGTERM are
passed on to mpiexec; when it ends the group is killed (TERM, then KILL) and the supervisor waits, with a
limit, until the save folder's lock (checkpoint/sharded.py `lock_problems`) is free: the proof that the
old job is gone on this host (remote ranks are Hydra's to clean up). Then it picks the newest checkpoint
whose manifest validates for this run (DIR's own, then its kept `step-*` folders: never merely the
newest folder), or step 0; with `--hostfile` it re-reads the slots and shrinks dp alone (tp, pp and cp
stay) to fit, refusing below `--min-ranks`; appends `{"event": "restart", ...}` to the log, and
relaunches. A crash loop (N restarts in a row that commit no new step) stops it. It runs no MPI of its
own (cli.py starts it with mpi4py's initialisation turned off).
Lesson: lessons/12_reliability.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from minipar.checkpoint import sharded as checkpoint
from minipar.distributed.watchdog import STALL_EXIT
from minipar.trainer import build
from minipar.trainer.arguments import OneLineParser, fail, parse_train_args
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate

PROG = "minipar launch"
GONE_LIMIT_S = 30.0  # how long the old job's processes and its hold on the save folder may take to go
TERM_GRACE_S = 5.0  # between TERM and KILL for what is left of the old process group
CRASH_LOOP_EXIT = 1  # the supervisor gave up: N restarts committed nothing new


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit(fail(PROG, "give the job after --: minipar launch --max-restarts N -- mpiexec -n K "
                                    "python -m minipar train ... --save DIR --save-every K"))
    split = argv.index("--")
    parser = OneLineParser(prog=PROG, description="Run a minipar train job; restart it from its newest "
                                                  "valid checkpoint when it loses a rank.")
    parser.add_argument("--max-restarts", type=int, required=True,
                        help="stop after this many restarts in a row that commit no new step")
    parser.add_argument("--min-ranks", type=int, default=1, help="never relaunch on fewer ranks")
    parser.add_argument("--hostfile", help="re-read before each restart: host[:slots] lines; dp shrinks "
                                           "to fit the slots")
    args = parser.parse_args(argv[:split])
    if args.max_restarts < 0 or args.min_ranks < 1:
        parser.error(f"--max-restarts must be at least 0 and --min-ranks at least 1, got "
                     f"{args.max_restarts} and {args.min_ranks}")
    return args, argv[split + 1 :]


class Job:
    """The mpiexec command, split into what the supervisor rewrites: its rank count and train's options."""

    def __init__(self, command: list[str]):
        self.command = list(command)
        self.train_at = next((i + 1 for i, word in enumerate(command[:-1])
                              if Path(word).name == "minipar" and command[i + 1] == "train"), None)
        launcher = command[: self.train_at or 0]  # mpiexec's own options come before the program
        self.ranks_at = next((i + 1 for i, word in enumerate(launcher[:-1]) if word in ("-n", "-np")), None)

    def problems(self) -> str | None:
        if self.train_at is None:
            return "the command after -- must run `minipar train` (python -m minipar train ...)"
        if self.ranks_at is None or not self.command[self.ranks_at].isdigit():
            return "the command after -- must give mpiexec its rank count as -n K"
        return None

    @property
    def train_args(self) -> list[str]:
        return self.command[self.train_at + 1 :]

    @property
    def world_size(self) -> int:
        return int(self.command[self.ranks_at])

    def with_changes(self, ranks: int, options: dict[str, str | None]) -> Job:
        """The command on `ranks` ranks, with train's options set (a value) or removed (None)."""
        args, kept = self.train_args, []
        i = 0
        while i < len(args):
            name = args[i].split("=", 1)[0]
            if name in options:
                i += 1 if "=" in args[i] else 2
                continue
            kept.append(args[i])
            i += 1
        for name, value in options.items():
            if value is not None:
                kept += [name, value]
        command = self.command[: self.train_at + 1] + kept
        command[self.ranks_at] = str(ranks)
        return Job(command)


def train_config(job: Job) -> TrainConfig | None:
    """The job's train options, or None where they are bad input (the job will say so itself)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return parse_train_args(job.train_args)
    except SystemExit:
        return None


class Supervisor:
    def __init__(self, args: argparse.Namespace, job: Job, cfg: TrainConfig):
        self.args, self.job, self.cfg = args, job, cfg
        self.save = Path(cfg.save)
        self.process: subprocess.Popen | None = None
        self.group = 0  # the process group of the job running now (its mpiexec's pid)
        self.stop_signal: int | None = None  # Ctrl-C or SIGTERM passed on: never restart after it

    def forward(self, signum, frame) -> None:
        self.stop_signal = signum
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)  # mpiexec passes it to every rank

    def run(self) -> int:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.forward)
        job, attempt, fruitless = self.job, 0, 0
        committed = self.newest_step()
        while True:
            code = self.run_once(job)
            if code == 0 or self.stop_signal is not None or not restartable(code):
                return code
            gone = self.wait_until_gone()
            if gone is not None:
                return fail(PROG, gone)
            newest = self.newest_step()
            if attempt > 0 and newest == committed:
                fruitless += 1
            elif newest != committed:
                fruitless = 0
            committed = newest
            if fruitless >= self.args.max_restarts:
                why = "no restart is allowed" if self.args.max_restarts == 0 else \
                    f"{fruitless} restart(s) in a row committed no new step"
                sys.stderr.write(f"{PROG}: error: the job ended with exit code {code} ({cause(code)}) and "
                                 f"{why} (--max-restarts {self.args.max_restarts}): stopping\n")
                return CRASH_LOOP_EXIT
            attempt += 1
            job, problem = self.next_job(attempt, code)
            if problem is not None:
                return fail(PROG, problem)
            if self.stop_signal is not None:  # Ctrl-C between two launches: none more
                return 128 + self.stop_signal

    def run_once(self, job: Job) -> int:
        self.process = subprocess.Popen(job.command, start_new_session=True)  # its own process group
        self.group = self.process.pid
        code = self.process.wait()
        self.end_group()
        return 128 - code if code < 0 else code  # mpiexec itself killed by a signal: the shell's code

    def end_group(self) -> None:
        """What is left of the old job on this host: TERM, a grace period, then KILL."""
        for signum, grace in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, GONE_LIMIT_S)):
            if not group_alive(self.group):
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.group, signum)
            deadline = time.monotonic() + grace
            while group_alive(self.group) and time.monotonic() < deadline:
                time.sleep(0.05)

    def wait_until_gone(self) -> str | None:
        """None once no process of the old group lives and the save folder's lock is free."""
        deadline = time.monotonic() + GONE_LIMIT_S
        while time.monotonic() < deadline:
            if not group_alive(self.group) and lock_is_free(self.save):
                return None
            time.sleep(0.1)
        return (f"the old job still holds --save {self.save} {GONE_LIMIT_S:g} s after it ended: not "
                "relaunching over it")

    def newest_valid(self, cfg: TrainConfig) -> tuple[Path | None, int]:
        """The newest checkpoint under --save whose manifest validates for this run, and its step."""
        candidates = [self.save, *sorted(self.save.glob("step-*"), reverse=True)]
        found = []
        for path in candidates:
            try:
                manifest = checkpoint.read_manifest(path, cfg.replace(resume=str(path)),
                                                    build.model_config(cfg))
            except checkpoint.CheckpointError:
                continue
            found.append((manifest["step"], path == self.save, path))
        if not found:
            return None, 0
        step, _, path = max(found)
        return path, step

    def newest_step(self) -> int | None:
        path, step = self.newest_valid(self.cfg)
        return step if path is not None else None

    def next_job(self, attempt: int, code: int) -> tuple[Job, str | None]:
        ranks, dp = self.job.world_size, self.cfg.dp
        if self.args.hostfile is not None:
            slots, problem = hostfile_slots(self.args.hostfile)
            if problem is not None:
                return self.job, problem
            ranks, dp, problem = self.shrunk_layout(slots)
            if problem is not None:
                return self.job, problem
        path, step = self.newest_valid(self.cfg)
        options = {"--resume": str(path) if path is not None else None}
        if self.cfg.dp is not None:  # given: set to the shrunk one (left out, it follows the world size)
            options["--dp"] = str(dp)
        job = self.job.with_changes(ranks, options)
        self.record({"event": "restart", "attempt": attempt, "from_step": step, "world_size": ranks,
                     "cause": cause(code)})
        return job, None

    def shrunk_layout(self, slots: int) -> tuple[int, int, str | None]:
        """(ranks, dp, None): the world the slots hold, dp shrunk alone; or why none will do."""
        cfg = self.cfg.resolved(self.job.world_size)
        model_ranks = cfg.tp * cfg.pp * cfg.cp
        for dp in range(min(cfg.dp, slots // model_ranks), 0, -1):
            ranks = dp * model_ranks
            if ranks < self.args.min_ranks:
                break
            if not validate(cfg.replace(dp=dp, resume=None), ranks):
                return ranks, dp, None
        return 0, 0, (f"--hostfile {self.args.hostfile} has {slots} slots: no layout with dp shrunk alone "
                      f"(tp {cfg.tp} x pp {cfg.pp} x cp {cfg.cp} per replica) fits on at least --min-ranks "
                      f"{self.args.min_ranks}")

    def record(self, entry: dict) -> None:
        if self.cfg.log is None:
            return
        try:
            with open(self.cfg.log, "a") as log:
                log.write(json.dumps(entry) + "\n")
        except OSError as error:
            sys.stderr.write(f"{PROG}: --log {self.cfg.log}: the restart record was not written "
                             f"({error.strerror})\n")


def restartable(code: int) -> bool:
    """A rank lost to a signal (Hydra exits with its number; 1 and 2, SIGHUP and SIGINT, are minipar's
    own codes) or a collective that stalled."""
    return code == STALL_EXIT or 3 <= code < 64 or code in (128 + signal.SIGKILL, 128 + signal.SIGTERM)


def cause(code: int) -> str:
    if code == STALL_EXIT:
        return f"a collective stalled (the watchdog's exit code {STALL_EXIT})"
    who, number = ("mpiexec was", code - 128) if code > 128 else ("a rank was", code)
    try:
        return f"{who} killed by {signal.Signals(number).name} (exit code {code})"
    except ValueError:
        return f"exit code {code}"


def group_alive(group: int) -> bool:
    """Whether a live (not zombie) process of the process group is left; /proc where there is one."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(group, 0)
            return True
        except ProcessLookupError:
            return False
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False


def lock_is_free(directory: Path) -> bool:
    """The old job's rank 0 held the save folder's flock (checkpoint/sharded.py): free once it is gone."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return True  # no folder: nothing held
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(descriptor)  # closing drops the lock at once


def hostfile_slots(path: str) -> tuple[int, str | None]:
    """The slots of an MPICH hostfile (`host[:slots]` a line, # comments), or why it cannot be read."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        return 0, f"--hostfile {path}: {error.strerror}"
    slots = 0
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        _, _, count = line.partition(":")
        if count and not (count.isdigit() and int(count) > 0):
            return 0, f"--hostfile {path}: {line!r} is not host[:slots]"
        slots += int(count) if count else 1
    return slots, None


def launch_main(argv: list[str]) -> int:
    try:
        args, command = parse(argv)
    except SystemExit as exit_request:
        return int(exit_request.code or 0)
    job = Job(command)
    problem = job.problems()
    if problem is not None:
        return fail(PROG, problem)
    cfg = train_config(job)
    if cfg is None:  # the job's bad input: it says so itself, on every rank (exit 2, never restarted)
        return subprocess.run(job.command).returncode
    if cfg.save is None or not cfg.save_every:
        return fail(PROG, "needs --save DIR --save-every K in the train command: a restart resumes from the "
                          "newest checkpoint there")
    return Supervisor(args, job, cfg).run()
