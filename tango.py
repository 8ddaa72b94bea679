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

Fast path: the null option is one extra key whose score is b_a and whose value is 0, so the whole
average is a single causal softmax attention whose values are the gates (queries/keys padded to
40 dims: [tau q^, 1, 0...] . [k^, 0, 0...] = l_ij and [tau q^, 1, 0...] . [0, b_a, 0...] = b_a).
No (T x T x F) tensor is ever formed. `tango_reference` is the plain formula, used by the tests.

Windowed TANGO: sources in the window j in (i-W, i] get the scores above; all older sources
j <= i-W share one score tau_a <q^_i, unit(sum_{j<=i-W} k^_j)>, contribute exp(score) * sum g_j
and mass exp(score) * n_old, n_old = i-W+1 (0-based). Cost O(T W (d + F)); decoding keeps the
last W-1 keys/gates plus two running sums. With W >= T it equals full-prefix TANGO.

TANGO with three gated-projection sets: {W_g, W_v, W_o} set 1 for the first application, set 2
for the middle ones, set 3 for the last; W_q, W_k, norm, tau, b shared. Needs K >= 3.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import HEAD_DIM, RMSNorm, UsageError, apply_rope, compiled_region

QK_PAD = 40  # 32 score dims + 1 null-option dim, padded to a multiple of 8 for fused kernels


# ----------------------------------------------------------------------------- aggregation
# All aggregation functions take
#   qs: (B, H, L, 32)  tau-scaled, normalized, rotated queries
#   kh: (B, H, S, 32)  normalized, rotated keys (the last L are the queries' own positions)
#   g:  (B, H, S, F/H) source gates, split into H groups
#   b:  (H,)           null-option scores
# and return G: (B, H, L, F/H).

def tango_reference(qs, kh, g, b):
    """Plain full-prefix TANGO average: explicit weights w (B, H, L, S), then w @ g."""
    L, S = qs.shape[2], kh.shape[2]
    scores = qs @ kh.transpose(-1, -2)  # l_ij
    visible = torch.ones(L, S, dtype=torch.bool, device=qs.device).tril(diagonal=S - L)
    m = torch.where(visible, scores.exp(), torch.zeros_like(scores))
    denom = b.exp().view(1, -1, 1) + m.sum(-1)  # exp(b_a) + sum_j exp(l_ij)
    return (m / denom[..., None]) @ g


def _augment(qs, kh, b):
    """Pad queries to [qs, 1, 0..] and keys to [kh, 0, 0..], and build the null key [0, b, 0..]."""
    B, H, L, _ = qs.shape
    qa = F.pad(torch.cat((qs, qs.new_ones(B, H, L, 1)), -1), (0, QK_PAD - HEAD_DIM - 1))
    ka = F.pad(kh, (0, QK_PAD - HEAD_DIM))
    null_k = F.pad(b.to(qs.dtype).view(1, -1, 1, 1).expand(B, -1, 1, 1), (HEAD_DIM, QK_PAD - HEAD_DIM - 1))
    return qa, ka, null_k


class ChunkedCausalAttention(torch.autograd.Function):
    """softmax(q k^T + causal mask) v in query chunks, saving only the output and the row
    log-sum-exp for backward (the FlashAttention recipe in plain PyTorch): memory O(chunk x S)
    per head instead of O(L x S), so TANGO's activation memory is linear in T. Lower-right causal
    alignment: query i sees keys j <= i + (S - L). q: (B, H, L, dk), k: (B, H, S, dk),
    v: (B, H, S, dv) -> (B, H, L, dv). No scaling (callers pre-scale q)."""

    @staticmethod
    def _scores(q, k, r0, r1, off):
        s = q[:, :, r0:r1] @ k[:, :, :r1 + off].transpose(-1, -2)  # keys beyond the chunk's last row are never visible
        rows = torch.arange(r0, r1, device=q.device).view(-1, 1)
        return s.masked_fill(torch.arange(r1 + off, device=q.device) > rows + off, float("-inf"))

    @staticmethod
    def forward(ctx, q, k, v, chunk):
        L, S = q.shape[2], k.shape[2]
        off = S - L
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        lse = q.new_empty(q.shape[:3])
        for r0 in range(0, L, chunk):
            r1 = min(r0 + chunk, L)
            s = ChunkedCausalAttention._scores(q, k, r0, r1, off)
            lse[:, :, r0:r1] = torch.logsumexp(s, -1)
            out[:, :, r0:r1] = torch.exp(s - lse[:, :, r0:r1, None]) @ v[:, :, :r1 + off]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        L, S = q.shape[2], k.shape[2]
        off = S - L
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (dout * out).sum(-1)  # rowsum(dO * O)
        for r0 in range(0, L, ctx.chunk):
            r1 = min(r0 + ctx.chunk, L)
            n = r1 + off
            p = torch.exp(ChunkedCausalAttention._scores(q, k, r0, r1, off) - lse[:, :, r0:r1, None])
            do = dout[:, :, r0:r1]
            ds = p * (do @ v[:, :, :n].transpose(-1, -2) - delta[:, :, r0:r1, None])
            dq[:, :, r0:r1] = ds @ k[:, :, :n]
            dk[:, :, :n] += ds.transpose(-1, -2) @ q[:, :, r0:r1]
            dv[:, :, :n] += p.transpose(-1, -2) @ do
        return dq, dk, dv, None


ATTN_CHUNK = 256  # query rows per chunk in ChunkedCausalAttention


def tango_fast(qs, kh, g, b, cache=None):
    """Full-prefix TANGO as one causal attention over [null key, keys] with the gates as values.

    With a cache (dict) the padded keys and gates are appended to it (decoding).
    """
    qa, ka, null_k = _augment(qs, kh, b)
    if cache is not None and "k" in cache:
        ka, g = torch.cat((cache["k"], ka), 2), torch.cat((cache["g"], g), 2)
    else:
        ka = torch.cat((null_k, ka), 2)
        g = torch.cat((g.new_zeros(g.shape[0], g.shape[1], 1, g.shape[3]), g), 2)
    if cache is not None:
        cache["k"], cache["g"] = ka, g
    return ChunkedCausalAttention.apply(qa, ka, g, ATTN_CHUNK)  # query i sees the null key and keys j <= i


def windowed_reference(qs, kh, g, b, window):
    """Plain Windowed TANGO, one query at a time (O(T^2); for tests). L == S required."""
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


def windowed_fast(qs, kh, g, b, window):
    """Windowed TANGO in chunks of W queries: each chunk scores its own and the previous chunk's
    keys (a (W x 2W) band), and one summary 'key' per query stands for all sources j <= i-W.
    Memory and time O(T W (d + F/H)) per head. L == S required (no cache)."""
    B, H, T, dh = qs.shape
    W = min(window, T)
    fh = g.shape[-1]
    # older sources for query i: j <= i - W, summarized by prefix sums taken at i - W
    n_old = (torch.arange(T, device=qs.device) - W + 1).clamp(min=0)
    k_old = F.pad(kh.cumsum(2), (0, 0, W, 0))[:, :, :T]
    g_old = F.pad(g.cumsum(2), (0, 0, W, 0))[:, :, :T]
    s_old = (qs * F.normalize(k_old, dim=-1)).sum(-1)
    s_old = torch.where(n_old > 0, s_old + n_old.clamp(min=1).to(qs.dtype).log(), torch.full_like(s_old, float("-inf")))
    # window sources, chunked: chunk c holds queries [cW, cW+W) and keys [cW-W, cW+W)
    nc = -(-T // W)
    pad = nc * W - T
    chunk = lambda t: F.pad(t, (0, 0, 0, pad)).view(B, H, nc, W, t.shape[-1])
    qc, kc, gc = chunk(qs), chunk(kh), chunk(g)
    two = lambda t: torch.cat((F.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :-1], t), 3)  # (B, H, nc, 2W, .)
    scores = qc @ two(kc).transpose(-1, -2)  # (B, H, nc, W, 2W)
    r = torch.arange(W, device=qs.device).view(W, 1)
    s = torch.arange(2 * W, device=qs.device).view(1, 2 * W)
    band = (s > r) & (s <= r + W)  # key cW-W+s is in (i-W, i] for query i = cW+r
    first = torch.zeros(nc, 1, 2 * W, dtype=torch.bool, device=qs.device)
    first[0, :, :W] = True  # chunk 0 has no previous chunk
    scores = scores.masked_fill(~band | first, float("-inf"))
    null = b.to(qs.dtype).view(1, H, 1, 1, 1).expand(B, H, nc, W, 1)
    w = torch.softmax(torch.cat((null, chunk(s_old[..., None]), scores), -1), -1)
    mean_old = g_old / n_old.clamp(min=1).view(1, 1, T, 1).to(g.dtype)
    out = w[..., 2:] @ two(gc) + w[..., 1:2] * chunk(mean_old)
    return out.reshape(B, H, nc * W, fh)[:, :, :T]


def windowed_step(qs, kh, g, b, window, cache):
    """Windowed TANGO decoding of new queries one at a time with O(1) state per token: the last
    W-1 keys/gates plus the running sums of older keys and gates and their count."""
    outs = []
    for t in range(qs.shape[2]):
        q, keys, gates = qs[:, :, t:t + 1], kh[:, :, t:t + 1], g[:, :, t:t + 1]
        if "k" in cache:
            keys, gates = torch.cat((cache["k"], keys), 2), torch.cat((cache["g"], gates), 2)
        B, H = q.shape[:2]
        logits = [b.to(q.dtype).view(1, H, 1, 1).expand(B, H, 1, 1), q @ keys.transpose(-1, -2)]
        values = [torch.zeros_like(gates[:, :, :1]), gates]
        n = cache.get("n", 0)
        if n > 0:
            s_old = (q * F.normalize(cache["sk"], dim=-1)).sum(-1, keepdim=True)
            logits.append(s_old + math.log(n))
            values.append(cache["sg"] / n)
        w = torch.softmax(torch.cat(logits, -1), -1)
        outs.append(w @ torch.cat(values, 2))
        if keys.shape[2] > window - 1:  # the oldest window source becomes an old source
            k0, g0 = keys[:, :, :1], gates[:, :, :1]
            cache["sk"] = cache["sk"] + k0 if n else k0
            cache["sg"] = cache["sg"] + g0 if n else g0
            cache["n"] = n + 1
            keys, gates = keys[:, :, 1:], gates[:, :, 1:]
        cache["k"], cache["g"] = keys, gates
    return torch.cat(outs, 2)


def windowed_prefill(qs, kh, g, b, window, cache):
    """Windowed TANGO over a whole prompt (empty cache), then the decoding state for its end."""
    out = windowed_fast(qs, kh, g, b, window)
    T = kh.shape[2]
    keep = min(T, window - 1)
    cache["k"], cache["g"] = kh[:, :, T - keep:], g[:, :, T - keep:]
    n = T - keep
    if n > 0:
        cache["sk"], cache["sg"] = kh[:, :, :n].sum(2, keepdim=True), g[:, :, :n].sum(2, keepdim=True)
    cache["n"] = n
    return out


# ----------------------------------------------------------------------------- modules

class GatedSet(nn.Module):
    """One gated-projection set: W_g, W_v (d x F) and W_o (F x d)."""

    def __init__(self, d, width):
        super().__init__()
        self.wg = nn.Linear(d, width, bias=False)
        self.wv = nn.Linear(d, width, bias=False)
        self.wo = nn.Linear(width, d, bias=False)
        self.wo.is_residual_out = True


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

    @compiled_region  # the repeated unit; the gated set is an argument, so three sets share one graph
    def update(self, x, cos, sin, gset, cache=None):
        """One TANGO update y = (G * v) W_o for x: (B, T, d) with the GatedSet gset."""
        B, T, d = x.shape
        H = self.n_head
        u = self.norm(x)
        heads = lambda t: t.view(B, T, H, -1).transpose(1, 2)
        qs = apply_rope(F.normalize(heads(self.wq(u)), dim=-1), cos, sin) * self.log_tau.exp().view(1, H, 1, 1)
        kh = apply_rope(F.normalize(heads(self.wk(u)), dim=-1), cos, sin)
        g = heads(F.silu(gset.wg(u)))  # (B, H, T, F/H)
        G = self.aggregate(qs, kh, g, cache)
        return gset.wo(G.transpose(1, 2).reshape(B, T, -1) * gset.wv(u))

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
