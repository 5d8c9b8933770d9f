"""A small GPT-style decoder (pre-norm transformer) for demos, examples and benchmarks."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int = 256
    """Byte-level tokens by default."""
    block_size: int = 64
    """Longest context, in tokens."""
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128

    def validate(self) -> None:
        if min(self.vocab_size, self.block_size, self.n_layer, self.n_head, self.n_embd) <= 0:
            raise ValueError(f"all sizes must be positive: {self}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")


def gpt_initializer(config: GPTConfig) -> Callable[[str, torch.Tensor], None]:
    """``init_fn(name, tensor)`` with :class:`GPT`'s initialization rules, for a GPT built on the meta
    device and initialized one layer-wise unit at a time (see :func:`gpu_worker.offload`)."""
    residual_std = 0.02 / math.sqrt(2 * config.n_layer)

    def init(name: str, tensor: torch.Tensor) -> None:
        if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
            nn.init.normal_(tensor, mean=0.0, std=residual_std)
        elif name.endswith(".bias"):
            nn.init.zeros_(tensor)
        elif tensor.dim() >= 2:
            nn.init.normal_(tensor, mean=0.0, std=0.02)
        else:  # LayerNorm weights
            nn.init.ones_(tensor)

    return init


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (B, nh, T, hs)
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(), nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final norm and an untied head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # scaled residual projections, as in GPT-2
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        _batch, time = idx.shape  # (B, T)
        if time > self.config.block_size:
            raise ValueError(f"sequence of {time} tokens is longer than block_size {self.config.block_size}")
        positions = torch.arange(time, device=idx.device)
        x = self.wte(idx) + self.wpe(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.8, top_k: int = 20, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of ``idx`` (B, T)."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :] / temperature
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
            logits[logits < kth] = -float("inf")
            next_token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, next_token], dim=1)
        return idx
