"""Layers and models: Linear, Embedding, LayerNorm, MLP, CausalSelfAttention, Block, GPT, MLPNet.

Names and shapes follow PyTorch (Linear.weight is (out, in)); the module system itself (Module,
Parameter, how initial weights are drawn from (seed, name) and cut to shards) is in module.py and
re-exported here, so `nn.Module` and `nn.Parameter` work as in PyTorch. Models expose `units()`: the
blocks in execution order (embedding, transformer blocks, head), which pipeline parallelism partitions
into stages, and `loss()`, applied after the last unit. Lesson: lessons/01_autograd.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minipar.core import functional as F
from minipar.core.backend import current as current_backend
from minipar.core.backend import xp_of
from minipar.core.module import Module, ModuleList, Parameter, initial_value  # noqa: F401
from minipar.core.options import option
from minipar.core.recompute import checkpoint

MODELS = ("gpt", "mlp", "moe")  # `minipar train --model`: GPT or MLPNet below, MoEGPT in moe.py


@dataclass
class ModelOptions:
    """The model (core/nn.py, core/moe.py)."""
    model: str = option("gpt", "the model: a GPT on digit addition, or an MLP on regression", MODELS)
    n_layer: int = option(4, "transformer blocks (GPT) or layers (MLP)")
    n_head: int = option(4, "attention heads per block")
    d_model: int = option(64, "width of the residual stream (GPT) or of the hidden layers (MLP)")
    seq_len: int = option(32, "tokens per sequence (the GPT's context)")

    @property
    def is_gpt(self) -> bool:
        """A GPT on token data: dense (gpt) or mixture of experts (moe)."""
        return self.model in ("gpt", "moe")

    def n_units(self) -> int:
        """Pipeline units of the model: embedding + blocks + head for the GPT, layers for the MLP."""
        return self.n_layer + 2 if self.is_gpt else self.n_layer


class Linear(Module):
    def __init__(self, in_features, out_features, bias=True, std=0.02, dtype="float64"):
        super().__init__()
        self.weight = Parameter((out_features, in_features), ("normal", std), dtype)
        self.bias = Parameter((out_features,), ("zeros",), dtype) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Embedding(Module):
    def __init__(self, num_embeddings, embedding_dim, std=0.02, dtype="float64"):
        super().__init__()
        self.weight = Parameter((num_embeddings, embedding_dim), ("normal", std), dtype)

    def forward(self, ids):
        return F.embedding(ids, self.weight)


class LayerNorm(Module):
    def __init__(self, dim, eps=1e-5, dtype="float64"):
        super().__init__()
        self.weight = Parameter((dim,), ("ones",), dtype)
        self.bias = Parameter((dim,), ("zeros",), dtype)
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps)


@dataclass
class GPTConfig:
    vocab_size: int = 13
    block_size: int = 32
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64
    dtype: str = "float64"

    @property
    def residual_std(self) -> float:
        """GPT-2 scales the projections into the residual stream by 1/sqrt(2 n_layer)."""
        return 0.02 / math.sqrt(2 * self.n_layer)


def causal_attention(q, k, v, n_head: int):
    """Scaled dot-product attention with a causal mask; q, k, v are (B, T, n_head * head_dim)."""
    B, T, C = q.shape
    hd = C // n_head

    def heads(t):
        return t.reshape(B, T, n_head, hd).transpose(0, 2, 1, 3)

    q, k, v = heads(q), heads(k), heads(v)
    scores = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hd))
    y = F.causal_softmax(scores) @ v  # softmax(scores + mask), mask -inf above the diagonal, in one op
    return y.transpose(0, 2, 1, 3).reshape(B, T, C)


def attention_core(q, k, v, n_head: int, recompute: bool = False, attention=causal_attention):
    """`attention` (causal_attention by default); with `recompute` (`--recompute selective`) only q, k
    and v are kept for backward, and the (B, n_head, T, T) scores and probabilities are recomputed there."""
    if not recompute:
        return attention(q, k, v, n_head)
    return checkpoint(lambda q, k, v: attention(q, k, v, n_head), q, k, v)


class CausalSelfAttention(Module):
    """`attention(q, k, v, n_head)` computes the heads' outputs: causal_attention, or one that splits
    the sequence over ranks (parallel/context.py's ring attention); `recompute_core` keeps only q, k, v
    for backward (`--recompute selective`)."""

    def __init__(self, cfg: GPTConfig, recompute_core: bool = False, attention=causal_attention):
        super().__init__()
        d = cfg.d_model
        self.n_head, self.recompute_core, self.attention = cfg.n_head, recompute_core, attention
        self.query = Linear(d, d, dtype=cfg.dtype)
        # No key bias: softmax is blind to a shift shared by all keys, so its gradient would be pure
        # roundoff, which Adam's normalisation turns into lr-sized noise that differs by layout.
        self.key = Linear(d, d, bias=False, dtype=cfg.dtype)
        self.value = Linear(d, d, dtype=cfg.dtype)
        self.proj = Linear(d, d, std=cfg.residual_std, dtype=cfg.dtype)

    def forward(self, x):
        y = attention_core(self.query(x), self.key(x), self.value(x), self.n_head, self.recompute_core,
                           self.attention)
        return self.proj(y)


class MLP(Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = Linear(cfg.d_model, 4 * cfg.d_model, dtype=cfg.dtype)
        self.proj = Linear(4 * cfg.d_model, cfg.d_model, std=cfg.residual_std, dtype=cfg.dtype)
        self.activation = F.gelu  # `train --fused` swaps in the fused-kernel GELU

    def forward(self, x):
        return self.proj(self.activation(self.fc(x)))


class Block(Module):
    """A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)).

    `recompute` (`--recompute full`): keep only the block's input for backward and run the block
    again there (core/recompute.py). `norm` makes the LayerNorms (sequence parallelism's work on a
    piece of the sequence)."""

    def __init__(self, cfg: GPTConfig, attn: Module | None = None, mlp: Module | None = None,
                 recompute: bool = False, norm=LayerNorm):
        super().__init__()
        self.ln_1 = norm(cfg.d_model, dtype=cfg.dtype)
        self.attn = attn or CausalSelfAttention(cfg)
        self.ln_2 = norm(cfg.d_model, dtype=cfg.dtype)
        self.mlp = mlp or MLP(cfg)
        self.recompute = recompute

    def forward(self, x):
        if not self.recompute:
            return self.residual_branches(x)
        return checkpoint(self.residual_branches, x, parameters=self.parameters())

    def residual_branches(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTEmbedding(Module):
    """Token plus position embeddings: the first pipeline unit."""

    def __init__(self, cfg: GPTConfig, wte: Module | None = None):
        super().__init__()
        self.wte = wte or Embedding(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype)
        self.wpe = Embedding(cfg.block_size, cfg.d_model, dtype=cfg.dtype)

    def forward(self, ids):
        positions = current_backend().xp.arange(ids.shape[1])
        return self.wte(ids) + self.wpe(positions)


class GPTHead(Module):
    """Final LayerNorm and the output projection to logits: the last pipeline unit."""

    def __init__(self, cfg: GPTConfig, lm_head: Module | None = None):
        super().__init__()
        self.ln_f = LayerNorm(cfg.d_model, dtype=cfg.dtype)
        self.lm_head = lm_head or Linear(cfg.d_model, cfg.vocab_size, bias=False, dtype=cfg.dtype)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


class GPT(Module):
    """A GPT-2 style decoder (untied input and output embeddings, so pipeline stages stay separate).

    `recompute`: "none", "selective" (the attention cores) or "full" (whole blocks): core/recompute.py.
    `attention`: how each block's attention combines q, k, v (see CausalSelfAttention)."""

    def __init__(self, cfg: GPTConfig, seed: int | None = 0, recompute: str = "none",
                 attention=causal_attention):
        super().__init__()
        self.config = cfg
        self.embed = GPTEmbedding(cfg)
        self.blocks = ModuleList([Block(cfg, CausalSelfAttention(cfg, recompute == "selective", attention),
                                        recompute=recompute == "full") for _ in range(cfg.n_layer)])
        self.head = GPTHead(cfg)
        if seed is not None:
            self.init_parameters(seed)

    def units(self):
        return [("embed", self.embed)] + [(f"blocks.{i}", b) for i, b in enumerate(self.blocks)] + [
            ("head", self.head)
        ]

    def forward(self, ids):
        x = ids
        for _, unit in self.units():
            x = unit(x)
        return x

    def loss(self, logits, targets, normaliser: int):
        """Summed token cross-entropy divided by the global token count (the same in every layout)."""
        return self.loss_and_correct(logits, targets, normaliser)[0]

    def loss_and_correct(self, logits, targets, normaliser: int):
        """The loss, and where the prediction is right: a boolean array of targets' shape, true where
        the target's logit is the row's largest (a tie counts as right, so tensor parallelism, which
        only has the all-reduced maximum, decides exactly the same). A method, not a static one:
        TensorParallelGPT overrides it with a loss that needs its comm."""
        V = logits.shape[-1]
        flat, xp = logits.data.reshape(-1, V), xp_of(logits.data)
        target_logit = flat[xp.arange(len(flat)), xp.asarray(targets).reshape(-1)]
        correct = (target_logit == flat.max(axis=-1)).reshape(targets.shape)
        loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), "sum") * (1.0 / normaliser)
        return loss, correct


@dataclass
class MLPConfig:
    d_in: int = 16
    d_hidden: int = 64
    d_out: int = 4
    n_layer: int = 4
    dtype: str = "float64"


class DenseLayer(Module):
    """Linear followed by GELU (or nothing, for the output layer): one pipeline unit of MLPNet."""

    def __init__(self, d_in, d_out, activate: bool, dtype, recompute: bool = False):
        super().__init__()
        self.linear = Linear(d_in, d_out, std=1.0 / math.sqrt(d_in), dtype=dtype)
        self.activation = F.gelu if activate else None  # `train --fused` swaps in the fused GELU
        self.recompute = recompute  # `--recompute full`: keep the input only, run again in backward

    def forward(self, x):
        return checkpoint(self.dense, x, parameters=self.parameters()) if self.recompute else self.dense(x)

    def dense(self, x):
        y = self.linear(x)
        return self.activation(y) if self.activation else y


class MLPNet(Module):
    """A stack of dense layers trained by regression: the small model for quick experiments."""

    def __init__(self, cfg: MLPConfig, seed: int | None = 0, recompute: str = "none"):
        super().__init__()
        self.config = cfg
        widths = [cfg.d_in] + [cfg.d_hidden] * (cfg.n_layer - 1) + [cfg.d_out]
        self.layers = ModuleList([DenseLayer(a, b, i < cfg.n_layer - 1, cfg.dtype, recompute == "full")
                                  for i, (a, b) in enumerate(zip(widths, widths[1:]))])
        if seed is not None:
            self.init_parameters(seed)

    def units(self):
        return [(f"layers.{i}", layer) for i, layer in enumerate(self.layers)]

    def forward(self, x):
        for layer in self.layers:  # its units, without their names
            x = layer(x)
        return x

    # An output counts as right within this distance of its target: the targets, tanh(2 x W), lie in
    # (-1, 1) with a spread of about 0.8, and predicting 0 everywhere is right for only 4% of them.
    ACCURACY_TOLERANCE = 0.1

    def loss(self, prediction, targets, normaliser: int):
        """Summed squared error divided by the global number of samples."""
        return self.loss_and_correct(prediction, targets, normaliser)[0]

    def loss_and_correct(self, prediction, targets, normaliser: int):
        """The loss, and which outputs (targets' shape) lie within ACCURACY_TOLERANCE of the target."""
        correct = abs(prediction.data - targets) <= self.ACCURACY_TOLERANCE
        return F.mse_loss(prediction, targets, "sum") * (1.0 / normaliser), correct
