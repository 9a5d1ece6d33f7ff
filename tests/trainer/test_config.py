"""TrainConfig's fields and the `minipar train` command line generated from them.

The oracle is the command line as it was written by hand before it was generated: every flag, its
default, its choices and its type, typed out below (not read from TrainConfig), so a field renamed,
retyped, re-defaulted or dropped from the command line fails here.
"""

import dataclasses
import re
import subprocess
import sys

import pytest

from minipar.core import backend
from minipar.memory.tracer import budget_mb
from minipar.parallel.schedules import build_schedule
from minipar.precision.formats import Precision
from minipar.trainer.arguments import parse_train_args, train_parser
from minipar.trainer.build import build_optimizer
from minipar.trainer.config import TrainConfig
from minipar.trainer.validate import validate

SWITCH = "store_true"
# flag: (default, choices, type or SWITCH), in the order `--help` lists them (by options object)
FLAGS = {
    "--model": ("gpt", ("gpt", "mlp", "moe"), str),
    "--n-layer": (4, None, int),
    "--n-head": (4, None, int),
    "--d-model": (64, None, int),
    "--seq-len": (32, None, int),
    "--n-experts": (4, None, int),
    "--top-k": (1, None, int),
    "--capacity-factor": (1.0, None, float),
    "--aux-loss-coef": (0.01, None, float),
    "--dp": (None, None, int),
    "--bucket-mb": (0.25, None, float),
    "--no-overlap": (False, None, SWITCH),
    "--tp": (1, None, int),
    "--sp": (False, None, SWITCH),
    "--pp": (1, None, int),
    "--microbatches": (1, None, int),
    "--schedule": ("1f1b", ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"), str),
    "--virtual-stages": (1, None, int),
    "--cp": (1, None, int),
    "--ep": (1, None, int),
    "--zero": (0, (0, 1, 2, 3), int),
    "--fsdp": (False, None, SWITCH),
    "--dp-replicate": (1, None, int),
    "--offload": ("none", ("none", "cpu", "disk"), str),
    "--device-mem-mb": (None, None, budget_mb),  # MiB, or auto
    "--chunk-mb": (None, None, float),
    "--eviction": ("opt", ("lru", "opt"), str),
    "--static-placement": (False, None, SWITCH),
    "--offload-dir": (None, None, str),
    "--recompute": ("none", ("none", "selective", "full"), str),
    "--precision": ("fp32", ("fp64", "fp32", "bf16", "fp16", "fp8"), str),
    "--fp8-recipe": ("delayed", ("delayed", "current", "block"), str),
    "--fp8-block": (128, None, int),
    "--fp8-accumulate": ("fp32", ("fp32", "fp64", "tc13"), str),
    "--fused": (False, None, SWITCH),
    "--optimizer": ("adamw", ("adamw", "sgd"), str),
    "--lr": (1.5e-3, None, float),
    "--weight-decay": (0.0, None, float),
    "--momentum": (0.9, None, float),  # new: it was SGD's hard-coded 0.9
    "--clip-grad-norm": (None, None, float),
    "--backend": (None, ("numpy", "cupy"), str),  # None: $MINIPAR_BACKEND, else numpy
    "--steps": (60, None, int),
    "--batch-size": (16, None, int),
    "--seed": (0, None, int),
    "--log": (None, None, str),
    "--save": (None, None, str),
    "--save-every": (None, None, int),
    "--keep-last": (None, None, int),
    "--save-async": (False, None, SWITCH),
    "--resume": (None, None, str),
    "--allow-changes": (False, None, SWITCH),
    "--collective-timeout": (None, None, float),
    "--check-reference": (False, None, SWITCH),
    "--quiet": (False, None, SWITCH),
    "--trace": (None, None, str),
}
# the help of the flags that had one before the parser was generated, word for word
KEPT_HELP = {
    "--dp": "data-parallel size (default: world / (tp*pp))",
    "--tp": "tensor-parallel size",
    "--zero": "ZeRO stage",
    "--eviction": "offload's eviction policy",
    "--steps": "total steps (a resumed run continues to it)",
    "--batch-size": "global batch (sequences)",
    "--backend": "array backend (default: $MINIPAR_BACKEND if set, else numpy)",
    "--bucket-mb": "DDP gradient bucket size",
    "--fused": "AdamW and GELU through the fusion interpreter",
    "--resume": "checkpoint directory to continue from",
    "--check-reference": "also train on one process (rank 0) and compare: PASS or FAIL (exit 1) over steps "
                         "1..min(20, steps), then the drift",
}


def flag_actions():
    return {a.option_strings[0]: a for a in train_parser()._actions if a.option_strings[0] != "-h"}


def test_the_parser_has_exactly_the_flags_defaults_choices_and_types():
    actions = flag_actions()
    assert list(actions) == list(FLAGS)
    for flag, (default, choices, kind) in FLAGS.items():
        action = actions[flag]
        assert action.default == default and type(action.default) is type(default), flag
        assert (tuple(action.choices) if action.choices is not None else None) == choices, flag
        if kind == SWITCH:
            assert action.nargs == 0 and action.const is True, flag  # a switch: present means True
        else:
            assert action.nargs is None and (action.type or str) is kind, flag


def test_help_lists_the_same_options_and_keeps_their_help():
    text = subprocess.run([sys.executable, "-m", "minipar", "train", "--help"], capture_output=True,
                          text=True, check=True).stdout
    listed = re.findall(r"^  (-[-\w]+)", text, re.MULTILINE)
    assert listed == ["-h", *FLAGS]
    assert "--loss-scaling" not in text  # Python only, as before
    for flag, help in KEPT_HELP.items():
        assert flag_actions()[flag].help == help


def test_every_field_has_help():
    for field in dataclasses.fields(TrainConfig):
        assert len(field.metadata.get("help", "").split()) >= 2, field.name
    assert all(action.help for action in flag_actions().values())


def test_no_arguments_give_the_default_config(monkeypatch):
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    assert parse_train_args([]) == TrainConfig()


def test_command_lines_parse_to_the_expected_config(monkeypatch):
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    cfg = parse_train_args(["--optimizer", "sgd", "--momentum", "0.5", "--zero", "2", "--dp", "2", "--fused",
                            "--chunk-mb", "1.5", "--log", "run.jsonl", "--n-layer", "3", "--lr", "1e-2"])
    assert cfg == TrainConfig(optimizer="sgd", momentum=0.5, zero=2, dp=2, fused=True, chunk_mb=1.5,
                              log="run.jsonl", n_layer=3, lr=0.01)
    assert type(cfg.dp) is int and type(cfg.chunk_mb) is float and type(cfg.momentum) is float
    cfg = parse_train_args(["--model", "mlp", "--precision", "fp64", "--device-mem-mb", "8", "--quiet",
                            "--check-reference", "--schedule", "gpipe", "--offload", "cpu"])
    assert cfg == TrainConfig(model="mlp", precision="fp64", device_mem_mb=8.0, quiet=True,
                              check_reference=True, schedule="gpipe", offload="cpu")


def test_backend_falls_back_to_the_environment_and_the_flag_wins(monkeypatch, capsys):
    monkeypatch.setenv(backend.BACKEND_ENV, "cupy")
    assert parse_train_args([]).backend == "cupy"
    assert parse_train_args(["--backend", "numpy"]).backend == "numpy"
    monkeypatch.setenv(backend.BACKEND_ENV, "tpu")
    with pytest.raises(SystemExit) as exit_request:
        parse_train_args([])
    assert exit_request.value.code == 2
    err = capsys.readouterr().err
    assert err == "minipar train: error: MINIPAR_BACKEND='tpu' is not one of numpy, cupy\n"


@pytest.mark.parametrize("argv, names", [
    (["--bogus"], "--bogus"),
    (["--loss-scaling"], "--loss-scaling"),  # a field with no flag
    (["--zero", "4"], "--zero"),
    (["--schedule", "zigzag"], "zigzag"),
    (["--dp", "two"], "--dp"),
    (["--fused", "yes"], "yes"),  # a switch takes no value
])
def test_bad_flags_exit_2_with_one_line(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_request:
        parse_train_args(argv)
    assert exit_request.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("minipar train: error: ") and err.count("\n") == 1 and names in err, err


@pytest.mark.parametrize("changes, message", [
    ({"zero": 4}, "--zero must be 0, 1, 2 or 3, got 4"),
    ({"schedule": "zigzag"},
     "--schedule must be one of naive, gpipe, 1f1b, interleaved, zb-h1, zb-v, dualpipev, got 'zigzag'"),
    ({"offload": "gpu"}, "--offload must be one of none, cpu, disk, got 'gpu'"),
    ({"optimizer": "adam"}, "--optimizer must be one of adamw, sgd, got 'adam'"),
    ({"eviction": "fifo"}, "--eviction must be one of lru, opt, got 'fifo'"),
    ({"momentum": 1.0}, "--momentum must be at least 0 and below 1, got 1.0"),
    ({"momentum": -0.1}, "--momentum must be at least 0 and below 1, got -0.1"),
])
def test_validate_refuses_what_the_parser_would(changes, message):
    """Configurations built in Python skip argparse: validate checks the same choices, in one line."""
    assert validate(TrainConfig(**changes, dp=1), 1) == [message]


@pytest.mark.parametrize("changes, world, message", [
    ({"fsdp": True, "zero": 3, "dp": 2}, 2,
     "--fsdp with --zero 3: both shard the model states over dp; choose one"),
    ({"dp_replicate": 2, "dp": 2}, 2, "--dp-replicate 2 needs --fsdp (hybrid sharding shards with FSDP)"),
    ({"fsdp": True, "dp_replicate": 3, "dp": 4}, 4, "--dp-replicate 3 does not divide --dp 4"),
    ({"fsdp": True, "dp_replicate": 0, "dp": 2}, 2, "--dp-replicate must be at least 1, got 0"),
    ({"fsdp": True, "precision": "fp8", "dp": 2}, 2,
     "--fsdp with --precision fp8 is not built: it runs in fp64, fp32, bf16 or fp16"),
    *[(dict(fsdp=True, dp=2, **chunks), 2, "--fsdp with --offload, --chunk-mb or --device-mem-mb is not "
       "built: FSDP gathers a module's parameters, not chunks of them; use --zero 3 with those")
      for chunks in ({"offload": "cpu", "device_mem_mb": "auto"}, {"chunk_mb": 0.01},
                     {"device_mem_mb": "auto"})],
    ({"fsdp": True, "model": "moe", "ep": 2, "dp": 2}, 2,
     "--fsdp with --ep 2 is not built: the experts' parameters are split over ep, and FSDP shards every "
     "parameter over all of dp; use --zero 1, 2 or 3 with --ep"),
])
def test_fsdp_combinations_are_refused_in_one_line(changes, world, message):
    assert validate(TrainConfig(**changes), world) == [message]


def test_every_choice_is_one_its_technique_runs():
    choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(TrainConfig)}
    for name in choices["schedule"]:
        build_schedule(name, 2, 4, 2 if name == "interleaved" else 1)  # interleaved V >= 2, dualpipev M >= 2K
    for name in choices["precision"]:
        Precision.from_name(name)
    for name in choices["backend"]:
        assert not (backend.unavailable(name) or "").startswith("unknown backend"), name
    assert validate(TrainConfig(momentum=0.0, optimizer="sgd", dp=1), 1) == []


def test_momentum_reaches_sgd():
    assert build_optimizer(TrainConfig(optimizer="sgd", momentum=0.5), []).momentum == 0.5
    assert build_optimizer(TrainConfig(optimizer="sgd"), []).momentum == 0.9


def test_the_formulas_and_the_chunk_checks_import_nothing_of_the_trainer_above_them():
    code = ("import sys; import minipar.memory.planner, minipar.parallel.schedules; "
            "assert not [m for m in sys.modules if m.startswith('minipar.trainer')], sys.modules.keys(); "
            "from minipar.parallel import zero_chunked; from minipar.core.nn import MLPNet, MLPConfig; "
            "from minipar.core.optim import AdamW; "
            "options = zero_chunked.ChunkedOptions(chunk_mb=0.001, device_mem_mb=0.01); "
            "model = MLPNet(MLPConfig(d_hidden=8, n_layer=2), seed=0); "
            "print(zero_chunked.config_errors(options), "
            "zero_chunked.size_errors(options, 1, model, AdamW([]))); "
            "assert not [m for m in sys.modules if m.startswith('minipar.trainer')]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("[] [") and "too small" in done.stdout  # the checks ran, on real sizes


# What the single-process reference of --check-reference changes, written out by hand: the layout
# (every parallel degree and what it shards or offloads) and this run's files and output.
SINGLE_PROCESS = {"dp": 1, "tp": 1, "pp": 1, "zero": 0, "microbatches": 1, "offload": "none",
                  "chunk_mb": None, "device_mem_mb": None, "log": None, "save": None, "resume": None,
                  "quiet": True, "check_reference": False}


def test_the_single_process_reference_resets_the_layout_and_keeps_the_training():
    run = TrainConfig(model="gpt", dp=2, tp=2, pp=2, zero=1, microbatches=4, schedule="gpipe",
                      precision="fp64", offload="cpu", chunk_mb=0.5, device_mem_mb=3.0, steps=7,
                      batch_size=8, seq_len=16, lr=1e-3, weight_decay=0.1, optimizer="sgd", momentum=0.5,
                      seed=3, n_layer=2, n_head=2, d_model=32, bucket_mb=0.5, fused=True, log="run.jsonl",
                      save="ckpt", resume="old", check_reference=True, quiet=False)
    reference = run.single_process()
    for field in dataclasses.fields(TrainConfig):
        expected = SINGLE_PROCESS.get(field.name, getattr(run, field.name))
        assert getattr(reference, field.name) == expected, field.name


def test_dp_left_out_is_what_the_world_leaves_after_tp_pp_and_cp():
    assert TrainConfig().resolved(8).dp == 8
    assert TrainConfig(cp=2).resolved(8).dp == 4
    assert TrainConfig(tp=2, pp=2, cp=2).resolved(8).dp == 1
    assert TrainConfig(dp=2, cp=2).resolved(8).dp == 2  # given: kept (validate then names the mismatch)


def test_micro_batches_cut_each_replicas_share_of_the_batch():
    # 12 sequences over dp 4: 3 per replica, which 2 micro-batches cannot cut (12 itself could be)
    assert validate(TrainConfig(batch_size=12, dp=4, microbatches=2), 4) == [
        "the per-replica batch 3 is not divisible by --microbatches 2"]
    assert validate(TrainConfig(batch_size=12, dp=4, microbatches=3), 4) == []
