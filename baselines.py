"""Baselines: Untied and Loop Transformer++ (SPEC.md section 2).

Transformer++ block (pre-norm, RMSNorm, RoPE, SwiGLU, no biases):

    x <- x + Attn(Norm(x))          q, k, v, o: d x d; causal softmax, scale 1/sqrt(32)
    x <- x + SwiGLU(Norm(x))        (SiLU(u W_1) * (u W_3)) W_2; W_1, W_3: d x F, W_2: F x d

Parameters per block: 4d^2 + 3dF + 2d. Untied Transformer++ stacks K independent blocks;
Loop Transformer++ applies one block K times. With the final norm, the non-embedding count is
    untied: K (4d^2 + 3dF + 2d) + d        loop: 4d^2 + 3dF + 2d + d
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from common import HEAD_DIM, RMSNorm, apply_rope, causal_attention


class Attention(nn.Module):
    """Causal multi-head softmax attention with RoPE. x: (B, T, d) -> (B, T, d)."""

    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.wo.is_residual_out = True

    def forward(self, u, cos, sin, cache=None):
        B, T, d = u.shape
        heads = lambda t: t.view(B, T, self.n_head, HEAD_DIM).transpose(1, 2)  # (B, H, T, 32)
        q = apply_rope(heads(self.wq(u)), cos, sin)
        k = apply_rope(heads(self.wk(u)), cos, sin)
        v = heads(self.wv(u))
        if cache is not None:  # KV cache: append this step's keys and values
            if "k" in cache:
                k = torch.cat((cache["k"], k), dim=2)
                v = torch.cat((cache["v"], v), dim=2)
            cache["k"], cache["v"] = k, v
        y = causal_attention(q, k, v)  # scale 1/sqrt(32)
        return self.wo(y.transpose(1, 2).reshape(B, T, d))


class SwiGLU(nn.Module):
    """(SiLU(u W_1) * (u W_3)) W_2 with W_1, W_3: d x F and W_2: F x d."""

    def __init__(self, d, width):
        super().__init__()
        self.w1 = nn.Linear(d, width, bias=False)
        self.w3 = nn.Linear(d, width, bias=False)
        self.w2 = nn.Linear(width, d, bias=False)
        self.w2.is_residual_out = True

    def forward(self, u):
        return self.w2(F.silu(self.w1(u)) * self.w3(u))


class TransformerBlock(nn.Module):
    """x <- x + Attn(Norm(x)); x <- x + SwiGLU(Norm(x)). Parameters: 4d^2 + 3dF + 2d."""

    def __init__(self, d, n_head, width):
        super().__init__()
        self.norm1 = RMSNorm(d)
        self.attn = Attention(d, n_head)
        self.norm2 = RMSNorm(d)
        self.mlp = SwiGLU(d, width)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.attn(self.norm1(x), cos, sin, cache)
        return x + self.mlp(self.norm2(x))


class TransformerPP(nn.Module):
    """Transformer++ body: K block applications, untied (K blocks) or looped (one block K times).

    forward(x (B, T, d), cos, sin, cache) -> (B, T, d). The decoding cache keeps keys and values
    per application (cache["app"][k] for application k), so a looped block has K KV caches.
    """

    def __init__(self, cfg, tied):
        super().__init__()
        self.depth = cfg.depth
        n_blocks = 1 if tied else cfg.depth
        self.blocks = nn.ModuleList(TransformerBlock(cfg.n_embd, cfg.n_head, cfg.width) for _ in range(n_blocks))

    def forward(self, x, cos, sin, cache=None):
        for k in range(self.depth):
            block = self.blocks[k % len(self.blocks)]
            x = block(x, cos, sin, None if cache is None else cache.setdefault(k, {}))
        return x


def untied_transformer(cfg):
    """Untied Transformer++: K independently parameterized blocks (SPEC section 2)."""
    return TransformerPP(cfg, tied=False)


def loop_transformer(cfg):
    """Loop Transformer++: one Transformer++ block applied K times (SPEC section 2)."""
    return TransformerPP(cfg, tied=True)
