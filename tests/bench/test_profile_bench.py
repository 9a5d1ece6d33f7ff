"""`bench profile` splits one step of the default GPT into phases and operations. Its call counts are
checked against the architecture counted by hand; its times are not asserted (appendix 01b quotes a run)."""

import json
import subprocess
import sys

import pytest

from minipar.core import nn
from minipar_lab.bench import profile


def test_the_profile_counts_each_operation_as_the_default_gpt_has_it(capsys):
    assert profile.main(["--repeats", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    layers = nn.GPTConfig().n_layer
    calls = r["op_calls_per_step"]
    # a block: query, key, value, attention projection, fc, mlp projection; then the lm head
    assert calls["Linear.forward"] == calls["Linear.backward"] == 6 * layers + 1
    assert calls["GELU.forward"] == calls["GELU.backward"] == layers
    assert calls["LayerNorm.forward"] == 2 * layers + 1 and calls["CrossEntropy.forward"] == 1
    assert calls["AdamW update"] == len(list(nn.GPT(nn.GPTConfig(), seed=0).parameters()))
    assert set(r["phases_s"]) == {"forward", "backward", "optimizer", "communication"}
    assert r["phases_s"]["communication"] < r["phases_s"]["optimizer"]  # one process sends nothing
    assert abs(r["step_s"] - sum(r["phases_s"].values())) < 1e-12
    in_ops = sum(s for name, s in r["ops_s"].items() if name != "AdamW update")
    assert 0 <= r["bookkeeping_s"] and in_ops + r["bookkeeping_s"] <= r["profiled_forward_backward_s"] + 1e-12


def test_a_recomputed_part_counts_its_operations_twice_and_once_only_in_the_total(capsys):
    """Full recomputation runs each block's forward twice (the head's once) and its backward once;
    selective, each attention core's two products and softmax twice. Recompute's own rules, which
    contain those operations, have no row: the rows would add up to more than the profiled time."""
    layers = nn.GPTConfig().n_layer
    for mode in ("full", "selective"):
        assert profile.main(["--repeats", "2", "--recompute", mode, "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        calls = r["op_calls_per_step"]
        assert r["model"]["recompute"] == mode and not any(name.startswith("Recompute") for name in calls)
        assert calls["CausalSoftmax.forward"] == 2 * layers and calls["MatMul.forward"] == 4 * layers
        assert calls["Linear.forward"] == (12 * layers + 1 if mode == "full" else 6 * layers + 1)
        assert calls["Linear.backward"] == 6 * layers + 1
        in_ops = sum(s for name, s in r["ops_s"].items() if name != "AdamW update")
        assert in_ops <= r["profiled_forward_backward_s"] + 1e-12


def test_a_bad_option_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "minipar", "bench", "profile", "--repeats", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--repeats" in done.stderr


def test_against_torch_without_pytorch_or_with_recomputation_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(profile.torch_gpt, "unavailable", lambda: "PyTorch is not installed")
    measured = []
    monkeypatch.setattr(profile, "profile_figures", lambda *a, **k: measured.append(a))
    assert profile.main(["--torch"]) == 2
    assert capsys.readouterr().err == "minipar bench profile: error: --torch: PyTorch is not installed\n"
    monkeypatch.setattr(profile.torch_gpt, "unavailable", lambda: None)
    assert profile.main(["--torch", "--recompute", "full"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "without recomputation" in err and measured == []  # before measuring


def test_against_torch_each_row_is_the_same_work_counted_from_the_model():
    """Each row sets minipar's operations beside the PyTorch kernels doing the same work, so the calls
    per step of both follow from the architecture, counted here by hand. A Linear is one minipar op
    each way and three products: addmm where it has a bias (query, value, both projections, fc), mm
    where it has none (key, the head) and for g W and g^T x; an attention product (q k^T, p v) is one
    bmm forward and two backward. Over two steps, per step."""
    pytest.importorskip("torch")
    L = nn.GPTConfig().n_layer
    t = profile.profile_figures("float64", 2, 2, against_torch=True)["torch"]
    rows = t["rows"]
    # AdamW updates each tensor: a block's two LayerNorms (2 each), q, v, both projections and fc (2
    # each), k (1); the two embeddings, the final LayerNorm and the head
    minipar_calls = {"Linear": 2 * (6 * L + 1), "attention products": 2 * 2 * L, "GELU": 2 * L,
                     "LayerNorm": 2 * (2 * L + 1), "softmax": 2 * L, "AdamW": 15 * L + 2 + 2 + 1}
    torch_calls = {"aten::addmm": 5 * L, "aten::mm": L + 1 + 2 * (6 * L + 1), "aten::bmm": 3 * 2 * L,
                   "aten::gelu": L, "aten::gelu_backward": L, "aten::native_layer_norm": 2 * L + 1,
                   "aten::native_layer_norm_backward": 2 * L + 1, "aten::_softmax": L,
                   "aten::_softmax_backward_data": L, "Optimizer.step#AdamW.step": 1}
    assert {row: r["minipar_calls"] for row, r in rows.items()} == minipar_calls
    assert {k: n for r in rows.values() for k, n in r["torch_kernel_calls"].items()} == torch_calls
    for engine in ("minipar", "torch"):
        assert all(r[f"{engine}_s"] > 0 for r in rows.values())
        assert sum(r[f"{engine}_s"] for r in rows.values()) < t[f"{engine}_profiled_s"]
