"""`minipar train`, `minipar plan` and `minipar schedule`: each command's main(argv) -> exit code.

memory/planner.py holds ZeRO's memory formulas and parallel/schedules.py the schedules as data; this
module parses a command's options, checks them (one line and exit code 2 on a mistake, like every
minipar command) and prints the table, chart or JSON. Lessons: 04_zero.md, 06_pipeline.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
from fractions import Fraction

from minipar.checkpoint import sharded as checkpoint
from minipar.memory import planner
from minipar.memory.tracer import BudgetTooSmall
from minipar.parallel import schedules
from minipar.trainer.arguments import OneLineParser, fail, parse_train_args
from minipar.trainer.simulate_command import simulate_main  # noqa: F401  (minipar simulate)
from minipar.trainer.validate import validate

# ---- minipar train ----------------------------------------------------------------------------------


def train_main(argv: list[str]) -> int:
    """Parse and validate on every rank, combine the verdicts (the one collective before them), train.

    The start-up is watched (distributed/watchdog.py) like every collective after it: a rank stuck
    while it validates its input or loads the checkpoint (a file system that stopped answering) leaves
    the others waiting in the verdicts' allgather or the barrier after the load, and the watchdog ends
    them within the collective timeout with one line naming that step, not a hang."""
    from mpi4py import MPI

    from minipar.distributed.watchdog import WATCHDOG

    world = MPI.COMM_WORLD
    WATCHDOG.catch_interrupts()  # Ctrl-C reaches a rank blocked in MPI too (distributed/watchdog.py)
    try:
        return _train(argv, world)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: one line each, the shell's code for SIGINT
        return interrupted(world.Get_rank())


def _train(argv: list[str], world) -> int:
    from minipar.distributed.communicator import wait_for_everyone
    from minipar.distributed.faults import install_excepthook
    from minipar.distributed.watchdog import set_collective_timeout, watching
    from minipar.trainer import loop as train

    cfg, usage = _parse(argv)
    if cfg is not None and cfg.collective_timeout is not None and cfg.collective_timeout > 0:
        set_collective_timeout(cfg.collective_timeout)  # a bad value is refused by validate, below
    ranks = list(range(world.Get_size()))
    with watching(STARTUP_CHECK, "world", ranks, world.Get_rank()):
        errors, code = _own_verdict(argv, world.Get_size(), world.Get_rank(), (cfg, usage))[1:]
        verdicts = world.allgather(errors)  # ranks may disagree (their environment, their files): all learn
    failed = [(rank, message) for rank, message in enumerate(verdicts) if message]
    if failed or code is not None:
        if failed and not errors:
            rank, message = failed[0]
            return fail("minipar train", f"{message} (on rank {rank})")
        return fail("minipar train", errors) if errors else int(code or 0)
    install_excepthook()
    try:
        train.train(cfg.resolved(world.Get_size()))
        stopped = None
    except train.RunStopped as reason:  # every rank at one step, or rank 0 alone at the end
        stopped = str(reason)
    except BudgetTooSmall as refusal:  # every rank reached it together, after the warm-up step
        return fail("minipar train", str(refusal))
    wait_for_everyone(world)  # e.g. while rank 0 alone runs --check-reference
    if stopped is None:
        return 0
    if world.Get_rank() == 0:  # one line: not a mistake in the input, so exit 1, not 2
        fail("minipar train", stopped)
    return 1


# What the watchdog's line names when a rank never reaches the verdicts' allgather.
STARTUP_CHECK = "the start-up check (every rank validates its input, then allgather of the verdicts)"


def _parse(argv: list[str]):
    """(config or None, the exit code of a usage error or --help or None): the parse alone, which
    cannot block, so that the start-up check runs under the run's own --collective-timeout."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parse_train_args(argv), None
    except SystemExit as exit_request:
        message = captured.getvalue().strip().removeprefix("minipar train: error: ")
        return None, (exit_request.code, message)


def _own_verdict(argv: list[str], world_size: int, rank: int, parsed=None):
    """(config, "" or this rank's one-line errors, None or the exit code of --help) without a
    collective. A usage error is captured rather than printed, so the verdicts can be combined.
    `parsed`: what _parse(argv) returned, where the caller has it."""
    from minipar.distributed.faults import inject_fault

    cfg, usage = parsed or _parse(argv)
    if cfg is None:
        code, message = usage
        return None, message if code else "", code
    inject_fault(rank, "while validating its input", startup="validate")  # tests: a rank stuck here
    errors = validate(cfg, world_size)
    if not errors and rank == 0 and cfg.save is not None:
        errors = checkpoint.lock_problems(cfg.save)  # held by rank 0 until this process ends
    return cfg, "; ".join(errors), None


def interrupted(rank: int) -> int:
    from minipar.distributed.watchdog import WATCHDOG

    WATCHDOG.say_interrupted(rank)  # once: a finalizer failing as the rank unwinds ends it with the same line
    return 130


# ---- minipar plan ------------------------------------------------------------------------------------


def _json_number(value: Fraction) -> int | float:
    return value.numerator if value.denominator == 1 else float(value)


def _format_bytes(value: Fraction) -> str:
    return f"{_json_number(value):,}" if value.denominator == 1 else f"{float(value):,.1f}"


def _parse_plan(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="minipar plan", description="ZeRO model-state memory per device.")
    parser.add_argument("--params", type=float, required=True, help="model parameters Ψ, e.g. 7.5e9")
    parser.add_argument("--dp", type=int, required=True, help="data-parallel degree N")
    parser.add_argument("--k", type=int, default=12, help="optimizer-state bytes per parameter (12)")
    parser.add_argument("--param-bytes", type=int, default=2, help="bytes per parameter (2, fp16)")
    parser.add_argument("--grad-bytes", type=int, default=2, help="bytes per gradient (2, fp16)")
    parser.add_argument("--mp", type=int, default=1, help="model-parallel degree splitting the model first")
    parser.add_argument("--device-gb", type=float, help="also: the largest model that fits in this many GB")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    if not (args.params > 0 and args.params.is_integer()):
        parser.error(f"--params must be a positive whole number of parameters, got {args.params:g}")
    args.params = int(args.params)
    for name, least in (("dp", 1), ("mp", 1), ("param_bytes", 1), ("grad_bytes", 1), ("k", 0)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")
    if args.device_gb is not None and not (0 < args.device_gb < math.inf):
        parser.error(f"--device-gb must be a positive number, got {args.device_gb:g}")
    return args


def _table(args: argparse.Namespace, sizes: dict[int, Fraction], fits: dict[int, int] | None) -> str:
    lines = [
        f"ZeRO-DP model states per device: Ψ = {args.params:,} parameters, N = {args.dp} data-parallel "
        f"ranks, K = {args.k}, {args.param_bytes}-byte parameters, {args.grad_bytes}-byte gradients",
    ]
    if args.mp > 1:
        lines.append(f"model parallel over {args.mp} devices first: every figure is divided by {args.mp}")
    width = max(len(_format_bytes(size)) for size in sizes.values())
    header = f"{'stage':<6} {'partitioned':<19} {'per device':>10} {'bytes':>{width}}  {'formula':<20}"
    if fits is not None:
        header += f"  largest Ψ in {args.device_gb:g} GB"
    lines.append(header.rstrip())
    for stage in planner.STAGES:
        row = (f"{stage:<6} {planner.PARTITIONED[stage]:<19} {planner.format_size(sizes[stage]):>10} "
               f"{_format_bytes(sizes[stage]):>{width}}  "
               f"{planner.formula(stage, args.param_bytes, args.grad_bytes):<20}")
        if fits is not None:
            row += f"  {planner.format_count(fits[stage])}"
        lines.append(row.rstrip())
    lines.append("(GB = 1e9 bytes, MB = 1e6, kB = 1e3; activations and temporary buffers not included)")
    return "\n".join(lines)


def plan_main(argv: list[str]) -> int:
    """The `minipar plan` command: model-state bytes per device for ZeRO stages 0-3."""
    try:
        args = _parse_plan(argv)
    except SystemExit as exit_request:  # a one-line usage error (2), or --help (0)
        return int(exit_request.code or 0)
    sizes_of = {"param_bytes": args.param_bytes, "grad_bytes": args.grad_bytes, "mp": args.mp}
    sizes = planner.bytes_per_device(args.params, args.dp, args.k, **sizes_of)
    fits = None
    if args.device_gb is not None:
        device_bytes = Fraction(repr(args.device_gb)) * 10**9  # the decimal typed, exactly
        fits = {stage: planner.max_params(device_bytes, args.dp, stage, args.k, **sizes_of)
                for stage in planner.STAGES}
    if not args.json:
        print(_table(args, sizes, fits))
        return 0
    report = {"params": args.params, "dp": args.dp, "k": args.k, **sizes_of,
              "bytes_per_device": {str(stage): _json_number(sizes[stage]) for stage in planner.STAGES}}
    if fits is not None:
        report["device_gb"] = args.device_gb
        report["max_params"] = {str(stage): fits[stage] for stage in planner.STAGES}
    print(json.dumps(report))
    return 0


# ---- minipar schedule --------------------------------------------------------------------------------


def _time_units(text: str) -> Fraction:
    """A cost in time units: a positive integer, decimal or fraction ("2", "1.5", "3/2")."""
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"invalid number of time units: {text!r}") from None
    if value <= 0 or value.denominator > 100 or value > MAX_COST:
        raise argparse.ArgumentTypeError(f"must be positive, at most {MAX_COST}, with a denominator of at "
                                         f"most 100, got {text}")
    return value


MAX_COST = 1000  # time units of a backward or weight gradient, the forward's 1: the chart's width


def _parse_schedule(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="minipar schedule", description="Draw a pipeline schedule.")
    parser.add_argument("--stages", type=int, required=True, help="pipeline stages K (ranks)")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches M per batch")
    parser.add_argument("--schedule", choices=list(schedules.SCHEDULES), required=True)
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="chunks V per rank (interleaved only; at least 2 there)")
    parser.add_argument("--backward-cost", type=_time_units, default=Fraction(1),
                        help="time units of a stage's backward (zb-h1, zb-v: of B, the input gradient); "
                             "forward: 1")
    parser.add_argument("--weight-cost", type=_time_units, default=None,
                        help="time units of a stage's weight gradient W (zb-h1, zb-v, dualpipev; default 1)")
    parser.add_argument("--overlap-cost", type=_time_units, default=None,
                        help="time units of a stage's F&B step (dualpipev only; default F + B + W)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the chart")
    args = parser.parse_args(argv)
    for name in ("stages", "microbatches", "virtual_stages"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} must be at least 1, got {getattr(args, name)}")
    if args.weight_cost is not None and args.schedule not in schedules.SPLIT_BACKWARD:
        parser.error(f"--weight-cost needs --schedule zb-h1, zb-v or dualpipev "
                     f"(the {args.schedule} backward is one step)")
    if args.overlap_cost is not None and args.schedule != "dualpipev":
        parser.error("--overlap-cost needs --schedule dualpipev (the only schedule with F&B steps)")
    if args.schedule == "dualpipev" and args.microbatches < 2 * args.stages:
        parser.error(f"--schedule dualpipev needs --microbatches >= 2 x --stages = {2 * args.stages}")
    if args.schedule in schedules.V_SHAPED and args.stages < 2:
        parser.error(f"--schedule {args.schedule} needs --stages of at least 2 (two chunks a rank, as a V)")
    if args.schedule == "interleaved" and args.virtual_stages < 2:
        parser.error("--schedule interleaved needs --virtual-stages of at least 2")
    if args.schedule != "interleaved" and args.virtual_stages != 1:
        parser.error(f"--virtual-stages {args.virtual_stages} needs --schedule interleaved")
    if args.schedule == "interleaved" and args.microbatches % args.stages:
        parser.error(f"--schedule interleaved needs --microbatches {args.microbatches} to be a "
                     f"multiple of --stages {args.stages}")
    args.weight_cost = Fraction(1) if args.weight_cost is None else args.weight_cost
    for error in schedules.size_errors(args.stages, args.microbatches,
                                       schedules.chunks_of(args.schedule, args.virtual_stages)):
        parser.error(error)
    return args


def schedule_main(argv: list[str]) -> int:
    """The `minipar schedule` command: chart (or JSON), bubble fraction and peak in-flight per stage."""
    try:
        args = _parse_schedule(argv)
    except SystemExit as exit_request:  # a one-line usage error (2), or --help (0)
        return int(exit_request.code or 0)
    schedule = schedules.build_schedule(args.schedule, args.stages, args.microbatches, args.virtual_stages)
    placement = schedules.placement_of(args.schedule)
    try:
        timeline = schedules.simulate(schedule, backward_cost=args.backward_cost,
                                      weight_cost=args.weight_cost, placement=placement,
                                      overlap_cost=args.overlap_cost)
    except schedules.TimelineTooLarge as why:
        return fail("minipar schedule", str(why))
    bubble = schedules.bubble_fraction(timeline)
    peaks = schedules.peak_inflight(schedule)
    microbatches = schedules.check_schedule(schedule)  # naive runs 1, whatever was asked
    split = schedules.splits_backward(schedule)
    if args.json:
        report = {
            "schedule": args.schedule,
            "stages": args.stages,
            "microbatches": microbatches,
            "virtual_stages": schedules.chunks_of(args.schedule, args.virtual_stages),
            "placement": placement,
            "forward_cost": 1,
            "backward_cost": _json_number(args.backward_cost),
            **({"weight_cost": _json_number(args.weight_cost)} if split else {}),
            # a stage's F&B step, as simulate priced it: --overlap-cost, or F + B + W (no gain)
            **({"overlap_cost": _json_number(schedules.action_costs(
                1, args.backward_cost, args.weight_cost, overlap_cost=args.overlap_cost)["F&B"])}
               if args.schedule == "dualpipev" else {}),
            "makespan": _json_number(timeline.makespan),
            "slot": _json_number(timeline.slot),
            "bubble_fraction": float(bubble),
            "bubble_fraction_exact": str(bubble),
            "peak_inflight": peaks,
            "p2p_messages": schedules.p2p_messages(schedule, placement),
            "timeline": [[None if cell is None else str(cell) for cell in row] for row in timeline.grid],
        }
        print(json.dumps(report))
        return 0
    costs = f"forward 1 time unit, backward {args.backward_cost}"
    if split:
        costs = (f"forward 1 time unit, input gradient B {args.backward_cost}, "
                 f"weight gradient W {args.weight_cost}")
    chunks = f", chunks per rank V={args.virtual_stages}" if args.virtual_stages > 1 else ""
    if placement == "v":
        chunks = ", 2 chunks per rank as a V (rank s: virtual stages s and 2K-1-s)"
    print(f"{args.schedule} schedule: stages K={args.stages}, micro-batches M={microbatches}{chunks}, "
          f"{costs}")
    if args.schedule == "naive":
        print("(naive runs the whole batch as one micro-batch; --microbatches is ignored)")
    if timeline.slot != 1:
        print(f"(one column = {timeline.slot} time unit)")
    print(schedules.render(timeline))
    print(f"bubble fraction: {bubble} = {float(bubble):.3f} (idle slots / all slots)")
    what = "(micro-batch, chunk) pairs" if schedules.virtual_stages_of(schedule) > 1 else "micro-batches"
    print(f"peak in-flight {what}: " + ", ".join(f"stage {s}: {p}" for s, p in enumerate(peaks)))
    print(f"point-to-point messages per step: {schedules.p2p_messages(schedule, placement)}")
    return 0
