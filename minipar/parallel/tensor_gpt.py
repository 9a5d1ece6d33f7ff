"""The GPT of nn.py assembled from the tensor-parallel layers of tensor.py.

Same parts, same parameter names ("embed.wte.weight", "blocks.0.attn.query.weight", ...), same
`units()`: only the layers inside are split, each split parameter carrying its `Shard`, so
`init_parameters(seed)` cuts this rank's piece from the very tensors the single-process GPT draws,
and any tp trains the same model. LayerNorms, the position embedding and the row-parallel biases are
replicated: f and g give them identical gradients on every tp rank. The head leaves the logits split
by vocabulary, and `loss` is the vocab-parallel cross-entropy, so the full logits never exist anywhere.
The model talks only over the communicator it is given (`grid.tp`), so pipeline stages and data-parallel
replicas compose around it. Lesson: lessons/05_tensor_parallel.md.
"""

from __future__ import annotations

from minipar.core.backend import xp_of
from minipar.core.nn import GPT, Block, GPTConfig, GPTEmbedding, GPTHead, Module, ModuleList, causal_attention
from minipar.parallel.tensor import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


class TensorParallelGPT(GPT):
    """nn.GPT with every weight matrix split over `comm` (Megatron's layout); `units()` and `forward()`
    are GPT's own. `mlp()`, when given, makes each block's MLP instead (a MoE layer replicated over tp:
    parallel/experts.py)."""

    def __init__(self, cfg: GPTConfig, comm, seed: int | None = 0, recompute: str = "none",
                 attention=causal_attention, mlp=None):
        Module.__init__(self)  # GPT's three parts, built here from split layers instead of dense ones
        self.config, self.comm = cfg, comm
        wte = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, comm, dtype=cfg.dtype)
        self.embed = GPTEmbedding(cfg, wte=wte)
        selective, full = recompute == "selective", recompute == "full"
        self.blocks = ModuleList([Block(cfg, attn=ParallelAttention(cfg, comm, selective, attention),
                                        mlp=mlp() if mlp else ParallelMLP(cfg, comm), recompute=full)
                                  for _ in range(cfg.n_layer)])
        lm_head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, comm, bias=False, dtype=cfg.dtype)
        self.head = GPTHead(cfg, lm_head=lm_head)
        self.vocab_start = lm_head.start  # the loss needs it even on a pipeline stage without the head
        if seed is not None:
            self.init_parameters(seed)

    def loss_and_correct(self, logits, targets, normaliser: int):
        """Summed token cross-entropy over the vocab-split logits, divided by the global token count;
        and where the target's logit is the row's largest, which the loss finds with no extra message."""
        width = logits.shape[-1]
        correct = xp_of(logits.data).zeros(targets.size, dtype=bool)
        total = vocab_parallel_cross_entropy(logits.reshape(-1, width), targets.reshape(-1), self.vocab_start,
                                             self.config.vocab_size, self.comm, correct)
        return total * (1.0 / normaliser), correct.reshape(targets.shape)
