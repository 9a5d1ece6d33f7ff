"""minipar's GPT written again in PyTorch, for `bench autograd` to time one against the other and
`bench saved` to count what each saves for backward.

PyTorch is an optional extra: nothing here imports it until a step is built, and `unavailable()`
says in one line why the comparison cannot run. The PyTorch model reads minipar's weights by name,
so both start from the same numbers; it is written with torch.nn.functional, op for op as minipar's
nn.GPT (pre-LayerNorm blocks, no key bias, tanh GELU, untied embeddings, summed cross-entropy over
the token count), trained with torch.optim.AdamW at minipar's defaults.
Lesson: lessons/01b_speed_appendix.md.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import time

import numpy as np

from minipar.core import nn, optim
from minipar.core.tensor_ops import linear_product


def unavailable() -> str | None:
    """Why PyTorch cannot be compared here (one line), or None when it can."""
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed (optional: pip install torch, a CPU build; not in make setup nor CI)"
    return None


def torch_version() -> str:
    import torch

    return torch.__version__


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


class MiniparGPTStep:
    """One training step of minipar's GPT (AdamW); calling it returns the loss before the update."""

    def __init__(self, cfg: nn.GPTConfig, tokens, targets):
        self.model = nn.GPT(cfg, seed=0)
        self.opt = optim.AdamW(self.model.parameters(), lr=1e-3)
        self.tokens, self.targets = tokens, targets

    def __call__(self) -> float:
        self.opt.zero_grad()
        loss = self.model.loss(self.model(self.tokens), self.targets, self.targets.size)
        loss.backward()
        self.opt.step()
        return loss.item()


class TorchGPTStep:
    """The same step in PyTorch, on one thread, from a copy of `model`'s weights. `recompute` mirrors
    minipar's (core/recompute.py) with torch.utils.checkpoint: "full" checkpoints each block on its input,
    "selective" each attention core on its q, k and v (B, T, C), as core/nn.py's `attention_core`."""

    def __init__(self, model: nn.GPT, tokens, targets, recompute: str = "none"):
        import torch

        torch.set_num_threads(1)  # one BLAS thread, as each minipar rank has
        self.torch, self.cfg, self.recompute = torch, model.config, recompute
        self.p = {name: torch.tensor(p.data.copy(), requires_grad=True)
                  for name, p in model.named_parameters()}
        self.opt = torch.optim.AdamW(self.p.values(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                     weight_decay=0.01)
        self.tokens, self.targets = torch.from_numpy(tokens), torch.from_numpy(targets)
        T = tokens.shape[1]
        dtype = self.p["embed.wte.weight"].dtype
        self.mask = torch.triu(torch.full((T, T), -math.inf, dtype=dtype), diagonal=1)

    def __call__(self) -> float:
        self.opt.zero_grad()
        loss = self.loss()
        loss.backward()
        self.opt.step()
        return loss.item()

    def loss(self):
        F, p = self.torch.nn.functional, self.p
        ids = self.tokens
        x = p["embed.wte.weight"][ids] + p["embed.wpe.weight"][self.torch.arange(ids.shape[1])]
        for i in range(self.cfg.n_layer):
            block = functools.partial(self.block, f"blocks.{i}.")
            x = self.checkpoint(block, x) if self.recompute == "full" else block(x)
        logits = F.linear(self.layer_norm(x, "head.ln_f"), p["head.lm_head.weight"])
        V = logits.shape[-1]
        total = F.cross_entropy(logits.reshape(-1, V), self.targets.reshape(-1), reduction="sum")
        return total * (1.0 / self.targets.numel())

    def layer_norm(self, x, name):
        return self.torch.nn.functional.layer_norm(x, (x.shape[-1],), self.p[name + ".weight"],
                                                   self.p[name + ".bias"], eps=1e-5)

    def checkpoint(self, function, *inputs):
        """function(*inputs), only the inputs saved, recomputed in backward (PyTorch's recommended form)."""
        from torch.utils.checkpoint import checkpoint

        return checkpoint(function, *inputs, use_reentrant=False)

    def block(self, b, x):
        F, p = self.torch.nn.functional, self.p
        x = x + self.attention(self.layer_norm(x, b + "ln_1"), b + "attn.")
        h = F.gelu(F.linear(self.layer_norm(x, b + "ln_2"), p[b + "mlp.fc.weight"], p[b + "mlp.fc.bias"]),
                   approximate="tanh")
        return x + F.linear(h, p[b + "mlp.proj.weight"], p[b + "mlp.proj.bias"])

    def attention(self, x, a):
        F, p = self.torch.nn.functional, self.p
        q = F.linear(x, p[a + "query.weight"], p[a + "query.bias"])
        k = F.linear(x, p[a + "key.weight"])
        v = F.linear(x, p[a + "value.weight"], p[a + "value.bias"])
        y = self.checkpoint(self.core, q, k, v) if self.recompute == "selective" else self.core(q, k, v)
        return F.linear(y, p[a + "proj.weight"], p[a + "proj.bias"])

    def core(self, q, k, v):
        """Causal attention of (B, T, C) q, k, v, as core/nn.py's causal_attention."""
        B, T, C = q.shape
        hd = C // self.cfg.n_head

        def heads(t):
            return t.reshape(B, T, self.cfg.n_head, hd).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(hd)) + self.mask
        y = self.torch.softmax(scores, dim=-1) @ v
        return y.transpose(1, 2).reshape(B, T, C)


def op_seconds(step: TorchGPTStep, repeats: int) -> tuple[dict[str, float], dict[str, float], float]:
    """PyTorch's own profiler over `repeats` steps, after one untimed (profiled): each event's seconds
    per step (its CPU time, what it calls included) and calls per step, keyed as the profiler names
    them ("aten::addmm", "Optimizer.step#AdamW.step"), and the profiled seconds of a step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):  # the profiler's first session sets itself up,
        step()  # about 0.3 s that would land on the steps measured
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        started = time.perf_counter()
        for _ in range(repeats):
            step()
        profiled = (time.perf_counter() - started) / repeats
    events = profiler.key_averages()
    return ({e.key: e.cpu_time_total * 1e-6 / repeats for e in events},  # the profiler's unit is the µs
            {e.key: e.count / repeats for e in events}, profiled)


class TorchMLPStep:
    """Forward and backward of minipar's MLPNet in PyTorch (summed squared error), from its weights."""

    def __init__(self, model: nn.MLPNet, x, y):
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.layers = [(torch.tensor(layer.linear.weight.data.copy(), requires_grad=True),
                        torch.tensor(layer.linear.bias.data.copy(), requires_grad=True))
                       for layer in model.layers]
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __call__(self) -> float:
        F, h = self.torch.nn.functional, self.x
        for w, b in self.layers:
            w.grad = b.grad = None
        for i, (w, b) in enumerate(self.layers):
            h = F.linear(h, w, b)
            h = F.gelu(h, approximate="tanh") if i < len(self.layers) - 1 else h
        loss = ((h - self.y) ** 2).sum()
        loss.backward()
        return loss.item()


class LinearProducts:
    """The matrix products of `model`'s Linear layers in one training step, at its shapes, with nothing
    else: for each layer the forward x W^T and the two backward products g W and g^T x, over `tokens`
    rows. `minipar()` runs them as minipar's Linear does (`linear_product`: NumPy's BLAS, or MKL with
    MINIPAR_BLAS=mkl); `torch()` as PyTorch does. Timed beside the two steps, they show how much of the
    gap is the BLAS library alone, which the engine itself cannot change."""

    def __init__(self, model: nn.Module, tokens: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.layers = []
        for module in model.modules():
            if isinstance(module, nn.Linear):
                w = module.weight.data
                x = rng.standard_normal((tokens, w.shape[1])).astype(w.dtype)
                g = rng.standard_normal((tokens, w.shape[0])).astype(w.dtype)
                self.layers.append((x, w, g))
        self.torch_layers: list | None = None  # the same arrays as torch tensors, at torch()'s first call

    def minipar(self) -> None:
        for x, w, g in self.layers:
            linear_product(x, w.T, "forward")
            linear_product(g, w, "input_grad")
            linear_product(g.T, x, "weight_grad")

    def torch(self) -> None:
        if self.torch_layers is None:  # round_times' untimed warm-up makes this first call
            import torch

            self.torch_layers = [tuple(torch.from_numpy(a) for a in layer) for layer in self.layers]
        for x, w, g in self.torch_layers:
            x @ w.T, g @ w, g.T @ x

