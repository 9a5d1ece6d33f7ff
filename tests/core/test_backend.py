"""The CuPy backend, tested without a GPU: a fake device (tests/fake_device.py) whose arrays MPI and
NumPy refuse proves that every communication path stages through the host, and with a
__cuda_array_interface__ that the CUDA-aware path hands MPI device memory directly.

    pytest -m "not mpi" tests/core/test_backend.py                       # one process
    mpiexec -n K python -m pytest -m mpi tests/core/test_backend.py       # K = 2, 4, 8
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import numpy
import pytest
from fake_device import fake_cupy
from mpi4py import MPI
from mpi_harness import mpi_given

from minipar.core import backend
from minipar.core.shards import shard_bounds
from minipar.distributed import collectives
from minipar.distributed.grid import factorisations
from minipar.trainer import loop as train
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate

WORLD = MPI.COMM_WORLD
REPO = Path(__file__).resolve().parents[2]
HIDE_CUPY = "import sys; sys.modules['cupy'] = None\n"  # `import cupy` fails, even where it is installed


def tiny(**changes) -> TrainConfig:
    base = TrainConfig(model="gpt", precision="fp64", n_layer=2, n_head=2, d_model=16, seq_len=8,
                       batch_size=8, steps=2, quiet=True)
    return base.replace(**changes)


def train_on_fake_device(cfg: TrainConfig, world, gpus=1, cuda_aware=False):
    """Train cfg with the CuPy backend on the fake device; (records, full state, fake, trainer)."""
    with fake_cupy(gpus=gpus, cuda_array_interface=cuda_aware) as fake:
        assert validate(cfg.replace(backend="cupy"), world.Get_size()) == []
        trainer = train.Trainer(cfg.replace(backend="cupy"), world)
        assert backend.current().cuda_aware == cuda_aware
        params = trainer.engine.model.parameters()
        assert params and all(isinstance(p.data, fake.ndarray) for p in params if p.data.size)
        records = trainer.run()
        return records, trainer.full_state(), fake, trainer


@pytest.fixture
def cuda_aware_env(monkeypatch):
    """Sets MINIPAR_CUDA_AWARE as a user would: returns a function taking True or False."""
    return lambda on: monkeypatch.setenv(backend.CUDA_AWARE_ENV, "1" if on else "0")


# ----- serial: the fake is as strict as a real device ------------------------------------------------


def test_fake_device_arrays_are_refused_by_mpi_numpy_and_pickle():
    with fake_cupy() as cupy:
        x, received = cupy.arange(4.0), cupy.zeros(4)
        with pytest.raises(TypeError):
            numpy.asarray(x)  # no implicit copy to the host, as in CuPy
        with pytest.raises(TypeError):
            MPI.COMM_SELF.Allreduce(x, received)  # no buffer protocol: MPI cannot read it
        with pytest.raises(TypeError):
            x + numpy.ones(4)  # no mixing with host arrays
        with pytest.raises(TypeError):
            pickle.dumps(x)  # a device array in a control message would be a hidden copy


def test_with_the_cuda_array_interface_mpi_reads_and_writes_the_fake_device():
    with fake_cupy(cuda_array_interface=True) as cupy:
        x, received = cupy.arange(4.0), cupy.zeros(4)
        MPI.COMM_SELF.Allreduce(x, received)
        assert numpy.array_equal(received.get(), numpy.arange(4.0))
        assert cupy.copies["to_host"] == 1  # only the .get() above


def test_numpy_backend_hands_its_own_arrays_to_mpi():
    be = backend.set_backend("numpy")
    x = numpy.arange(6.0).reshape(2, 3)
    assert be.send_buffer(x) is x and be.to_host(x) is x and be.from_host(x) is x
    copied = be.send_buffer(x, copy=True)
    assert copied is not x and numpy.array_equal(copied, x)
    assert be.send_buffer(x.T).flags.c_contiguous and numpy.array_equal(be.send_buffer(x.T), x.T)
    assert type(be.receive_buffer((2, 3), "float32")) is numpy.ndarray and not be.cuda_aware


# ----- serial: choosing the backend, the device, CUDA-awareness; clear errors -------------------


def test_the_device_follows_the_node_local_rank():
    with fake_cupy(gpus=3) as cupy:
        for local_rank in range(7):
            assert backend.set_backend("cupy", local_rank=local_rank).device == local_rank % 3
            assert cupy.state.device_in_use == local_rank % 3
        be = backend.set_backend("cupy")  # no local rank: CUDA's current device stays
        assert be.device is None and cupy.state.device_in_use == 6 % 3 and be.xp is cupy


def test_cuda_awareness_comes_from_the_environment(monkeypatch):
    with fake_cupy():
        for value, expected in (("1", True), ("yes", True), ("0", False), ("", False)):
            monkeypatch.setenv(backend.CUDA_AWARE_ENV, value)
            assert backend.set_backend("cupy").cuda_aware is expected
        assert backend.set_backend("cupy", cuda_aware=False).cuda_aware is False
        assert backend.set_backend("numpy", cuda_aware=True).cuda_aware is False  # host arrays


def test_missing_cupy_or_gpu_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    reason = backend.unavailable("cupy")
    assert "needs the cupy package" in reason and "\n" not in reason
    assert validate(tiny(backend="cupy"), 1) == [reason]
    with pytest.raises(RuntimeError, match="needs the cupy package"):
        backend.set_backend("cupy")
    assert backend.current().name == "numpy"
    with fake_cupy(gpus=0):
        reason = backend.unavailable("cupy")
        assert "needs a CUDA GPU" in reason and "\n" not in reason
        assert validate(tiny(backend="cupy"), 1) == [reason]
    with fake_cupy(gpus=1):
        assert backend.unavailable("cupy") is None and validate(tiny(backend="cupy"), 1) == []
    assert backend.unavailable("numpy") is None


def run_cli(argv: list[str], env: dict, ranks: int = 1) -> subprocess.CompletedProcess:
    program = HIDE_CUPY + f"from minipar.cli import main\nsys.exit(main({argv!r}))\n"
    command = [sys.executable, "-c", program]
    if ranks > 1:
        command = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), *command]
    env = {k: v for k, v in os.environ.items() if k != backend.BACKEND_ENV} | env
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**env, "MPIEXEC_TIMEOUT": "60"})


TINY_ARGS = ["train", "--steps", "1", "--n-layer", "1", "--d-model", "8", "--n-head", "2", "--seq-len", "4",
             "--batch-size", "4", "--quiet"]


@pytest.mark.parametrize("flag, env", [(["--backend", "cupy"], {}), ([], {backend.BACKEND_ENV: "cupy"})])
def test_train_asks_for_cupy_where_there_is_none_exit_2_one_line(flag, env):
    job = run_cli(TINY_ARGS + flag, env)
    assert job.returncode == 2, job
    assert job.stderr.count("\n") == 1 and "needs the cupy package" in job.stderr, job.stderr


def test_the_flag_wins_over_the_environment_and_a_bad_environment_is_named():
    assert run_cli(TINY_ARGS + ["--backend", "numpy"], {backend.BACKEND_ENV: "cupy"}).returncode == 0
    job = run_cli(TINY_ARGS, {backend.BACKEND_ENV: "torch"})
    assert job.returncode == 2 and "MINIPAR_BACKEND='torch' is not one of numpy, cupy" in job.stderr, job


def test_every_rank_says_why_before_any_collective():
    job = run_cli(TINY_ARGS + ["--backend", "cupy"], {}, ranks=2)
    assert job.returncode != 0, job
    assert job.stderr.count("needs the cupy package") == 2, job.stderr
    assert "Traceback" not in job.stderr


@pytest.mark.parametrize("model, precision", [("gpt", "fp64"), ("gpt", "fp32"), ("mlp", "fp64")])
def test_one_process_on_the_device_trains_to_the_numpy_numbers_bit_for_bit(model, precision):
    cfg = tiny(model=model, precision=precision, steps=3, dp=1)
    records, state, fake, _ = train_on_fake_device(cfg, MPI.COMM_SELF)
    losses, reference = train.reference_run(cfg)
    assert [r["loss"] for r in records] == losses
    assert all(numpy.array_equal(state[name], array) for name, (_, array) in reference.items())
    assert fake.copies["to_device"] > 0 and fake.copies["synchronize"] > 0


def rank_values(seed: int, rank: int, n: int, dtype: str) -> numpy.ndarray:
    """Small integers, so sums are exact in any order and any dtype."""
    return numpy.random.default_rng([seed, rank]).integers(-20, 20, n).astype(dtype)


def collective_cases(comm, n: int, seed: int, dtype: str):
    """(name, call on device arrays, expected host result, staged even on a CUDA-aware MPI)."""
    every = [rank_values(seed, r, n, dtype) for r in range(comm.size)]
    total = numpy.sum(every, axis=0, dtype=dtype)
    shard = slice(*shard_bounds(n, comm.size, comm.rank))
    gathered = numpy.concatenate([v[slice(*shard_bounds(n, comm.size, r))] for r, v in enumerate(every)])
    left, right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size

    def ring_exchange(x):
        request = comm.isend(x, right, tag=7)
        received = comm.recv(x.shape, x.dtype, left, tag=7)
        request.Wait()
        return received

    return [
        ("all_reduce", lambda x: comm.all_reduce(x), total, False),
        ("all_reduce max", lambda x: comm.all_reduce(x, op="max"), numpy.max(every, axis=0), False),
        ("reduce_scatter", lambda x: comm.reduce_scatter(x), total[shard], False),
        ("all_gather", lambda x: comm.all_gather(x[shard], numel=n), gathered, False),
        ("all_gather sizes", lambda x: comm.all_gather(x[shard]), gathered, False),
        ("broadcast", lambda x: comm.broadcast(x, root=comm.size - 1), every[-1], False),
        ("isend/recv", ring_exchange, every[left], False),
        ("ring_all_reduce", lambda x: collectives.ring_all_reduce(comm, x), total, True),
        ("ring_reduce_scatter", lambda x: collectives.ring_reduce_scatter(comm, x), total[shard], True),
        ("ring_all_gather", lambda x: collectives.ring_all_gather(comm, x[shard], n), gathered, True),
    ]


@mpi_given(max_examples=8, n=st.integers(0, 40), seed=st.integers(0, 2**16),
           dtype=st.sampled_from(["float64", "float32", "int64"]), cuda_aware=st.booleans())
def test_every_collective_stages_through_the_host_unless_mpi_is_cuda_aware(comm, n, seed, dtype, cuda_aware):
    with fake_cupy(cuda_array_interface=cuda_aware) as cupy:
        backend.set_backend("cupy", cuda_aware=cuda_aware)
        for name, call, expected, always_staged in collective_cases(comm, n, seed, dtype):
            x = cupy.asarray(rank_values(seed, comm.rank, n, dtype))
            cupy.copies.clear()
            result = call(x)
            copies = dict(cupy.copies)
            assert isinstance(result, cupy.ndarray), name
            assert numpy.array_equal(result.get(), expected) and result.dtype == expected.dtype, name
            assert copies.get("synchronize", 0) >= 1, (name, copies)  # before MPI reads device memory
            staged = always_staged or not cuda_aware  # one copy out of the device, one back in
            assert copies.get("to_host", 0) == copies.get("to_device", 0) == int(staged), (name, copies)


# ----- multi-rank: whole training runs on the fake device --------------------------------------------


def layouts(size: int) -> list[dict]:
    """Every layout of tiny() on `size` ranks that validate accepts: dp x pp x tp, ZeRO, offload."""
    found = []
    for dp, pp, tp in factorisations(size):
        microbatches = 2 if pp > 1 and (8 // dp) % 2 == 0 else 1
        for extra in ({"zero": 0}, {"zero": 1}, {"zero": 3}, {"offload": "cpu", "device_mem_mb": 0.3}):
            cfg = tiny(dp=dp, pp=pp, tp=tp, microbatches=microbatches, **extra)
            if validate(cfg, size) == []:
                found.append(dict(dp=dp, pp=pp, tp=tp, microbatches=microbatches, **extra))
    return found


@mpi_given(max_examples=6, layout=st.sampled_from(layouts(WORLD.size) or [{}]), cuda_aware=st.booleans(),
           seed=st.integers(0, 2**16))
def test_every_layout_trains_on_the_device_to_the_single_process_numbers(
        comm, cuda_aware_env, layout, cuda_aware, seed):
    cuda_aware_env(cuda_aware)
    cfg = tiny(seed=seed, **layout)
    records, state, fake, trainer = train_on_fake_device(cfg, comm.mpi, gpus=2, cuda_aware=cuda_aware)
    assert fake.state.device_in_use == WORLD.rank % 2  # one node here: node-local rank = world rank
    store = getattr(trainer.engine.updater, "store", None)
    if store is not None:  # the offload tiers: device blocks in device memory, cpu blocks in host memory
        for block in store.blocks.values():
            assert isinstance(block.data, fake.ndarray) == (block.tier == "device"), block.tier
    if comm.rank == 0:
        check = train.compare_with_reference(cfg, records, state)
        assert check["max_rel_loss_deviation"] <= 1e-9 and check["max_rel_weight_deviation"] <= 1e-9, check


def test_a_checkpoint_saved_on_the_device_resumes_on_numpy_and_back(tmp_path):
    cfg = tiny(dp=1, steps=2)
    with fake_cupy():
        train.train(cfg.replace(backend="cupy", save=str(tmp_path / "device")), MPI.COMM_SELF)
    train.train(cfg.replace(save=str(tmp_path / "host")), MPI.COMM_SELF)
    resumed = {}
    for saved_on in ("device", "host"):
        for backend_name in ("numpy", "cupy"):
            with fake_cupy():
                run = cfg.replace(backend=backend_name, resume=str(tmp_path / saved_on), steps=4)
                resumed[saved_on, backend_name] = [r["loss"] for r in train.train(run, MPI.COMM_SELF)]
    losses, _ = train.reference_run(cfg.replace(steps=4))
    assert all(found == losses[2:] for found in resumed.values()), (resumed, losses)
