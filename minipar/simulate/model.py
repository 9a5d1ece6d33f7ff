"""FLOPs and parameters of a GPT from its shape: the arithmetic a step's compute time starts from.

The idea (Narayanan et al. 2021, appendix): a transformer block of width h on s tokens does
24·s·h²(1 + s/6h) multiply-adds-times-two per sequence in its matmuls (q, k, v, the projection and
the 4h MLP: 24sh²; the attention scores and the weighted sum: 4s²h); the logits add 2·s·h·V. So a
forward over B sequences costs 24·B·s·L·h²(1 + s/6h + V/12Lh), backward twice that (the input
gradient and the weight gradient), 72·B·s·L·h²(1 + s/6h + V/12Lh) in all: the model FLOPs that
MFU counts. Full recomputation runs the blocks' forward once more, not the logits: 96·B·s·L·h²(1 +
s/6h + V/16Lh), what the hardware runs and what the paper's Table 1 reports.
Elementwise work (LayerNorm, GELU, softmax) is left out, as the paper does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """A GPT's sizes: blocks L, width h, heads a, sequence s, vocabulary V."""

    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab: int


def parameter_count(m: ModelShape) -> int:
    """minipar's GPT exactly: token and position embeddings, 12h² + 12h per block (q, k, v, two
    projections and fc, each with a bias but the key, whose bias softmax would cancel; two
    LayerNorms), ln_f, and an untied lm_head without bias."""
    # exercise 14.1: the GPT's parameter count from its shape
    h = m.d_model
    embeddings = m.vocab * h + m.seq_len * h
    block = 12 * h * h + 12 * h
    return embeddings + m.n_layer * block + 2 * h + h * m.vocab
    # end exercise


def layer_forward_flops(m: ModelShape, sequences: int) -> int:
    """One block's forward FLOPs over `sequences` sequences: 24·B·s·h² + 4·B·s²·h."""
    s, h = m.seq_len, m.d_model
    return sequences * (24 * s * h * h + 4 * s * s * h)


def logit_forward_flops(m: ModelShape, sequences: int) -> int:
    """The output projection's forward FLOPs: 2·B·s·h·V."""
    return 2 * sequences * m.seq_len * m.d_model * m.vocab


def model_flops(m: ModelShape, sequences: int) -> int:
    """Forward and backward, three passes: 72·B·s·L·h²(1 + s/6h + V/12Lh)."""
    return 3 * (m.n_layer * layer_forward_flops(m, sequences) + logit_forward_flops(m, sequences))


def hardware_flops(m: ModelShape, sequences: int, recompute: str = "none") -> int:
    """What the hardware runs: full recomputation adds one forward of the blocks (the 96 form);
    selective recomputation adds the attention core's score matmuls (4·B·s²·h per block)."""
    extra = 0
    if recompute == "full":
        extra = m.n_layer * layer_forward_flops(m, sequences)
    elif recompute == "selective":
        extra = m.n_layer * 4 * sequences * m.seq_len ** 2 * m.d_model
    return model_flops(m, sequences) + extra
