"""Activation memory as a formula: the bytes minipar's GPT saves for backward, per block and per rank.

The idea: every array a Function saves for backward (core/autograd.py's activation meter counts
them) is a product of the sizes s (sequence), b (micro-batch), h (d_model), a (heads), t (tensor
parallel ranks) and V (vocabulary). Counting what each operation of a block saves, in values:

    ln_1, ln_2        xhat (sbh) and 1/std (sb) each              2sbh + 2sb
    query, key, value each saves its input x (replicated)         3sbh
    attention core    q, k (sbh/t each); the softmax (as²b/t);
                      softmax and v again for the weighted sum
                      (as²b/t + sbh/t); scaling the scores by a
                      constant keeps nothing                      3sbh/t + 2as²b/t
    proj (attention)  its input (sbh/t)                           sbh/t
    fc, GELU, proj    fc's input sbh; GELU's input and proj's
                      input, 4sbh/t each                          sbh + 8sbh/t

    one block, none:       sbh(6 + 12/t) + 2as²b/t + 2sb     (t = 1: 18sbh + 2as²b + 2sb)
    selective:             sbh(6 + 12/t) + 2sb               the core keeps only q, k, v: 3sbh/t
    full:                  sbh                               the block's input only

With sequence parallelism (parallel/sequence.py) the LayerNorms work on s/t positions, so their
2sbh + 2sb become (2sbh + 2sb)/t, and full recomputation keeps sbh/t per block:

    none, --sp:            sbh(4 + 14/t) + 2as²b/t + 2sb/t
    selective, --sp:       sbh(4 + 14/t) + 2sb/t
    full, --sp:            sbh/t

Korthikanti et al. (2022) count sbh(34 + 5as/h) for the same block: their activations are 2 bytes and
their dropout masks 1 byte, and they count q, k and v's shared input once (minipar's meter counts it
three times, once per Linear that saves it, and softmax's output twice: for softmax's backward and for
the weighted sum's). Their selective recomputation drops the 5as/h term as this one drops 2as²b/t.

The 4sbh left whole under --sp are the gathered inputs of query, key, value and fc: each Linear saves
the input it multiplies, where Megatron saves the sequence piece and all-gathers it again in backward
(their sbh(34/t + 5as/(ht)), everything divided by t). A run's peak adds the embedding (0 values;
sb with tensor parallelism: its lookup's mask) and the head (ln_f sbh + sb, over t with --sp;
lm_head's input sbh; the softmax sbV/t; the loss, scaled by a constant, nothing), and, with
recomputation, the largest transient of backward: a block recomputed on top of the kept inputs.
`gpt_activation_peak` is that high-water mark for one pipeline stage holding the whole model (pp = 1);
the memory ledger's measured `activations_peak` equals it to the byte (tests/parallel/test_recompute.py,
test_sequence.py). Lesson: lessons/01_autograd.md.
"""

from __future__ import annotations

from minipar.core.shards import padded_bounds


def block_activation_values(s: int, b: int, h: int, a: int, t: int = 1, recompute: str = "none",
                            sp: bool = False) -> int:
    """Values one transformer block keeps for backward on one tensor-parallel rank."""
    p = t if sp else 1  # sequence parallelism: the LayerNorms and the block input on s/t positions
    if recompute == "full":
        return s * b * h // p
    layer_norms = 2 * (s * b * h + s * b) // p
    kept = layer_norms + 4 * s * b * h + 12 * s * b * h // t  # q, k, v and fc inputs; the split rest
    return kept if recompute == "selective" else kept + 2 * a * s * s * b // t


def attention_core_values(s: int, b: int, h: int, a: int, t: int = 1) -> int:
    """Values the attention core saves when it is recorded: q, k, v and the softmax's output twice."""
    return 3 * s * b * h // t + 2 * a * s * s * b // t


def head_values(s: int, b: int, h: int, vocab: int, t: int = 1, sp: bool = False) -> int:
    """ln_f (sbh + sb, over tp with --sp), lm_head's input (sbh), the vocab-parallel softmax
    (sb V/t, V padded to a multiple of t); the loss's scaling by 1/tokens keeps nothing."""
    start, stop = padded_bounds(vocab, t, 0)
    return (s * b * h + s * b) // (t if sp else 1) + s * b * h + s * b * (stop - start)


def embedding_values(s: int, b: int, h: int, t: int = 1) -> int:
    """The token lookup saves nothing; tensor parallelism's multiplies it by a mask, saving the mask."""
    return 0 if t == 1 else s * b


def gpt_activation_peak(s: int, b: int, h: int, a: int, n_layer: int, vocab: int, t: int = 1,
                        recompute: str = "none", bytes_per_value: int = 8, sp: bool = False) -> int:
    """The most bytes saved for backward at once during one micro-batch's forward and backward."""
    block = block_activation_values(s, b, h, a, t, recompute, sp)
    kept = embedding_values(s, b, h, t) + n_layer * block
    end_of_forward = kept + head_values(s, b, h, vocab, t, sp)
    if recompute == "none":
        return end_of_forward * bytes_per_value
    if recompute == "full":  # backward reruns the last block whole on top of every block's input
        recomputed = block_activation_values(s, b, h, a, t, "none", sp)
        return max(end_of_forward, kept + recomputed) * bytes_per_value
    # selective: backward reruns the last block's core once ln_2, the MLP and proj have been through
    # backward, on top of what remains of the block (ln_1, the q, k, v inputs, the core's q, k, v)
    freed = (s * b * h + s * b) // (t if sp else 1) + s * b * h + 9 * s * b * h // t
    return max(end_of_forward, kept - freed + attention_core_values(s, b, h, a, t)) * bytes_per_value
