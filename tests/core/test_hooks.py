"""Hooks with removable handles: Module's forward and backward hooks, the meters' listeners, the
memory ledger's subscription, and the techniques that attach through them instead of patching methods.

    pytest -m "not mpi" tests/core/test_hooks.py
"""

from __future__ import annotations

import ast
import gc
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import minipar
from minipar.core import autograd, nn, optim
from minipar.core.autograd import ActivationMeter, Tensor
from minipar.core.hooks import HookList
from minipar.distributed.communicator import Comm
from minipar.distributed.grid import ProcessGrid
from minipar.fusion import training as fused_training
from minipar.memory.ledger import MemoryLedger, TierMeter, buffer_meter, tier_meter
from minipar.parallel.zero import ZeroStage2
from minipar.parallel.zero3 import ZeroStage3
from minipar.parallel.zero_chunked import ChunkedZero3
from minipar.precision.mixed import LossScaling, loss_scaling_of
from minipar.trainer import build
from minipar.trainer.config import TrainConfig


class Scale(nn.Module):
    """y = w * x: one parameter, so a hook can tell whether its gradient exists yet."""

    def __init__(self, value=2.0):
        super().__init__()
        self.w = nn.Parameter((1,))
        self.w.data[...] = value

    def forward(self, x):
        return x * self.w


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Scale(2.0), Scale(3.0)

    def forward(self, x):
        return self.second(self.first(x))


def leaf(values):
    return Tensor(np.asarray(values, dtype=float), requires_grad=True)


# ---- handles and hook lists ----

def test_handles_remove_once_in_a_with_block_and_first_goes_ahead():
    hooks, calls = HookList(), []
    a = hooks.add(lambda: calls.append("a"))
    hooks.add(lambda: calls.append("b"))
    hooks.add(lambda: calls.append("first"), first=True)
    hooks.call_all()
    assert calls == ["first", "a", "b"]
    a.remove()
    a.remove()  # idempotent: the second removal takes nothing else with it
    with hooks.add(lambda: calls.append("scoped")):
        calls.clear()
        hooks.call_all()
        assert calls == ["first", "b", "scoped"]
    calls.clear()
    hooks.call_all()
    assert calls == ["first", "b"] and len(hooks) == 2


def test_a_hook_may_remove_itself_while_the_list_is_being_called():
    hooks, calls = HookList(), []
    handle = hooks.add(lambda: (calls.append("once"), handle.remove()))
    hooks.add(lambda: calls.append("after"))
    hooks.call_all()
    hooks.call_all()
    assert calls == ["once", "after", "after"]


# ---- forward hooks ----

def test_forward_hooks_see_and_replace_args_and_output_in_registration_order():
    module, seen = Scale(2.0), []
    module.register_forward_pre_hook(lambda m, args: seen.append(("pre1", m, args[0].data.tolist())))
    module.register_forward_pre_hook(lambda m, args: (args[0] + 1.0,))  # x -> x + 1
    module.register_forward_pre_hook(lambda m, args: seen.append(("pre3", args[0].data.tolist())))
    module.register_forward_hook(lambda m, args, out: seen.append(("post1", args[0].data.tolist(),
                                                                   out.data.tolist())))
    module.register_forward_hook(lambda m, args, out: out * 10.0)
    module.register_forward_hook(lambda m, args, out: seen.append(("post3", out.data.tolist())))
    out = module(leaf([1.0, 2.0]))
    assert seen == [("pre1", module, [1.0, 2.0]), ("pre3", [2.0, 3.0]),
                    ("post1", [2.0, 3.0], [4.0, 6.0]), ("post3", [40.0, 60.0])]
    np.testing.assert_array_equal(out.data, [40.0, 60.0])


def test_a_pre_hook_returning_a_single_value_replaces_the_one_argument():
    module = Scale(2.0)
    module.register_forward_pre_hook(lambda m, args: leaf([5.0]))
    np.testing.assert_array_equal(module(leaf([1.0])).data, [10.0])


def test_removed_forward_hooks_stop_running_and_the_others_stay():
    module, calls = Scale(2.0), []
    pre = module.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    post = module.register_forward_hook(lambda m, args, out: out * 0.0)
    module.register_forward_hook(lambda m, args, out: calls.append("kept"))
    np.testing.assert_array_equal(module(leaf([1.0])).data, [0.0])
    pre.remove()
    post.remove()
    calls.clear()
    np.testing.assert_array_equal(module(leaf([1.0])).data, [2.0])
    assert calls == ["kept"]


# ---- backward hooks ----

def test_the_backward_pre_hook_fires_before_any_parameter_gradient_and_the_full_hook_after_all():
    model, events = TwoLayers(), []

    def grads(module):
        return [p.grad is not None for p in module.parameters()]

    for name, module in (("first", model.first), ("second", model.second), ("both", model)):
        module.register_full_backward_pre_hook(lambda m, name=name: events.append((name, "pre", grads(m))))
        module.register_full_backward_hook(lambda m, name=name: events.append((name, "full", grads(m))))
    x = leaf([1.0, 2.0])
    model(x).sum().backward()
    assert events == [("both", "pre", [False, False]), ("second", "pre", [False]),
                      ("second", "full", [True]), ("first", "pre", [False]),
                      ("first", "full", [True]), ("both", "full", [True, True])]
    np.testing.assert_array_equal(x.grad, [6.0, 6.0])  # the hooks pass the gradient through unchanged
    np.testing.assert_array_equal(model.first.w.grad, [3.0 * 3.0])


def test_backward_hooks_run_in_order_and_stop_after_remove():
    module, calls = Scale(), []
    a = module.register_full_backward_pre_hook(lambda m: calls.append("pre a"))
    module.register_full_backward_pre_hook(lambda m: calls.append("pre b"))
    b = module.register_full_backward_hook(lambda m: calls.append("full a"))
    module.register_full_backward_hook(lambda m: calls.append("full b"))
    module(leaf([1.0])).sum().backward()
    assert calls == ["pre a", "pre b", "full a", "full b"]
    a.remove()
    b.remove()
    calls.clear()
    module(leaf([1.0])).sum().backward()
    assert calls == ["pre b", "full b"]


def test_the_full_backward_hook_does_not_fire_when_no_input_requires_grad():
    module, calls = Scale(), []
    module.register_full_backward_pre_hook(lambda m: calls.append("pre"))
    module.register_full_backward_hook(lambda m: calls.append("full"))
    module(Tensor(np.ones(2))).sum().backward()  # like token ids into an embedding
    assert calls == ["pre"]
    assert module.w.grad is not None


def test_the_full_backward_hook_sits_on_the_first_input_that_requires_grad():
    class Add(nn.Module):
        def forward(self, a, b):
            return a + b

    module, calls = Add(), []
    module.register_full_backward_hook(lambda m: calls.append("full"))
    module(np.ones(2), leaf([1.0, 2.0])).sum().backward()  # a plain array first, then a tensor
    assert calls == ["full"]


# ---- meters ----

@pytest.mark.parametrize("meter_class", [ActivationMeter, TierMeter])
def test_meters_call_every_subscriber_in_order_and_stop_after_remove(meter_class):
    meter, calls = meter_class(), []

    def change(m):
        m.add(8) if isinstance(m, ActivationMeter) else m.set("params", 8, "cpu")

    a = meter.subscribe(lambda *args: calls.append(("a", args)))
    meter.subscribe(lambda *args: calls.append(("b", args)))
    meter.subscribe(lambda *args: calls.append(("first", args)), first=True)
    change(meter)
    expected = (8,) if meter_class is ActivationMeter else ("params", 8, "cpu")
    assert calls == [("first", expected), ("a", expected), ("b", expected)]
    a.remove()
    calls.clear()
    change(meter)
    assert [name for name, _ in calls] == ["first", "b"]


def test_two_ledgers_both_record_and_a_closed_one_stops():
    before = autograd.activation_meter.current
    with MemoryLedger() as kept:
        closed = MemoryLedger()
        buffer_meter.add(100)
        tier_meter.set("optimizer", 7, "disk")
        closed.close()
        buffer_meter.add(50)
        tier_meter.set("optimizer", 9, "disk")
        x = leaf(np.ones(4))
        y = x * leaf(np.ones(4))  # saves two buffers of 32 bytes for backward
        buffer_meter.release(150)
    assert kept.held_peak["buffers"] == 150 and closed.held_peak["buffers"] == 100
    assert kept.current[("optimizer", "disk")] == 9 and closed.current[("optimizer", "disk")] == 7
    assert kept.current[("activations", "device")] == before + 64
    assert closed.current[("activations", "device")] == 0
    buffer_meter.add(1)  # kept is closed too now: neither hears it
    assert kept.current[("buffers", "device")] == 0 and closed.current[("buffers", "device")] == 100
    buffer_meter.release(1)
    y.sum().backward()


def test_a_ledger_dropped_without_close_leaves_the_meters():
    gc.collect()  # earlier tests' engines and ledgers, collected during this test, would leave the meters too
    listening = (len(autograd.activation_meter.listeners), len(buffer_meter.listeners),
                 len(tier_meter.listeners))
    ledger = MemoryLedger()
    assert len(buffer_meter.listeners) == listening[1] + 1
    del ledger
    gc.collect()
    assert (len(autograd.activation_meter.listeners), len(buffer_meter.listeners),
            len(tier_meter.listeners)) == listening


# ---- techniques attach through hooks, never by reassigning methods ----

def tiny_gpt():
    return nn.GPT(nn.GPTConfig(vocab_size=12, block_size=6, n_layer=2, n_head=2, d_model=8), seed=3)


def assert_nothing_patched(model):
    for module in model.modules():
        assert "forward" not in vars(module), type(module).__name__
        if hasattr(type(module), "forward"):  # a ModuleList has none
            assert type(module).forward is module.forward.__func__


@pytest.mark.parametrize("engine", ["zero2", "zero3", "chunked"])
def test_zero_engines_leave_every_forward_the_class_method_and_run_as_hooks(engine):
    model, comm = tiny_gpt(), Comm(MPI.COMM_SELF)
    optimizer = optim.AdamW([])
    if engine == "chunked":
        updater = ChunkedZero3(model, optimizer, comm, chunk_numel=4096)
    else:
        updater = {"zero2": ZeroStage2, "zero3": ZeroStage3}[engine](model, optimizer, comm)
    assert_nothing_patched(model)
    hooks_per_unit = {"zero2": 1, "zero3": 4, "chunked": 4}[engine]
    assert len(updater.hooks) == hooks_per_unit * len(model.units())
    for _, unit in model.units():  # each hook list of each unit holds what the engine registered
        lists = [unit._forward_pre_hooks, unit._forward_hooks, unit._backward_pre_hooks, unit._backward_hooks]
        assert sum(map(len, lists)) == hooks_per_unit
    for handle in updater.hooks:
        handle.remove()
    assert all(not unit._backward_hooks and not unit._forward_pre_hooks for _, unit in model.units())


def test_the_chunked_store_relieves_ahead_of_ledgers_and_leaves_with_its_engine():
    with MemoryLedger():
        engine = ChunkedZero3(tiny_gpt(), optim.AdamW([]), Comm(MPI.COMM_SELF), chunk_numel=4096)
        relief, ledger_listener = engine.relief, autograd.activation_meter.listeners.handles()[-1]
        assert autograd.activation_meter.listeners.handles()[0] == relief  # ahead of the ledger made before
        del engine
        gc.collect()
        assert relief not in autograd.activation_meter.listeners.handles()
        assert ledger_listener in autograd.activation_meter.listeners.handles()


def test_fp16_registers_its_loss_scaling_at_the_gradients_ready_point_and_fused_adamw_by_argument():
    grid = ProcessGrid(Comm(MPI.COMM_SELF), 1, 1, 1)
    cfg = TrainConfig(model="mlp", n_layer=2, d_model=8, quiet=True, dp=1)
    fp16 = build.build_updater(cfg.replace(precision="fp16"), grid, build.build_model(cfg, grid))
    bf16 = build.build_updater(cfg.replace(precision="bf16"), grid, build.build_model(cfg, grid))
    assert isinstance(loss_scaling_of(fp16), LossScaling) and loss_scaling_of(bf16) is None
    assert list(fp16.gradient_transforms) == [loss_scaling_of(fp16)] and not bf16.gradient_transforms
    assert optim.AdamW([], update_rule=fused_training.adamw_update).update_rule is fused_training.adamw_update
    assert optim.AdamW([]).update_rule is optim.adamw_update


# ---- autograd does not import functional ----

def test_autograd_imports_nothing_of_functional_not_even_inside_a_function():
    source = pathlib.Path(autograd.__file__).read_text()
    imported = [alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}"
                for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names]
    assert not [name for name in imported if "functional" in name or "_ops" in name], imported


def test_tensor_operators_work_after_importing_autograd_alone():
    program = ("import numpy as np\nfrom minipar.core.autograd import Tensor\n"
               "t = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)\n"
               "w = Tensor(np.ones((3, 2)))\n"
               "loss = ((t + t) @ w).sum() + (t * 2 - 1).mean() + t[0].max() + t.T.reshape(6).sum()\n"
               "loss.backward()\nprint(loss.item(), t.grad.sum())")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["81.0", "33.0"], minipar.__file__
