"""A small GPT: the model the demo, the benchmarks and the tests train.

It is a modern decoder-only transformer cut down to what fits in one file, so
that the engine is exercised on the tensors a real language model saves for
backward, not on a toy MLP:

    idx (B, T) ──wte──▶ dropout ──▶ Block × n_layer ──▶ RMSNorm ──▶ lm_head (= wte.T) ──▶ logits (B, T, V)

    Block:  x ──▶ RMSNorm ──▶ causal self-attention (rotary q, k) ──▶ dropout ──(+x)──▶
            x ──▶ RMSNorm ──▶ SwiGLU MLP ─────────────────────────▶ dropout ──(+x)──▶

What each block saves for backward, per token, is roughly: two norm inputs and
outputs, q, k, v before and after rotary, the attention output (plus the
(T, T) probabilities on the "math" path), and the MLP's three hidden-sized
tensors. That mix of cheap-to-recompute (norms, SiLU) and expensive (matmul,
attention) outputs is what the planner chooses between.

Two attention paths compute the same function:

- ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` with
  ``is_causal=True``; the fast path, and the kernel a real model would use.
- ``"math"``: explicit ``softmax(q k^T / sqrt(d))`` under a causal mask. Every
  op is an ordinary autograd op with a deterministic CPU kernel, so tests that
  compare gradients bitwise, and the planner's per-op accounting, can rely on it.

There are no learned position embeddings (rotary supplies position), the output
head is tied to the token embedding, and every weight is drawn from torch's
global RNG, so ``torch.manual_seed(s)`` before construction fixes the model.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ATTENTION_CHOICES", "Block", "GPTConfig", "MiniGPT"]

ATTENTION_CHOICES = ("sdpa", "math")
"""Valid values of ``GPTConfig.attention``."""

INIT_STD = 0.02
"""Standard deviation of the normal init of every linear and embedding weight (GPT-2's value)."""

ROPE_BASE = 10_000.0
"""Rotary base: the wavelength of the slowest-turning pair of channels, in positions."""

NORM_EPS = 1e-6
"""Added to the mean square in RMSNorm so an all-zero row does not divide by zero."""

SWIGLU_MULTIPLE = 8
"""The SwiGLU hidden width is rounded up to a multiple of this, for friendlier matmul shapes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and regularization of a ``MiniGPT``. The defaults train on bytes in seconds on a CPU."""

    vocab_size: int = 256
    """Number of token ids. 256 covers byte-level text (see ``offload.models.corpus``)."""
    n_layer: int = 4
    """Number of transformer blocks: the regions the engine can offload or recompute."""
    n_head: int = 4
    """Attention heads. ``n_embd / n_head`` is the head width and must be even for rotary."""
    n_embd: int = 128
    """Residual stream width. Saved bytes per block grow linearly with it, FLOPs quadratically."""
    seq_len: int = 128
    """Longest sequence the model accepts; sizes the rotary tables and the causal mask."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention probabilities and residual branches.
    Nonzero dropout makes recompute depend on replaying the RNG state exactly."""
    mlp_ratio: float = 4
    """MLP width relative to ``n_embd`` before the SwiGLU 2/3 correction, which keeps its
    parameter count equal to a plain ``mlp_ratio * n_embd`` GELU MLP."""
    bias: bool = False
    """Whether linear layers carry a bias. Off, as in most current models."""
    attention: str = "sdpa"
    """Attention path, one of ``ATTENTION_CHOICES``: ``"sdpa"`` (fused kernel) or ``"math"``
    (explicit softmax; deterministic, every intermediate is an ordinary saved tensor)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be an integer >= 1; pass a positive int.")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "choose n_embd as a multiple of n_head "
                f"(e.g. {self.n_head * 2 * max(1, self.n_embd // (2 * self.n_head))})."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"GPTConfig head width n_embd / n_head = {self.n_embd} / {self.n_head} = {self.head_dim} is odd; "
                f"rotary embeddings rotate channel pairs, so choose n_embd and n_head with an even quotient."
            )
        for name in ("dropout", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"GPTConfig.{name}={value!r}: must be a number; pass a float.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r}: must be in [0, 1); use 0.0 to disable dropout.")
        if not self.mlp_ratio > 0:
            raise ValueError(f"GPTConfig.mlp_ratio={self.mlp_ratio!r}: must be > 0; 4 is the usual choice.")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(
                f"GPTConfig.attention={self.attention!r}: unknown attention path; "
                f"choose one of {', '.join(repr(c) for c in ATTENTION_CHOICES)}."
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        """SwiGLU hidden width: 2/3 of ``mlp_ratio * n_embd``, rounded up to ``SWIGLU_MULTIPLE``."""
        hidden = int(2 / 3 * self.mlp_ratio * self.n_embd)
        return -(-hidden // SWIGLU_MULTIPLE) * SWIGLU_MULTIPLE


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension, computed in float32."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_f32 = x.float()
        normed = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return normed.type_as(x) * self.weight


def _rotary_tables(head_dim: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, (seq_len, head_dim / 2) in float32: computed in
    Python's double precision and rounded once, so every process builds the same tables. (torch's
    float32 ``cos`` did not: on torch 2.13.0+cpu with two threads, the first call in a process gave
    another result at 4094 of these 8192 angles, by up to 1.5e-4, in 7 of 30 processes; a model
    built in one process then trained differently from the same model built in another.)"""
    inv_freq = [ROPE_BASE ** (-i / head_dim) for i in range(0, head_dim, 2)]
    angles = [[position * f for f in inv_freq] for position in range(seq_len)]
    cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64)
    sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64)
    return cos.to(torch.float32), sin.to(torch.float32)


class Rotary(nn.Module):
    """Rotary position embedding: rotates channel pairs (i, i + d/2) by a position-dependent angle."""

    cos: torch.Tensor  # buffers, registered in __init__
    sin: torch.Tensor

    def __init__(self, head_dim: int, seq_len: int) -> None:
        super().__init__()
        cos, sin = _rotary_tables(head_dim, seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape (B, H, T, head_dim)."""
        seq = x.size(-2)
        cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary q and k, on the path ``config.attention`` names."""

    causal_mask: torch.Tensor  # a buffer, registered in __init__ on the "math" path only

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.attention = config.attention
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.rotary = Rotary(config.head_dim, config.seq_len)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        if self.attention == "math":
            mask = torch.ones(config.seq_len, config.seq_len, dtype=torch.bool).tril()
            self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = self.rotary(q), self.rotary(k)
        if self.attention == "sdpa":
            dropout_p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            scores = scores.masked_fill(~self.causal_mask[:seq, :seq], float("-inf"))
            y = self.attn_dropout(scores.softmax(dim=-1)) @ v
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_dropout(self.proj(y))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: the gated MLP of LLaMA-family models."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.up = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.down = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.silu(self.gate(x)) * self.up(x)))


class Block(nn.Module):
    """One pre-norm transformer block: attention then MLP, each added to the residual stream."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.n_embd)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MiniGPT(nn.Module):
    """Decoder-only byte-level language model; see the module docstring for its shape."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"MiniGPT(config=...) needs a GPTConfig, got {type(config).__name__}.")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        for module in self.modules():
            if module is self.lm_head:
                continue  # tied: its weight is wte.weight, initialized once as the embedding
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, INIT_STD)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, INIT_STD)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def num_params(self) -> int:
        """Number of parameters, counting the tied embedding / output weight once."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab_size) for token ids ``idx`` (B, T), and the mean cross-entropy
        against ``targets`` (B, T) when given, else ``None``."""
        if idx.dim() != 2 or idx.size(1) > self.config.seq_len:
            raise ValueError(
                f"MiniGPT expects token ids of shape (batch, seq) with seq <= seq_len={self.config.seq_len}, "
                f"got shape {tuple(idx.shape)}; crop the input or build the model with a larger seq_len."
            )
        x = self.drop(self.wte(idx))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
