"""Activation memory as a formula: the bytes minipar's GPT saves for backward, per block and per rank.

The idea: every array a Function saves for backward (core/autograd.py's activation meter counts
each buffer once, whoever saves it) is a product of the sizes s (sequence), b (micro-batch),
h (d_model), a (heads), t (tensor parallel ranks) and V (vocabulary). These are the items of
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), Table 2,
mapped exactly: no dropout (its masks, and its output the product with v would save, are gone: that
product saves the softmax output itself), minipar's value size in place of their 2 bytes, and
LayerNorm's saved statistics (1/std, sb per LayerNorm), which they leave out. In values:

    item (their Table 2)              theirs, bytes         minipar, values
    ln_1, ln_2 inputs                 4sbh                  2sbh (xhat each) + 2sb (1/std each)
    QKV's shared input                2sbh                  sbh
    QK^T: q and k                     4sbh/t                2sbh/t
    softmax output                    2as²b/t               as²b/t
    softmax dropout mask, its output  as²b/t + 2as²b/t      -
    attention over values: v          2sbh/t                sbh/t
    linear projection's input         2sbh/t                sbh/t
    its dropout mask, the MLP's       sbh + sbh             -
    MLP: fc's input                   2sbh                  sbh
    GELU's input, fc2's input         8sbh/t + 8sbh/t       4sbh/t + 4sbh/t

    one block, none:       sbh(4 + 12/t) + as²b/t + 2sb     (t = 1: 16sbh + as²b + 2sb)
    selective:             sbh(4 + 12/t) + 2sb              the core keeps only q, k, v: 3sbh/t
    full:                  sbh                              the block's input only

Their 34sbh + 5as²b for t = 1 is this in 2-byte values with 2sbh of dropout masks and 4as²b of
attention dropout added. With sequence parallelism (parallel/sequence.py) the LayerNorms work on s/t
positions, so their 2sbh + 2sb become (2sbh + 2sb)/t; QKV and fc keep their piece of the gathered
input, sbh/t each, and all-gather it again in backward, as Megatron does; and full recomputation keeps
sbh/t per block. Every item is divided by t, as their sbh(34/t + 5as/(ht)) is:

    none, --sp:            16sbh/t + as²b/t + 2sb/t
    selective, --sp:       16sbh/t + 2sb/t
    full, --sp:            sbh/t

The gathered input that is made again in backward, from the first reader's weight gradient to the last
one's, is a temporary buffer (the memory ledger's buffer meter), not a saved activation: it is not in
these formulas, as it is not in the paper's. Integer indices are saved too, 8 bytes each whatever
the value size (`index_bytes`): the token ids (sb) and positions (s) of the lookups, the targets (sb)
of the loss. A run's peak adds the embedding (0 values; 2sb with tensor parallelism: its lookups'
masks, plus their ids) and the head (ln_f sbh + sb and lm_head's input sbh, each over t with --sp; the
softmax sbV/t; the loss, scaled by a constant, nothing), and, with recomputation, the largest transient
of backward: a block recomputed on top of the kept inputs. `gpt_activation_peak` is that high-water mark
for one pipeline stage holding the whole model (pp = 1); the memory ledger's measured
`activations_peak` equals it to the byte (tests/parallel/test_recompute.py, test_sequence.py).
Lesson: lessons/01_autograd.md.
"""

from __future__ import annotations

from minipar.core.shards import padded_bounds

INDEX_BYTES = 8  # an int64 index (token ids, positions, targets), whatever the value size


def block_activation_values(s: int, b: int, h: int, a: int, t: int = 1, recompute: str = "none",
                            sp: bool = False) -> int:
    """Values one transformer block keeps for backward on one tensor-parallel rank."""
    p = t if sp else 1  # sequence parallelism: the LayerNorms, the gathered inputs, the block input over t
    if recompute == "full":
        return s * b * h // p
    layer_norms = 2 * (s * b * h + s * b) // p
    gathered = 2 * s * b * h // p  # QKV's and fc's inputs (--sp: their piece, gathered again in backward)
    kept = layer_norms + gathered + 12 * s * b * h // t  # q, k, v, proj, GELU and fc2 inputs, split
    return kept if recompute == "selective" else kept + a * s * s * b // t


def attention_core_values(s: int, b: int, h: int, a: int, t: int = 1) -> int:
    """Values the attention core adds when it is recorded on top of its inputs q, k and v (which the
    recomputation keeps): the softmax's output, once, though the softmax and the product with v save it."""
    return a * s * s * b // t


def head_values(s: int, b: int, h: int, vocab: int, t: int = 1, sp: bool = False) -> int:
    """ln_f (sbh + sb) and lm_head's input (sbh), each over tp with --sp, the vocab-parallel softmax
    (sb V/t, V padded to a multiple of t); the loss's scaling by 1/tokens keeps nothing."""
    start, stop = padded_bounds(vocab, t, 0)
    return (2 * s * b * h + s * b) // (t if sp else 1) + s * b * (stop - start)


def head_index_bytes(s: int, b: int, t: int = 1) -> int:
    """The loss's targets (sb indices); with tensor parallelism, its local targets and which are its
    own (sb indices and sb booleans)."""
    return s * b * INDEX_BYTES + (0 if t == 1 else s * b)


def embedding_values(s: int, b: int, h: int, t: int = 1) -> int:
    """The token lookup saves nothing; tensor parallelism's multiplies it by a mask, saving the mask."""
    return 0 if t == 1 else s * b


def embedding_index_bytes(s: int, b: int, t: int = 1, sp: bool = False) -> int:
    """The lookups' ids: the tokens' (sb) and the positions' (s; s/t, the piece's, with --sp)."""
    return (s * b + s // (t if sp else 1)) * INDEX_BYTES


def gpt_activation_peak(s: int, b: int, h: int, a: int, n_layer: int, vocab: int, t: int = 1,
                        recompute: str = "none", bytes_per_value: int = 8, sp: bool = False) -> int:
    """The most bytes saved for backward at once during one micro-batch's forward and backward."""
    block = block_activation_values(s, b, h, a, t, recompute, sp)
    kept = (embedding_values(s, b, h, t) + n_layer * block) * bytes_per_value
    kept += embedding_index_bytes(s, b, t, sp)
    end_of_forward = kept + head_values(s, b, h, vocab, t, sp) * bytes_per_value + head_index_bytes(s, b, t)
    if recompute == "none":
        return end_of_forward
    if recompute == "full":  # backward reruns the last block whole on top of every block's input
        recomputed = block_activation_values(s, b, h, a, t, "none", sp)
        return max(end_of_forward, kept + recomputed * bytes_per_value)
    # selective: backward reruns the last block's core once ln_2, the MLP and proj have been through
    # backward, on top of what remains of the block (ln_1, the QKV input, the core's q, k, v)
    freed = (2 * s * b * h + s * b) // (t if sp else 1) + 9 * s * b * h // t  # ln_2, fc's input; the split
    return max(end_of_forward, kept + (attention_core_values(s, b, h, a, t) - freed) * bytes_per_value)
