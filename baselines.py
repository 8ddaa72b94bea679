"""Baselines: Untied and Loop Transformer++, GAU and FLASH (MATH.md, "Transformer++" and "GAU and FLASH").

Transformer++ is the modern Transformer recipe as summarized in "Mamba: Linear-Time Sequence
Modeling with Selective State Spaces" (arXiv 2312.00752, §4.2), with SwiGLU from "GLU Variants
Improve Transformer" (arXiv 2002.05202, §2); TANGO's paper compares against it (§2, "Baselines").

Transformer++ block (pre-norm, RMSNorm, RoPE, SwiGLU, no biases):

    x <- x + Attn(Norm(x))          q, k, v, o: d x d; causal softmax, scale 1/sqrt(32)
    x <- x + SwiGLU(Norm(x))        (SiLU(u W_1) * (u W_3)) W_2; W_1, W_3: d x F, W_2: F x d

q, k, v come from one matmul (qkv: 3d x d, rows [W_q; W_k; W_v]) and u W_1, u W_3 from one
(w13: 2F x d, rows [W_1; W_3]); the math is the same as separate projections.

Parameters per block: 4d^2 + 3dF + 2d. Untied Transformer++ stacks K independent blocks;
Loop Transformer++ applies one block K times. With the final norm, the non-embedding count is
    untied: K (4d^2 + 3dF + 2d) + d        loop: 4d^2 + 3dF + 2d + d
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from common import HEAD_DIM, RMSNorm, apply_rope, causal_attention, compiled_region


class Attention(nn.Module):
    """Causal multi-head softmax attention with RoPE. x: (B, T, d) -> (B, T, d).
    qkv: the fused [W_q; W_k; W_v] (3d x d), wo: W_o."""

    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.wo.is_residual_out = True

    def forward(self, u, cos, sin, cache=None):
        B, T, d = u.shape
        heads = lambda t: t.view(B, T, self.n_head, HEAD_DIM).transpose(1, 2)  # (B, H, T, 32)
        q, k, v = self.qkv(u).split(d, dim=-1)  # u W_q, u W_k, u W_v
        q = apply_rope(heads(q), cos, sin)
        k = apply_rope(heads(k), cos, sin)
        v = heads(v)
        if cache is not None:  # KV cache: append this step's keys and values
            if "k" in cache:
                k = torch.cat((cache["k"], k), dim=2)
                v = torch.cat((cache["v"], v), dim=2)
            cache["k"], cache["v"] = k, v
        y = causal_attention(q, k, v)  # scale 1/sqrt(32)
        return self.wo(y.transpose(1, 2).reshape(B, T, d))


class SwiGLU(nn.Module):
    """(SiLU(u W_1) * (u W_3)) W_2 with W_1, W_3: d x F (fused: w13, rows [W_1; W_3]) and W_2: F x d.
    forward(u (..., d)) -> (..., d)."""

    def __init__(self, d, width):
        super().__init__()
        self.width = width
        self.w13 = nn.Linear(d, 2 * width, bias=False)
        self.w2 = nn.Linear(width, d, bias=False)
        self.w2.is_residual_out = True

    def forward(self, u):
        a, b = self.w13(u).split(self.width, dim=-1)  # u W_1, u W_3
        return self.w2(F.silu(a) * b)


class TransformerBlock(nn.Module):
    """x <- x + Attn(Norm(x)); x <- x + SwiGLU(Norm(x)). Parameters: 4d^2 + 3dF + 2d.

    forward(x (B, T, d), cos, sin (B|1, 1, T, d_h / 2) RoPE tables (common.rope_cos_sin), cache:
    this application's KV-cache dict or None) -> (B, T, d)."""

    def __init__(self, d, n_head, width):
        super().__init__()
        self.norm1 = RMSNorm(d)
        self.attn = Attention(d, n_head)
        self.norm2 = RMSNorm(d)
        self.mlp = SwiGLU(d, width)

    @compiled_region  # one block application: the repeated unit of Transformer++, Parcae
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
    """Untied Transformer++: K independently parameterized blocks."""
    return TransformerPP(cfg, tied=False)


def loop_transformer(cfg):
    """Loop Transformer++: one Transformer++ block applied K times."""
    return TransformerPP(cfg, tied=True)


# ============================================================================= GAU and FLASH
# "Transformer Quality in Linear Time" (Hua, Dai, Liu, Le 2022; arXiv 2202.10447): §2 GAU, §3 FLASH.
#
# One gated attention unit replaces attention and the feed-forward network:
#
#     u = Norm(x)
#     [U | V | Z] = SiLU(u W_in)            W_in: d x (2e + s), fused; U, V: e wide, Z: s wide
#     Q = Z * gq + bq, K = Z * gk + bk      per-dim scale and offset (g ~ N(1, 0.02), b = 0; see below)
#     Q, K <- RoPE(Q), RoPE(K)
#     y = (U * mix(Q, K, V)) W_o            W_o: e x d
#     x <- x + y
#
# GAU: mix = A V with A_ij = relu(Q_i . K_j / c)^2 for j <= i (else 0), c = cfg.block_size.
# FLASH: four scale-offset heads (Q_q, K_q local; Q_l, K_l global), chunks of C = cfg.chunk
# tokens (absolute sequence index // C); mix = local + global with
#     local_i  = sum_{j <= i, same chunk} relu(Q_q_i . K_q_j / C)^2 V_j
#     global_i = Q_l_i (sum_{h < chunk(i)} K_l[h]^T V[h]) / C       (exclusive prefix sum)
# No token shift, no relative-position bias.
#
# Init of the scale g (our change from g ~ N(0, 0.02)): the paper's code draws g ~ N(0, 0.02)
# but also adds a relative-position bias inside the relu, which keeps the kernel alive at init.
# Without that bias (we use RoPE alone), |Q . K| / c ~ 1e-5 and relu(.)^2 ~ 1e-12: GAU's
# gradients sit far below AdamW's eps and the unit barely trains (measured: the unit's W_in moved
# by ~2e-6). We draw g ~ N(1, 0.02), so Q ~ K ~ Z at init. Measured on stdlib, CPU tier, depth 4,
# 40 updates: dev NLL 6.05 with N(0, 0.02) vs 4.87 with N(1, 0.02) (MATH.md, "GAU and FLASH").
#
# RoPE on the s-dim Q/K (our choice; MATH.md, "GAU and FLASH"): the body receives the 32-dim
# tables (head dim d_h = 32), so the s dims are split into s/32 groups of 32 and each group is
# rotated with those tables. This is RoPE with the 32-dim frequency schedule repeated s/32 times;
# every group is an exact rotation by position, so Q_i . K_j depends on positions only through
# i - j (the relative-position property holds exactly). Requires s % 32 == 0.
#
# Parameters per unit: 3de + ds + 4s + d (GAU), 3de + ds + 8s + d (FLASH) (norm gain d, W_in,
# W_o, 2 or 4 scale-offset pairs). cfg.tie_unit (default True) shares one unit across the K
# applications, as in the TANGO comparison; tie_unit=False gives K independent units. With the
# final norm, the non-embedding count is
#     GAU:   units (3de + ds + 4s + d) + d        FLASH: units (3de + ds + 8s + d) + d
# with units = 1 (tied) or K (untied).
#
# Decoding cache (one dict per application k, cache[k]): GAU keeps rotated keys and values;
# FLASH keeps the running global state sum_{h<g} K_l[h]^T V[h] / C of completed chunks (s x e)
# plus the current chunk's K_q, K_l and V, and its token count. Cached decoding equals the full
# forward, also across chunk boundaries.

from common import UsageError  # noqa: E402  (kept with this section; the header imports are Transformer++'s)

def rope_groups(t, cos, sin):
    """RoPE on the last dim of t: (B, T, m), m a multiple of 32, applied per 32-dim group with the
    32-dim tables cos, sin: (B|1, 1, T, 16)."""
    B, T, m = t.shape
    g = t.view(B, T, m // HEAD_DIM, HEAD_DIM).transpose(1, 2)  # (B, m/32, T, 32)
    return apply_rope(g, cos, sin).transpose(1, 2).reshape(B, T, m)


def gau_attend(q, k, v, c, cache=None):
    """GAU mixing relu(q k^T / c)^2 (causal) times v. q: (B, L, s), k: (B, L, s), v: (B, L, e).

    With a cache (dict) the keys and values are appended to it; query i sees keys j <= i + S - L
    of the S cached keys (lower-right alignment), which covers training, prefill and decoding.
    """
    if cache is not None:
        if "k" in cache:
            k, v = torch.cat((cache["k"], k), 1), torch.cat((cache["v"], v), 1)
        cache["k"], cache["v"] = k, v
    L, S = q.shape[1], k.shape[1]
    a = F.relu(q @ k.transpose(1, 2) / c).square()  # (B, L, S)
    visible = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(diagonal=S - L)
    return torch.where(visible, a, torch.zeros_like(a)) @ v


def flash_reference(qq, kq, ql, kl, v, C):
    """Plain FLASH mixing through the explicit T x T matrix (for tests). All (B, T, .) tensors;
    w_ij = relu(qq_i . kq_j / C)^2 for j <= i in i's chunk, ql_i . kl_j / C for j in an earlier
    chunk, 0 otherwise; returns w @ v: (B, T, e)."""
    T = qq.shape[1]
    i = torch.arange(T, device=qq.device)
    ci = i // C
    same = (ci[:, None] == ci[None, :]) & (i[None, :] <= i[:, None])
    earlier = ci[None, :] < ci[:, None]
    local = F.relu(qq @ kq.transpose(1, 2) / C).square()
    glob = ql @ kl.transpose(1, 2) / C
    zero = torch.zeros_like(local)
    return torch.where(same, local, torch.where(earlier, glob, zero)) @ v


def flash_chunked(qq, kq, ql, kl, v, C):
    """FLASH mixing in chunks of C (linear in T): T padded on the right to a multiple of C; local
    quadratic part inside each chunk, global part from the exclusive prefix sum of per-chunk
    states M_h = K_l[h]^T V[h] / C (s x e). Inputs (B, T, .) -> (B, T, e)."""
    B, T, _ = qq.shape
    n = C if T > C else T  # a single chunk needs no padding (same result, no wasted work)
    G = -(-T // n)
    pad = G * n - T
    chunk = lambda t: F.pad(t, (0, 0, 0, pad)).view(B, G, n, t.shape[-1])
    qq, kq, vc = chunk(qq), chunk(kq), chunk(v)
    a = F.relu(qq @ kq.transpose(-1, -2) / C).square()  # (B, G, n, n)
    causal = torch.ones(n, n, dtype=torch.bool, device=a.device).tril()
    out = torch.where(causal, a, torch.zeros_like(a)) @ vc
    if G > 1:
        ql, kl = chunk(ql), chunk(kl)
        m = kl.transpose(-1, -2) @ vc / C  # (B, G, s, e)
        state = torch.cat((torch.zeros_like(m[:, :1]), m[:, :-1].cumsum(1)), 1)  # sum_{h<g} M_h
        out = out + ql @ state
    return out.reshape(B, G * n, -1)[:, :T]


def flash_prefill(qq, kq, ql, kl, v, C, cache):
    """FLASH over a whole prompt (empty cache), then the decoding state for its end."""
    out = flash_chunked(qq, kq, ql, kl, v, C)
    T = qq.shape[1]
    done = T - T % C  # tokens in completed chunks
    cache["state"] = kl[:, :done].transpose(1, 2) @ v[:, :done] / C  # (B, s, e)
    cache["kq"], cache["kl"], cache["v"] = kq[:, done:], kl[:, done:], v[:, done:]
    cache["n"] = T
    return out


def flash_step(qq, kq, ql, kl, v, C, cache):
    """FLASH decoding of new tokens one at a time from the state built by flash_prefill."""
    outs = []
    for t in range(qq.shape[1]):
        kqb = torch.cat((cache["kq"], kq[:, t:t + 1]), 1)
        klb = torch.cat((cache["kl"], kl[:, t:t + 1]), 1)
        vb = torch.cat((cache["v"], v[:, t:t + 1]), 1)
        local = F.relu(qq[:, t:t + 1] @ kqb.transpose(1, 2) / C).square() @ vb
        outs.append(local + ql[:, t:t + 1] @ cache["state"])
        cache["n"] += 1
        if cache["n"] % C == 0:  # the chunk is complete: fold it into the global state
            cache["state"] = cache["state"] + klb.transpose(1, 2) @ vb / C
            kqb, klb, vb = kqb[:, :0], klb[:, :0], vb[:, :0]
        cache["kq"], cache["kl"], cache["v"] = kqb, klb, vb
    return torch.cat(outs, 1)


class GAUUnit(nn.Module):
    """One gated attention unit's parameters: norm gain (d), fused W_in (d x (2e + s)), n_qk
    per-dim scale-offset pairs on Z (gamma ~ N(1, 0.02), beta = 0), W_o (e x d).
    Parameters: 3de + ds + 2 n_qk s + d."""
    no_decay = ("gamma", "beta")  # per-dimension scale and offset: no weight decay (harness.optim.no_decay_parameters)

    def __init__(self, d, e, s, n_qk):
        super().__init__()
        self.e, self.s, self.n_qk = e, s, n_qk
        self.norm = RMSNorm(d)
        self.w_in = nn.Linear(d, 2 * e + s, bias=False)
        self.gamma = nn.Parameter(torch.empty(n_qk, s).normal_(1.0, 0.02))
        self.beta = nn.Parameter(torch.zeros(n_qk, s))
        self.wo = nn.Linear(e, d, bias=False)
        self.wo.is_residual_out = True

    def init_constants(self):
        """The documented initial constants, as (value, want) pairs (tests/test_registry.py checks them); want (mean, tolerance) for a statistic of random draws: gamma ~ N(1, 0.02), beta = 0."""
        return [(self.gamma.mean(), (1.0, 0.01)), (self.gamma.std(), (0.02, 0.005)), (self.beta, 0.0)]

    def project(self, x, cos, sin):
        """x: (B, T, d) -> U, V: (B, T, e) and n_qk rotated scale-offset heads of Z, each (B, T, s)."""
        B, T, _ = x.shape
        U, V, Z = F.silu(self.w_in(self.norm(x))).split([self.e, self.e, self.s], -1)
        heads = Z[:, :, None, :] * self.gamma + self.beta  # (B, T, n_qk, s)
        heads = rope_groups(heads.reshape(B, T, self.n_qk * self.s), cos, sin)
        return U, V, heads.view(B, T, self.n_qk, self.s).unbind(2)


class GAUStack(nn.Module):
    """GAU / FLASH body: K applications of a gated attention unit (one shared unit when
    cfg.tie_unit, else K). forward(x (B, T, d), cos, sin, cache) -> (B, T, d).

    flash=False: GAU (full causal attention, c = cfg.block_size). flash=True: FLASH with chunk
    C = cfg.chunk; impl="reference" uses flash_reference (explicit T x T matrix, no cache).
    Raises UsageError for s not a multiple of 32 or a chunk < 1.
    """

    def __init__(self, cfg, flash=False, impl="fast"):
        super().__init__()
        d, e, s = cfg.n_embd, cfg.width, cfg.gau_s
        if s < HEAD_DIM or s % HEAD_DIM:
            raise UsageError(f"--gau_s {s}: must be a positive multiple of {HEAD_DIM} (RoPE in 32-dim groups)")
        if flash and cfg.chunk < 1:
            raise UsageError(f"--chunk {cfg.chunk}: must be >= 1")
        if impl not in ("fast", "reference"):
            raise ValueError(f"impl must be 'fast' or 'reference', not {impl!r}")
        self.depth, self.flash, self.impl = cfg.depth, flash, impl
        self.c = cfg.chunk if flash else cfg.block_size
        n_units = 1 if cfg.tie_unit else cfg.depth
        self.units = nn.ModuleList(GAUUnit(d, e, s, 4 if flash else 2) for _ in range(n_units))

    def forward(self, x, cos, sin, cache=None):
        for k in range(self.depth):
            x = self.apply_unit(self.units[k % len(self.units)], x, cos, sin,
                                None if cache is None else cache.setdefault(k, {}))
        return x

    @compiled_region  # one unit application: the repeated unit
    def apply_unit(self, unit, x, cos, sin, cache=None):
        """x + (U * mix(Q, K, V)) W_o for one GAUUnit `unit`: (B, T, d) -> (B, T, d)."""
        U, V, qk = unit.project(x, cos, sin)
        return x + unit.wo(U * self.mix(qk, V, cache))

    def mix(self, qk, v, cache):
        if not self.flash:
            q, k = qk
            return gau_attend(q, k, v, self.c, cache)
        if cache is None:
            return (flash_reference if self.impl == "reference" else flash_chunked)(*qk, v, self.c)
        if self.impl == "reference":
            raise ValueError("the reference implementation has no decoding cache")
        if "n" not in cache:
            return flash_prefill(*qk, v, self.c, cache)
        return flash_step(*qk, v, self.c, cache)


def gau(cfg):
    """Full-attention GAU (arXiv 2202.10447, §2). Non-embedding parameters:
    units (3de + ds + 4s + d) + d, units = 1 if cfg.tie_unit else K; e = cfg.width, s = cfg.gau_s."""
    return GAUStack(cfg)


def flash(cfg, impl="fast"):
    """FLASH, chunk C = cfg.chunk (arXiv 2202.10447, §3). Non-embedding parameters:
    units (3de + ds + 8s + d) + d, units = 1 if cfg.tie_unit else K."""
    return GAUStack(cfg, flash=True, impl=impl)
