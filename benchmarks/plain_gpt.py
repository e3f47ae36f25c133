"""A plain PyTorch GPT: the reference our Megatron-Core trainer is measured against in benchmarks/throughput.py.

The same architecture as our local-spec model (learned absolute positions, pre-LayerNorm blocks with
biases, fused QKV projection, causal ``scaled_dot_product_attention``, GELU MLP, final LayerNorm, output
layer tied to the embedding, no dropout), trained the way a PyTorch user would: fp32 weights, bf16 autocast
on GPU, ``torch.optim.AdamW`` (fused on CUDA), one micro-batch per step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, *, layers: int, hidden: int, heads: int, vocab: int, seq: int, ffn: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.size(1), device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.embed.weight)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))


class PlainTrainer:
    """One optimizer step per call on a fresh random micro-batch copied from host memory (as a loader would)."""

    def __init__(self, shape, device: torch.device, *, bf16: bool, compiled: bool, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = PlainGPT(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, vocab=shape.vocab,
                              seq=shape.seq, ffn=shape.ffn_size).to(device)
        self.forward = torch.compile(self.model) if compiled else self.model
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1, **fused)
        self.device = device
        self.bf16 = bf16
        pool = torch.randint(0, shape.vocab, (8, shape.micro_batch, shape.seq + 1))
        self.pool = pool.pin_memory() if device.type == "cuda" else pool
        self.calls = 0
        self.last_loss: torch.Tensor | None = None

    def step(self) -> None:
        batch = self.pool[self.calls % len(self.pool)].to(self.device, non_blocking=True)
        self.calls += 1
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.forward(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_loss = loss.detach()
