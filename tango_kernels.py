"""TANGO's averages G (tango.py): the plain formulas and the fast paths, with their decoding state.

Fast path: the null option is one extra key whose score is b_a and whose value is 0, so the whole
average is a single causal softmax attention whose values are the gates (queries/keys padded to
40 dims: [tau q^, 1, 0...] . [k^, 0, 0...] = l_ij and [tau q^, 1, 0...] . [0, b_a, 0...] = b_a),
computed by ChunkedCausalAttention in chunks of query rows (the FlashAttention recipe). No
(T x T x F) tensor is ever formed. `tango_reference` is the plain formula, used by the tests.

Windowed TANGO (its definition: tango.py): WindowedAttention computes it in chunks of
C query rows, each reading one slice of W + C keys and gates (strided views, no copies), with
running sums for the older gates; its backward goes by chunks of C keys, each reading the W + C
queries that see them. Chunks of the same geometry run together as one batch of matmuls: cost
O(T (W + C) (32 + F/H)) per head, time per token flat in T.
`windowed_reference` is the plain formula. Decoding keeps the last W-1 keys/gates plus two running
sums.

Layout: the update (tango.Tango.update) computes the gates, the values and G per head group,
(H, B T, F/H) in memory (one matmul per group, u W_g[a] with W_g[a] the group's d x F/H block;
y = (G * v) W_o as the sum of the groups' (G * v)[a] W_o[a]), and both fast paths return their
(B, H, T, F/H) output with the heads outermost in memory, so no F-wide activation is ever
transposed or copied. With each group's rows contiguous, the chunk products of the averages run
faster on this project's CPU than on the (B, T, H, F/H) layout of one (B T) x F matmul
(results/README.md, issue 12).

Memory: both fast paths save for backward only their inputs (queries, keys, gates, b), the output
and one log-sum-exp per query, and recompute the weights in backward, so the activation memory of
one update is O(B T (d + F)) and the transients O(B H C S) (full prefix: S = T keys per chunk of C
rows) or O(max(B H C, R) (C + W)) (windowed, R = WINDOW_GROUP_ROWS rows per group of chunks).

Precision (bfloat16 autocast): the custom autograd functions turn autocast off inside and choose
every dtype themselves: queries, keys, scores, the running maximum / log-sum-exp, the normalizing
sums and the old-source sums are float32 (float64 for float64 inputs), only the weight x gate
products run in autocast's dtype. In bfloat16, scores near tau = 10 would resolve in steps of 1/16
(weights off by up to 3 %, averages by 1-2 %); with float32 scores the averages are within about
0.3 % of float64, like PyTorch's attention in bfloat16 (tests/test_bf16.py).

Compilation: torch.compile leaves both fast paths eager (torch.compiler.disable; the compiled
TANGO update is the graph before them and the graph after). Traced, their Python loops over T / C
query chunks were unrolled into one graph, so compile time grew with T: on this project's CPU, at
T = 4096 the first compiled step of a Windowed TANGO model (64 chunks per update) took about ten
minutes and a full-prefix one about two, and neither then stepped faster than eager
(tests/test_compile.py checks that no model's graphs grow with T).
"""
import functools
import math

import torch
import torch.nn.functional as F

from common import HEAD_DIM

QK_PAD = 40  # 32 score dims + 1 null-option dim, padded to a multiple of 8 for fused kernels


# ----------------------------------------------------------------------------- aggregation
# All aggregation functions take
#   qs: (B, H, L, 32)  tau-scaled, normalized, rotated queries
#   kh: (B, H, S, 32)  normalized, rotated keys (the last L are the queries' own positions)
#   g:  (B, H, S, F/H) source gates, split into H groups
#   b:  (H,)           null-option scores
# and return G: (B, H, L, F/H).
#
# Precision of the fast paths (fixed on purpose, the same with and without autocast): queries,
# keys, scores, their log-sum-exp, the normalizing sums and the running sums of old sources are
# float32 (float64 if the inputs are); only the products of weights with gates run in the gates'
# compute dtype: autocast's (bfloat16) when autocast is on, else the gates' own dtype.

def _acc_dtype(t):
    """float32, or float64 for float64 inputs: the dtype of scores and sums."""
    return torch.promote_types(t.dtype, torch.float32)


def _gate_dtype(g):
    """The dtype of the weight x gate products: autocast's when it is on (and g is not float64), else g's."""
    dev = g.device.type
    if g.dtype != torch.float64 and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return g.dtype


def _no_autocast(t):
    """Autocast off for t's device: the custom functions below choose every dtype themselves."""
    return torch.autocast(t.device.type, enabled=False)


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


def _batched(t):
    """t (B, H, ...) with B and H mergeable into one batch dimension (a copy only if they are not)."""
    return t if t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1) else t.contiguous()


def _matmul_into(out, a, b, beta=1.0):
    """out = beta out + a @ b for (..., m, n) tensors with the same leading dimensions. On CPU
    (or with one leading entry) written in place one matrix batch at a time, so out, a and b may be
    any strided views (overlapping windows of the gates included) and nothing is copied; beta = 0
    ignores out's old contents. On CUDA with several entries, or with mixed dtypes, one batched
    matmul into a temporary (there kernel launches cost more than copies)."""
    if a.dtype == b.dtype == out.dtype and (out.device.type == "cpu" or out.shape[:-3].numel() == 1):
        if out.dim() > 3:
            for o, x, y in zip(out, a, b):
                _matmul_into(o, x, y, beta)
        else:
            out.baddbmm_(a, b, beta=beta)
    elif beta == 0:
        out.copy_(a @ b)
    else:
        out += (a @ b).to(out.dtype)


LOG2E = 1 / math.log(2)  # exp(x) = 2^(x log2 e)
# The fast paths compute their weights as 2^x with x in base-2 units (queries scaled by LOG2E, the
# log-sum-exp kept as log2): torch.exp on CPU takes a slow path for masked (-inf) entries (torch
# 2.13, AVX-512: a (4, 64, 320) tile with a fifth of it masked took 77 us against 16 us unmasked;
# torch.exp2 24 us either way; results/README.md, issue 12). Same values up to rounding.


class ChunkedCausalAttention(torch.autograd.Function):
    """softmax(q k^T + causal mask) v in query chunks, saving only q, k, v, the output and the row
    log-sum-exp for backward and recomputing the weights there (the FlashAttention recipe in plain
    PyTorch; FlashAttention, arXiv 2205.14135, section 3.1): memory O(chunk x S) per head instead
    of O(L x S), so TANGO's activation memory is linear in T. Lower-right causal alignment: query i
    sees keys j <= i + (S - L). q: (B, H, L, dk), k: (B, H, S, dk), v: (B, H, S, dv) ->
    (B, H, L, dv) in v's compute dtype (see "Precision" above). No scaling (callers pre-scale q)."""

    @staticmethod
    def _scores(q, k, r0, r1, off):
        s = q[:, :, r0:r1] @ k[:, :, :r1 + off].transpose(-1, -2)  # keys beyond the chunk's last row are never visible
        rows = torch.arange(r0, r1, device=q.device).view(-1, 1)
        return s.masked_fill_(torch.arange(r1 + off, device=q.device) > rows + off, float("-inf"))

    @staticmethod
    def forward(ctx, q, k, v, chunk):
        acc, dt = _acc_dtype(q), _gate_dtype(v)
        with _no_autocast(q):
            q, k, v = _batched(q.to(acc)), _batched(k.to(acc)), _batched(v.to(dt))
            L, S = q.shape[2], k.shape[2]
            off = S - L
            q2 = q * LOG2E  # scores in base-2 units (see LOG2E)
            out = v.new_empty(q.shape[1], q.shape[0], L, v.shape[-1]).transpose(0, 1)  # heads outermost (Layout)
            lse2 = q.new_empty(q.shape[:3])  # log2 of each row's normalizer
            for r0 in range(0, L, chunk):
                r1 = min(r0 + chunk, L)
                p = ChunkedCausalAttention._scores(q2, k, r0, r1, off)
                m = p.amax(-1, keepdim=True)
                p = p.sub_(m).exp2_()
                l = p.sum(-1, keepdim=True)
                lse2[:, :, r0:r1] = (m + l.log2())[..., 0]
                _matmul_into(out[:, :, r0:r1], p.div_(l).to(dt), v[:, :, :r1 + off], beta=0.0)  # normalized weights x values
        ctx.save_for_backward(q, k, v, out, lse2)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2 = ctx.saved_tensors
        with _no_autocast(q):
            acc, dt = q.dtype, v.dtype
            L, S = q.shape[2], k.shape[2]
            off = S - L
            dout = _batched(dout.to(dt))
            q2 = q * LOG2E
            dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
            delta = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O)
            for r0 in range(0, L, ctx.chunk):
                r1 = min(r0 + ctx.chunk, L)
                n = r1 + off
                p = ChunkedCausalAttention._scores(q2, k, r0, r1, off).sub_(lse2[:, :, r0:r1, None]).exp2_()
                do = dout[:, :, r0:r1]
                _matmul_into(dv[:, :, :n], p.to(dt).transpose(-1, -2), do)  # dV += P^T dO
                ds = (do @ v[:, :, :n].transpose(-1, -2)).to(acc).sub_(delta[:, :, r0:r1]).mul_(p)  # P (dO V^T - delta)
                dq[:, :, r0:r1] = ds @ k[:, :, :n]
                _matmul_into(dk[:, :, :n], ds.transpose(-1, -2), q[:, :, r0:r1])
        return dq, dk, dv.to(dt), None


ATTN_CHUNK = 256  # query rows per chunk in ChunkedCausalAttention


@torch.compiler.disable  # eager inside compiled regions (see "Compilation" above)
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


def _windows(x, start, stride, n, length):
    """n windows of `length` rows of x (B, H, T, D), window c from row start + c stride, as a
    (B, H, n, length, D) view (windows may overlap; nothing is copied)."""
    B, H, T, D = x.shape
    s = x.stride()
    return x.as_strided((B, H, n, length, D), (s[0], s[1], stride * s[2], s[2], s[3]), x.storage_offset() + start * s[2])


def _chunks(x, r0, n, rows):
    """n consecutive chunks of `rows` rows of x (B, H, T, D) from row r0, as a (B, H, n, rows, D) view."""
    return x[:, :, r0:r0 + n * rows].unflatten(2, (n, rows))


def _groups(T, W, C, n_max, by_keys=False):
    """WindowedAttention's tiles: chunks of C rows [r0, r0 + rows), each with the window of the
    other side that it meets, in groups of one geometry. Yields (r0, n, rows, w0, ws, L): n chunks
    from r0 (stride C), chunk c meeting rows [w0 + c ws, w0 + c ws + L).
    Forward (rows are queries): the keys [r0 - W, r0 + C); by_keys (backward, rows are keys): the
    queries [r0, r0 + C + W). Chunks away from the edges share that geometry with stride C and are
    grouped up to n_max; a chunk at an edge (window clipped to [0, T), or fewer than C rows) is a
    group of its own."""
    groups = []
    for r0 in range(0, T, C):
        rows = min(C, T - r0)
        if by_keys:
            inner = rows == C and r0 + C + W <= T
            w0, L = r0, min(r0 + rows + W, T) - r0
        else:
            inner = rows == C and r0 >= W
            w0, L = max(r0 - W, 0), r0 + rows - max(r0 - W, 0)
        last = groups[-1] if groups else None
        if inner and last and last[5] and last[1] < n_max:
            last[1] += 1
        else:
            groups.append([r0, 1, rows, w0, L, inner])
    for r0, n, rows, w0, L, inner in groups:
        yield r0, n, rows, w0, C if inner else 0, L


def _group_size(B, H, C):
    """Chunks per group: about WINDOW_GROUP_ROWS rows over batch and heads, at least one chunk."""
    return max(1, WINDOW_GROUP_ROWS // (B * H * C))


@functools.lru_cache(maxsize=64)
def _masks(n, rows, L, off, step, W, by_keys, dtype, device):
    """The masks of a group's (n, rows, L) tiles, from the distance query position - key position,
    off + c step + (j - i if by_keys else i - j) for chunk c, row i, column j. Only the columns
    where some distance lies outside the window [0, W) need them: those before and after the
    columns that are in every row's window (for an inner group the first and last C). So the masks
    come as a list of at most two (columns, band, old): columns a slice of [0, L), band the
    additive window mask on them (0 for distances in [0, W), -inf elsewhere), old where the key is
    an old source of the query (distance >= W; None if nowhere in the slice)."""
    i = torch.arange(rows, device=device).view(1, rows, 1)
    j = torch.arange(L, device=device).view(1, 1, L)
    c = torch.arange(n, device=device).view(n, 1, 1)
    dist = off + c * step + (j - i if by_keys else i - j)
    outside = (dist < 0) | (dist >= W)
    inside = (~outside.flatten(0, 1).any(0)).nonzero().flatten().tolist()  # columns in every row's window:
    a, z = (inside[0], inside[-1] + 1) if inside else (L, L)  # one interval, as dist is monotone in j
    masks = []
    for cs in [cs for cs in (slice(0, a), slice(z, L)) if cs.stop > cs.start]:
        band = torch.zeros(n, rows, cs.stop - cs.start, dtype=dtype, device=device).masked_fill_(outside[..., cs], float("-inf"))
        old = dist[..., cs] >= W
        masks.append((cs, band, old.to(dtype) if bool(old.any()) else None))
    return masks


class WindowedAttention(torch.autograd.Function):
    """Windowed TANGO average (L == S == T), saving for backward only q, k, g, b, the output and the
    row log-sum-exp (as ChunkedCausalAttention) and recomputing the rest. q, k: (B, H, T, 32),
    g: (B, H, T, F/H), b: (H,) -> (B, H, T, F/H) in g's compute dtype, heads outermost in memory
    (see "Layout").

    Query i has the logits: null b; window scores s_ij = q_i . k_j for i-W < j <= i; and one
    summary logit z_i = so_i + log n_i, so_i = q_i . unit(K_i), for its n_i = i-W+1 old sources
    j <= i-W (K_i: their key sum), whose value is their mean gate. So the summary adds
    exp(so_i - lse_i) x (sum of old gates) to the output: every old source gets the weight
    exp(so_i - lse_i).

    Forward by chunks of C queries [r0, r0 + C), each reading the slice of C + W keys and gates
    [r0 - W, r0 + C) (clipped at 0): one (C x (C + W)) tile of scores with the window mask, where
    the old keys of the slice (j <= i - W) then get the old-source weight; the old sources before
    the slice enter through a sum of their gates. Backward by chunks of C keys [c0, c0 + C) (the
    order of FlashAttention-2's backward, arXiv 2307.08691, section 3.1.2), each meeting the
    C + W queries [c0, c0 + C + W) that see them: its gate and key gradients are written once; the
    queries from c0 + C + W on see the whole chunk as old sources (one sum of e_t dO_t). Chunks
    with the same geometry run together, as matmuls over strided windows of the gates (views, no
    copies), in groups of about WINDOW_GROUP_ROWS rows (_groups). Work O(T (C + W) (32 + F/H))
    per head, memory O(group (C + W)) besides inputs, output and the summary keys K (a cumulative
    sum of k over T, recomputed in backward). Logits are in base-2 units (see LOG2E).
    """

    @staticmethod
    def _summary(q, k, W):
        """unit(K_i), |K_i| and so_i (-inf where n_i = 0) for every query; K_i = sum_{j <= i-W} k_j."""
        T = q.shape[2]
        K = F.pad(k.cumsum(2), (0, 0, W, 0))[:, :, :T]
        norm = K.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        unit = K / norm
        so = (q * unit).sum(-1).masked_fill(torch.arange(T, device=q.device) < W, float("-inf"))
        return unit, norm, so

    @staticmethod
    def forward(ctx, q, k, g, b, W, chunk):
        acc, dt = _acc_dtype(q), _gate_dtype(g)
        with _no_autocast(q):
            q, k, g, b = q.to(acc).contiguous(), k.to(acc).contiguous(), g.to(dt), b.to(acc)
            B, H, T, _ = q.shape
            C, dev = chunk, q.device
            q2, b2 = q * LOG2E, b.view(1, H, 1, 1, 1) * LOG2E  # base-2 logits (LOG2E)
            so2 = WindowedAttention._summary(q, k, W)[2][..., None] * LOG2E
            floor = torch.maximum(b2[:, :, 0], so2)  # each row's maximum is at least its null and summary logits
            out = g.new_empty(H, B, T, g.shape[-1]).transpose(0, 1)  # heads outermost (Layout)
            lse2 = q.new_empty(B, H, T, 1)
            g_old, done = q.new_zeros(B, H, 1, g.shape[-1]), 0  # sum of the gates [0, done)
            for r0, n, rows, w0, ws, L in _groups(T, W, C, _group_size(B, H, C)):
                masks = _masks(n, rows, L, r0 - w0, C - ws, W, False, acc, dev)
                p = torch.empty(B, H, n, rows, L, dtype=acc, device=dev)
                _matmul_into(p, _chunks(q2, r0, n, rows), _windows(k, w0, ws, n, L).transpose(-1, -2), beta=0.0)  # scores
                for cs, band, _ in masks:
                    p[..., cs] += band  # the window mask, on the columns that need one
                m = torch.maximum(p.amax(-1, keepdim=True), _chunks(floor, r0, n, rows))
                p = p.sub_(m).exp2_()  # unnormalized window weights, each <= 1
                e = (_chunks(so2, r0, n, rows) - m).exp2_()  # weight of each old source, unnormalized
                for cs, _, old in masks:
                    if old is not None:
                        p[..., cs].addcmul_(old, e)  # the old keys in the slice
                n_before = (w0 + ws * torch.arange(n, device=dev, dtype=acc)).view(n, 1, 1)  # old sources before the slice
                l = p.sum(-1, keepdim=True).add_((b2 - m).exp2_()).addcmul_(e, n_before)
                lse2[:, :, r0:r0 + n * rows] = (m + l.log2()).flatten(2, 3)
                r = l.reciprocal_()
                p, e = p.mul_(r), e.mul_(r)  # normalized
                o = _chunks(out, r0, n, rows)
                _matmul_into(o, p.to(dt), _windows(g, w0, ws, n, L), beta=0.0)  # window and old sources in the slice
                if w0 + ws * (n - 1) > 0:  # + old sources before each slice: sums of the gates [0, w0 + c ws)
                    if w0 > done:
                        g_old += g[:, :, done:w0].sum(2, keepdim=True, dtype=acc)
                        done = w0
                    sums = g_old.unsqueeze(2)
                    if n > 1:
                        blocks = _chunks(g, w0, n - 1, ws).sum(3, dtype=acc)
                        sums = torch.cat((g_old, blocks), 2).cumsum(2)
                        g_old, done = sums[:, :, -1:], w0 + (n - 1) * ws
                        sums = sums.unsqueeze(3)
                    o.addcmul_(e, sums)
        ctx.save_for_backward(q, k, g, b, out, lse2)
        ctx.W, ctx.chunk = W, chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        """Key chunk by key chunk (see the class docstring), last to first: gate and key gradients
        written once per chunk, query gradients and the window part of the summary gradient summed
        into their rows; rowsum(dO * O) computed per group for its own rows before use."""
        q, k, g, b, out, lse2 = ctx.saved_tensors
        W, C = ctx.W, ctx.chunk
        with _no_autocast(q):
            acc, dt, dev = q.dtype, g.dtype, q.device
            B, H, T, _ = q.shape
            unit, norm, so = WindowedAttention._summary(q, k, W)
            dout = dout.to(dt)
            w_null = (b.view(1, H, 1, 1) * LOG2E - lse2).exp2()  # null weight per query
            e_all = (so[..., None] * LOG2E - lse2).exp2()  # weight of each old source per query (0 if none)
            D = q.shape[-1]
            dqs = q.new_zeros(B, H, T, D + 1)  # per query: dq from the window scores, and their sum (the window part of dz)
            dk, dg = torch.empty_like(k), torch.empty_like(g)
            delta = torch.empty_like(lse2)  # rowsum(dO * O)
            qa = torch.cat((q * LOG2E, -lse2), -1)  # qa . [k, 1] = (s - lse) log2 e
            ka = F.pad(k, (0, 1), value=1.0)
            d_old, top = q.new_zeros(B, H, 1, g.shape[-1]), T  # sum of e_t dO_t over the queries [top, T)
            groups = list(_groups(T, W, C, _group_size(B, H, C), by_keys=True))
            for c0, n, rows, w0, ws, L in reversed(groups):
                c1 = c0 + n * rows
                delta[:, :, c0:c1] = (dout[:, :, c0:c1].to(acc) * out[:, :, c0:c1].to(acc)).sum(-1, keepdim=True)
                masks = _masks(n, rows, L, w0 - c0, ws - C, W, True, acc, dev)
                p = torch.empty(B, H, n, rows, L, dtype=acc, device=dev)
                _matmul_into(p, _chunks(ka, c0, n, rows), _windows(qa, w0, ws, n, L).transpose(-1, -2), beta=0.0)
                for cs, band, _ in masks:
                    p[..., cs] += band
                p.exp2_()  # normalized window weights, transposed: (keys, queries)
                do = _windows(dout, w0, ws, n, L)
                dp = torch.empty(B, H, n, L, rows, dtype=dt, device=dev)  # dO g^T, made (queries, keys): faster on CPU
                _matmul_into(dp, do, _chunks(g, c0, n, rows).transpose(-1, -2), beta=0.0)
                ds = dp.transpose(-1, -2).to(acc).sub_(_windows(delta, w0, ws, n, L).transpose(-1, -2)).mul_(p)  # gradient of the window scores
                rows_of = (w0 + ws * torch.arange(n, device=dev).view(n, 1) + torch.arange(L, device=dev)).flatten()  # the queries' rows
                for cs, _, old in masks:  # queries t >= j + W in the tile: the chunk's keys are old sources for them
                    if old is not None:
                        p[..., cs].addcmul_(old, _windows(e_all, w0, ws, n, L).transpose(-1, -2)[..., cs])
                dg_c = _chunks(dg, c0, n, rows)
                _matmul_into(dg_c, p.to(dt), do, beta=0.0)  # window and old queries in the tile
                # + every query t from the tile's end hi = w0 + c ws + L on: sums of e_t dO_t over [hi, T)
                hi0, hi = w0 + L, w0 + ws * (n - 1) + L
                if hi < top:
                    _matmul_into(d_old, e_all[:, :, hi:top].transpose(-1, -2).to(dt), dout[:, :, hi:top])
                    top = hi
                sums = d_old.unsqueeze(2)
                if n > 1:
                    blocks = q.new_empty(B, H, n - 1, 1, g.shape[-1])
                    _matmul_into(blocks, _chunks(e_all, hi0, n - 1, ws).transpose(-1, -2).to(dt), _chunks(dout, hi0, n - 1, ws), beta=0.0)
                    sums = torch.cat((blocks, sums), 2).flip(2).cumsum(2).flip(2)
                    d_old, top = sums[:, :, 0], hi0
                if top < T:
                    dg_c += sums
                _matmul_into(_chunks(dk, c0, n, rows), ds, _windows(q, w0, ws, n, L), beta=0.0)
                dqs.index_add_(2, rows_of, (ds.transpose(-1, -2) @ _chunks(ka, c0, n, rows)).flatten(2, 3))  # ka = [k, 1]
            db = -(w_null * delta).sum((0, 2, 3))
            # softmax gradients over all logits sum to 0: dz = -(null + window parts), z the summary logit
            dq, ds_sum = dqs[..., :D], dqs[..., D:]
            dz = (w_null * delta - ds_sum).masked_fill(torch.arange(T, device=dev).view(-1, 1) < W, 0.0)
            # so_i = q_i . unit(K_i), K_i = sum_{j <= i-W} k_j (dz_i = 0 where there are no old sources)
            dq += dz * unit
            du = dz * q
            dK = (du - unit * (unit * du).sum(-1, keepdim=True)) / norm
            if T > W:
                dk[:, :, :T - W] += dK.flip(2).cumsum(2).flip(2)[:, :, W:]
        return dq, dk, dg, db, None, None


WINDOW_CHUNK = 32  # rows per chunk in WindowedAttention
WINDOW_GROUP_ROWS = 4096  # rows (over batch and heads) per group of chunks in WindowedAttention


@torch.compiler.disable  # eager inside compiled regions (see "Compilation" above)
def windowed_fast(qs, kh, g, b, window):
    """Windowed TANGO (WindowedAttention): memory and time O(T (C + W) (32 + F/H)) per head,
    C = WINDOW_CHUNK query rows per chunk. L == S required (no cache)."""
    return WindowedAttention.apply(qs, kh, g, b, window, WINDOW_CHUNK)


def windowed_step(qs, kh, g, b, window, cache):
    """Windowed TANGO decoding of new queries one at a time with O(1) state per token: the last
    W-1 keys/gates plus the running sums of older keys and gates and their count (all in float32
    or wider)."""
    acc = _acc_dtype(qs)
    outs = []
    with _no_autocast(qs):
        for t in range(qs.shape[2]):
            q, keys, gates = qs[:, :, t:t + 1].to(acc), kh[:, :, t:t + 1].to(acc), g[:, :, t:t + 1].to(acc)
            if "k" in cache:
                keys, gates = torch.cat((cache["k"], keys), 2), torch.cat((cache["g"], gates), 2)
            B, H = q.shape[:2]
            logits = [b.to(acc).view(1, H, 1, 1).expand(B, H, 1, 1), q @ keys.transpose(-1, -2)]
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
    return torch.cat(outs, 2).to(_gate_dtype(g))


def windowed_prefill(qs, kh, g, b, window, cache):
    """Windowed TANGO over a whole prompt (empty cache), then the decoding state for its end."""
    out = windowed_fast(qs, kh, g, b, window)
    acc = _acc_dtype(qs)
    T = kh.shape[2]
    keep = min(T, window - 1)
    cache["k"], cache["g"] = kh[:, :, T - keep:].to(acc), g[:, :, T - keep:].to(acc)
    n = T - keep
    if n > 0:
        cache["sk"], cache["sg"] = (t[:, :, :n].to(acc).sum(2, keepdim=True) for t in (kh, g))
    cache["n"] = n
    return out
