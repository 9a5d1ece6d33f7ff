"""`python -m minipar bench saved`: the bytes one GPT forward saves for backward, minipar against PyTorch.

For the default GPT (d_model 64, seq 32) and the wide one (d_model 256, seq 64), in float32 and float64,
batch 16, under each --recompute mode: the bytes held for backward at the end of one forward (embedding
to loss, the graph alive), minipar's from the activation meter (each buffer once, its base's nbytes),
PyTorch's from a `torch.autograd.graph.saved_tensors_hooks` pack hook over the same forward of the same
GPT (bench/torch_gpt.py: minipar's weights; torch.utils.checkpoint for recomputation) recording each
saved tensor's storage: each storage counted once, its full nbytes (a saved view keeps its whole
storage alive), parameters left out (the ledger counts them as parameters). And the ratio. With
--by-op each engine's bytes by the operations that saved them (a buffer several operations save is
one row, named by all of them): where the two differ.

PyTorch is an optional extra (never in `make setup` nor CI): without it, one line and exit code 2.
Lesson: lessons/01b_speed_appendix.md ("Against PyTorch").

    python -m minipar bench saved [--batch 16] [--by-op] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections import defaultdict

from minipar.core import nn
from minipar.core.autograd import Node, activation_meter
from minipar.core.recompute import RECOMPUTE_MODES
from minipar.trainer.arguments import fail
from minipar.trainer.tasks import AdditionTask
from minipar_lab.bench import torch_gpt
from minipar_lab.bench.profile import MODELS
from minipar_lab.bench.table import right_aligned

DTYPES = ("float32", "float64")


def gpt_config(model: str, dtype: str) -> nn.GPTConfig:
    base = MODELS[model]
    return nn.GPTConfig(block_size=base.block_size, d_model=base.d_model, dtype=dtype)


def minipar_saved(model: nn.GPT, ids, targets) -> tuple[int, dict[str, int]]:
    """Bytes the activation meter gains over one forward and loss, and those bytes by the Functions
    holding them, read from the graph's nodes at the end of forward."""
    before = activation_meter.current
    loss = model.loss(model(ids), targets, targets.size)
    saved = activation_meter.current - before
    return saved, bytes_by_saver(nodes_saving(loss.node))


def nodes_saving(root: Node):
    """Every node of the graph below root (leaves are not nodes), each once."""
    seen, stack = {id(root): root}, [root]
    while stack:
        for link in stack.pop().next:
            if isinstance(link, Node) and id(link) not in seen:
                seen[id(link)] = link
                stack.append(link)
    return seen.values()


def bytes_by_saver(nodes) -> dict[str, int]:
    """Each buffer the nodes hold in the meter, under the names of every Function holding it."""
    savers: dict[int, set] = defaultdict(set)
    nbytes = {}
    for node in nodes:
        for base in node.ctx.held_buffers if node.ctx is not None else ():
            savers[id(base)].add(node.function.__name__)
            nbytes[id(base)] = base.nbytes
    return by_row(savers, nbytes)


def by_row(savers: dict, nbytes: dict) -> dict[str, int]:
    rows: dict[str, int] = defaultdict(int)
    for key, names in savers.items():
        rows[" + ".join(sorted(names))] += nbytes[key]
    return dict(sorted(rows.items(), key=lambda row: -row[1]))


OUTSIDE = "(outside torch functions)"  # saved with no torch function running: checkpoint's inputs


class StorageCount:
    """The tensors autograd saves, by storage: each storage's nbytes, counted once however many saved
    tensors view it, and the torch functions (torch.overrides' names: "linear", "layer_norm") running
    when each was saved. Storages whose data pointer is in `excluded` (the parameters') are left out.
    `pack` is a saved_tensors_hooks pack hook; it reads only `untyped_storage()`, so it runs on any
    object that has one."""

    def __init__(self, excluded: set[int]):
        self.excluded = excluded
        self.nbytes: dict[int, int] = {}
        self.savers: dict[int, set] = defaultdict(set)
        self.running = [OUTSIDE]  # the torch functions running now, innermost last

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.excluded:
            self.nbytes[storage.data_ptr()] = storage.nbytes()
            self.savers[storage.data_ptr()].add(self.running[-1])
        return tensor  # kept as autograd keeps it: counting changes nothing

    def total(self) -> int:
        return sum(self.nbytes.values())


@contextlib.contextmanager
def saved_storages(excluded_tensors):
    """A StorageCount of what autograd saves inside the block, the storages of `excluded_tensors` out."""
    import torch
    from torch.overrides import TorchFunctionMode

    count = StorageCount({t.untyped_storage().data_ptr() for t in excluded_tensors})

    class Naming(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            count.running.append(getattr(func, "__name__", str(func)))
            try:
                return func(*args, **(kwargs or {}))
            finally:
                count.running.pop()

    with torch.autograd.graph.saved_tensors_hooks(count.pack, lambda tensor: tensor), Naming():
        yield count


def torch_saved(model: nn.GPT, ids, targets, recompute: str) -> tuple[int, dict[str, int]]:
    """PyTorch's bytes saved over the same forward and loss (storages once, parameters out), and by the
    torch functions that saved them."""
    step = torch_gpt.TorchGPTStep(model, ids, targets, recompute)
    with saved_storages(step.p.values()) as storages:
        loss = step.loss()
    del loss
    return storages.total(), by_row(storages.savers, storages.nbytes)


def saved_case(model_name: str, dtype: str, recompute: str, batch: int) -> dict:
    cfg = gpt_config(model_name, dtype)
    ids, targets = AdditionTask(cfg.block_size, 0).global_batch(0, batch)
    model = nn.GPT(cfg, seed=0, recompute=recompute)
    mine, mine_by_op = minipar_saved(model, ids, targets)
    theirs, theirs_by_op = torch_saved(model, ids, targets, recompute)
    return {"model": model_name, "seq": cfg.block_size, "d_model": cfg.d_model, "dtype": dtype,
            "recompute": recompute, "batch": batch, "minipar": mine, "torch": theirs,
            "ratio": mine / theirs, "minipar_by_op": mine_by_op, "torch_by_op": theirs_by_op}


def saved_figures(batch: int, models=tuple(MODELS), dtypes=DTYPES, modes=RECOMPUTE_MODES) -> list[dict]:
    return [saved_case(model, dtype, mode, batch) for model in models for dtype in dtypes for mode in modes]


COLUMNS = [("model", lambda r: r["model"]), ("seq", lambda r: r["seq"]), ("d_model", lambda r: r["d_model"]),
           ("dtype", lambda r: r["dtype"]), ("--recompute", lambda r: r["recompute"]),
           ("minipar (B)", lambda r: f"{r['minipar']:,}"), ("PyTorch (B)", lambda r: f"{r['torch']:,}"),
           ("ratio", lambda r: f"{r['ratio']:.4f}")]


def by_op_lines(row: dict) -> list[str]:
    lines = [f"{row['model']} {row['dtype']} --recompute {row['recompute']}, bytes by the operations saving them"]
    for engine, key in (("minipar", "minipar_by_op"), ("PyTorch", "torch_by_op")):
        lines += [f"  {engine:<8} {name:<40} {nbytes:>12,}" for name, nbytes in row[key].items()]
    return lines


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="minipar bench saved", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--by-op", action="store_true", help="each engine's bytes by the operations saving them")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.batch < 1:
        return fail(p.prog, f"--batch must be a positive integer, got {args.batch}")
    if torch_gpt.unavailable():
        return fail(p.prog, torch_gpt.unavailable())
    rows = saved_figures(args.batch)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"bytes saved for backward at the end of one forward (embedding to loss), batch {args.batch}; "
          f"PyTorch {torch_gpt.torch_version()}: saved_tensors_hooks, each storage once, parameters out")
    print("\n".join(right_aligned(rows, COLUMNS)))
    for row in rows if args.by_op else ():
        print("\n".join(by_op_lines(row)))
    return 0
