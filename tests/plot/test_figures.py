"""`python -m minipar plot`: the data behind each figure against its formula, and the command on tiny
inputs writing non-empty PNGs (serial; the measured runs themselves are `make figures`)."""

import importlib
import json
from fractions import Fraction

import numpy as np
import pytest

from minipar.parallel.pipeline import bubble_formula
from minipar.parallel.schedules import bubble_fraction, build_schedule, simulate
from minipar_lab.plot import allreduce, bubble, gantt, loss, offload, registry, roofline, zero


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_simulated_bubble_is_gpipes_formula(schedule, stages):
    microbatches = list(range(1, 9))
    expected = [Fraction(stages - 1, m + stages - 1) for m in microbatches]
    assert bubble.simulated(schedule, stages, microbatches) == expected
    assert [bubble_formula(stages, m) for m in microbatches] == expected  # the line the figure draws


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_alpha_beta_fit_recovers_alpha_and_beta_from_exact_times(ranks):
    alpha, beta = 7.5e-6, 3.2e9  # 7.5 µs a step, 3.2 GB/s
    sizes = np.array(allreduce.SIZES, dtype=float)
    seconds = 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * sizes / beta  # the ring's cost, by hand
    fitted = allreduce.fit_alpha_beta(sizes, seconds, ranks)
    assert fitted == pytest.approx((alpha, beta), rel=1e-9)
    noisy = seconds * np.where(np.arange(len(sizes)) % 2, 1.02, 0.98)  # ±2%: the fit stays within a few %
    assert allreduce.fit_alpha_beta(sizes, noisy, ranks) == pytest.approx((alpha, beta), rel=0.05)


def test_simulated_bars_are_the_timeline_of_gpipe_written_out():
    """GPipe's figure 2 with K = 2, M = 2: the backwards in reverse, as each stage's list has them."""
    timeline = simulate(build_schedule("gpipe", 2, 2), forward_cost=1, backward_cost=2)
    assert gantt.simulated_bars(timeline) == [
        (0, "F0", 0.0, 1.0), (0, "F1", 1.0, 2.0), (0, "B1", 5.0, 7.0), (0, "B0", 7.0, 9.0),
        (1, "F0", 1.0, 2.0), (1, "F1", 2.0, 3.0), (1, "B1", 3.0, 5.0), (1, "B0", 5.0, 7.0)]
    busy = sum(stop - start for *_, start, stop in gantt.simulated_bars(timeline))
    assert 1 - busy / (2 * 9.0) == pytest.approx(1 / 3) == bubble_fraction(timeline)  # (K-1)/(M+K-1)


def test_measured_bars_read_the_pipeline_record():
    timing = {"stage_action_times_s": [[["F0", 0.0, 0.25], ["B0", 0.5, 1.0]], [["F0", 0.25, 0.5]]]}
    bars = gantt.measured_bars(timing)
    assert bars == [(0, "F0", 0.0, 0.25), (0, "B0", 0.5, 1.0), (1, "F0", 0.25, 0.5)]


def test_zero_lines_are_the_papers_formulas():
    psi, p, g, k = 1000, 8, 8, 16
    lines = zero.formula_bytes(psi, [1, 2, 4])
    for i, n in enumerate([1, 2, 4]):
        assert lines[0][i] == (p + g + k) * psi
        assert lines[1][i] == (p + g) * psi + Fraction(k * psi, n)
        assert lines[2][i] == p * psi + Fraction((g + k) * psi, n)
        assert lines[3][i] == Fraction((p + g + k) * psi, n)
    assert zero.model_states({"params": 1, "grads": 20, "optimizer": 300, "activations_peak": 4000}) == 321


def test_offload_curves_are_one_tiers_rows_by_budget():
    mib = 2**20
    rows = [{"tier": "cpu", "budget_mb": 4.0, "eviction": "lru", "moved_bytes": 3 * mib},
            {"tier": "disk", "budget_mb": 2.0, "eviction": "lru", "moved_bytes": 9 * mib},
            {"tier": "cpu", "budget_mb": 2.0, "eviction": "opt", "moved_bytes": 4 * mib},
            {"tier": "cpu", "budget_mb": 2.0, "eviction": "lru", "moved_bytes": 5 * mib}]
    assert offload.moved_by_policy(rows) == {"lru": ([2.0, 4.0], [5.0, 3.0]), "opt": ([2.0], [4.0])}


def test_roofline_is_the_lower_of_its_two_roofs():
    assert list(roofline.attainable([0.1, 1.0, 10.0], compute_roof=2e9, bandwidth=4e9)) == [4e8, 2e9, 2e9]
    rows = {"floor": {"seconds": 0.5}, "copy": {"seconds": 0.25},
            "eager": {"seconds": 2.0, "bytes_moved": 64}, "fused": {"seconds": 1.0, "bytes_moved": 16}}
    assert roofline.roofs(rows, size=4) == (8 * 4 / 0.5, 3 * 4 * 4 / 0.25)  # 8 ops a value; 12 B a value
    assert roofline.points(rows, size=4) == {"eager": (0.5, 16.0), "fused": (2.0, 32.0)}


def test_curves_take_accuracy_only_where_every_record_has_it():
    plain = [{"step": 0, "loss": 2.0}, {"step": 1, "loss": None}]
    series = loss.curves(plain)
    assert series["step"] == [0, 1] and series["loss"][0] == 2.0 and np.isnan(series["loss"][1])
    assert "accuracy" not in series
    assert loss.curves([{"step": 0, "loss": 1.0, "accuracy": 0.5}])["accuracy"] == [0.5]


def test_curves_of_a_log_written_under_launch_skip_restarts_and_take_the_later_record_of_a_step():
    """`minipar launch` appends {"event": "restart", ...} and the relaunched run logs the steps after its
    checkpoint again (elastic.py): one line, the step's later loss."""
    first = [{"step": s, "loss": 10.0 - s} for s in range(7)]  # killed after step 6
    restart = {"event": "restart", "attempt": 1, "from_step": 5, "world_size": 4, "cause": "killed"}
    again = [{"step": s, "loss": 100.0 - s} for s in range(5, 9)]  # resumed at step 5
    series = loss.curves([*first, restart, *again])
    assert series["step"] == list(range(9))
    assert series["loss"] == [10.0, 9.0, 8.0, 7.0, 6.0, 95.0, 94.0, 93.0, 92.0]


def write_log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_command_draws_each_figure_from_saved_inputs(tmp_path):
    log = write_log(tmp_path / "run.jsonl", [
        {"step": s, "loss": 2.0 - s / 10, "accuracy": s / 10,
         "pipeline": {"stages": 2, "microbatches": 2, "bubble_measured": 0.4, "stage_action_times_s": [
             [["F0", 0.0, 1.0], ["F1", 1.0, 2.0], ["B1", 4.0, 6.0], ["B0", 6.0, 8.0]],
             [["F0", 1.0, 2.0], ["F1", 2.0, 3.0], ["B1", 3.0, 5.0], ["B0", 5.0, 7.0]]]}} for s in range(3)])
    pp = tmp_path / "pp.json"
    pp.write_text(json.dumps({"stages": 2, "rows": [
        {"schedule": "1f1b", "microbatches": m, "bubble_measured": 1 / (m + 1)} for m in (1, 2, 4)]}))
    ring = tmp_path / "allreduce.json"
    ring.write_text(json.dumps({"ranks": 2, "sizes": allreduce.SIZES,
                                "seconds": [1e-5 + n / 1e9 for n in allreduce.SIZES]}))
    memory = tmp_path / "memory.json"
    memory.write_text(json.dumps({"offload": [
        {"tier": "cpu", "budget_mb": b, "eviction": e, "moved_bytes": int(2**20 * (10 - b)),
         "states_over_budget": 13 / b} for b in (2.0, 4.0) for e in ("lru", "opt")]}))
    out = tmp_path / "figures"
    for argv in (["loss", "--log", str(log)], ["gantt", "--log", str(log)],
                 ["bubble", "--bench-json", str(pp)], ["allreduce", "--json", str(ring)],
                 ["offload", "--bench-json", str(memory)],
                 ["roofline", "--size", "4096", "--repeats", "1"], ["simulate"]):
        assert registry.main([*argv, "--out", str(out)]) == 0
        png = out / importlib.import_module(f"minipar_lab.plot.{argv[0]}").FILE
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert registry.main(["nothing"]) == 2
    assert registry.main(["loss", "--log", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors == ["minipar plot: error: choose one of " + ", ".join(registry.FIGURES) + ", all",
                      f"minipar plot loss: error: no log file {tmp_path / 'missing.jsonl'}"]
    with pytest.raises(SystemExit) as stop:
        registry.main(["bubble", "--schedule", "zb-h1"])
    assert stop.value.code == 2


def test_a_figure_that_wrote_no_file_is_an_error_not_a_success(tmp_path, capsys, monkeypatch):
    """A figure whose drawing returns without writing its PNG (here a benchmark's save_plot that only
    prints, as the benches' did before they drew through bench/canvas.py) is an error: the command must not
    then print the PNG's name as drawn."""
    from minipar_lab.plot import trace

    monkeypatch.setattr(trace.tracer, "save_plot", lambda path, data: "(no plot: matplotlib missing)")
    monkeypatch.setattr(trace.tracer, "measure_trace", lambda: {})
    assert registry.main(["trace", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"minipar plot trace: error: no {tmp_path / trace.FILE} was written "
        "(is matplotlib installed? pip install -e '.[viz]')"]


@pytest.mark.parametrize("name", registry.FIGURES)
def test_without_matplotlib_every_figure_stops_with_one_line_before_it_computes(name, tmp_path, capsys,
                                                                               monkeypatch, no_matplotlib):
    """plot loss trains 60 steps, plot trace measures a run: a missing matplotlib must stop them before."""
    module = importlib.import_module(f"minipar_lab.plot.{name}")
    monkeypatch.setattr(module, "draw", lambda args, path: pytest.fail(f"plot {name} computed its figure"))
    assert registry.main([name, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"minipar plot {name}: error: matplotlib is not installed: "
                                       "pip install -e '.[viz]'\n")


@pytest.mark.parametrize("name", registry.FIGURES)
def test_every_figure_is_a_file_with_its_png_name_and_a_docstring(name):
    module = importlib.import_module(f"minipar_lab.plot.{name}")
    assert module.FILE.endswith(".png") and "Lesson: lessons/" in module.__doc__


@pytest.mark.parametrize("schedule,microbatches,virtual", [
    ("gpipe", 3, 1), ("1f1b", 4, 1), ("zb-h1", 3, 1), ("interleaved", 4, 2), ("naive", 1, 1),
    ("zb-v", 4, 2), ("dualpipev", 4, 2)])
def test_the_schedule_is_read_off_the_measured_actions(schedule, microbatches, virtual):
    table = build_schedule(schedule, 2, microbatches, virtual if schedule == "interleaved" else 1)
    # the runner times an F&B step ("F3.0&BW1.1") as its two parts
    timing = {"stages": 2, "microbatches": microbatches,
              "stage_action_times_s": [[[label, 0.0, 0.0] for a in actions for label in str(a).split("&")]
                                       for actions in table]}
    assert gantt.schedule_of(timing) == (schedule, virtual)
    if schedule == "dualpipev":  # with MoE and ep the two parts take turns: each timed in stretches
        interleaved = [[[label, 0.0, 0.0] for a in actions
                        for label in (str(a).split("&") * 2 if a.backward is not None else [str(a)])]
                       for actions in table]
        assert gantt.schedule_of({**timing, "stage_action_times_s": interleaved}) == (schedule, virtual)
    timing["stage_action_times_s"][0].reverse()
    with pytest.raises(ValueError, match="no schedule"):
        gantt.schedule_of(timing)


def test_a_v_pipeline_gets_a_unit_for_each_of_its_2k_chunks():
    args = gantt.pipeline_args(4, "zb-v", 8)  # a GPT of 6 blocks: 8 units for 8 chunks
    assert args[args.index("--n-layer") + 1] == "6"
    with pytest.raises(ValueError, match="--schedule dualpipev needs --microbatches >= 2 x --pp = 8"):
        gantt.pipeline_args(4, "dualpipev", 4)


def test_a_pipeline_the_trainer_refuses_is_refused_before_any_run():
    with pytest.raises(ValueError, match="at least 2"):
        gantt.pipeline_args(1, "1f1b", 4)
    with pytest.raises(ValueError):
        gantt.pipeline_args(2, "1f1b", 5)  # 5 micro-batches do not divide the batch of 32


@pytest.mark.parametrize("line", [
    "3",  # a bare number
    '{"step": 0, "loss": {"value": 1.0}}',  # a dict as the loss
    '{"step": 0, "loss": "abc"}',  # a string would be drawn as a category: a meaningless chart
    '{"step": "zero", "loss": 1.0}',
    '{"step": 0, "loss": true}',
    '{"step": 0, "loss": 1.0, "accuracy": "high"}',
    "[1, 2]",
])
def test_a_malformed_log_line_is_one_line_and_exit_code_2(tmp_path, capsys, line):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0, "loss": 2.0}\n' + line + "\n")
    assert registry.main(["loss", "--log", str(log), "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("minipar plot loss: error: not a `minipar train --log` file: record 2 ")
    assert captured.err.count("\n") == 1 and not (tmp_path / loss.FILE).exists()


def test_an_out_that_cannot_be_made_is_refused_before_the_figure_is_computed(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setattr(loss, "draw", lambda args, path: pytest.fail("computed before --out was checked"))
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        assert registry.main(["loss", "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(f"minipar plot loss: error: --out {out}: cannot make the folder (")
        assert captured.err.count("\n") == 1
