"""Mixture of experts: a GPT whose MLPs are E experts behind a top-k router (`--model moe`).

Idea (Switch Transformer, GShard): each block's MLP becomes E MLPs, the experts; a linear router
scores every token, and the token goes to its k best experts only, its output their outputs weighted
by the router's probabilities. Parameters grow E-fold while the work per token stays that of k MLPs.

Capacity: an expert takes at most C = ceil(capacity_factor * T * k / E) tokens of each sequence of T
tokens, computed exactly on the decimal the user typed (in floating point 1.1 * 25 * 2 / 5 is
11.000000000000002: 12 slots instead of 11); the assignments of a sequence are taken in position order
(position t's first choice, then its second, ..., then position t+1's), and those past C are dropped
(their MoE output is 0, the residual carries them on). Capacity and the auxiliary load-balancing loss
are computed per sequence (Megatron's `seq_aux_loss`), so how a batch is split over ranks never changes
which tokens are dropped.

Auxiliary loss (Switch, per sequence): aux_s = E * sum_e f_e * P_e, with f_e the share of the
sequence's T*k assignments that chose e (before dropping) and P_e the router's mean probability for e
over the sequence; summed over blocks, averaged over the global batch's sequences, times
`--aux-loss-coef`. Its gradient flows through P only (the choice is not differentiable). Each layer
attaches its aux loss to its output (`AttachAuxLoss`, Megatron's `MoEAuxLossAutoScaler`): the output
passes unchanged and backward gives the aux loss its gradient there, so the aux terms of a block
reach its router on whichever pipeline stage holds it, with nothing added to the last stage's loss.

What it costs: E times the MLP parameters and their optimizer states (expert parallelism,
parallel/experts.py, splits them over ranks; tokens then travel to their expert and back by all-to-all).
Lesson: lessons/15_experts.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from minipar.core import functional as F
from minipar.core.autograd import Function, Tensor
from minipar.core.backend import xp_of
from minipar.core.module import Module, ModuleList
from minipar.core.nn import (
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    GPTConfig,
    GPTEmbedding,
    GPTHead,
    Linear,
    causal_attention,
)
from minipar.core.options import option
from minipar.core.recompute import recomputing


@dataclass
class MoEConfig:
    n_experts: int = 4
    top_k: int = 1
    capacity_factor: float = 1.0
    aux_loss_coef: float = 0.01

    def capacity(self, seq_len: int) -> int:
        """Most tokens of one sequence an expert takes: ceil(factor * T * k / E), at least 1, with the
        factor taken as the decimal typed (`repr` gives the shortest decimal that reads back as the float;
        `Fraction(1.1)` would be the binary float's value, a little above 1.1)."""
        factor = Fraction(repr(float(self.capacity_factor)))
        return max(1, math.ceil(factor * seq_len * self.top_k / self.n_experts))


def route(probs, top_k: int, capacity: int):
    """The routing decision from router probabilities (B, T, E), as plain arrays.

    Returns `choice` (B, T, k): each token's experts, best first (ties to the lower index);
    `kept` (B, T, k): whether the assignment fits in its expert's capacity, assignments of a sequence
    taken in position order; `counts` (B, E): assignments per expert and sequence, before dropping;
    `slot` (B, T, k): the assignment's place in its expert's queue for the sequence (kept: < capacity)."""
    # exercise 15.1: top-k routing with a capacity per expert
    xp = xp_of(probs)
    B, T, E = probs.shape
    choice = xp.argsort(-probs, axis=-1, kind="stable")[..., :top_k]
    onehot = (choice.reshape(B, T * top_k)[..., None] == xp.arange(E)).astype(xp.int64)  # (B, T*k, E)
    rank_in_expert = (xp.cumsum(onehot, axis=1) * onehot).sum(-1) - 1  # place in its expert's queue
    kept = (rank_in_expert < capacity).reshape(B, T, top_k)
    return choice, kept, onehot.sum(axis=1), rank_in_expert.reshape(B, T, top_k)
    # end exercise


class IndexAdd(Function):
    """out = zeros(rows, d); out[index] += y (repeated rows add): the combine step of the experts."""

    @staticmethod
    def forward(ctx, y, index, rows: int):
        ctx.save_for_backward(index)
        out = xp_of(y).zeros((rows,) + y.shape[1:], dtype=y.dtype)
        xp_of(y).add.at(out, index, y)
        return out

    @staticmethod
    def backward(ctx, g):
        return g[ctx.saved[0]], None, None


class RoutingStats:
    """What the MoE layers of one model routed, shared by the model and its layers (so by every
    pipeline stage cut from it): per block, the tokens each expert kept; the aux losses of forwards
    not yet counted in a loss; and `aux_grad`, d(loss)/d(a summed per-sequence aux loss) this step:
    coef / global sequences = coef * T / normaliser (the normaliser carries fp16's loss scale)."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self.aux_grad = 0.0
        self.pending = 0.0  # summed per-sequence aux losses (before coef / sequences) not yet settled
        self.routed = 0.0  # the same sum, of every forward since the last `take` (for the log)
        self.kept: list[list[int]] = []  # per block, in the order the layers were made

    def add_layer(self) -> int:
        """A place for one more layer's counts; layers are made in block order, so it is the block's."""
        self.kept.append([0] * self.n_experts)
        return len(self.kept) - 1

    def record(self, layer: int, aux: float, kept: list[int]) -> None:
        self.pending += aux
        self.routed += aux
        self.kept[layer] = [a + b for a, b in zip(self.kept[layer], kept)]

    def set_normaliser(self, coef: float, seq_len: int, normaliser) -> None:
        self.aux_grad = coef * seq_len / normaliser

    def settle(self) -> float:
        """The aux part of the loss of the forwards since the last settle (its value: the gradient
        is already attached to the activations)."""
        value = self.pending * self.aux_grad
        self.pending = 0.0
        return value

    def take(self, coef: float, sequences: int) -> tuple[float, list[list[int]]]:
        """The aux part of the loss, coef * (summed per-sequence aux losses) / `sequences` (the global
        batch's: without fp16's loss scale, which `aux_grad` carries), and the tokens each block's
        experts kept, since the last take."""
        stats = (coef * self.routed / sequences, self.kept)
        self.routed, self.kept = 0.0, [[0] * self.n_experts for _ in self.kept]
        return stats


class AttachAuxLoss(Function):
    """Forward: the activations x, unchanged. Backward: x's gradient passes on, and the aux loss gets
    `routing.aux_grad` (Megatron's MoEAuxLossAutoScaler): the aux loss joins the backward pass at
    its layer's output, on the rank that holds the layer, without being added to the loss tensor."""

    @staticmethod
    def forward(ctx, x, aux, routing: RoutingStats):
        ctx.routing, ctx.aux_shape, ctx.aux_dtype = routing, aux.shape, aux.dtype  # no array kept
        return x

    @staticmethod
    def backward(ctx, g):
        return g, xp_of(g).full(ctx.aux_shape, ctx.routing.aux_grad, ctx.aux_dtype), None


class MoELayer(Module):
    """Router plus E expert MLPs in place of a block's MLP. After each forward, `aux_loss` holds this
    layer's summed per-sequence aux loss (a Tensor, before the coefficient and the 1/sequences) and
    `tokens_per_expert` (E,) the assignments each expert kept; both also go to `routing`, the model's
    RoutingStats (a layer made alone has its own)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, routing: RoutingStats | None = None):
        super().__init__()
        self.moe = moe
        self.router = Linear(cfg.d_model, moe.n_experts, bias=False, dtype=cfg.dtype)
        self.experts = ModuleList([MLP(cfg) for _ in range(moe.n_experts)])
        self.join_routing(routing)

    def join_routing(self, routing: RoutingStats | None) -> None:
        self.routing = routing if routing is not None else RoutingStats(self.moe.n_experts)
        self.index = self.routing.add_layer()
        self.aux_loss: Tensor | None = None
        self.tokens_per_expert: list[int] = []

    def attach_aux_loss(self, out, aux: Tensor):
        """Record this forward's routing (once: not again when `--recompute full` reruns the block in
        backward, which routes the same tokens alike) and hand back `out` carrying the aux loss's
        gradient (the rerun's graph carries it then)."""
        self.aux_loss = aux
        if not recomputing():
            self.routing.record(self.index, aux.item(), self.tokens_per_expert)
        return AttachAuxLoss.apply(out, aux, self.routing)

    def forward(self, x):
        B, T, D = x.shape
        E, k = self.moe.n_experts, self.moe.top_k
        probs = F.softmax(self.router(x), axis=-1)
        choice, kept, counts, _ = route(probs.data, k, self.moe.capacity(T))
        aux = self.sequence_aux_loss(probs, counts, T)
        flat_x, flat_probs = x.reshape(B * T, D), probs.reshape(B * T, E)
        tokens = xp_of(x.data).repeat(xp_of(x.data).arange(B * T), k)  # token of each assignment
        experts, keep = choice.reshape(-1), kept.reshape(-1)
        outputs = []
        for e, expert in enumerate(self.experts):  # every expert runs, on 0 tokens too: its grads exist
            mine = tokens[keep & (experts == e)]  # in position order
            gate = flat_probs[mine, e].reshape(len(mine), 1)
            outputs.append(IndexAdd.apply(expert(flat_x[mine]) * gate, mine, B * T))
        self.tokens_per_expert = [int((keep & (experts == e)).sum()) for e in range(E)]
        out = outputs[0]
        for y in outputs[1:]:
            out = out + y
        return self.attach_aux_loss(out.reshape(B, T, D), aux)

    def sequence_aux_loss(self, probs, counts, T: int):
        """sum over sequences of E * sum_e (counts_e / (T k)) * mean_t probs_e, as one weighted sum."""
        E, k = self.moe.n_experts, self.moe.top_k
        weights = (E / (T * k * T)) * counts[:, None, :].astype(probs.data.dtype)  # (B, 1, E)
        return (probs * weights).sum()


class MoEGPT(GPT):
    """GPT with every block's MLP a MoELayer (`layer(cfg, moe, routing)` makes them: expert parallelism
    passes its own); the same units, embedding, attention and head. `routing` (RoutingStats) is what
    its layers routed."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, seed: int | None = 0, recompute: str = "none",
                 attention=causal_attention, layer=MoELayer):
        Module.__init__(self)  # GPT's __init__ would build dense blocks: this builds MoE ones
        self.config, self.moe = cfg, moe
        self.routing = RoutingStats(moe.n_experts)
        self.embed = GPTEmbedding(cfg)
        self.blocks = ModuleList([Block(cfg, CausalSelfAttention(cfg, recompute == "selective", attention),
                                        layer(cfg, moe, self.routing), recompute=recompute == "full")
                                  for _ in range(cfg.n_layer)])
        self.head = GPTHead(cfg)
        if seed is not None:
            self.init_parameters(seed)

    def loss_and_correct(self, logits, targets, normaliser: int):
        """The language-model loss (GPT's, or the next class's in the MRO: tensor parallelism's) plus
        coef * (summed per-sequence aux losses) / global sequences: its value here, its gradient
        already attached to the layers' outputs (it needs this normaliser, so set it before backward);
        and where the language model's predictions are right."""
        lm, correct = super().loss_and_correct(logits, targets, normaliser)
        self.routing.set_normaliser(self.moe.aux_loss_coef, targets.shape[1], normaliser)
        return lm + self.routing.settle(), correct

    def take_routing_stats(self, sequences: int) -> tuple[float, list[list[int]]]:
        """This model's aux-loss part of the losses over a batch of `sequences` and the tokens each
        block's experts kept, since the last call (for the log)."""
        return self.routing.take(self.moe.aux_loss_coef, sequences)


def routing_of(model) -> RoutingStats | None:
    """The RoutingStats of the MoE layers in `model` (a whole model or a pipeline stage), or None."""
    return next((m.routing for m in model.modules() if isinstance(m, MoELayer)), None)


@dataclass
class MoEOptions:
    """Mixture of experts (core/moe.py; with --model moe)."""
    n_experts: int = option(4, "--model moe: experts per block (core/moe.py)")
    top_k: int = option(1, "--model moe: experts each token is routed to")
    capacity_factor: float = option(1.0, "--model moe: an expert takes at most ceil(factor*T*k/E) "
                                    "tokens of each sequence; the rest are dropped in position order")
    aux_loss_coef: float = option(0.01, "--model moe: weight of the load-balancing loss")


def config_errors(options: MoEOptions) -> list[str]:
    """`--model moe`'s checks: one line each, naming the flags (the trainer asks them of moe runs)."""
    errors = []
    if options.n_experts < 1:
        errors.append(f"--n-experts must be at least 1 (got {options.n_experts})")
    elif not 1 <= options.top_k <= options.n_experts:
        errors.append(f"--top-k must be between 1 and --n-experts {options.n_experts} (got {options.top_k})")
    if not (math.isfinite(options.capacity_factor) and options.capacity_factor > 0):
        errors.append(f"--capacity-factor must be a positive number (got {options.capacity_factor})")
    if not (math.isfinite(options.aux_loss_coef) and options.aux_loss_coef >= 0):
        errors.append(f"--aux-loss-coef must be a non-negative number (got {options.aux_loss_coef})")
    return errors
