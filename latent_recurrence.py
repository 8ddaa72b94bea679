"""LRT (latent recurrence: a high block's state fed to the next slot) and LRT with thought tokens.

Sources: LRT is arXiv 2605.26797 (Huang, He, ..., Shen), abstract; the seed paper "latent recurrence
with thought tokens" is known only from its abstract (no arXiv id found). Both are *reconstructed*:
the source and target blocks, the memory norm, the interleaved training schedule's subsets and the
thought slot's input are our choices where the abstracts are silent (MATH.md, "LRT and LRT with a
thought token", lists them). Backbone: untied Transformer++ (baselines.py), K blocks; a_l is the
residual stream entering block l, z_l = a_{l+1} the one leaving it.

A slot sequence i = 0..S-1 (lrt: one slot per token, S = T; lrt-think: slots (t,0) = e(x_t) and
(t,k) = e_θ,k for k = 1..n, n = cfg.n_thoughts, all at RoPE position t, S = (n + 1) T):

    m_i        = RMSNorm_m(z_src(i-1)),  m_0 = 0            memory: the previous slot's source state
    a_tgt(i)  += W_m m_i                                    residual injection (W_m: d x d, zero init)
    lrt_kv:    every block's softmax for query i also holds one private slot
               k_m = W_km m_i, v_m = W_vm m_i (per head; W_km, W_vm: d x d, shared by all blocks;
               no RoPE, as the query and its private key share position t). m_0 = 0 makes it a
               zero key and value (a sink) for slot 0 and in the init pass.
    output for x_{t+1}: z_{K-1} of slot (t, n)              only the last slot of a token is scored

src = cfg.lrt_src (-1: floor(2K/3), "upper-middle"), tgt = cfg.lrt_tgt (default 0, block 0's
input). The exact model is sequential in the slots (slot i needs z_src(i-1), which needs m_{i-1}):
that is `sequential_reference` and cached decoding (one slot per pass).

Training and the full forward: interleaved parallel refinement (k = cfg.lrt_subsets):
  1. init pass: all S slots with m = 0; keep every block's keys/values (after RoPE) and z_src
     (its output z_{K-1} is not used: the last block's attention and MLP are skipped);
  2. for j = 0..k-1, the rows P_j = {i : i mod k = j}: recompute them with m_i from the kept
     z_src(i-1); in each block their queries attend to the kept keys/values with P_j's rows
     replaced by the fresh ones; write the fresh keys/values and z_src back;
  3. output: each row's value from its own refinement (every row is refined exactly once).
Gradients flow through both passes (cfg.lrt_detach_init: the init pass without gradients).
Exactness: with k >= S (one slot per subset) row j reads only refined rows, so the forward equals
the sequential model and cached decoding; with k = 1 it is the two-pass computation
`two_pass_reference` (memories from the init pass). In between it approximates both, so prefill
(which runs it on the prompt) followed by exact one-slot decoding equals the full forward only at
k >= S. Off switch: W_m = 0 (its init) without lrt_kv is untied Transformer++ for lrt, and for
lrt-think a Transformer++ over the slot sequence whose thought slots see only attention.

Decoding: per token n + 1 sequential single-slot passes (one KV row per block each); the body's
cache holds every block's keys/values and the last slot's z_src. Prefill: the parallel forward
on the prompt's slots.

Parameters: K (4d^2 + 3dF + 2d) + d (final norm) + d^2 + d (W_m, RMSNorm_m) [+ 2 d^2 with lrt_kv]
[+ n d: e_θ,k for lrt-think]. Forward MACs (flops.py): both passes over S rows, 2 S K (4d^2 + 3dF)
+ S d^2 (W_m) [+ 2 S d^2], scores and mix 2 S^2 d K each [+ 2 S d K with lrt_kv], head V d T, less
the init pass's last-block attention and MLP (only z_{K-1} needs them; kept when that block is the
source): S (d^2 + 3dF) linear, S^2 d [+ S d] scores and as much mix.
"""
import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

from baselines import Attention, SwiGLU
from common import HEAD_DIM, RMSNorm, UsageError, apply_rope, causal_attention, compiled_region


def private_slot_attention(q, k, v, km, vm, mask):
    """lrt_kv's attention: query i's softmax over its visible keys k_j and its private key k_m,i,
    scores <q_i, .> / sqrt(32), mixing v_j and v_m,i. q: (B, H, n, 32); k, v: (B, H, S, 32); km, vm:
    (B, H, n, 32); mask: (n, S) bool, True = visible. Returns (B, H, n, 32) in v's dtype. Scores and
    weights are float32 or wider under bfloat16 autocast too, as in PyTorch's fused attention."""
    acc = torch.promote_types(q.dtype, torch.float32)
    q, k, km = q.to(acc), k.to(acc), km.to(acc)
    with torch.autocast(q.device.type, enabled=False):  # a bfloat16 matmul would round the scores to 1/256
        s = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))      # (B, H, n, S)
        s_m = (q.unsqueeze(-2) @ km.unsqueeze(-1)).squeeze(-1)               # (B, H, n, 1)
    p = torch.softmax(torch.cat((s, s_m), -1) / math.sqrt(HEAD_DIM), -1).to(v.dtype)
    return p[..., :-1] @ v + (p[..., -1:].unsqueeze(-1) @ vm.unsqueeze(-2)).squeeze(-2)


class LRTBlock(nn.Module):
    """A Transformer++ block (the parameters and names of baselines.TransformerBlock) whose
    attention is split so the body can place fresh keys/values into a buffer between projecting
    and attending, and whose softmax can hold a private memory slot per query."""

    def __init__(self, d, n_head, width):
        super().__init__()
        self.n_head = n_head
        self.norm1 = RMSNorm(d)
        self.attn = Attention(d, n_head)
        self.norm2 = RMSNorm(d)
        self.mlp = SwiGLU(d, width)

    def heads(self, t):
        """(B, n, d) -> (B, H, n, 32)."""
        B, n, d = t.shape
        return t.view(B, n, self.n_head, HEAD_DIM).transpose(1, 2)

    @compiled_region
    def project(self, x, cos, sin, cache=None):
        """x: (B, n, d) rows -> q, k, v: (B, H, n, 32), q and k rotated. cache only marks decoding."""
        q, k, v = self.attn.qkv(self.norm1(x)).split(x.shape[-1], dim=-1)
        return apply_rope(self.heads(q), cos, sin), apply_rope(self.heads(k), cos, sin), self.heads(v)

    @compiled_region
    def finish(self, x, q, k, v, mask=None, mem=None, cache=None):
        """Attention of the n rows' queries q over the S keys/values k, v (B, H, S, 32), then W_o and
        the SwiGLU half. mask: (n, S) bool (True = visible) or None (lower-right causal). mem: None
        or the private (k_m, v_m), (B, H, n, 32) each. Returns the rows' output (B, n, d)."""
        B, H, n, _ = q.shape
        S = k.shape[2]
        if mem is None:
            y = causal_attention(q, k, v) if mask is None else F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            if mask is None:
                mask = torch.ones(n, S, dtype=torch.bool, device=q.device).tril(diagonal=S - n)
            y = private_slot_attention(q, k, v, *mem, mask)
        x = x + self.attn.wo(y.transpose(1, 2).reshape(B, n, H * HEAD_DIM))
        return x + self.mlp(self.norm2(x))


def source_block(cfg):
    """The block whose output z_src feeds the memory: cfg.lrt_src, or floor(2K/3) for -1."""
    return cfg.lrt_src if cfg.lrt_src != -1 else (2 * cfg.depth) // 3


class LatentRecurrence(nn.Module):
    """LRT body (think=False) or LRT with n = cfg.n_thoughts thought slots per token (think=True).
    forward(x (B, T, d), cos, sin, cache) -> (B, T, d): the last slot's z_{K-1} of every token.
    Raises UsageError for lrt_src / lrt_tgt outside 0..K-1, lrt_subsets < 1, n_thoughts < 0."""

    def __init__(self, cfg, think):
        super().__init__()
        K, d = cfg.depth, cfg.n_embd
        self.src = source_block(cfg)
        self.tgt = cfg.lrt_tgt
        if not 0 <= self.src < K:
            raise UsageError(f"--lrt_src {cfg.lrt_src}: must be -1 (floor(2K/3)) or a block 0..{K - 1}")
        if not 0 <= self.tgt < K:
            raise UsageError(f"--lrt_tgt {cfg.lrt_tgt}: must be a block 0..{K - 1}")
        if cfg.lrt_subsets < 1:
            raise UsageError(f"--lrt_subsets {cfg.lrt_subsets}: must be >= 1")
        if think and cfg.n_thoughts < 0:
            raise UsageError(f"--n_thoughts {cfg.n_thoughts}: must be >= 0")
        self.subsets, self.detach_init = cfg.lrt_subsets, cfg.lrt_detach_init
        self.n = cfg.n_thoughts if think else 0
        self.blocks = nn.ModuleList(LRTBlock(d, cfg.n_head, cfg.width) for _ in range(K))
        self.mem_norm = RMSNorm(d)                    # RMSNorm_m
        self.w_m = nn.Parameter(torch.zeros(d, d))    # W_m (a Parameter, so LM's Linear init leaves it at 0)
        self.w_km = self.w_vm = None
        if cfg.lrt_kv:
            self.w_km, self.w_vm = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        if self.n > 0:
            self.thought = nn.Parameter(torch.randn(self.n, d) * 0.02)  # e_θ,k, initialized like a token row
        self.sequential_passes = self.n + 1  # sequential single-slot passes per decoded token (bench.py decode)

    own_init = ("w_m",)  # a matrix not drawn from N(0, 0.02)

    def init_constants(self):
        """The documented initial constants, as (value, want) pairs (tests/test_registry.py checks them): W_m = 0; the thought inputs e_theta ~ N(0, 0.02) like a token row."""
        return [(self.w_m, 0.0)] + ([(self.thought.std(), (0.02, 0.006))] if self.n > 0 else [])

    # ------------------------------------------------------------------ slots
    def slots(self, x, cos, sin):
        """Tokens (B, T, d) -> slot inputs (B, S, d) in the order (t,0), (t,1), ..., all at position t."""
        if self.n == 0:
            return x, cos, sin
        B, T, d = x.shape
        th = self.thought.to(x.dtype).expand(B, T, self.n, d)
        seq = torch.cat((x.unsqueeze(2), th), 2).reshape(B, T * (self.n + 1), d)
        rep = lambda r: r.repeat_interleave(self.n + 1, dim=2)
        return seq, rep(cos), rep(sin)

    def scored(self, y):
        """Slot outputs (B, S, d) -> the last slot of every token (B, T, d)."""
        return y if self.n == 0 else y.view(y.shape[0], -1, self.n + 1, y.shape[-1])[:, :, -1]

    # ------------------------------------------------------------------ the K blocks on some rows
    def memory(self, src):
        """m_i = RMSNorm_m(z_src(i-1)) for i = 0..S (a row of zeros before slot 0): (B, S, d) -> (B, S + 1, d)."""
        return self.mem_norm(F.pad(src, (0, 0, 1, 0)))

    def rows(self, x, cos, sin, m=None, kv=None, rows=None, cache=None, need_out=True):
        """The K blocks on n slot rows x: (B, n, d) with their RoPE rows; m: their memories (B, n, d)
        or None (m = 0). kv: None (the rows are the whole sequence), or one (K, V) per block,
        (B, H, S, 32): with rows (LongTensor (n,)) the rows' entries are replaced, without rows the
        fresh ones are appended (decoding). Returns z_{K-1} (B, n, d), z_src (B, n, d), the (K, V) per block;
        need_out=False (the init pass) skips what only z_{K-1} needs and returns None for it."""
        mem = None
        if self.w_km is not None:
            if m is None:
                z = x.new_zeros(x.shape[0], self.blocks[0].n_head, x.shape[1], HEAD_DIM)
                mem = (z, z)
            else:
                mem = (self.blocks[0].heads(self.w_km(m)), self.blocks[0].heads(self.w_vm(m)))
        mask = None
        if rows is not None and kv is not None and len(rows) < kv[0][0].shape[2]:
            mask = rows[:, None] >= torch.arange(kv[0][0].shape[2], device=x.device)[None, :]
        out_kv, src = [], None
        for l, blk in enumerate(self.blocks):
            if l == self.tgt and m is not None:
                x = x + F.linear(m, self.w_m)
            q, k, v = blk.project(x, cos, sin, cache)
            if kv is not None:
                K0, V0 = kv[l]
                if rows is None:
                    k, v = torch.cat((K0, k), 2), torch.cat((V0, v), 2)
                else:
                    k, v = K0.index_copy(2, rows, k), V0.index_copy(2, rows, v)
            out_kv.append((k, v))
            if not need_out and l == len(self.blocks) - 1 and l != self.src:
                return None, src, out_kv  # the last block's attention and MLP would only make z_{K-1}
            x = blk.finish(x, q, k, v, mask, mem, cache)
            if l == self.src:
                src = x
        return x, src, out_kv

    # ------------------------------------------------------------------ forward
    def parallel(self, x, cos, sin, cache=None):
        """Interleaved parallel refinement on slot inputs x: (B, S, d) -> outputs (B, S, d), z_src, (K, V) per block."""
        B, S, d = x.shape
        k = min(self.subsets, S)
        with torch.no_grad() if self.detach_init and torch.is_grad_enabled() else nullcontext():
            _, src, kv = self.rows(x, cos, sin, cache=cache, need_out=False)  # init pass, m = 0
        out = None
        for j in range(k):
            rows = torch.arange(j, S, k, device=x.device)
            m = self.memory(src)[:, rows]  # m_i from z_src(i-1) as kept so far
            y, s, kv = self.rows(x[:, rows], cos[:, :, rows], sin[:, :, rows], m, kv, rows, cache)
            src = src.index_copy(1, rows, s)
            out = y.new_zeros(B, S, d).index_copy(1, rows, y) if out is None else out.index_copy(1, rows, y)
        return out, src, kv

    def forward(self, x, cos, sin, cache=None):
        xs, cs, sn = self.slots(x, cos, sin)
        if cache is None:
            return self.scored(self.parallel(xs, cs, sn)[0])
        if "kv" not in cache:  # prefill: the parallel forward on the prompt's slots
            y, src, kv = self.parallel(xs, cs, sn, cache)
            cache["kv"], cache["src"] = kv, src[:, -1:]
            return self.scored(y)
        outs = []
        for i in range(xs.shape[1]):  # decoding: one slot per pass, memory from the previous slot
            m = self.mem_norm(cache["src"])
            y, cache["src"], cache["kv"] = self.rows(xs[:, i:i + 1], cs[:, :, i:i + 1], sn[:, :, i:i + 1], m,
                                                     cache["kv"], None, cache)
            outs.append(y)
        return self.scored(torch.cat(outs, 1))


# ----------------------------------------------------------------------------- references (tests)
def with_memory(body, x, cos, sin, m):
    """One plain causal pass over slot rows x: (B, S, d) with given memories m (B, S, d) (None: 0).
    Returns z_{K-1}, z_src."""
    y, src, _ = body.rows(x, cos, sin, m)
    return y, src


def sequential_reference(body, x, cos, sin):
    """The exact model, slot by slot without a cache: m_{i+1} = RMSNorm_m(z_src(i)) from a full
    recomputation of slots 0..i. x: tokens (B, T, d) -> the scored rows (B, T, d)."""
    xs, cs, sn = body.slots(x, cos, sin)
    S = xs.shape[1]
    m = torch.zeros_like(xs)
    for i in range(S - 1):
        _, src = with_memory(body, xs[:, :i + 1], cs[:, :, :i + 1], sn[:, :, :i + 1], m[:, :i + 1])
        m = m.index_copy(1, torch.tensor([i + 1], device=m.device), body.mem_norm(src[:, i:i + 1]))
    return body.scored(with_memory(body, xs, cs, sn, m)[0])


def two_pass_reference(body, x, cos, sin):
    """lrt_subsets = 1 written out: a pass with m = 0, then a pass with m_i = RMSNorm_m(z_src(i-1))
    of the first. x: tokens (B, T, d) -> the scored rows (B, T, d)."""
    xs, cs, sn = body.slots(x, cos, sin)
    _, src = with_memory(body, xs, cs, sn, None)
    return body.scored(with_memory(body, xs, cs, sn, body.memory(src)[:, :-1])[0])


def lrt(cfg):
    """LRT on untied Transformer++ (arXiv 2605.26797, reconstructed). Non-embedding parameters:
    K (4d^2 + 3dF + 2d) + d + d^2 + d (+ 2 d^2 with lrt_kv)."""
    return LatentRecurrence(cfg, think=False)


def lrt_think(cfg):
    """LRT with n = cfg.n_thoughts thought slots per token (the seed paper, reconstructed).
    Non-embedding parameters: those of lrt + n d."""
    return LatentRecurrence(cfg, think=True)
