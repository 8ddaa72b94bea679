"""Every registered model against a float64 hand computation written from the equations in its
docstring (tango.py, baselines.py, parcae.py, depth_attention.py, ponder.py), with every parameter moved away from its init
(random tau, null scores, A_log, dt_bias, B, C, scale-offsets, norm gains), so that a one-line
change in a model's update cannot hide behind an init value.

The hand computations use only plain tensor arithmetic: their own RMSNorm, SiLU, softmax and RoPE
(pairs (x_i, x_{i+16}) of each 32-dim head rotated by position * 10000^(-2i/32)); nothing from
common.py, tango.py, baselines.py, parcae.py, depth_attention.py or ponder.py except the parameters they read and Parcae/RDM's
seeded evaluation state h_0 (a table of random numbers, not an equation).
"""
import math

import pytest
import torch

import checks
import models
import parcae
from common import ModelConfig

F64 = torch.float64
V, T_SEQ = 61, 11
CFG = dict(vocab_size=V, block_size=32, n_embd=64, n_head=2, width=32, window=4, chunk=4, gau_s=64,
           n_prelude=1, n_core=2, n_coda=1)
DEPTH = {"tango-3set": 4, "parcae": 2, "rdm": 2,  # three sets: first, middle (twice), last
         "depth-attn": 4, "loop-depth-attn": 4}  # Depth-Attention: C(l) = {0}, {0}, {0, 2} (stride 2)
DEPTH.update({"loopstack": 3, "plt": 3, "loopfold": 4})  # parallel loops: N loops of n_core = 2 blocks
CFG["plt_window"] = 4  # PLT: a G-SWA window shorter than T_SEQ


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def config(name, **kw):
    return ModelConfig(**{**CFG, "model": name, "depth": DEPTH.get(name, 2), **kw})


def perturbed(name, seed=0, **kw):
    """A float64 model of `name` with every parameter drawn away from its init."""
    torch.manual_seed(seed)
    model = models.build_model(config(name, **kw)).double().eval()
    g = torch.Generator().manual_seed(seed + 1)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            leaf = pname.rsplit(".", 1)[-1]
            if leaf == "log_tau":  # tau in [2, 12], different per head
                p.copy_(torch.empty_like(p).uniform_(math.log(2), math.log(12), generator=g))
            elif leaf in ("null", "A_log", "dt_bias", "beta"):
                p.copy_(0.7 * rnd(*p.shape))
            elif leaf == "gamma":
                p.copy_(1 + 0.5 * rnd(*p.shape))
            elif p.dim() == 1:  # RMSNorm gains
                p.copy_(1 + 0.3 * rnd(*p.shape))
            elif pname == "wte.weight":
                p.copy_(rnd(*p.shape))
            else:  # matrices (incl. Parcae's B and C): entries ~ N(0, 1/fan_in)
                p.copy_(rnd(*p.shape) / math.sqrt(p.shape[1]))
    return model


# ----------------------------------------------------------------------------- plain building blocks

def rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def silu(z):
    return z / (1 + torch.exp(-z))


def softplus(z):
    return torch.log1p(torch.exp(z))


def unit(v):
    return v / v.norm(dim=-1, keepdim=True)


def lin(x, w):
    """x W for a weight stored as nn.Linear stores it (out x in)."""
    return x @ w.t()


def rope(x, pos):
    """x: (T, 32k); each 32-dim group rotated: pair (x_i, x_{i+16}) by angle pos * 10000^(-i/16)."""
    T, m = x.shape
    i = torch.arange(16, dtype=F64)
    ang = pos.to(F64)[:, None] * 10000.0 ** (-2 * i / 32)  # (T, 16)
    c, s = torch.cos(ang), torch.sin(ang)
    out = []
    for g in range(m // 32):
        a, b = x[:, 32 * g:32 * g + 16], x[:, 32 * g + 16:32 * g + 32]
        out += [a * c - b * s, a * s + b * c]
    return torch.cat(out, -1)


def causal_softmax_rows(scores):
    """Row-wise softmax over j <= i of a (T, T) score matrix."""
    T = scores.shape[0]
    out = torch.zeros_like(scores)
    for i in range(T):
        e = torch.exp(scores[i, :i + 1] - scores[i, :i + 1].max())
        out[i, :i + 1] = e / e.sum()
    return out


# ----------------------------------------------------------------------------- parameter access
# Transformer++ may keep q/k/v as three d x d maps (wq, wk, wv) or one fused `qkv` (rows [q; k; v]),
# and SwiGLU W_1, W_3 as two maps (w1, w3) or one fused `w13` (rows [W_1; W_3]).

def attn_weights(attn):
    if hasattr(attn, "qkv"):
        wq, wk, wv = attn.qkv.weight.chunk(3, 0)
    else:
        wq, wk, wv = attn.wq.weight, attn.wk.weight, attn.wv.weight
    return wq, wk, wv, attn.wo.weight


def mlp_weights(mlp):
    if hasattr(mlp, "w13"):
        w1, w3 = mlp.w13.weight.chunk(2, 0)
    else:
        w1, w3 = mlp.w1.weight, mlp.w3.weight
    return w1, w3, mlp.w2.weight


# ----------------------------------------------------------------------------- hand computations

def attention(u, attn, pos, n_head):
    """Causal softmax attention with RoPE on q and k, scale 1/sqrt(32), then W_o."""
    wq, wk, wv, wo = attn_weights(attn)
    q, k, v = lin(u, wq), lin(u, wk), lin(u, wv)
    heads = []
    for a in range(n_head):
        sl = slice(32 * a, 32 * a + 32)
        qa, ka = rope(q[:, sl], pos), rope(k[:, sl], pos)
        heads.append(causal_softmax_rows(qa @ ka.t() / math.sqrt(32)) @ v[:, sl])
    return lin(torch.cat(heads, -1), wo)


def swiglu(u, mlp):
    w1, w3, w2 = mlp_weights(mlp)
    return lin(silu(lin(u, w1)) * lin(u, w3), w2)


def tpp_block(x, blk, pos, H):
    """Transformer++: x + Attn(Norm x), then + SwiGLU(Norm x)."""
    x = x + attention(rms(x, blk.norm1.weight), blk.attn, pos, H)
    return x + swiglu(rms(x, blk.norm2.weight), blk.mlp)


def sandwich_block(x, blk, pos, H):
    """RDM: x' = n2(x + Attn(n1 x)); x'' = n4(x' + SwiGLU(n3 x'))."""
    x = rms(x + attention(rms(x, blk.n1.weight), blk.attn, pos, H), blk.n2.weight)
    return rms(x + swiglu(rms(x, blk.n3.weight), blk.mlp), blk.n4.weight)


def tango_update(x, body, gset, pos, H, window=None):
    """One TANGO update (tango.py docstring), per head a and query i, as written there."""
    T, _ = x.shape
    u = rms(x, body.norm.weight)
    q, k = lin(u, body.wq.weight), lin(u, body.wk.weight)
    g = silu(lin(u, gset.wg.weight))  # source gate
    v = lin(u, gset.wv.weight)        # destination, linear
    Fh = g.shape[1] // H
    G = torch.zeros_like(g)
    for a in range(H):
        qa = rope(unit(q[:, 32 * a:32 * a + 32]), pos)
        ka = rope(unit(k[:, 32 * a:32 * a + 32]), pos)
        tau, b = torch.exp(body.log_tau[a]), body.null[a]
        ga = g[:, Fh * a:Fh * (a + 1)]
        for i in range(T):
            lo = 0 if window is None else max(0, i - window + 1)  # sources lo..i get their own score
            m = torch.exp(tau * (ka[lo:i + 1] @ qa[i]))
            num, mass = m @ ga[lo:i + 1], m.sum()
            if lo > 0:  # Windowed TANGO: the lo older sources share one score
                s_old = torch.exp(tau * (qa[i] @ unit(ka[:lo].sum(0))))
                num, mass = num + s_old * ga[:lo].sum(0), mass + s_old * lo
            G[i, Fh * a:Fh * (a + 1)] = num / (torch.exp(b) + mass)
    return lin(G * v, gset.wo.weight)


def tango_body(x, model, pos):
    cfg, body = model.cfg, model.body
    K = cfg.depth
    for k in range(K):
        s = 0 if cfg.model != "tango-3set" or k == 0 else 2 if k == K - 1 else 1  # first, middle, last
        window = cfg.window if cfg.model == "tango-windowed" else None
        x = x + tango_update(x, body, body.sets[s], pos, cfg.n_head, window)
    return x


def tpp_body(x, model, pos):
    cfg, blocks = model.cfg, model.body.blocks
    assert len(blocks) == (1 if cfg.model == "loop" else cfg.depth)
    for k in range(cfg.depth):
        x = tpp_block(x, blocks[k % len(blocks)], pos, cfg.n_head)
    return x


def gau_unit(x, unit_, pos, e, c, chunk=None):
    """GAU (chunk None): relu(Q K^T / c)^2 causal; FLASH: local relu^2 in the chunk + global linear.
    [U | V | Z] = SiLU(u W_in) with U, V e wide and Z the rest (s wide)."""
    T = x.shape[0]
    uvz = silu(lin(rms(x, unit_.norm.weight), unit_.w_in.weight))
    U, Vv, Z = uvz[:, :e], uvz[:, e:2 * e], uvz[:, 2 * e:]
    heads = [rope(Z * unit_.gamma[h] + unit_.beta[h], pos) for h in range(unit_.gamma.shape[0])]
    W = torch.zeros(T, T, dtype=F64)
    for i in range(T):
        for j in range(i + 1):
            if chunk is None:
                W[i, j] = torch.relu(heads[0][i] @ heads[1][j] / c) ** 2
            elif i // chunk == j // chunk:
                W[i, j] = torch.relu(heads[0][i] @ heads[1][j] / chunk) ** 2
            else:
                W[i, j] = heads[2][i] @ heads[3][j] / chunk
    return lin(U * (W @ Vv), unit_.wo.weight)


def gau_body(x, model, pos):
    cfg, units = model.cfg, model.body.units
    assert len(units) == (1 if cfg.tie_unit else cfg.depth)
    for k in range(cfg.depth):
        unit_ = units[k % len(units)]
        assert unit_.gamma.shape == (4 if cfg.model == "flash" else 2, cfg.gau_s)  # scale-offset heads on Z
        x = x + gau_unit(x, unit_, pos, cfg.width, cfg.block_size, cfg.chunk if cfg.model == "flash" else None)
    return x


def eval_h0(T, d, std):
    """The seeded evaluation state (a table of random numbers; its std is the documented one)."""
    return parcae.eval_state(0, T, d, std, "cpu", F64)[0]


def parcae_body(x, model, pos, depth=None, h0=None):
    body, H, d = model.body, model.cfg.n_head, model.cfg.n_embd
    for blk in body.prelude:
        x = tpp_block(x, blk, pos, H)
    e = rms(x, body.prelude_norm.weight)
    delta = softplus(body.dt_bias)
    abar = torch.exp(-delta * torch.exp(body.A_log))  # Abar = exp(Delta A), A = -exp(A_log)
    inj = delta * lin(e, body.B)                        # Delta * (B e)
    h = eval_h0(x.shape[0], d, math.sqrt(2 / (5 * d))) if h0 is None else h0
    for _ in range(model.cfg.depth if depth is None else depth):
        u = abar * h + inj
        for blk in body.core:
            u = tpp_block(u, blk, pos, H)
        h = u
    y = lin(h, body.C)
    for blk in body.coda:
        y = tpp_block(y, blk, pos, H)
    return y


def rdm_body(x, model, pos):
    body, H, d = model.body, model.cfg.n_head, model.cfg.n_embd
    x = x * math.sqrt(d)
    for blk in body.prelude:
        x = sandwich_block(x, blk, pos, H)
    e, h = x, eval_h0(x.shape[0], d, math.sqrt(2 / 5))
    for _ in range(model.cfg.depth):
        u = lin(torch.cat((h, e), -1), body.adapter.weight)  # W [h; e]
        for blk in body.core:
            u = sandwich_block(u, blk, pos, H)
        h = u
    for blk in body.coda:
        h = sandwich_block(h, blk, pos, H)
    return h


def depth_attn_body(x, model, pos):
    """Depth-Attention (depth_attention.py docstring): per head, before sequence attention, layer l's
    value at t becomes sum_{j in C(l)} w_j v~^j_t + w_self v^l_t, w = softmax of <q^l_t, k^j_t> / sqrt(32)
    over C(l) and self; C(l) = {j < l: j mod s == 0} U {l-r..l-1}, s = da_stride or floor(K/2) (-1: no
    strided j)."""
    cfg, blocks = model.cfg, model.body.blocks
    K, H, T = cfg.depth, cfg.n_head, x.shape[0]
    s, r = cfg.da_stride or K // 2, cfg.da_recent
    keys, vals = [], []  # per layer, per head: (T, 32) rotated keys and mixed values
    for l in range(K):
        blk = blocks[l % len(blocks)]
        C = sorted({j for j in range(l) if 0 <= s <= 1 or s > 1 and j % s == 0} | set(range(max(0, l - r), l)))
        wq, wk, wv, wo = attn_weights(blk.attn)
        u = rms(x, blk.norm1.weight)
        q, k, v = lin(u, wq), lin(u, wk), lin(u, wv)
        outs, lk, lv = [], [], []
        for a in range(H):
            sl = slice(32 * a, 32 * a + 32)
            qa, ka, va = rope(q[:, sl], pos), rope(k[:, sl], pos), v[:, sl]
            if C:
                mixed = torch.zeros_like(va)
                for t in range(T):
                    sc = torch.stack([qa[t] @ keys[j][a][t] for j in C] + [qa[t] @ ka[t]]) / math.sqrt(32)
                    w = torch.exp(sc - sc.max())
                    w = w / w.sum()
                    mixed[t] = sum(w[i] * vals[j][a][t] for i, j in enumerate(C)) + w[-1] * va[t]
                va = mixed
            lk.append(ka)
            lv.append(va)
            outs.append(causal_softmax_rows(qa @ ka.t() / math.sqrt(32)) @ va)
        keys.append(lk)
        vals.append(lv)
        x = x + lin(torch.cat(outs, -1), wo)
        x = x + swiglu(rms(x, blk.norm2.weight), blk.mlp)
    return x


def ponder_body(x, model, pos):
    """PonderLM-2 (ponder.py docstring): slots (t,0) = e(x_t), (t,k) = Norm_θ(H_{t,k-1}), all at
    position t, in slot order; bootstrap b = 1..n, N = cfg.jacobi refinements, a final pass; the
    output is H_{t,n}."""
    cfg, blocks = model.cfg, model.body.blocks
    n, T, d = cfg.n_thoughts, x.shape[0], x.shape[1]
    g = model.body.think_norm.weight if n else None  # (no thought slots: no Norm_θ)

    def run(slots):  # one pass: rows (0,0), (0,1), ..., (1,0), ... -> H (T, S, d)
        S = len(slots)
        h = torch.stack(slots, 1).reshape(T * S, d)
        for blk in blocks:
            h = tpp_block(h, blk, pos.repeat_interleave(S), cfg.n_head)
        return h.view(T, S, d)

    zs = []
    for b in range(1, n + 1):
        h = run([x] + zs)
        zs = [rms(h[:, k], g) for k in range(b)]
    for _ in range(cfg.jacobi):
        h = run([x] + zs)
        zs = [rms(h[:, k], g) for k in range(n)]
    return run([x] + zs)[:, n]


def lrt_body(x, model, pos):
    """LRT / LRT with thought tokens (latent_recurrence.py docstring), row by row: slots (t,0) = e(x_t),
    (t,k) = e_θ,k, all at position t; an init pass with m = 0; then for j = 0..k-1 the rows
    i = j mod k again, with m_i = RMSNorm_m(z_src(i-1)) (m_0 = 0) added as W_m m_i to block tgt's
    input, each query over the kept keys/values of rows <= i with this subset's rows fresh, and with
    lrt_kv one more key W_km m_i / value W_vm m_i (no RoPE) in its softmax; output z_{K-1} of (t, n)."""
    cfg, body = model.cfg, model.body
    n = cfg.n_thoughts if cfg.model == "lrt-think" else 0
    K, H, d = cfg.depth, cfg.n_head, x.shape[1]
    src = cfg.lrt_src if cfg.lrt_src >= 0 else (2 * K) // 3
    X = torch.stack([row for t in range(x.shape[0]) for row in [x[t]] + [body.thought[k] for k in range(n)]])
    P = pos.repeat_interleave(n + 1)
    S = X.shape[0]
    keys, vals = [[None] * S for _ in range(K)], [[None] * S for _ in range(K)]
    zsrc, out = [None] * S, [None] * S

    def run(rows, mem):  # the K blocks on these rows; mem: (len(rows), d)
        h = X[rows]
        for l, blk in enumerate(body.blocks):
            if l == cfg.lrt_tgt:
                h = h + lin(mem, body.w_m)
            wq, wk, wv, wo = attn_weights(blk.attn)
            u = rms(h, blk.norm1.weight)
            q, k, v = rope(lin(u, wq), P[rows]), rope(lin(u, wk), P[rows]), lin(u, wv)
            for a, r in enumerate(rows):
                keys[l][r], vals[l][r] = k[a], v[a]
            y = torch.zeros_like(h)
            for a, r in enumerate(rows):
                for hh in range(H):
                    sl = slice(32 * hh, 32 * hh + 32)
                    ks = [keys[l][j][sl] for j in range(r + 1)]
                    vs = [vals[l][j][sl] for j in range(r + 1)]
                    if cfg.lrt_kv:
                        ks.append(lin(mem[a], body.w_km.weight)[sl])
                        vs.append(lin(mem[a], body.w_vm.weight)[sl])
                    sc = torch.stack(ks) @ q[a, sl] / math.sqrt(32)
                    w = torch.exp(sc - sc.max())
                    y[a, sl] = (w / w.sum()) @ torch.stack(vs)
            h = h + lin(y, wo)
            h = h + swiglu(rms(h, blk.norm2.weight), blk.mlp)
            if l == src:
                for a, r in enumerate(rows):
                    zsrc[r] = h[a]
        return h

    run(list(range(S)), torch.zeros(S, d, dtype=x.dtype))  # init pass
    k = min(cfg.lrt_subsets, S)
    for j in range(k):
        rows = list(range(j, S, k))
        mem = torch.stack([rms(zsrc[r - 1], body.mem_norm.weight) if r > 0 else torch.zeros(d, dtype=x.dtype)
                           for r in rows])
        for a, h in enumerate(run(rows, mem)):
            out[rows[a]] = h
    return torch.stack(out[n::n + 1])


HAND = {"tango": tango_body, "tango-windowed": tango_body, "tango-3set": tango_body, "loop": tpp_body,
        "untied": tpp_body, "gau": gau_body, "flash": gau_body, "parcae": parcae_body, "rdm": rdm_body,
        "depth-attn": depth_attn_body, "loop-depth-attn": depth_attn_body, "ponder": ponder_body,
        "lrt": lrt_body, "lrt-think": lrt_body}


def loopstack_body(x, model, pos):
    """Loop stack (parallel_loops.py docstring): h^l = R(h^{l-1}), R = the n_core blocks, N = depth loops."""
    for _ in range(model.cfg.depth):
        for blk in model.body.blocks:
            x = tpp_block(x, blk, pos, model.cfg.n_head)
    return x


def plt_body(x, model, pos):
    """PLT (parallel_loops.py docstring): loop 1 plain; x^l_t = a e_t + b Norm_loop(h^{l-1}_{t-1}) (0 at t = 0;
    without --plt_shift h^{l-1}_t);
    loops >= 2: per head o_t = g Attn(q_t; loop-1 keys j <= t) + (1 - g) Attn(q_t; own keys t-W < j <= t),
    g = sigmoid(w_h . q_t + c_h) with the rotated query."""
    cfg, body = model.cfg, model.body
    H, W, T = cfg.n_head, cfg.plt_window, x.shape[0]
    a, b = body.clp_a[0], body.clp_b[0]

    def heads(h, blk):
        wq, wk, wv, _ = attn_weights(blk.attn)
        u = rms(h, blk.norm1.weight)
        q, k, v = lin(u, wq), lin(u, wk), lin(u, wv)
        return [(rope(q[:, 32 * i:32 * i + 32], pos), rope(k[:, 32 * i:32 * i + 32], pos), v[:, 32 * i:32 * i + 32])
                for i in range(H)]

    e, h, loop1 = x, x, []
    for blk in body.blocks:
        loop1.append(heads(h, blk))
        h = tpp_block(h, blk, pos, H)
    for _ in range(2, cfg.depth + 1):
        z = rms(h, body.norm_loop.weight)
        prev = z.clone()  # without the shift: h^{l-1}_t at every t
        if cfg.plt_shift:
            prev[0], prev[1:] = 0, z[:-1]
        h = a * e + b * prev
        for i, blk in enumerate(body.blocks):
            outs = []
            for hd, (q, k, v) in enumerate(heads(h, blk)):
                _, k1, v1 = loop1[i][hd]
                o = torch.zeros(T, 32, dtype=F64)
                for t in range(T):
                    g = 1 / (1 + torch.exp(-(q[t] @ blk.gate_w[hd] + blk.gate_b[hd])))
                    s1 = q[t] @ k1[:t + 1].t() / math.sqrt(32)
                    w1 = torch.exp(s1 - s1.max())
                    lo = max(0, t - W + 1)
                    s2 = q[t] @ k[lo:t + 1].t() / math.sqrt(32)
                    w2 = torch.exp(s2 - s2.max())
                    o[t] = g * (w1 / w1.sum()) @ v1[:t + 1] + (1 - g) * (w2 / w2.sum()) @ v[lo:t + 1]
                outs.append(o)
            h = h + lin(torch.cat(outs, -1), attn_weights(blk.attn)[3])
            h = h + swiglu(rms(h, blk.norm2.weight), blk.mlp)
    return h


def loopfold_body(x, model, pos):
    """LoopFold (parallel_loops.py docstring): stages [loop 1], then groups of f (--fold_layout last: groups
    of f, then [loop N]); in a stage r_1 = u,
    r_{i+1} = P(r_i), o_i = R(r_i), y_1 = o_1, y_{i+1} = o_{i+1} + C(y_i - r_{i+1});
    P(u) = u + W_p2 SiLU(W_p1 RMSNorm(u)), C(e) = e + U_c V_c^T e."""
    cfg, body = model.cfg, model.body
    N, f = cfg.depth, cfg.fold

    def R(r):
        for blk in body.blocks:
            r = tpp_block(r, blk, pos, cfg.n_head)
        return r

    P = lambda u: u + lin(silu(lin(rms(u, body.pred_norm.weight), body.pred_w1)), body.pred_w2)
    C = lambda e: e + lin(lin(e, body.corr_v), body.corr_u)
    if cfg.fold_layout == "first":  # loop 1 alone, then groups of f
        sizes = [1] + [min(f, N - s) for s in range(1, N, f)]
    else:  # "last": groups of f over loops 1..N-1, then loop N alone
        sizes = [min(f, N - 1 - s) for s in range(0, N - 1, f)] + [1]
    u = x
    for n in sizes:
        r = [u]
        for _ in range(n - 1):
            r.append(P(r[-1]))
        o = [R(ri) for ri in r]
        y = o[0]
        for i in range(1, n):
            y = o[i] + C(y - r[i])
        u = y
    return u


HAND.update({"loopstack": loopstack_body, "plt": plt_body, "loopfold": loopfold_body})


def hand_logits(model, idx, pos=None, body_fn=None):
    """Embedding -> body (by hand) -> RMSNorm -> tied head, one sequence at a time."""
    E = model.wte.weight[:model.cfg.vocab_size]  # the V real rows; the rest pad the matmul (never predicted)
    body_fn = body_fn or HAND[model.cfg.model]
    rows = []
    for r in range(idx.shape[0]):
        p = torch.arange(idx.shape[1]) if pos is None else pos
        x = body_fn(E[idx[r]], model, p)
        rows.append(lin(rms(x, model.norm_f.weight), E[:model.cfg.vocab_size]))  # padding rows are not logits
    return torch.stack(rows)


def tokens(B=2, T=T_SEQ, seed=3):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- tests

def test_every_registered_model_has_a_hand_computation():
    """HAND is the one list of the registry kept in the tests: a hand computation uses nothing of
    the model's code, so it cannot live in the model's registry row (models.py, "Adding a model", step 4)."""
    missing = set(models.REGISTRY) - set(HAND)
    assert not missing, f"no float64 hand computation in HAND for {sorted(missing)}"
    assert set(HAND) <= set(models.REGISTRY)


@pytest.mark.parametrize("name", list(models.REGISTRY))
@torch.no_grad()
def test_model_equals_hand_computation(name):
    model = perturbed(name)
    idx = tokens()
    logits, _ = model(idx)
    torch.testing.assert_close(logits, hand_logits(model, idx), rtol=1e-9, atol=1e-9)


FLAG_VALUES = [(name, flag, v) for name in models.REGISTRY for flag, v in checks.flag_values(config(name))]


def test_every_model_flag_has_values_beside_the_config():
    """Each model flag of each model is run at some value beside this file's config."""
    assert {(n, f) for n, f, _ in FLAG_VALUES} == {(n, f) for n, s in models.REGISTRY.items() for f in s.flags}


@pytest.mark.parametrize("name, flag, value", FLAG_VALUES)
@torch.no_grad()
def test_every_model_flag_value_equals_hand_computation(name, flag, value):
    """Each model flag (--plt_shift, --fold_layout, --da_stride, --n_thoughts, ...) at values beside
    this file's config, against the hand computation: its branches are computed by hand too."""
    model = perturbed(name, **{flag: value})
    idx = tokens()
    torch.testing.assert_close(model(idx)[0], hand_logits(model, idx), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["gau", "flash"])
@torch.no_grad()
def test_untied_units_equal_hand_computation(name):
    model = perturbed(name, tie_unit=False)
    assert len(model.body.units) == model.cfg.depth
    idx = tokens()
    torch.testing.assert_close(model(idx)[0], hand_logits(model, idx), rtol=1e-9, atol=1e-9)


@torch.no_grad()
def test_explicit_positions_reach_every_rope():
    """The hand computation with arbitrary (repeated, non-contiguous) positions: RoPE uses the
    given ids, not the sequence index (latent tokens rely on this)."""
    pos = torch.tensor([0, 1, 1, 2, 7, 7, 7, 8, 30, 31, 100])
    for name in ("tango-windowed", "loop", "flash", "parcae", "depth-attn", "ponder"):
        model = perturbed(name, seed=5)
        idx = tokens(seed=5)
        torch.testing.assert_close(model(idx, positions=pos)[0], hand_logits(model, idx, pos),
                                   rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("name", list(models.REGISTRY))
@torch.no_grad()
def test_shift_invariance(name):
    """RoPE makes scores depend on positions only through i - j: positions + 37 give the same
    logits; reversed positions do not (so the check is not vacuous)."""
    model = perturbed(name, seed=1)
    if name == "plt":  # PLT's G-SWA gate reads the post-RoPE query, an absolute position (tests/test_parallel_loops.py)
        for blk in model.body.blocks:
            blk.gate_w.zero_()
    idx = tokens(seed=1)
    T = idx.shape[1]
    base, _ = model(idx)
    shifted, _ = model(idx, positions=torch.arange(T) + 37)
    torch.testing.assert_close(shifted, base, rtol=1e-9, atol=1e-9)
    other, _ = model(idx, positions=torch.arange(T).flip(0))
    assert (other - base).abs().max() > 1e-3


@torch.no_grad()
def test_parcae_per_sequence_depths_equal_hand_computation():
    """Training-mode schedule with given depths and h_0: each row is its own T_i recurrences from
    h_0 (idle steps are the identity)."""
    from common import rope_cos_sin
    model = perturbed("parcae", seed=2)
    model.train()
    body, d = model.body, model.cfg.n_embd
    idx = tokens(B=3, seed=2)
    T = idx.shape[1]
    h0 = torch.randn(3, T, d, generator=torch.Generator().manual_seed(9), dtype=F64) * 0.1
    depths = torch.tensor([1, 3, 2])
    cos, sin = rope_cos_sin(torch.arange(T), dtype=F64)
    got = model.norm_f(body(model.wte(idx), cos, sin, None, depths=depths, h0=h0)) @ model.wte.weight.t()
    E, pos = model.wte.weight, torch.arange(T)
    for r in range(3):
        y = parcae_body(E[idx[r]], model, pos, depth=int(depths[r]), h0=h0[r])
        torch.testing.assert_close(got[r], lin(rms(y, model.norm_f.weight), E), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name,kw", [("lrt", dict(lrt_kv=True, lrt_subsets=3)), ("lrt", dict(lrt_src=0, lrt_tgt=1)),
                                     ("lrt-think", dict(n_thoughts=2, lrt_kv=True)),
                                     ("lrt-think", dict(lrt_subsets=1, lrt_detach_init=True))])
@torch.no_grad()
def test_lrt_settings_equal_hand_computation(name, kw):
    """LRT's options (private memory slot, subsets, source/target blocks, thoughts) at explicit repeated positions."""
    model = perturbed(name, seed=4, **kw)
    idx = tokens(seed=4)
    pos = torch.tensor([0, 1, 1, 2, 7, 7, 7, 8, 30, 31, 100])
    torch.testing.assert_close(model(idx, positions=pos)[0], hand_logits(model, idx, pos), rtol=1e-9, atol=1e-9)
