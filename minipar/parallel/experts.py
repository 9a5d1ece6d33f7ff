"""Expert parallelism (`--ep E`): the experts of each MoE block split over E ranks inside dp.

Idea (GShard, DeepSpeed-MoE): the dp ranks form blocks of E consecutive ranks (the "ep" group); in
a block, rank j holds experts j*n/E .. (j+1)*n/E - 1 of each MoE layer (n = --n-experts), and the
router and everything else stay replicated as in data parallelism. Each rank routes its own
tokens (core/moe.py: per sequence, so the same tokens are dropped as on one process), writes them
into a dispatch buffer padded to capacity, (n, b, C, d) for its b sequences, and an all-to-all over
the ep group sends expert e's rows to e's rank; the experts run on what arrives, and a second
all-to-all brings the outputs home to be weighted by the gates. Gradients: the router's and the
attention's are summed over all of dp; an expert's only over the ranks that hold it (the
expert-data-parallel group "edp": the same place in every ep block). ZeRO (stages 1-3) shards the
experts' states over edp and reduce-scatters their gradients there, the rest over dp
(`ExpertParallelZero`). With a pipeline, each layer's aux loss reaches its router on its own stage
(core/moe.py's AttachAuxLoss, told the step's normaliser by `AuxLossRunner`).

What it saves: each rank holds n/E experts instead of n (their parameters, gradients and optimizer
states). What it costs: two all-to-alls forward and two backward per MoE layer, each (E-1)/E of the
dispatch buffer, n*b*C*d elements: a formula, since the buffer is padded to capacity.
Lesson: lessons/15_experts.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from minipar.core import functional as F
from minipar.core.autograd import no_grad
from minipar.core.backend import xp_of
from minipar.core.module import Module, ModuleList
from minipar.core.moe import IndexAdd, MoEConfig, MoEGPT, MoELayer, MoEOptions, RoutingStats, route
from minipar.core.nn import MLP, GPTConfig, Linear, ModelOptions
from minipar.core.options import option
from minipar.distributed.collectives import Wire
from minipar.distributed.communicator import Comm
from minipar.distributed.grid import ProcessGrid
from minipar.parallel.api import LocalUpdater, Runner, RunnerWrapper, Updater
from minipar.parallel.ddp import DataParallelOptions
from minipar.parallel.mappings import AllToAll
from minipar.parallel.tensor_gpt import TensorParallelGPT
from minipar.parallel.zero import ZeroStage1, ZeroStage2
from minipar.parallel.zero3 import ZeroStage3


class ExpertGroups:
    """The two communicators of expert parallelism, split from dp: `ep` (a block of ep consecutive
    dp ranks: tokens travel inside it) and `edp` (the ranks at the same place of every block: they
    hold the same experts and sum their gradients)."""

    def __init__(self, grid: ProcessGrid, ep: int):
        block, place = divmod(grid.dp_rank, ep)
        nodes = grid.dp.nodes
        self.ep: Comm = grid.dp.split(color=block, key=place, name="ep", reuse=(ep,),
                                      nodes=None if nodes is None else nodes[block * ep:(block + 1) * ep])
        self.edp: Comm = grid.dp.split(color=place, key=block, name="edp", reuse=(ep,),
                                       nodes=None if nodes is None else nodes[place::ep])


class LocalExperts(ModuleList):
    """This rank's experts, named by their global index, so names match the one-process model."""

    def __init__(self, cfg: GPTConfig, first: int, count: int):
        super().__init__([])
        self.first = first
        for e in range(first, first + count):
            self.add_module(str(e), MLP(cfg))


class ExpertParallelMoELayer(MoELayer):
    """MoELayer whose experts live on the ranks of `groups.ep`; the same routing and aux loss."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, routing: RoutingStats | None = None, *,
                 groups: ExpertGroups):
        Module.__init__(self)  # MoELayer's __init__ would build every expert: this builds this rank's
        self.moe, self.groups = moe, groups
        self.per_rank = moe.n_experts // groups.ep.size
        self.router = Linear(cfg.d_model, moe.n_experts, bias=False, dtype=cfg.dtype)
        self.experts = LocalExperts(cfg, groups.ep.rank * self.per_rank, self.per_rank)
        self.join_routing(routing)

    def forward(self, x):
        B, T, D = x.shape
        E, k, C = self.moe.n_experts, self.moe.top_k, self.moe.capacity(T)
        probs = F.softmax(self.router(x), axis=-1)
        choice, kept, counts, slot = route(probs.data, k, C)
        aux = self.sequence_aux_loss(probs, counts, T)
        xp = xp_of(x.data)
        keep = kept.reshape(-1)
        tokens = xp.repeat(xp.arange(B * T), k)[keep]
        experts = choice.reshape(-1)[keep]
        sequences = tokens // T
        rows = (experts * B + sequences) * C + slot.reshape(-1)[keep]  # its row of the (E, B, C) buffer
        self.tokens_per_expert = [int((experts == e).sum()) for e in range(E)]
        dispatch = IndexAdd.apply(x.reshape(B * T, D)[tokens], rows, E * B * C)
        outputs = self.run_experts(dispatch.reshape(self.groups.ep.size, self.per_rank * B * C * D), B, C, D)
        gate = probs.reshape(B * T, E)[tokens, experts].reshape(len(tokens), 1)
        return self.attach_aux_loss(IndexAdd.apply(outputs[rows] * gate, tokens, B * T).reshape(B, T, D), aux)

    def run_experts(self, dispatch, B: int, C: int, D: int):
        """All-to-all the dispatch buffer, run each local expert on its rows from every ep rank (padding
        included: its outputs are never combined, so it gets no gradient), and all-to-all back."""
        n = self.groups.ep.size
        arrived = AllToAll.apply(dispatch, self.groups.ep).reshape(n, self.per_rank, B * C, D)
        outs = [expert(arrived[:, j].reshape(n * B * C, D)).reshape(n, 1, B * C, D)
                for j, expert in enumerate(self.experts)]
        back = F.concatenate(outs, axis=1).reshape(n, self.per_rank * B * C * D)
        return AllToAll.apply(back, self.groups.ep).reshape(self.moe.n_experts * B * C, D)


class AuxLossRunner(RunnerWrapper):
    """The inner runner, with the MoE layers told this step's aux-loss gradient (coef / global
    sequences, from the normaliser) before any backward: a pipeline stage that holds MoE layers but
    not the loss gets it here. Its loss adds the aux part of its layers that no loss counted (every
    stage before the last), so the losses summed over stages are one process's."""

    def __init__(self, runner: Runner, routing: RoutingStats, coef: float):
        self.runner, self.routing, self.coef = runner, routing, coef

    def forward_backward(self, inputs, targets, normaliser: int, scored=None) -> float:
        self.routing.set_normaliser(self.coef, targets.shape[1], normaliser)
        loss = self.runner.forward_backward(inputs, targets, normaliser, scored)
        return loss + self.routing.settle()


def dispatch_bytes_per_step(cfg, local_sequences: int) -> int:
    """All-to-all bytes one rank sends per step: 4 all-to-alls per MoE layer and micro-batch (two
    forward, two backward; 6 with --recompute full, whose backward reruns the forward's two), each
    (ep-1)/ep of the padded buffer n_experts * b * C * d_model."""
    itemsize = 8 if cfg.precision == "fp64" else 4
    capacity = MoEConfig(cfg.n_experts, cfg.top_k, cfg.capacity_factor).capacity(cfg.seq_len)
    b = local_sequences // cfg.microbatches
    buffer = cfg.n_experts * b * capacity * cfg.d_model * itemsize
    per_layer = 6 if cfg.recompute == "full" else 4
    return per_layer * cfg.n_layer * cfg.microbatches * buffer * (cfg.ep - 1) // cfg.ep


class ExpertParallelUpdater(LocalUpdater):
    """Sum the gradients over the ranks that hold the same parameter, then step: experts over edp,
    everything else over dp (one all-reduce per parameter: small models, kept plain)."""

    def __init__(self, model, optimizer, dp: Comm, groups: ExpertGroups):
        super().__init__(model, optimizer)
        self.dp, self.groups = dp, groups

    def synchronize_gradients(self) -> None:
        with no_grad():
            for name, param in self.model.named_parameters():
                comm = self.comm_of(name)
                if param.grad is not None and comm.size > 1:
                    param.grad = comm.all_reduce(param.grad)

    def comm_of(self, name: str) -> Comm:
        return self.groups.edp if is_expert(name) else self.dp

    def ready_gradients(self):
        """Each sum is the same on the ranks that made it: their first rank counts it (GradientPiece)."""
        return [replace(piece, counted=self.comm_of(piece.name).rank == 0)
                for piece in super().ready_gradients()]


class TensorParallelMoEGPT(MoEGPT, TensorParallelGPT):
    """MoE with tensor parallelism: attention, embedding and head split over tp as in tensor_gpt.py,
    the MoE layers (router and experts) replicated over tp. Each tp rank has the whole residual stream,
    so each routes the same tokens the same way and computes the same expert gradients: no collective
    of its own. The loss is tensor parallelism's (next in the MRO) plus the aux loss (MoEGPT)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, comm: Comm, seed: int | None = 0,
                 recompute: str = "none", layer=MoELayer):
        self.routing = RoutingStats(moe.n_experts)
        TensorParallelGPT.__init__(self, cfg, comm, seed=None, recompute=recompute,
                                   mlp=lambda: layer(cfg, moe, self.routing))
        self.moe = moe
        if seed is not None:
            self.init_parameters(seed)


class ModelPart:
    """The parameters of `model` that `wanted(name)` picks, seen as a model of their own: its units
    are the model's units cut down to those parameters. ZeRO shards each part over its own group."""

    def __init__(self, model, wanted):
        self.model, self.wanted = model, wanted

    def named_parameters(self):
        return [(name, p) for name, p in self.model.named_parameters() if self.wanted(name)]

    def units(self):
        return [(name, UnitPart(unit, name, self.wanted)) for name, unit in self.model.units()]


class UnitPart:
    """The parameters of one unit that a ModelPart picks; its hooks are the unit's own (ZeRO 2-3 hook
    the unit: each part's hook then moves only that part's parameters and gradients)."""

    def __init__(self, unit, prefix: str, wanted):
        self.unit = unit
        self.chosen = [p for name, p in unit.named_parameters() if wanted(f"{prefix}.{name}")]

    def parameters(self):
        return self.chosen

    def register_forward_pre_hook(self, hook):
        return self.unit.register_forward_pre_hook(hook)

    def register_forward_hook(self, hook):
        return self.unit.register_forward_hook(hook)

    def register_full_backward_pre_hook(self, hook):
        return self.unit.register_full_backward_pre_hook(hook)

    def register_full_backward_hook(self, hook):
        return self.unit.register_full_backward_hook(hook)


def is_expert(name: str) -> bool:
    return ".experts." in name


class ExpertParallelZero(Updater):
    """ZeRO (stage 1, 2 or 3) with experts: the experts' states sharded over edp (the ranks holding
    them) and their gradients reduce-scattered over it only, the rest over dp; each part is a ZeRO
    updater of its own, both hooked on the same units (stages 2-3)."""

    def __init__(self, model, optimizer_of, dp: Comm, groups: ExpertGroups, stage: int,
                 prefetch: bool = False, working: Wire | None = None):
        """working: stage 3's 16-bit working copy in bf16 or fp16 (zero3.py), else None."""
        Updater.__init__(self, model, None)
        makers: dict[int, Callable[..., Updater]] = {
            1: ZeroStage1, 2: ZeroStage2, 3: partial(ZeroStage3, prefetch=prefetch, working=working)}
        make = makers[stage]
        self.parts = [make(ModelPart(model, lambda n: not is_expert(n)), optimizer_of([]), dp),
                      make(ModelPart(model, is_expert), optimizer_of([]), groups.edp)]
        self.optimizer = self.parts[0].optimizer
        self.gathers_parameters = stage == 3

    def synchronize_gradients(self) -> None:
        for part in self.parts:
            part.synchronize_gradients()

    def ready_gradients(self):
        return [piece for part in self.parts for piece in part.ready_gradients()]

    def apply_optimizer(self) -> None:
        for part in self.parts:
            part.apply_optimizer()

    def release_gradients(self) -> None:
        for part in self.parts:
            part.release_gradients()

    def memory(self) -> dict:
        held = [part.memory() for part in self.parts]
        return {key: sum(h[key] for h in held) for key in held[0]}

    def checkpoint_pieces(self) -> dict:
        return {**self.parts[0].checkpoint_pieces(), **self.parts[1].checkpoint_pieces()}

    def load_logical(self, state) -> None:
        for part in self.parts:
            part.load_logical(state)

    def local_state(self) -> dict:
        return {**self.parts[0].local_state(), **self.parts[1].local_state()}


@dataclass
class ExpertOptions:
    """Expert parallelism (parallel/experts.py; with --model moe)."""
    ep: int = option(1, "--model moe: expert parallelism, the experts split over blocks of ep dp ranks "
                     "(parallel/experts.py)", single_process=1)


def config_errors(options: ExpertOptions, data_parallel: DataParallelOptions, moe: MoEOptions,
                  model: ModelOptions) -> list[str]:
    """`--ep`'s checks, one line each."""
    ep = options.ep
    if ep == 1:
        return []
    if ep < 1:
        return [f"--ep must be at least 1 (got {ep})"]
    if model.model != "moe":
        return [f"--ep {ep} needs --model moe (experts to split)"]
    errors = []
    dp = data_parallel.dp if data_parallel.dp is not None else 1
    if dp % ep:
        errors.append(f"--ep {ep} does not divide dp={dp} (ep groups are blocks of ep dp ranks)")
    if moe.n_experts % ep:
        errors.append(f"--n-experts {moe.n_experts} is not divisible by --ep {ep}")
    return errors
