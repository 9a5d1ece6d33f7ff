"""`make kill-campaign`: SIGKILL a rank of an asynchronously checkpointing job at random times, and check
that what each kill leaves resumes exactly. Not part of make test (it takes minutes).

The unit tests (tests/checkpoint/test_save_async.py) kill at each named point of a save; this campaign
kills where nobody thought to look. Each round starts the same 2-rank job with `--save DIR --save-every 1
--save-async`, waits for its first step, SIGKILLs one rank (chosen at random) after a random delay
within the job's training time, and lets Hydra end the rest. Then, for each round:
- the newest manifest, DIR/manifest.json, validates (checkpoint/sharded.py's `read_manifest`: every file
  it names there, whole, with its SHA-256), and its step is at most the last step the job logged;
- `train --resume DIR` to the end logs the losses of the uninterrupted run (no saving at all) bit for bit.
A kill before the first commit leaves no manifest: the round then checks that a fresh run is exact too.

    python tests/kill_campaign.py [--kills 50] [--steps 12] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minipar.checkpoint import sharded as checkpoint  # noqa: E402
from minipar.trainer import build  # noqa: E402
from minipar.trainer.arguments import parse_train_args  # noqa: E402

SMALL = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4",
         "--precision", "fp64", "--quiet"]
ENV = {**os.environ, "MPIEXEC_TIMEOUT": "300", "OPENBLAS_NUM_THREADS": "1"}
RANKS = 2


def train_command(steps: int, *args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "mpiexec"), "-n", str(RANKS), sys.executable, "-m", "minipar",
            "train", *SMALL, "--steps", str(steps), *args]


def losses(log: Path) -> list[float]:
    """The losses a log holds; none where no step ran (a resume from the last step opens no log)."""
    if not log.exists():
        return []
    return [json.loads(line)["loss"] for line in log.read_text().splitlines() if line.strip()]


def rank_pids(mpiexec: int) -> dict[int, int]:
    """{rank: pid} of the job's python ranks: mpiexec's descendants (Hydra's proxy, then the ranks, each
    in a session of its own) whose environment has PMI_RANK."""
    parents, ranks = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry)] = (int(fields[1]), fields[0])
        except (OSError, ValueError):
            continue
    family = {mpiexec}
    for _ in range(3):  # mpiexec -> hydra_pmi_proxy -> rank
        family |= {pid for pid, (parent, _) in parents.items() if parent in family}
    for pid in family - {mpiexec}:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((v.split(b"=", 1)[1] for v in environ if v.startswith(b"PMI_RANK=")), None)
        if rank is not None and parents[pid][1] != "Z":
            ranks[int(rank)] = pid
    return ranks


def wait_for_first_step(log: Path, job: subprocess.Popen, limit_s: float = 120) -> float:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and job.poll() is None:
        if log.exists() and log.read_text().strip():
            return time.monotonic()
        time.sleep(0.02)
    raise RuntimeError("the job logged no step")


def reference(steps: int, log: Path, *saving: str) -> tuple[list[float], float]:
    """An uninterrupted run's losses, and its training time: from its first step logged to its exit
    (the last save and the ranks' ends included)."""
    job = subprocess.Popen(train_command(steps, *saving, "--log", str(log)), cwd=ROOT, env=ENV,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = wait_for_first_step(log, job)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err
    return losses(log), time.monotonic() - first


def kill_round(steps: int, folder: Path, log: Path, rank: int, delay: float) -> dict:
    """Start the saving job, SIGKILL `rank` `delay` s after its first step; what was seen."""
    job = subprocess.Popen(train_command(steps, "--save", str(folder), "--save-every", "1", "--save-async",
                                         "--log", str(log)),
                           cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    started = time.monotonic()
    first = wait_for_first_step(log, job)
    while time.monotonic() < first + delay and job.poll() is None:
        time.sleep(0.01)
    ended_s = time.monotonic() - first if job.poll() is not None else None  # before its kill time
    killed_at = time.monotonic() - started
    pid = rank_pids(job.pid).get(rank)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    try:
        _, err = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        _, err = job.communicate()
        return {"hung": True, "killed_at_s": killed_at}
    return {"killed": pid is not None, "killed_at_s": round(killed_at, 2), "ended_s": ended_s,
            "exit": job.returncode,
            "logged_steps": len(losses(log)), "stderr_tail": err.strip().splitlines()[-1:]}


def check_round(steps: int, folder: Path, work: Path, whole: list[float]) -> dict:
    """The newest manifest validates; resuming from it (or from step 0 if none) reproduces `whole`."""
    cfg = parse_train_args([*SMALL, "--steps", str(steps), "--resume", str(folder)])
    found: dict = {"manifest": (folder / checkpoint.MANIFEST).exists()}
    resume: list[str] = []
    if found["manifest"]:
        try:
            found["step"] = checkpoint.read_manifest(folder, cfg, build.model_config(cfg))["step"]
            resume = ["--resume", str(folder)]
        except checkpoint.CheckpointError as error:
            found["invalid"] = str(error)
            return found
    found["stray_tmp"] = sorted(p.name for p in folder.rglob("*.tmp"))  # debris: the next save clears it
    log = work / "resumed.jsonl"
    resumed = subprocess.run(train_command(steps, *resume, "--log", str(log)), cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=300)
    start = found.get("step", 0)
    found["exact"] = resumed.returncode == 0 and losses(log) == whole[start:]
    if resumed.returncode != 0:
        found["resume_error"] = resumed.stderr.strip().splitlines()[-1:]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    chance = random.Random(args.seed)
    failures = missed = 0
    with tempfile.TemporaryDirectory(prefix="minipar-kills-") as tmp:
        work = Path(tmp)
        whole, _ = reference(args.steps, work / "whole.jsonl")  # the oracle: no saving at all
        saving, training_s = reference(args.steps, work / "saving.jsonl", "--save", str(work / "saving"),
                                       "--save-every", "1", "--save-async")  # the kill window
        assert saving == whole, "saving changed the losses"
        print(f"uninterrupted, saving every step: {args.steps} steps, {training_s:.2f} s from the first "
              "step to the end: each kill comes at a uniformly random time in that window (a round that "
              "ends before its kill time sets the window to its own length: the load changes)", flush=True)
        n = 0
        while n - missed < args.kills:  # a round that ended before its kill time is checked, not counted
            round_dir = work / f"round{n:03d}"
            round_dir.mkdir()
            rank, delay = chance.randrange(RANKS), chance.uniform(0, training_s)
            seen = kill_round(args.steps, round_dir / "ck", round_dir / "killed.jsonl", rank, delay)
            seen.update(check_round(args.steps, round_dir / "ck", round_dir, whole))
            ok = seen.get("exact") and not seen.get("hung") and \
                seen.get("step", 0) <= seen.get("logged_steps", 0)
            failures += not ok
            if not seen.get("killed"):  # the job had already ended: checked all the same, not counted,
                missed += 1  # and the window follows the machine's pace: that run's own length
                training_s = seen.get("ended_s") or training_s
            print(json.dumps({"round": n, "rank": rank, "delay_s": round(delay, 2), **seen,
                              "ok": bool(ok)}), flush=True)
            n += 1
    print(f"{n - missed} kills, {missed} more rounds ended before their kill time; {n - failures} of {n} "
          "rounds left a checkpoint that validated and resumed exactly", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
