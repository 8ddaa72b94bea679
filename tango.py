"""TANGO ("TANGO: Treating Tokens as Operators", §2; our reconstruction: MATH.md, "TANGO").

One gated update replaces attention and the feed-forward network; one block is applied K times.
Each position averages the gates of the positions up to it, weighted by a softmax over scores; one
more option, "attend to nothing" (the null option), takes weight exp(b_a) in that softmax's
denominator and contributes no gate, so a token can keep its average small:

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

The update below is these equations (Tango.update_reference) and the plain averages
(tango_reference, windowed_reference); the fast paths behind one call, tango_kernels.gated_update
(chunked kernels and a per-head-group layout on CPU, PyTorch's fused attention on CUDA; memory
linear in T, Windowed TANGO linear in T), their precision under bf16: tango_kernels.py.

TANGO with three gated-projection sets: {W_g, W_v, W_o} set 1 for the first application, set 2
for the middle ones, set 3 for the last; W_q, W_k, norm, tau, b shared. Needs K >= 3.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import RMSNorm, UsageError, apply_rope, compiled_region
from tango_kernels import chunked_average, gated_update


# ----------------------------------------------------------------------------- the averages, plain
# qs: (B, H, L, 32) tau-scaled unit rotated queries; kh: (B, H, S, 32) unit rotated keys (the last L
# are the queries' own positions); g: (B, H, S, F/H) gates, head a's channels; b: (H,) null scores.

def tango_reference(qs, kh, g, b):
    """Plain full-prefix TANGO average G (B, H, L, F/H): explicit weights w (B, H, L, S), then w @ g."""
    L, S = qs.shape[2], kh.shape[2]
    scores = qs @ kh.transpose(-1, -2)  # l_ij
    visible = torch.ones(L, S, dtype=torch.bool, device=qs.device).tril(diagonal=S - L)
    m = torch.where(visible, scores.exp(), torch.zeros_like(scores))
    denom = b.exp().view(1, -1, 1) + m.sum(-1)  # exp(b_a) + sum_j exp(l_ij)
    return (m / denom[..., None]) @ g


def windowed_reference(qs, kh, g, b, window):
    """Plain Windowed TANGO average G (B, H, T, F/H), one query at a time (O(T^2); for tests). L == S."""
    B, H, T, _ = qs.shape
    out = []
    for i in range(T):
        lo = max(i - window + 1, 0)  # window sources lo..i, older sources 0..lo-1
        logits = [b.view(1, H, 1).expand(B, H, 1).to(qs.dtype), qs[:, :, i:i + 1] @ kh[:, :, lo:i + 1].transpose(-1, -2)]
        values = [torch.zeros_like(g[:, :, :1]), g[:, :, lo:i + 1]]
        logits[1] = logits[1][:, :, 0]
        if lo > 0:
            k_old = F.normalize(kh[:, :, :lo].sum(2), dim=-1)
            s_old = (qs[:, :, i] * k_old).sum(-1, keepdim=True)  # one score for every old source
            logits.append(s_old + math.log(lo))  # mass exp(s_old) * n_old
            values.append(g[:, :, :lo].mean(2, keepdim=True))
        w = torch.softmax(torch.cat(logits, -1), -1)  # (B, H, n)
        out.append((w[:, :, None, :] @ torch.cat(values, 2))[:, :, 0])
    return torch.stack(out, 2)


# ----------------------------------------------------------------------------- modules

class GatedSet(nn.Module):
    """One gated-projection set: W_g, W_v (d x F) and W_o (F x d); head a averages the gate
    channels [a F/H, (a+1) F/H)."""

    def __init__(self, d, width):
        super().__init__()
        self.wg = nn.Linear(d, width, bias=False)
        self.wv = nn.Linear(d, width, bias=False)
        self.wo = nn.Linear(width, d, bias=False)
        self.wo.is_residual_out = True


class Tango(nn.Module):
    """TANGO body (full-prefix, windowed or three-set). forward(x (B, T, d), cos, sin, cache) -> (B, T, d).

    impl="fast" (default) or "reference" (plain formulas, for tests). Raises UsageError for a
    width that is not a multiple of n_head. Three sets act together from K = 3 (set_index; the
    registry's min_depth refuses fewer).
    """
    no_decay = ("log_tau", "null")  # temperature and null score: no weight decay (harness.optim.no_decay_parameters)
    rope_float32 = True  # LM builds its RoPE tables in float32 or wider: a bf16 table's rounding unnormalises q, k

    def __init__(self, cfg, windowed=False, n_sets=1, impl="fast"):
        super().__init__()
        d, H = cfg.n_embd, cfg.n_head
        if cfg.width % H:
            raise UsageError(f"TANGO width {cfg.width} must be a multiple of n_head {H}")
        self.depth, self.n_head, self.window = cfg.depth, H, cfg.window
        self.windowed, self.impl = windowed, impl
        self.norm = RMSNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.log_tau = nn.Parameter(torch.full((H,), math.log(10.0)))
        self.null = nn.Parameter(torch.zeros(H))
        self.sets = nn.ModuleList(GatedSet(d, cfg.width) for _ in range(n_sets))

    def init_constants(self):
        """The documented initial constants, as (value, want) pairs (tests/test_registry.py checks them): tau = 10 per head, null score b = 0."""
        return [(self.log_tau.exp(), 10.0), (self.null, 0.0)]

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
        """One TANGO update y = (G * v) W_o for x: (B, T, d) with the GatedSet gset -> (B, T, d)."""
        B, T, d = x.shape
        H = self.n_head
        u = self.norm(x)
        heads = lambda t: t.view(B, T, H, -1).transpose(1, 2)  # (B, H, T, 32)
        # unit q, k in float32 or wider under autocast: tau = 10 would magnify bfloat16's rounding
        unit = lambda t: F.normalize(heads(t).to(torch.promote_types(t.dtype, torch.float32)), dim=-1)
        qs = apply_rope(unit(self.wq(u)), cos, sin) * self.log_tau.exp().view(1, H, 1, 1)
        kh = apply_rope(unit(self.wk(u)), cos, sin)
        if self.impl == "reference":
            return self.update_reference(u, qs, kh, gset, cache)
        return gated_update(u, qs, kh, gset.wg.weight, gset.wv.weight, gset.wo.weight, self.null,
                            self.window if self.windowed else None, cache)  # the same equations, device-fast

    def update_reference(self, u, qs, kh, gset, cache=None):
        """The rest of the update as written: g = SiLU(u W_g), v = u W_v, G averaged, y = (G * v) W_o.
        u: (B, T, d), qs, kh: (B, H, T, 32) -> (B, T, d)."""
        B, T, _ = u.shape
        g = F.silu(gset.wg(u))  # (B, T, F)
        v = gset.wv(u)
        G = self.aggregate(qs, kh, g.view(B, T, self.n_head, -1).transpose(1, 2), cache)  # (B, H, T, F/H)
        return gset.wo(G.transpose(1, 2).reshape(B, T, -1) * v)

    def aggregate(self, qs, kh, g, cache=None):
        """The reference update's average G (B, H, T, F/H) of qs, kh (B, H, T, 32), g (B, H, T, F/H),
        four ways: full prefix without a cache, tango_reference; full prefix with one, ValueError
        (the reference keeps no decoding state); windowed without a cache, windowed_reference;
        windowed with a cache, the chunked kernels' decoding (tango_kernels.chunked_average: the
        prompt, then one token at a time, checked against windowed_reference by the tests)."""
        b = self.null
        if not self.windowed:
            if cache is not None:
                raise ValueError("the reference implementation has no decoding cache")
            return tango_reference(qs, kh, g, b)
        if cache is None:
            return windowed_reference(qs, kh, g, b, self.window)
        return chunked_average(qs, kh, g, b, self.window, cache)


def tango(cfg, impl="fast"):
    """Full-prefix TANGO (MATH.md, "TANGO"). Non-embedding parameters: 2d^2 + 3dF + d + 2H + d."""
    return Tango(cfg, impl=impl)


def tango_windowed(cfg, impl="fast"):
    """Windowed TANGO, window cfg.window (MATH.md, "TANGO"). Same parameter count as TANGO."""
    return Tango(cfg, windowed=True, impl=impl)


def tango_3set(cfg, impl="fast"):
    """TANGO with three gated-projection sets (TANGO paper §2; results §4.2). Parameters: 2d^2 + 9dF + d + 2H + d."""
    return Tango(cfg, n_sets=3, impl=impl)
