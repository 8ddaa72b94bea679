"""TANGO ("TANGO: Treating Tokens as Operators", §2; our reconstruction: MATH.md, "TANGO").

One gated update replaces attention and the feed-forward network; one block is applied K times:

    u      = Norm(x)                                       (B, T, d)
    q, k   = u W_q, u W_k                                  W_q, W_k: d x d, H heads of 32
    q^, k^ = RoPE(unit(q)), RoPE(unit(k))                  per-head cosine scores
    l_ij   = tau_a <q^_i, k^_j>  (j <= i),  null score b_a  (tau_a = exp(log_tau_a) > 0)
    w_ij   = exp(l_ij) / (exp(b_a) + sum_{j' <= i} exp(l_ij'))
    g_j    = SiLU(u_j W_g)   source gate (nonlinear)       W_g: d x F
    v_i    = u_i W_v         destination (linear)          W_v: d x F
    G_i    = sum_{j <= i} w_ij g_j      head a averages gate channels [a F/H, (a+1) F/H)
    x     <- x + (G_i * v_i) W_o                           W_o: F x d

Parameters per block: 2d^2 + 3dF + d + 2H (plus the final norm d in the model count).
Init (our choice, not in the paper): tau_a = 10, b_a = 0, linear maps N(0, 0.02), W_o scaled.

Windowed TANGO: sources in the window j in (i-W, i] get the scores above; all older sources
j <= i-W share one score tau_a <q^_i, unit(sum_{j<=i-W} k^_j)>, contribute exp(score) * sum g_j
and mass exp(score) * n_old, n_old = i-W+1 (0-based). With W >= T it equals full-prefix TANGO.

The averages G, the plain formulas and the fast paths (chunked, memory linear in T; Windowed
TANGO in time per token flat in T), their precision under bf16 and their layout: tango_kernels.py.

TANGO with three gated-projection sets: {W_g, W_v, W_o} set 1 for the first application, set 2
for the middle ones, set 3 for the last; W_q, W_k, norm, tau, b shared. Needs K >= 3.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import RMSNorm, UsageError, apply_rope, compiled_region
from tango_kernels import tango_fast, tango_reference, windowed_fast, windowed_prefill, windowed_reference, windowed_step


# ----------------------------------------------------------------------------- modules

class GatedSet(nn.Module):
    """One gated-projection set: W_g, W_v (d x F) and W_o (F x d), used per head group (see heads)."""

    def __init__(self, d, width):
        super().__init__()
        self.wg = nn.Linear(d, width, bias=False)
        self.wv = nn.Linear(d, width, bias=False)
        self.wo = nn.Linear(width, d, bias=False)
        self.wo.is_residual_out = True

    def heads(self, H):
        """W_g, W_v as (H, d, F/H) and W_o as (H, F/H, d): the blocks of gate channels
        [a F/H, (a+1) F/H) that head a averages (views of the Linear weights, nothing copied)."""
        d = self.wo.out_features
        w_in = lambda lin: lin.weight.view(H, -1, d).transpose(1, 2)
        return w_in(self.wg), w_in(self.wv), self.wo.weight.view(d, H, -1).permute(1, 2, 0)


class Tango(nn.Module):
    """TANGO body (full-prefix, windowed or three-set). forward(x (B, T, d), cos, sin, cache) -> (B, T, d).

    impl="fast" (default) or "reference" (plain formulas, for tests). Raises UsageError for a
    width that is not a multiple of n_head, or three sets with K < 3.
    """
    no_decay = ("log_tau", "null")  # temperature and null score: no weight decay (train.no_decay_parameters)

    def __init__(self, cfg, windowed=False, n_sets=1, impl="fast"):
        super().__init__()
        d, H = cfg.n_embd, cfg.n_head
        if cfg.width % H:
            raise UsageError(f"TANGO width {cfg.width} must be a multiple of n_head {H}")
        if n_sets == 3 and cfg.depth < 3:
            raise UsageError(f"--depth {cfg.depth}: TANGO with three gated-projection sets needs depth >= 3")
        self.depth, self.n_head, self.window = cfg.depth, H, cfg.window
        self.windowed, self.impl = windowed, impl
        self.norm = RMSNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.log_tau = nn.Parameter(torch.full((H,), math.log(10.0)))
        self.null = nn.Parameter(torch.zeros(H))
        self.sets = nn.ModuleList(GatedSet(d, cfg.width) for _ in range(n_sets))

    def set_index(self, k):
        """Gated-projection set used at application k (0-based): 0 first, 1 middle, 2 last."""
        if len(self.sets) == 1:
            return 0
        return 0 if k == 0 else 2 if k == self.depth - 1 else 1

    def forward(self, x, cos, sin, cache=None):
        for k in range(self.depth):
            x = x + self.update(x, cos, sin, self.sets[self.set_index(k)],
                                None if cache is None else cache.setdefault(k, {}))
        return x

    @compiled_region  # the repeated unit; the gated set is an argument, so three sets share its graphs
    def update(self, x, cos, sin, gset, cache=None):
        """One TANGO update y = (G * v) W_o for x: (B, T, d) with the GatedSet gset."""
        B, T, d = x.shape
        H = self.n_head
        u = self.norm(x)
        heads = lambda t: t.view(B, T, H, -1).transpose(1, 2)
        qs = apply_rope(F.normalize(heads(self.wq(u)), dim=-1), cos, sin) * self.log_tau.exp().view(1, H, 1, 1)
        kh = apply_rope(F.normalize(heads(self.wk(u)), dim=-1), cos, sin)
        # gates, values and G per head group, (H, B T, F/H): each group's channels contiguous for the
        # averages (tango_kernels.py, "Layout"); y = (G * v) W_o is the sum of the groups' products
        wg, wv, wo = gset.heads(H)
        ue = u.reshape(1, B * T, d).expand(H, -1, -1)  # u for every group (a view)
        g = F.silu(torch.bmm(ue, wg))
        G = self.aggregate(qs, kh, g.view(H, B, T, -1).transpose(0, 1), cache)  # (B, H, T, F/H)
        Gv = G.transpose(0, 1).reshape(H, B * T, -1) * torch.bmm(ue, wv)
        return torch.bmm(Gv, wo).sum(0).view(B, T, d)

    def aggregate(self, qs, kh, g, cache):
        b = self.null
        if not self.windowed:
            if self.impl == "reference":
                if cache is not None:
                    raise ValueError("the reference implementation has no decoding cache")
                return tango_reference(qs, kh, g, b)
            return tango_fast(qs, kh, g, b, cache)
        if cache is None:
            fn = windowed_reference if self.impl == "reference" else windowed_fast
            return fn(qs, kh, g, b, self.window)
        if "n" not in cache:
            return windowed_prefill(qs, kh, g, b, self.window, cache)
        return windowed_step(qs, kh, g, b, self.window, cache)


def tango(cfg, impl="fast"):
    """Full-prefix TANGO (MATH.md, "TANGO"). Non-embedding parameters: 2d^2 + 3dF + d + 2H + d."""
    return Tango(cfg, impl=impl)


def tango_windowed(cfg, impl="fast"):
    """Windowed TANGO, window cfg.window (MATH.md, "TANGO"). Same parameter count as TANGO."""
    return Tango(cfg, windowed=True, impl=impl)


def tango_3set(cfg, impl="fast"):
    """TANGO with three gated-projection sets (TANGO paper §4.2). Parameters: 2d^2 + 9dF + d + 2H + d."""
    return Tango(cfg, n_sets=3, impl=impl)
