"""Sequence parallelism (Korthikanti et al., 2022): the regions tensor parallelism leaves replicated,
cut along the sequence.

The idea. Between a row-parallel linear and the next column-parallel one (the residual add and the
LayerNorm), Megatron's tensor parallelism (tensor.py) has every tp rank hold the whole (b, s, h)
activation. Here each tp rank keeps s/tp positions of it instead. Where the activation leaves a
tensor-parallel region the partial sums are reduce-scattered along the sequence (not all-reduced),
and where it enters the next one the pieces are all-gathered:

    tensor parallelism    ... -> g (all-reduce)      -> LN, residual on (b, s, h)    -> f (identity) -> ...
    sequence parallelism  ... -> reduce-scatter (s)  -> LN, residual on (b, s/t, h)  -> all-gather   -> ...

An all-reduce is a reduce-scatter and an all-gather, so the activations cross the wire with the same
bytes as under tensor parallelism (each collective's backward is the other one). The replicated
parameters used on a piece of the sequence (LayerNorm weights and biases, the row-parallel biases,
the position embedding: Megatron marks them `sequence_parallel`) get only their piece's gradient on
each tp rank; a small all-reduce of their gradients over tp (in backward, micro-batch by micro-batch,
so that ZeRO-2/3 reduce-scatter summed gradients) makes them whole.

The column-parallel layers after a gather (query, key and value; fc; lm_head) keep this rank's piece
of their input, not the gathered whole, and all-gather it again in backward for their weight
gradients, once per gathered input (Megatron's sequence_parallel linear; mappings.py's
LinearOnGatheredSequence): so every activation of a block is divided by tp, Korthikanti et al.'s
Table 2 with sequence parallelism.

What it saves: the LayerNorm and residual activations, the column layers' inputs, and the block
inputs that full recomputation keeps, divided by tp (memory/activations.py has the bytes). What it
costs: the bytes of tensor parallelism, plus one all-gather of the (b, s, h) activation per gathered
input in backward (2 per block and the head's: (t-1)/t of its bytes each), plus 2(t-1)/t times the
replicated parameters' gradient bytes per micro-batch.
Lesson: lessons/05_tensor_parallel.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import cast

from minipar.core import functional as F
from minipar.core import layer_ops
from minipar.core.autograd import Function
from minipar.core.backend import xp_of
from minipar.core.nn import (
    Block,
    GPTConfig,
    GPTEmbedding,
    GPTHead,
    LayerNorm,
    ModelOptions,
    Module,
    ModuleList,
    attention_core,
)
from minipar.core.options import option
from minipar.parallel.mappings import (
    GatheredPiece,
    gather_from_sequence_parallel,
    linear_on_gathered_sequence,
    reduce_scatter_to_sequence_parallel,
    replicated_on_sequence_piece,
)
from minipar.parallel.tensor import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    TensorOptions,
    VocabParallelEmbedding,
)
from minipar.parallel.tensor_gpt import TensorParallelGPT

# ---- the layers: tensor.py's, with the collectives along the sequence ---------------------------------


class LayerNormOnSequencePiece(Function):
    """layer_ops.LayerNorm on this rank's piece, whose backward sums the weight's and the bias's
    gradients over tp (each piece gives its positions' share). Its node reads the weight as the
    parameter it is, as LayerNorm's does: a copy handed out by ReplicatedOnSequencePiece would be an
    array the node keeps until backward, held but counted by no meter."""

    reads_in_backward = layer_ops.LayerNorm.reads_in_backward  # the weight (ZeRO-3 re-gathers it)

    @staticmethod
    def forward(ctx, x, weight, bias, eps, comm):
        ctx.comm = comm
        return layer_ops.LayerNorm.forward(ctx, x, weight, bias, eps)

    @staticmethod
    def backward(ctx, g):
        gx, gw, gb, _ = layer_ops.LayerNorm.backward(ctx, g)
        gw = ctx.comm.all_reduce(gw) if gw is not None else None
        gb = ctx.comm.all_reduce(gb) if gb is not None else None
        return gx, gw, gb, None, None


class SequenceParallelLayerNorm(LayerNorm):
    """nn.LayerNorm on this rank's (b, s/t, h) piece; its weight and bias gradients summed over tp."""

    def __init__(self, dim, comm, eps=1e-5, dtype="float64"):
        super().__init__(dim, eps, dtype)
        self.comm = comm

    def forward(self, x):
        return LayerNormOnSequencePiece.apply(x, self.weight, self.bias, self.eps, self.comm)


class SequenceParallelColumnLinear(ColumnParallelLinear):
    """ColumnParallelLinear on an input all-gathered along the sequence that keeps only this rank's
    piece of it for backward, and gathers it again there for the weight gradient, once for all the
    layers that share the input (mappings.py's LinearOnGatheredSequence, Megatron's sequence_parallel
    linear). Called as `layer(gathered, piece)`: the gathered Tensor and its GatheredPiece."""

    def __init__(self, in_features, out_features, comm, bias=True, std=0.02, dtype="float64"):
        super().__init__(in_features, out_features, comm, bias, input_is_copied=True, std=std, dtype=dtype)

    def forward(self, x, piece: GatheredPiece):  # type: ignore[override]  # the gathered input's piece too
        return linear_on_gathered_sequence(x, self.weight, self.bias, piece)


def gathered_with_piece(x, comm) -> tuple:
    """The all-gathered (b, s, h) Tensor of this rank's (b, s/t, h) piece x, and the GatheredPiece its
    readers keep instead of it."""
    return gather_from_sequence_parallel(x, comm), GatheredPiece(x, comm)


class SequenceParallelRowLinear(RowParallelLinear):
    """RowParallelLinear whose partial sums are reduce-scattered along the sequence (not all-reduced);
    the replicated bias is added on this rank's positions."""

    def forward(self, x_parallel):
        y = reduce_scatter_to_sequence_parallel(F.linear(x_parallel, self.weight), self.comm)
        return y + replicated_on_sequence_piece(self.bias, self.comm) if self.bias is not None else y


class SequenceParallelAttention(ParallelAttention):
    """ParallelAttention entered by an all-gather of the sequence and left by a reduce-scatter."""

    def __init__(self, cfg, comm, recompute_core: bool = False):
        super().__init__(cfg, comm, recompute_core)
        d = cfg.d_model
        self.query = SequenceParallelColumnLinear(d, d, comm, dtype=cfg.dtype)
        self.key = SequenceParallelColumnLinear(d, d, comm, bias=False, dtype=cfg.dtype)
        self.value = SequenceParallelColumnLinear(d, d, comm, dtype=cfg.dtype)
        self.proj = SequenceParallelRowLinear(d, d, comm, std=cfg.residual_std, dtype=cfg.dtype)

    def forward(self, x):
        # query, key and value keep one piece between them, and backward gathers it again once
        x, piece = gathered_with_piece(x, self.comm)
        y = attention_core(self.query(x, piece), self.key(x, piece), self.value(x, piece), self.local_heads,
                           self.recompute_core)
        return self.proj(y)


class SequenceParallelMLP(ParallelMLP):
    """ParallelMLP entered by an all-gather of the sequence and left by a reduce-scatter."""

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        d, self.comm = cfg.d_model, comm
        self.fc = SequenceParallelColumnLinear(d, 4 * d, comm, dtype=cfg.dtype)
        self.proj = SequenceParallelRowLinear(4 * d, d, comm, std=cfg.residual_std, dtype=cfg.dtype)

    def forward(self, x):
        return self.proj(self.activation(self.fc(*gathered_with_piece(x, self.comm))))


class SequenceParallelEmbedding(GPTEmbedding):
    """The vocab-parallel lookup's partial sums reduce-scattered along the sequence, then this rank's
    positions of the position embedding added (its gradient summed over tp)."""

    def __init__(self, cfg: GPTConfig, comm):
        super().__init__(cfg, wte=VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, comm, dtype=cfg.dtype))
        self.comm = comm

    def forward(self, ids):
        partial = cast(VocabParallelEmbedding, self.wte).partial_lookup(ids)
        tokens = reduce_scatter_to_sequence_parallel(partial, self.comm)
        piece = ids.shape[1] // self.comm.size
        positions = xp_of(self.wpe.weight.data).arange(self.comm.rank * piece, (self.comm.rank + 1) * piece)
        return tokens + F.embedding(positions, replicated_on_sequence_piece(self.wpe.weight, self.comm))


class SequenceParallelHead(GPTHead):
    """ln_f on this rank's positions, then the sequence all-gathered into the vocab-parallel lm_head,
    which keeps only the piece (gathered again in backward, as the blocks' column layers)."""

    def __init__(self, cfg: GPTConfig, comm):
        lm_head = SequenceParallelColumnLinear(cfg.d_model, cfg.vocab_size, comm, bias=False, dtype=cfg.dtype)
        super().__init__(cfg, lm_head=lm_head)
        self.ln_f = SequenceParallelLayerNorm(cfg.d_model, comm, dtype=cfg.dtype)
        self.comm, self.vocab_start = comm, lm_head.start

    def forward(self, x):
        return self.lm_head(*gathered_with_piece(self.ln_f(x), self.comm))


class SequenceParallelGPT(TensorParallelGPT):
    """TensorParallelGPT with its replicated regions cut along the sequence: the same parameter names,
    shards and `units()`, so initialisation, checkpoints, ZeRO and the pipeline need no change. The
    units pass (b, s/tp, d_model) pieces between them; the loss is TensorParallelGPT's."""

    def __init__(self, cfg: GPTConfig, comm, seed: int | None = 0, recompute: str = "none"):
        Module.__init__(self)
        self.config, self.comm = cfg, comm
        self.embed = SequenceParallelEmbedding(cfg, comm)
        norm = functools.partial(SequenceParallelLayerNorm, comm=comm)
        self.blocks = ModuleList([
            Block(cfg, attn=SequenceParallelAttention(cfg, comm, recompute == "selective"),
                  mlp=SequenceParallelMLP(cfg, comm), recompute=recompute == "full", norm=norm)
            for _ in range(cfg.n_layer)])
        self.head = SequenceParallelHead(cfg, comm)
        self.vocab_start = self.head.vocab_start
        if seed is not None:
            self.init_parameters(seed)


# ---- what `minipar train --sp` needs (trainer/validate.py gathers it) ----------------------------------


@dataclass
class SequenceOptions:
    """Sequence parallelism (parallel/sequence.py; inside --tp)."""
    sp: bool = option(False, "sequence parallelism inside --tp (needs --tp > 1)", single_process=False)


def config_errors(options: SequenceOptions, tensor: TensorOptions, model: ModelOptions) -> list[str]:
    """--sp cuts the GPT's sequence over the tensor-parallel ranks: it needs them, and equal pieces."""
    if not options.sp:
        return []
    if model.model != "gpt":
        return ["--sp needs --model gpt (sequence parallelism cuts the GPT's sequence; the MLP has none)"]
    if tensor.tp < 2:
        return [f"--sp needs --tp > 1, got --tp {tensor.tp} (sequence parallelism splits the sequence over "
                "the tensor-parallel ranks)"]
    if model.seq_len % tensor.tp:
        return [f"--sp: --seq-len {model.seq_len} is not divisible by --tp {tensor.tp} "
                "(each tensor-parallel rank keeps seq_len/tp positions)"]
    return []
