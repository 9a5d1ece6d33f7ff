"""`bench saved` (minipar_lab/bench/saved.py): the bytes one GPT forward saves for backward, minipar's
beside PyTorch's. Without PyTorch (as in CI) the bench refuses in one line and the count by storage is
checked on stand-in tensors; with it, on a PyTorch graph counted by hand, and minipar saves at most
PyTorch's bytes in every case."""

import pytest

from minipar.core import nn
from minipar_lab.bench import saved


def test_without_pytorch_the_bench_is_one_line_and_exit_2_before_measuring(monkeypatch, capsys):
    monkeypatch.setattr(saved.torch_gpt, "unavailable", lambda: "PyTorch is not installed")
    measured = []
    monkeypatch.setattr(saved, "saved_figures", lambda *a, **k: measured.append(a))
    assert saved.main([]) == 2
    assert capsys.readouterr().err == "minipar bench saved: error: PyTorch is not installed\n"
    assert saved.main(["--batch", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batch" in err and measured == []


class Storage:
    def __init__(self, address, nbytes):
        self.address, self.size = address, nbytes

    def data_ptr(self):
        return self.address

    def nbytes(self):
        return self.size


class SavedView:
    """What the pack hook reads of a saved tensor: its storage (a view's is its base's, whole)."""

    def __init__(self, storage):
        self.storage = storage

    def untyped_storage(self):
        return self.storage


def test_the_count_takes_each_storage_once_whole_and_leaves_the_excluded_out():
    """Without PyTorch: three saved views of one 4,096-byte storage count 4,096 B once; a 100-byte
    storage saved once counts 100; a parameter's storage (excluded) nothing. The hook hands each
    tensor back as it came, and names the function running when it was saved."""
    shared, alone, parameter = Storage(1000, 4096), Storage(9000, 100), Storage(5000, 64)
    count = saved.StorageCount({parameter.data_ptr()})
    views = [SavedView(shared), SavedView(shared), SavedView(parameter), SavedView(alone)]
    count.running.append("linear")
    assert [count.pack(view) for view in views[:3]] == views[:3]
    count.running.pop()
    count.pack(views[3])
    assert count.total() == 4096 + 100 and count.nbytes == {1000: 4096, 9000: 100}
    assert count.savers == {1000: {"linear"}, 9000: {saved.OUTSIDE}}


def test_pytorchs_count_takes_each_storage_once_whole_and_leaves_parameters_out():
    """Counted by hand: x @ W^T saves x (12 fp64: 96 B) and not W, a parameter; a view of a (4, 10) array
    multiplied by itself saves the view twice, which keeps the whole storage alive: 320 B once; exp
    saves its (4, 5) result, 160 B; concatenating and summing save no tensor."""
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.ones(5, 3, dtype=torch.float64))
    x = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    with saved.saved_storages([w]) as storages:
        h = torch.nn.functional.linear(x, w)
        view = torch.cat([h, h], dim=1)[:, :2]
        (view * view).sum() + torch.exp(h).sum()
    assert storages.total() == 96 + 320 + 160
    assert sorted(storages.nbytes.values()) == [96, 160, 320]
    assert storages.savers[x.untyped_storage().data_ptr()] == {"linear"}


def test_minipar_saves_at_most_pytorchs_bytes_in_every_case():
    """Both GPTs, both precisions, every recomputation mode, batch 2. PyTorch's checkpoint keeps only
    its inputs, saved outside any torch function: a block's input (B, T, d) under full, the q, k, v of
    each attention core under selective, n_layer times; minipar's Recompute the same."""
    pytest.importorskip("torch")
    rows = saved.saved_figures(batch=2)
    assert len(rows) == 2 * 2 * 3
    for row in rows:
        case = (row["model"], row["dtype"], row["recompute"])
        assert 0 < row["minipar"] <= row["torch"], case
        assert sum(row["torch_by_op"].values()) == row["torch"], case
        kept = {"none": 0, "selective": 3, "full": 1}[row["recompute"]]
        value_bytes = 2 * row["seq"] * row["d_model"] * (4 if row["dtype"] == "float32" else 8)
        checkpoint_inputs = kept * nn.GPTConfig().n_layer * value_bytes
        assert row["torch_by_op"].get(saved.OUTSIDE, 0) == checkpoint_inputs, case
        assert row["minipar_by_op"].get("Recompute", 0) == checkpoint_inputs, case


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_minipars_rows_by_function_add_up_to_the_meters_bytes(recompute):
    """Without PyTorch: the rows come from walking the graph's nodes at the end of forward, so every
    buffer the meter counts must be in exactly one row. The softmax's output is the one buffer two
    Functions save (the softmax and the product after it); recomputation leaves neither, and keeps
    the recomputed pieces' inputs under Recompute."""
    cfg = nn.GPTConfig(block_size=8, n_layer=2, n_head=2, d_model=8)
    ids, targets = saved.AdditionTask(8, 0).global_batch(0, 2)
    total, rows = saved.minipar_saved(nn.GPT(cfg, seed=0, recompute=recompute), ids, targets)
    assert sum(rows.values()) == total > 0
    assert ("CausalSoftmax + MatMul" in rows) == (recompute == "none")
    assert ("Recompute" in rows) == (recompute != "none")
