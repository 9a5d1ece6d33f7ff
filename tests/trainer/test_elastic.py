"""`minipar launch` (trainer/elastic.py): a job that loses a rank restarts from its newest valid
checkpoint, and only then.

The oracles: a job killed once (SIGKILL on rank 2 at step 7, a one-shot MINIPAR_FAULT) ends with the
same final weights, bit for bit, as the same job never killed, and --check-reference's one process; the
log's restart record is written by hand in the test. What must never restart (bad input, Ctrl-C) and a
crash loop are spawned too; the supervisor's rules (which exit codes, how the command is rewritten,
hostfiles) are checked on their own. Each spawned job is a tiny GPT on 2 or 4 ranks.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pace

from minipar.trainer import elastic

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
ROOT = Path(__file__).resolve().parents[2]
TINY = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4",
        "--precision", "fp64"]


def train_command(ranks: int, *args: str) -> list[str]:
    return [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "minipar", "train", *TINY, *args]


def environment(fault: str | None = None) -> dict:
    extra = {"MINIPAR_FAULT": fault} if fault else {}
    return {**os.environ, "MPIEXEC_TIMEOUT": "200", "OPENBLAS_NUM_THREADS": "1", **extra}


def launch(options: list[str], command: list[str], fault: str | None = None, **popen):
    """`python -m minipar launch OPTIONS -- COMMAND`, run to its end: (result, seconds)."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "minipar", "launch", *options, "--", *command],
                            capture_output=True, text=True, timeout=400, cwd=ROOT, env=environment(fault))
    return result, time.monotonic() - started


def final_weights(directory: Path) -> dict:
    """Every array of the committed checkpoint in `directory`, by file and name."""
    manifest = json.loads((directory / "manifest.json").read_text())
    arrays = {}
    for file in manifest["files"]:
        with np.load(directory / file) as data:
            arrays.update({(Path(file).name, name): data[name] for name in data.files})
    return manifest["step"], arrays


def restarts(log: Path) -> list[dict]:
    return [record for record in map(json.loads, log.read_text().splitlines()) if "event" in record]


# ---- the rules, on their own ----------------------------------------------------------------------------


def test_only_a_lost_rank_or_a_stalled_collective_is_restarted():
    assert elastic.restartable(9) and elastic.restartable(15) and elastic.restartable(75)
    for code in (0, 1, 2, 130):  # done, a run that stopped itself (--check-reference FAIL), bad input, Ctrl-C
        assert not elastic.restartable(code), code
    assert elastic.cause(9) == "a rank was killed by SIGKILL (exit code 9)"
    assert elastic.cause(75) == "a collective stalled (the watchdog's exit code 75)"


def test_the_relaunch_command_resumes_and_shrinks_only_what_it_must():
    job = elastic.Job(["mpiexec", "-n", "4", "python", "-m", "minipar", "train", "--dp", "4", "--resume=old",
                       "--save", "ck", "--save-every", "5"])
    again = job.with_changes(2, {"--resume": "ck/step-000005", "--dp": "2"})
    assert again.command == ["mpiexec", "-n", "2", "python", "-m", "minipar", "train", "--save", "ck",
                             "--save-every", "5", "--resume", "ck/step-000005", "--dp", "2"]
    left = job.with_changes(4, {"--resume": None})
    assert left.train_args == ["--dp", "4", "--save", "ck", "--save-every", "5"] and left.world_size == 4
    assert elastic.Job(["mpiexec", "python", "-m", "minipar", "train"]).problems() is not None  # no -n K


def test_a_hostfile_gives_its_slots(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# the nodes left\nnode1:2\nnode2\n\nnode3:4  # big one\n")
    assert elastic.hostfile_slots(str(hosts)) == (7, None)
    hosts.write_text("node1:two\n")
    assert "is not host[:slots]" in elastic.hostfile_slots(str(hosts))[1]


def test_the_lock_is_seen_held_while_another_process_holds_it(tmp_path):
    hold = f"import fcntl, os, time; d = os.open({str(tmp_path)!r}, os.O_RDONLY); " \
           "fcntl.flock(d, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not elastic.lock_is_free(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert elastic.lock_is_free(tmp_path)
    descriptor = os.open(tmp_path, os.O_RDONLY)  # and checking it did not keep it
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(descriptor)


def test_a_smaller_world_shrinks_dp_alone_and_never_below_min_ranks(tmp_path):
    """dp x tp = 3 x 2 on 6 ranks: 5 slots hold dp 2 (4 ranks), never tp 1; 3 slots hold dp 1 (2 ranks),
    unless --min-ranks 3; a layout that no longer divides the batch (dp 3 of batch 4) is passed over."""
    def supervisor(slots_needed_at_least: int, dp: int, tp: int, batch: int):
        args = elastic.parse(["--max-restarts", "1", "--min-ranks", str(slots_needed_at_least),
                              "--hostfile", "hosts", "--",
                              "mpiexec", "-n", str(dp * tp), "python", "-m", "minipar", "train"])[0]
        job = elastic.Job(train_command(dp * tp, "--dp", str(dp), "--tp", str(tp), "--batch-size", str(batch),
                                        "--save", str(tmp_path), "--save-every", "5"))
        return elastic.Supervisor(args, job, elastic.train_config(job))

    assert supervisor(1, 3, 2, 6).shrunk_layout(5) == (4, 2, None)
    assert supervisor(1, 3, 2, 6).shrunk_layout(3) == (2, 1, None)
    assert supervisor(1, 4, 1, 4).shrunk_layout(3) == (2, 2, None)  # dp 3 does not divide the batch of 4
    _, _, refused = supervisor(3, 3, 2, 6).shrunk_layout(3)
    assert refused == ("--hostfile hosts has 3 slots: no layout with dp shrunk alone (tp 2 x pp 1 x cp 1 per "
                       "replica) fits on at least --min-ranks 3")


def test_no_process_of_the_old_job_is_left_before_a_relaunch(tmp_path, monkeypatch):
    """The old job's group (here a shell and its child, both ignoring SIGTERM, as a rank stuck in a
    system call would be deaf to it) is gone after end_group: TERM, then KILL once the grace is over;
    wait_until_gone then finds no live process of it and the save folder's lock free."""
    monkeypatch.setattr(elastic, "TERM_GRACE_S", 0.5)
    job = elastic.Job(train_command(2, "--save", str(tmp_path), "--save-every", "5"))
    args = elastic.parse(["--max-restarts", "1", "--", *job.command])[0]
    supervisor = elastic.Supervisor(args, job, elastic.train_config(job))
    old = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 60 & echo $!; wait"], stdout=subprocess.PIPE,
                           text=True, start_new_session=True)
    child = int(old.stdout.readline())
    supervisor.group = old.pid
    assert elastic.group_alive(old.pid)
    supervisor.end_group()
    old.wait(timeout=10)
    assert not elastic.group_alive(old.pid) and supervisor.wait_until_gone() is None
    assert not os.path.exists(f"/proc/{child}") or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_launch_refuses_a_job_it_could_not_restart(capsys):
    train = ["mpiexec", "-n", "2", "python", "-m", "minipar", "train", "--steps", "4"]
    assert elastic.launch_main(["--max-restarts", "2", "--", *train]) == 2
    assert capsys.readouterr().err == ("minipar launch: error: needs --save DIR --save-every K in the train "
                                       "command: a restart resumes from the newest checkpoint there\n")
    assert elastic.launch_main(["--max-restarts", "2", "--", *train, "--save", "ck"]) == 2
    assert elastic.launch_main(["--max-restarts", "-1", "--", *train]) == 2
    assert elastic.launch_main(["--max-restarts", "2", "--", "mpiexec", "-n", "2", "hostname"]) == 2
    assert elastic.launch_main(["--max-restarts", "2"]) == 2


# ---- spawned: the job of the issue, and what is never restarted -------------------------------------------


def test_spawns_mpiexec_a_rank_killed_at_step_7_restarts_from_step_5_to_the_same_weights(tmp_path):
    """4 ranks, --save-every 5, rank 2 SIGKILLed once at step 7: the supervisor relaunches from the
    checkpoint of step 5 and the job finishes its 20 steps, exit 0, PASS against one process; the final
    weights are bit for bit those of the same job run without the kill."""
    steps = ["--steps", "20", "--save-every", "5"]
    plain = subprocess.run(train_command(4, *steps, "--save", str(tmp_path / "plain"), "--quiet"),
                           capture_output=True, text=True, timeout=300, cwd=ROOT, env=environment())
    assert plain.returncode == 0, plain.stderr
    log = tmp_path / "log.jsonl"
    result, _ = launch(["--max-restarts", "2"],
                       train_command(4, *steps, "--save", str(tmp_path / "ck"), "--log", str(log),
                                     "--check-reference"),
                       fault=f"rank:2,step:7,signal:KILL,once:{tmp_path / 'fired'}")
    assert result.returncode == 0, result.stderr
    assert "check against one process: PASS over steps 1..20 (tolerance 1.0e-09)" in result.stdout
    assert restarts(log) == [{"event": "restart", "attempt": 1, "from_step": 5, "world_size": 4,
                              "cause": "a rank was killed by SIGKILL (exit code 9)"}]
    steps_logged = [record["step"] for record in map(json.loads, log.read_text().splitlines())
                    if "step" in record]
    assert steps_logged == [*range(7), *range(5, 20)]  # steps 5 and 6 twice: the later record counts
    (step, killed), (plain_step, plain) = final_weights(tmp_path / "ck"), final_weights(tmp_path / "plain")
    assert step == plain_step == 20 and plain.keys() == killed.keys() and len(plain) > 0
    for key in plain:  # every rank's file of the final checkpoint: parameters and optimizer states
        assert plain[key].tobytes() == killed[key].tobytes(), key  # bit for bit


def test_spawns_mpiexec_a_smaller_world_relaunches_on_2_ranks_with_dp_shrunk(tmp_path):
    """The hostfile read before the restart has 2 slots: dp 4 becomes dp 2 (tp, pp stay), PASS at fp64's
    1e-9 against one process."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    log = tmp_path / "log.jsonl"
    command = train_command(4, "--dp", "4", "--steps", "10", "--save-every", "5", "--save",
                            str(tmp_path / "ck"), "--log", str(log), "--check-reference")
    result, _ = launch(["--max-restarts", "1", "--min-ranks", "2", "--hostfile", str(hosts)], command,
                       fault=f"rank:2,step:7,signal:KILL,once:{tmp_path / 'fired'}")
    assert result.returncode == 0, result.stderr
    assert "check against one process: PASS over steps 1..10 (tolerance 1.0e-09)" in result.stdout
    assert [(r["from_step"], r["world_size"]) for r in restarts(log)] == [(5, 2)]


def test_spawns_mpiexec_bad_input_is_never_restarted(tmp_path):
    log = tmp_path / "log.jsonl"
    result, seconds = launch(["--max-restarts", "3"],
                             train_command(2, "--tp", "3", "--save", str(tmp_path), "--save-every", "5",
                                           "--log", str(log)))
    assert result.returncode == 2 and seconds < pace.allowance(), (seconds, result.stderr)
    assert result.stderr.count("does not match the world size 2") == 2 and not log.exists()


def test_spawns_mpiexec_a_crash_loop_stops_after_n_restarts_that_commit_nothing(tmp_path):
    """Rank 1 is killed at step 7 every time: the first restart (the job had committed step 5) is
    worth it, the next one commits nothing new, and with --max-restarts 1 the supervisor stops."""
    log = tmp_path / "log.jsonl"
    result, _ = launch(["--max-restarts", "1"],
                       train_command(2, "--steps", "10", "--save-every", "5", "--save", str(tmp_path / "ck"),
                                     "--log", str(log), "--quiet"), fault="rank:1,step:7,signal:KILL")
    assert result.returncode == elastic.CRASH_LOOP_EXIT, result.stderr
    assert "1 restart(s) in a row committed no new step (--max-restarts 1): stopping" in result.stderr
    assert [r["from_step"] for r in restarts(log)] == [5]


def test_spawns_mpiexec_ctrl_c_is_passed_on_and_never_restarted(tmp_path):
    log = tmp_path / "log.jsonl"
    command = [sys.executable, "-m", "minipar", "launch", "--max-restarts", "3", "--",
               *train_command(2, "--steps", "100000", "--save-every", "1000", "--save", str(tmp_path / "ck"),
                              "--log", str(log), "--quiet")]
    supervisor = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=ROOT, env=environment())
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.1)  # training has begun
        supervisor.send_signal(signal.SIGINT)
        _, stderr = supervisor.communicate(timeout=60)
    finally:
        supervisor.kill()
    assert supervisor.returncode == 130, stderr
    assert sorted(stderr.strip().splitlines()) == [f"minipar train: interrupted (rank {r})" for r in (0, 1)]
    assert restarts(log) == []


def test_spawns_mpiexec_a_stalled_collective_is_restarted(tmp_path):
    """Rank 1 stops (SIGSTOP) once at step 7: rank 0's watchdog ends the job with its own exit code,
    and the supervisor relaunches from step 5; the job ends as a run never stopped would, PASS."""
    log = tmp_path / "log.jsonl"
    result, _ = launch(["--max-restarts", "1"],
                       train_command(2, "--steps", "10", "--save-every", "5", "--save", str(tmp_path / "ck"),
                                     "--log", str(log), "--collective-timeout", "2", "--check-reference"),
                       fault=f"rank:1,step:7,stall:stop,once:{tmp_path / 'fired'}")
    assert result.returncode == 0, result.stderr
    assert "PASS over steps 1..10" in result.stdout
    assert restarts(log) == [{"event": "restart", "attempt": 1, "from_step": 5, "world_size": 2,
                              "cause": "a collective stalled (the watchdog's exit code 75)"}]
