"""A small GPT (GPT-2's architecture, pre-LayerNorm) for character-level language modelling.

    tokens (B, T) -> token embedding + learned position embedding
                  -> layers x [x + attention(LayerNorm(x)); x + MLP(LayerNorm(x))]
                  -> LayerNorm -> head (nn.Linear to the vocabulary) -> logits (B, T, vocab)

Where the products are, so that lpsim reaches each of them:

- every matrix product outside attention is an ``nn.Linear`` (``attention.qkv``, q, k and v as one
  layer; ``attention.output``; ``mlp.hidden``, width -> 4 width; ``mlp.output``; ``head``), which
  ``lpsim.nn.inject`` quantises and runs under MACs;
- the two products of attention, the scores q k^T and the context p v, are computed by
  ``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)`` on
  (batch, heads, T, head_dim) tensors, which ``lpsim.nn.quantize_functions`` quantises;
- the embeddings are lookups (no products); LayerNorm, GELU (exact, erf), the residual additions
  and the softmax are elementwise.

Initialisation as GPT-2's: every Linear weight and both embeddings normal with standard deviation
0.02, biases zero, LayerNorms weight 1 and bias 0, and the two projections that end a residual
branch (``attention.output``, ``mlp.output``) with standard deviation 0.02 / sqrt(2 layers). No
dropout; the head is not tied to the token embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "CausalSelfAttention", "MLP", "Block"]

INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT.

    Attributes:
        vocab_size: tokens in the vocabulary.
        context: the longest sequence, in tokens (the position embedding's length).
        layers: transformer blocks.
        width: the residual stream's channels (the embedding dimension).
        heads: attention heads; must divide width (head_dim = width / heads).
    """

    vocab_size: int
    context: int = 128
    layers: int = 4
    width: int = 128
    heads: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "layers", "width", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.width % self.heads:
            raise ValueError(
                f"GPTConfig.heads ({self.heads}) must divide width ({self.width}): each head "
                "takes width / heads channels"
            )

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one Linear to q, k and v, torch's
    scaled_dot_product_attention (scale 1 / sqrt(head_dim)), and an output Linear."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.output = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    """Linear to 4 width, GELU (exact), Linear back to width."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.hidden = nn.Linear(config.width, 4 * config.width)
        self.output = nn.Linear(4 * config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(F.gelu(self.hidden(x)))


class Block(nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.width)
        self.attention = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """The GPT of the module docstring; ``forward(tokens)`` maps int64 (B, T) tokens, T at most
    config.context, to float logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.width)
        self.position_embedding = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.final_norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab_size)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's initialisation (see the module docstring), drawn from torch's default
        generator in module order."""
        residual_std = INIT_STD / math.sqrt(2 * self.config.layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = (
                    residual_std if name.endswith(("attention.output", "mlp.output")) else INIT_STD
                )
                nn.init.normal_(module.weight, mean=0.0, std=std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.config.context:
            raise ValueError(
                f"GPT.forward: sequences of {length} tokens exceed the context of "
                f"{self.config.context}"
            )
        positions = torch.arange(length, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))
