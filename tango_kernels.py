"""TANGO's update on each device (tango.py holds its equations): one call, gated_update.

Device switch (choose_path): the model calls gated_update, which runs
  "grouped" on CPU: the per-head-group layout and the chunked kernels below (fastest on a 2-core CPU);
  "fused" elsewhere (CUDA): one matmul per weight and the averages in PyTorch's fused attention
  (fused_average), inside the compiled region of the update.
A prompt given with an empty decoding cache (prefill) takes its path's average, then fills the
decoding state (prefill_state); the tokens after it run the chunked kernels' decoding (eagerly).

Fused path. TANGO's average is softmax attention with the gates as values and the null option as one
extra key [0, b_a] whose value is 0 (queries [tau q^, 1], keys [k^, 0]). Full prefix: one causal
SDPA over [null key, keys], with one dummy query in front so that the causal mask stays square,
in the kernels fused_plan chooses per dtype (memory-efficient, and cuDNN under bf16/fp16; value
blocks of SDPA_VALUE_BLOCK = 128 gate columns, which select the register-resident variants).
Windowed: FlexAttention over the window only (a block mask of FLEX_BLOCK x FLEX_BLOCK tiles along
the band j in (i - W, i], window_blocks; tiles outside it are never run), which returns the
window's average O and log-sum-exp lse; the null option and the older-source summary join
through the log-sum-exp (_fused_windowed): work O(T (W + FLEX_BLOCK)) per head, nothing unfolded.
SDPA runs only with fused kernels (sdpa_backends): a missing kernel is an error naming the
shapes, never the math backend, which materializes the scores (the memory-efficient kernel:
Rabe and Staats, "Self-attention Does Not Need O(n^2) Memory", arXiv 2112.05682). attention_work
counts the tiles either plan executes. Under bf16 autocast scores come from q, k in bf16 with
float32 accumulation (fused_plan states the precision; SCORE_SPLIT = True restores float32-like
scores by a high and a low half, q k = q_hi k_hi + q_lo k_hi + q_hi k_lo, at 3x the score dims).

Chunked kernels (CPU, and decoding everywhere). ChunkedCausalAttention computes the same causal
attention in chunks of query rows (the FlashAttention recipe) with queries/keys padded to QK_PAD
dims; no (T x T x F) tensor is ever formed. WindowedAttention computes Windowed TANGO in chunks of
C query rows, each reading one slice of W + C keys and gates (strided views, no copies), with
running sums for the older gates; its backward goes by chunks of C keys, each reading the W + C
queries that see them. Chunks of the same geometry run together as one batch of matmuls: cost
O(T (W + C) (32 + F/H)) per head, time per token flat in T. Decoding keeps the last W-1
keys/gates plus two running sums.

Grouped layout (CPU): gates, values and G per head group, (H, B T, F/H) in memory (one matmul
per group, u W_g[a] with W_g[a] the group's d x F/H block; y = (G * v) W_o as the sum of the
groups' (G * v)[a] W_o[a]), and both chunked kernels return (B, H, T, F/H) with the heads
outermost in memory, so no F-wide activation is transposed or copied: with each group's rows
contiguous the chunk products run faster on a CPU than on one (B T) x F matmul's layout.

Memory, fused path (training): gated_update keeps for backward u W_g (SiLU's input), the gates
(the kernels' values), the attention kernels' outputs and the query/key-sized tensors (u, the
kernels' q and k, their log-sum-exp): at most 4 (B, T, F) tensors in the compute dtype in all
(full prefix: T + 1 rows, the null key's; at the 70M tier's widths about 3.0x in float32, 3.6x
under eager bf16 autocast, which casts q and k anew for each value block). u W_v, SiLU's output,
the windowed merge and G * v are recomputed in backward (selective checkpointing of the step after
the kernels, _keep_matmuls: one more d x F matmul per token for u W_v; the W_o matmul's output is
kept, not recomputed). Without it one update keeps 6 to 8 such tensors.

Memory, chunked kernels: both save for backward only their inputs (queries, keys, gates, b), the
output and one log-sum-exp per query, and recompute the weights in backward: the activation memory
of one update is O(B T (d + F)), the transients O(B H C S) (full prefix: S = T keys per chunk of C
rows) or O(max(B H C, R) (C + W)) (windowed, R = WINDOW_GROUP_ROWS rows per group of chunks).

Precision (bfloat16 autocast): the chunked kernels turn autocast off inside and choose every dtype
themselves: queries, keys, scores, the running maximum / log-sum-exp, the normalizing sums and the
old-source sums are float32 (float64 for float64 inputs), only the weight x gate products run in
autocast's dtype (scores in bfloat16 would resolve steps of 1/16 near tau = 10).

Compilation: torch.compile leaves the chunked kernels eager (torch.compiler.disable): traced, their
Python loops over T / C query chunks would unroll into one graph whose compile time grows with T.
The fused path has no loop over T and is traced into the update's graph.
"""
import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from common import HEAD_DIM, is_out_of_memory

# torch's activation checkpointing (torch.utils.checkpoint, imported with torch), by attribute: no import line
# that reads like this project's harness/checkpoint.py; a module-level name, which the tests replace
checkpoint = torch.utils.checkpoint.checkpoint
CheckpointPolicy = torch.utils.checkpoint.CheckpointPolicy
create_selective_checkpoint_contexts = torch.utils.checkpoint.create_selective_checkpoint_contexts

QK_PAD = 40  # 32 score dims + 1 null-option dim, padded to a multiple of 8 for fused kernels


# ----------------------------------------------------------------------------- the one call

def choose_path(device):
    """The update's path on a torch.device: "grouped" or "fused" (module docstring, "Device switch")."""
    if device.type == "cpu":
        return "grouped"  # the per-head-group layout and chunked kernels: fastest on this project's CPU
    return "fused"  # PyTorch's fused attention, traced into the compiled update: no Python loop over chunks


def gated_update(u, qs, kh, wg, wv, wo, b, window=None, cache=None):
    """The gated part of one TANGO update (tango.py, Tango.update_reference: its equations):
    g = SiLU(u W_g), v = u W_v, G = the average of the gates, y = (G * v) W_o.

    u: (B, T, d) normed input; qs, kh: (B, H, T, 32) tau-scaled queries and keys (unit, rotated);
    wg, wv: (F, d) and wo: (d, F), nn.Linear weights; b: (H,) null scores; window: Windowed
    TANGO's W, or None for the full prefix; cache: None or the decoding dict of this application.
    Returns y: (B, T, d) in u's compute dtype. The path is choose_path(u.device).
    """
    B, T, d = u.shape
    H = qs.shape[1]
    if choose_path(u.device) == "grouped":  # module docstring, "Grouped layout"
        w_in = lambda w: w.view(H, -1, d).transpose(1, 2)  # (H, d, F/H): group a's columns, a view
        ue = u.reshape(1, B * T, d).expand(H, -1, -1)  # u for every group (a view)
        g = F.silu(torch.bmm(ue, w_in(wg)))
        G = chunked_average(qs, kh, g.view(H, B, T, -1).transpose(0, 1), b, window, cache)  # (B, H, T, F/H)
        Gv = G.transpose(0, 1).reshape(H, B * T, -1) * torch.bmm(ue, w_in(wv))
        return torch.bmm(Gv, wo.view(d, H, -1).permute(1, 2, 0)).sum(0).view(B, T, d)
    g = F.silu(F.linear(u, wg)).view(B, T, H, -1).transpose(1, 2)  # (B, H, T, F/H), a view
    if cache is None:  # module docstring, "Memory": the kernels' outputs kept, the rest recomputed in backward
        parts, finish = fused_parts(qs, kh, g, b, window)

        def tail(u, wv, wo, *parts):  # (G * u W_v) W_o, weights cast here: autocast's weight cache differs in the recompute
            G, dt = finish(parts).transpose(1, 2).reshape(B, T, -1), _compute_dtype(u)
            with torch.autocast(u.device.type, enabled=False):
                Gv = G * F.linear(u.to(dt), wv.to(dt))
                return F.linear(Gv, wo.to(Gv.dtype))
        return checkpoint(tail, u, wv, wo, *parts, use_reentrant=False, context_fn=functools.partial(_keep_matmuls, wv.shape[0]))
    if is_prefill(cache, window):  # a whole prompt in one fused call, then its decoding state
        G = fused_average(qs, kh, g, b, window)
        prefill_state(qs, kh, g, b, window, cache)
    else:
        G = chunked_average(qs, kh, g, b, window, cache)
    return F.linear(G.transpose(1, 2).reshape(B, T, -1) * F.linear(u, wv), wo)


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _keep_matmuls(width):
    """Selective checkpointing: keep the outputs of the matmuls whose output is not `width` (F) wide
    (W_o's, d wide), recompute every other op in backward, u W_v included (F wide: not kept)."""
    def policy(ctx, op, *args, **kwargs):  # args[-1]: the matmul's right operand, (..., out columns)
        keep = op in _MATMULS and args[-1].shape[-1] != width
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def is_prefill(cache, window):
    """True if the decoding cache of one application is empty (the next call is a whole prompt)."""
    return "k" not in cache if window is None else "n" not in cache


def prefill_state(qs, kh, g, b, window, cache):
    """Fill an empty decoding cache with the state after a prompt (qs, kh, g: (B, H, T, .)), as
    the chunked kernels' prefill does: full prefix, the padded null key, keys and gates (tango_fast);
    windowed, the last W-1 keys and gates and the sums of the older ones (windowed_prefill)."""
    if window is None:
        _, ka, null_k = _augment(qs, kh, b)
        cache["k"] = torch.cat((null_k, ka), 2)
        cache["g"] = torch.cat((g.new_zeros(g.shape[0], g.shape[1], 1, g.shape[3]), g), 2)
        return
    acc = _acc_dtype(qs)
    T = kh.shape[2]
    keep = min(T, window - 1)
    cache["k"], cache["g"] = kh[:, :, T - keep:].to(acc), g[:, :, T - keep:].to(acc)
    n = T - keep
    if n > 0:
        cache["sk"], cache["sg"] = (t[:, :, :n].to(acc).sum(2, keepdim=True) for t in (kh, g))
    cache["n"] = n


def chunked_average(qs, kh, g, b, window=None, cache=None):
    """The averages G (B, H, T, F/H) by the chunked kernels, four ways: full prefix (tango_fast,
    which appends to a cache if one is given); windowed without a cache (windowed_fast); windowed
    with an empty cache (windowed_prefill: the prompt, then the decoding state); windowed with a
    filled cache (windowed_step: new tokens one at a time)."""
    if window is None:
        return tango_fast(qs, kh, g, b, cache)
    if cache is None:
        return windowed_fast(qs, kh, g, b, window)
    if "n" not in cache:
        return windowed_prefill(qs, kh, g, b, window, cache)
    return windowed_step(qs, kh, g, b, window, cache)


# ----------------------------------------------------------------------------- fused path

SDPA_VALUE_BLOCK = 128  # gate columns per full-prefix SDPA call: <= 128 selects register-resident kernels
SCORE_SPLIT = False  # scores from hi/lo halves of q, k under bf16/fp16 (3x the score dims; see fused_plan)
FLEX_BLOCK = 32  # Windowed TANGO: query and key rows per FlexAttention tile (the block mask's granularity)
FLEX_VALUE_BLOCK = 256  # Windowed TANGO: gate columns per FlexAttention call
FULL_PREFIX_KERNEL = "sdpa"  # full prefix: "sdpa" (fused_plan's kernels) or "flex" (FlexAttention, causal band)
GRID_LIMIT = 65535  # CUDA's limit on a launch grid's y and z sizes, where both kernels put batch and heads
NEG = -1.0e4  # score of a padding key: exp underflows to 0 in every dtype


class FusedPlan(NamedTuple):
    """What the fused path runs for one compute dtype (fused_plan)."""
    backends: tuple  # full prefix: the SDPA kernels allowed, tried in PyTorch's priority order
    value_block: int  # full prefix: gate columns per SDPA call
    split: bool  # scores from hi/lo halves of q and k (_hi_lo), else from q, k in the compute dtype


def fused_plan(dtype):
    """The fused path's plan for attention in `dtype` (autocast's, or the inputs' without it).

    Read from PyTorch 2.13's own selection code (ATen mem_eff_attention/kernels/cutlassF.h and
    cutlassB.h, shipped in the wheel's include/): the memory-efficient kernel takes the first
    variant whose kMaxK >= max(q/k dim, value dim). At <= 128 that is forward 64x128_rf (output
    accumulator in registers) and backward 128x128_k128 (bf16) / 128x64_k128 (float32); wider
    values fall to 32x128_gmem (accumulator through global memory) and 128x64_k65536. So values
    go in blocks of SDPA_VALUE_BLOCK = 128 columns for every dtype; bf16/fp16 may also take cuDNN
    attention (tried after the efficient kernel: PyTorch's default priority). float32: the
    efficient kernel only (cuDNN takes no float32). Never MATH (it materializes the scores).

    Precision: without the split (SCORE_SPLIT False, the default) scores come from q, k rounded
    to bf16 (8-bit mantissa; kernels accumulate in float32): at tau = 10 a score moves by up to
    about 0.02 (tests/test_tango_fused.py measures the averages and gradients against float64).
    The split keeps float32-like scores but triples the score dims (104 instead of 40): with
    value blocks of 128 the executed work is then about 2x the exact causal work (attention_work).
    FULL_PREFIX_KERNEL = "flex" runs the full prefix by FlexAttention instead (the windowed path
    with W = T: no null key row, about 1.13x the exact causal work at the 70M tier against SDPA's
    1.46x; its speed against these kernels is for `python -m tools.bench kernels` on a GPU).
    """
    low = dtype in (torch.bfloat16, torch.float16)
    backends = (SDPBackend.EFFICIENT_ATTENTION,) + ((SDPBackend.CUDNN_ATTENTION,) if low else ())
    return FusedPlan(backends, SDPA_VALUE_BLOCK, SCORE_SPLIT and low)


def sdpa_backends(device_type, dtype=torch.float32):
    """The SDPA kernels the fused path may take for `dtype` on a device type: fused ones only
    (fused_plan). MATH is never in the list: with no fused kernel for the shapes SDPA raises."""
    return list(fused_plan(dtype).backends)


def _compute_dtype(t):
    """The dtype attention on t runs in: autocast's when it is on (and t is not float64), else t's."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) and t.dtype != torch.float64 else t.dtype


def _hi_lo(x, split):
    """[x] or, with split, x as (hi, lo) in autocast's dtype dt: hi = x with its float32 mantissa cut
    to dt's (a bit mask, so hi is exact in dt), lo = round(x - hi); hi + lo = x to about 2^-16.
    Not hi = round(x): torch.compile (Inductor) elides a float32 -> dt -> float32 round trip inside
    a kernel, which made lo = x - hi exactly 0."""
    if not split:
        return [x]
    dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x = x.float()
    drop = 23 - round(-math.log2(torch.finfo(dt).eps))  # float32 mantissa bits dt lacks (16 bf16, 13 fp16)
    hi = (x.view(torch.int32) & -(1 << drop)).view(torch.float32)
    return [hi.to(dt), (x - hi).to(dt)]


def _fused_qk(q, keys, split):
    """Augmented queries and keys whose dot products are the logits: queries [q, 1] and keys
    [k, e] for the score q k + e, e the extra column (0 for a source key, b_a for the null key).
    With split the products run as q_hi k_hi + q_lo k_hi + q_hi k_lo and e as e_hi + e_lo.
    keys: a list of (k, e) pairs, each k (..., n, 32) and e broadcastable to (..., n, 1).
    Returns (qa, [ka, ...]), padded to a multiple of 8 dims."""
    qh = _hi_lo(q, split)
    ones = torch.ones_like(qh[0][..., :1])
    qa = torch.cat(qh + ([qh[0]] if split else []) + [ones] * (2 if split else 1), -1)
    kas = []
    for k, e in keys:
        kh_ = _hi_lo(k, split)
        eh = _hi_lo(e.expand(*k.shape[:-1], 1), split)
        parts = ([kh_[0], kh_[0], kh_[1]] if split else kh_) + eh
        kas.append(torch.cat([t.to(qa.dtype) for t in parts], -1))
    pad = -qa.shape[-1] % 8
    return F.pad(qa, (0, pad)), [F.pad(ka, (0, pad)) for ka in kas]


def _check_grid(B, H, what):
    """ValueError (one line) if heads pass CUDA's grid limit: batch slices split the launch, heads cannot."""
    if H > GRID_LIMIT:
        raise ValueError(f"TANGO fused path: {H} heads in one {what} launch pass CUDA's grid limit of {GRID_LIMIT}")


def _sdpa(q, k, D, values, mask=None, is_causal=False):
    """softmax(q k^T + mask) V with scale 1 in the fused kernels only (sdpa_backends), V's D columns
    in blocks of at most SDPA_VALUE_BLOCK sharing q and k, each block built when it is used
    (values(c0, c1): V's columns [c0, c1), (N, M, S, c1 - c0)) and padded to a multiple of 8;
    batches of more than GRID_LIMIT in separate launches (the kernels' grid is (L / 64, M, N)).
    q: (N, M, L, e), k: (N, M, S, e) -> the list of the blocks' outputs (N, M, L, width), views of
    the kernels' outputs. RuntimeError naming the shapes if no fused kernel takes them."""
    outs = []
    N, M = q.shape[:2]
    _check_grid(N, M, "attention")
    backends = sdpa_backends(q.device.type, q.dtype)
    with sdpa_kernel(backends):
        for c0 in range(0, D, SDPA_VALUE_BLOCK):
            w = min(SDPA_VALUE_BLOCK, D - c0)
            vc = F.pad(values(c0, c0 + w).to(q.dtype), (0, -w % 8)).contiguous()  # aligned row strides
            parts = []
            for n0 in range(0, N, GRID_LIMIT):
                qn, kn, vn = (t[n0:n0 + GRID_LIMIT] for t in (q, k, vc))
                if torch.compiler.is_compiling():  # traced: PyTorch itself raises for a missing kernel
                    parts.append(F.scaled_dot_product_attention(qn, kn, vn, attn_mask=mask, is_causal=is_causal, scale=1.0))
                    continue
                try:
                    parts.append(F.scaled_dot_product_attention(qn, kn, vn, attn_mask=mask, is_causal=is_causal, scale=1.0))
                except RuntimeError as e:
                    if is_out_of_memory(e):  # the shapes fit a kernel, not the memory: the out-of-memory line
                        raise
                    raise RuntimeError(
                        f"TANGO fused path: no fused attention kernel ({', '.join(b.name for b in backends)}) for "
                        f"q {tuple(qn.shape)} k {tuple(kn.shape)} v {tuple(vn.shape)} {q.dtype} on {q.device}"
                        + (f", mask {tuple(mask.shape)}" if mask is not None else "") + f": {e}") from None
            o = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
            outs.append(o[..., :w])
    return outs


def fused_average(qs, kh, g, b, window=None):
    """TANGO's (window None, or W >= T) or Windowed TANGO's average G (B, H, T, F/H) of
    qs, kh: (B, H, T, 32), g: (B, H, T, F/H), b: (H,) in PyTorch's fused attention (module
    docstring, "Fused path"); output in the compute dtype (autocast's when it is on)."""
    parts, finish = fused_parts(qs, kh, g, b, window)
    return finish(parts)


def fused_parts(qs, kh, g, b, window=None):
    """fused_average in two steps: (parts, finish), parts the list of the attention kernels'
    outputs, finish(parts) -> G (elementwise: concatenation, the windowed log-sum-exp merge), so a
    caller can keep the parts and recompute finish in backward (gated_update)."""
    B, H, T, _ = qs.shape
    if (window is None or window >= T) and FULL_PREFIX_KERNEL == "flex":  # the window of all T keys: causal
        return _fused_windowed(qs, kh, g, b, T)
    if window is None or window >= T:
        split = fused_plan(_compute_dtype(qs)).split
        zero = qs.new_zeros(B, H, 1, 1)
        null = (qs.new_zeros(B, H, 1, HEAD_DIM), b.to(qs.dtype).view(1, H, 1, 1).expand(B, H, 1, 1))
        qa, (kn, ka) = _fused_qk(qs, [null, (kh, zero)], split)
        qa = F.pad(qa, (0, 0, 1, 0))  # a dummy query in front: the causal mask over [null, keys] stays square
        values = lambda c0, c1: F.pad(g[..., c0:c1], (0, 0, 1, 0))  # the null key's value 0, then the gates
        parts = _sdpa(qa, torch.cat((kn, ka), 2), g.shape[-1], values, is_causal=True)
        return parts, lambda ps: (ps[0] if len(ps) == 1 else torch.cat(ps, -1))[:, :, 1:]  # dummy query dropped
    return _fused_windowed(qs, kh, g, b, window)


# Windowed TANGO on the fused path: FlexAttention over the window only, then the log-sum-exp merge.

def window_blocks(T, W, n, device=None):
    """The window's tiles for FlexAttention: query block m (rows [m n, m n + n)) meets key blocks
    j = m - r for r = 0..R, R = (W + n - 2) // n, of which it needs those with some distance
    i - j' in [0, W) (partial: some but not all; full: all, so FlexAttention skips the mask there).
    Returns (kv_num, kv_idx, full_num, full_idx): (1, 1, nb) counts and (1, 1, nb, nb) int32
    block indices (used ones first: at most R + 1 per row; FlexAttention's layout has nb columns),
    nb = ceil(T / n). No T x T tensor: (T / n)^2 indices, 256 KiB at T = 8192."""
    nb, R = -(-T // n), (W + n - 2) // n
    m = torch.arange(nb, device=device).view(nb, 1)
    r = torch.arange(R + 1, device=device).view(1, R + 1)
    j = m - r
    lo_dist, hi_dist = r * n - (n - 1), r * n + n - 1  # the smallest and largest i - j' in tile (m, j)
    any_ = (j >= 0) & (lo_dist <= W - 1)
    full = any_ & (lo_dist >= 0) & (hi_dist <= W - 1)
    part = any_ & ~full

    def pack(flags):  # the used blocks' indices first, ascending, then block 0 (never read), nb columns
        order = torch.sort((~flags).to(torch.int8) * (R + 1) + (R - r).expand_as(flags), dim=1, stable=True).indices
        idx = torch.where(torch.gather(flags, 1, order), torch.gather(j, 1, order), 0)
        idx = F.pad(idx, (0, nb - R - 1)) if nb > R + 1 else idx[:, :nb]  # FlexAttention's layout: nb columns
        return flags.sum(1).to(torch.int32).view(1, 1, nb), idx.to(torch.int32).view(1, 1, nb, nb)

    return pack(part) + pack(full)


@functools.lru_cache(maxsize=16)
def window_block_mask(T, W, n, device):
    """FlexAttention's BlockMask for the window j in (i - W, i] of T queries and keys, tiles n x n
    (window_blocks; the mask function decides inside the partial tiles)."""
    def in_window(b, h, i, j):
        return (i >= j) & (i - j < W)
    return BlockMask.from_kv_blocks(*window_blocks(T, W, n, device), BLOCK_SIZE=n, mask_mod=in_window,
                                    seq_lengths=(T, T))


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    """flex_attention compiled (its fused kernel); eager flex_attention materializes the scores."""
    return torch.compile(flex_attention, dynamic=False)


def window_flex(q, k, v, W):
    """The window's softmax average and its log-sum-exp by FlexAttention with the window's block
    mask: q, k: (B, H, T, e), v: (B, H, T, D), one dtype -> O (B, H, T, D) normalized over the
    window keys j in (i - W, i], lse (B, H, T, 1) in float32 or wider (natural log).
    On CUDA it runs FlexAttention's kernel (traced into the compiled update, or compiled here when
    eager) over tiles of FLEX_BLOCK rows; on CPU FlexAttention runs eagerly (scores materialized,
    forward only: for tests). Batches of more than GRID_LIMIT run in separate launches; more heads
    than that: ValueError."""
    T = q.shape[2]
    _check_grid(q.shape[0], q.shape[1], "FlexAttention")
    build = window_block_mask.__wrapped__ if torch.compiler.is_compiling() else window_block_mask  # traced: no cache
    mask = build(T, W, FLEX_BLOCK, q.device)
    eager_cuda = q.device.type == "cuda" and not torch.compiler.is_compiling()
    fn = _compiled_flex() if eager_cuda else flex_attention
    opts = None if q.device.type != "cuda" else {  # kernel tiles within the block mask's; every row sees itself
        "BLOCK_M": FLEX_BLOCK, "BLOCK_N": FLEX_BLOCK, **{f"bwd_BLOCK_{s}": FLEX_BLOCK for s in ("M1", "N1", "M2", "N2")},
        "ROWS_GUARANTEED_SAFE": True}
    parts = [fn(*(t[n0:n0 + GRID_LIMIT] for t in (q, k, v)), block_mask=mask, scale=1.0, return_aux=AuxRequest(lse=True),
                kernel_options=opts) for n0 in range(0, q.shape[0], GRID_LIMIT)]  # grid (T / n, batch, heads)
    o, lse = (torch.cat(t, 0) for t in zip(*[(o, aux.lse) for o, aux in parts]))
    return o, lse.unsqueeze(-1)


class _WindowDense(torch.autograd.Function):
    """window_dense's autograd: saves what FlexAttention saves (q, k, v, O, lse) and recomputes the
    scores in backward, so memory counts on CPU match the kernel's."""

    @staticmethod
    def _weights(q, k, W):
        """The window's softmax weights P (B, H, T, T) and log-sum-exp (B, H, T, 1)."""
        T = q.shape[2]
        i = torch.arange(T, device=q.device)
        visible = (i.view(-1, 1) >= i) & (i.view(-1, 1) - i < W)
        s = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)).masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(s, -1, keepdim=True)
        return (s - lse).exp(), lse

    @staticmethod
    def forward(ctx, q, k, v, W):
        p, lse = _WindowDense._weights(q, k, W)
        o = p.to(v.dtype) @ v
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.W = W
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, _ = ctx.saved_tensors
        p, _ = _WindowDense._weights(q, k, ctx.W)
        delta = (do * o).sum(-1, keepdim=True).to(p.dtype)  # rowsum(dO * O)
        ds = p * ((do @ v.transpose(-1, -2)).to(p.dtype) - delta + dlse)  # d lse / d s = P
        ds = ds.to(q.dtype)
        return ds @ k, ds.transpose(-1, -2) @ q, p.to(v.dtype).transpose(-1, -2) @ do, None


def window_dense(q, k, v, W):
    """window_flex's function written densely (T x T scores; for tests, as FlexAttention has no
    CPU backward): (O, lse) of q, k: (B, H, T, e), v: (B, H, T, D), saving for backward what
    FlexAttention saves."""
    return _WindowDense.apply(q, k, v, W)


window_kernel = window_flex  # the window's (O, lse); tests on CPU swap in window_dense for gradients


def _fused_windowed(qs, kh, g, b, W):
    """Windowed TANGO, fused path. The window j in (i - W, i] by window_kernel: O_i, its average of
    the gates, and lse_i, the log-sum-exp of its scores. The null option (logit b) and the older
    sources (one logit z_i = <q_i, unit(K_i)> + log n_i for the n_i = i - W + 1 sources j <= i - W,
    K_i their key sum, value their mean gate S_i / n_i) join through the log-sum-exp:
    tot = logsumexp(lse, b, z), G = O e^(lse - tot) + (S / n) e^(z - tot) (exact). Gates in
    column blocks of FLEX_VALUE_BLOCK; no window is unfolded. Returns (parts, finish) as
    fused_parts: parts [O of each block, lse], finish the merge."""
    D = g.shape[-1]
    dt = _compute_dtype(qs)
    with torch.autocast(qs.device.type, enabled=False):  # every dtype below chosen here
        q, k, gd = qs.to(dt), kh.to(dt), g.to(dt)
        outs = [window_kernel(q, k, gd[..., c0:min(c0 + FLEX_VALUE_BLOCK, D)], W)
                for c0 in range(0, D, FLEX_VALUE_BLOCK)]
    return [o for o, _ in outs] + [outs[0][1]], lambda parts: _window_merge(parts, qs, kh, g, b, W)


def _window_merge(parts, qs, kh, g, b, W):
    """G from the window's blocks O and lse (parts) and the null and older-source logits (_fused_windowed)."""
    B, H, T, D = g.shape
    dt = _compute_dtype(qs)
    acc = torch.promote_types(dt, torch.float32)
    with torch.autocast(qs.device.type, enabled=False):
        O = parts[0] if len(parts) == 2 else torch.cat(parts[:-1], -1)
        lse = parts[-1].to(acc)
        idx = torch.arange(T, device=qs.device).view(T, 1)
        n_old = (idx - W + 1).clamp(min=0).to(acc)  # old sources of query i
        K = F.pad(kh.to(acc).cumsum(2), (0, 0, W, 0))[:, :, :T]  # sum of the keys j <= i - W
        z = (qs.to(acc) * F.normalize(K, dim=-1)).sum(-1, keepdim=True) + n_old.log()  # -inf without old sources
        tot = torch.logsumexp(torch.cat((lse, b.to(acc).view(1, H, 1, 1).expand(B, H, T, 1), z), -1), -1, keepdim=True)
        S = F.pad(g.to(dt).cumsum(2, dtype=acc), (0, 0, W, 0))[:, :, :T]  # sum of the gates j <= i - W
        mean_old = (S / n_old.clamp(min=1)).to(dt)
        return O * (lse - tot).exp().to(dt) + mean_old * (z - tot).exp().to(dt)


def _efficient_tile(e, w):
    """(query rows, key rows) of the memory-efficient forward kernel PyTorch picks for q/k dim e and
    value dim w (cutlassF.h, sm80+: the first variant with kMaxK >= max(e, w))."""
    k = max(e, w)
    return (64, 64) if k <= 64 else (64, 128) if k <= 128 else (32, 128)


def attention_work(B, H, T, W, fh, dtype):
    """The attention work the fused path's plan executes, counted by tiles, against the model's.

    B, H, T: batch, heads, tokens; W: Windowed TANGO's window or None (full prefix); fh: gate
    columns per head (F / H); dtype: the compute dtype (fused_plan). Counts the forward's
    multiply-accumulates in whole tiles (a tile that is partly masked costs all of it; the
    backward runs over the same tiles): full prefix, the memory-efficient kernel's tiles over the
    T + 1 queries and keys (a dummy query, the null key), causal tiles skipped, per value block
    (q/k dims padded as _fused_qk pads them, values to 8); windowed, FlexAttention's tiles from
    window_blocks, per value block (q/k 32 dims, values padded to a power of two, as FlexAttention
    pads head dims; also the full prefix with FULL_PREFIX_KERNEL "flex", over the causal band).
    Model work (flops.py's convention): full prefix T (T + 1) / 2 (32 + fh), windowed T W (32 + fh),
    per batch row and head.
    Returns {"executed", "model", "ratio", "kernel", "grid"} (MACs, MACs, executed / model, the
    kernel and tile, the launch grid of one value block, which CUDA caps at GRID_LIMIT on y, z)."""
    plan = fused_plan(dtype)
    full = W is None or W >= T
    if full and FULL_PREFIX_KERNEL != "flex":
        e = (3 * HEAD_DIM + 2 if plan.split else HEAD_DIM + 1) + 7 & ~7  # _fused_qk's width
        L = T + 1
        executed = 0
        for c0 in range(0, fh, plan.value_block):
            w = min(plan.value_block, fh - c0) + 7 & ~7
            M, N = _efficient_tile(e, w)
            tiles = sum(-(-min(L, q0 + M) // N) for q0 in range(0, L, M))  # causal: keys up to the block's last row
            executed += tiles * M * N * (e + w)
        M, N = _efficient_tile(e, min(plan.value_block, fh) + 7 & ~7)
        model = T * (T + 1) // 2 * (HEAD_DIM + fh)
        kernel, grid = f"efficient {M}x{N} (q/k {e})", (-(-L // M), H, B)
    else:
        n, W = FLEX_BLOCK, T if full else W  # full prefix by FlexAttention: the causal band of T (fused_parts)
        kv_num, _, full_num, _ = window_blocks(T, W, n)
        tiles = int(kv_num.sum() + full_num.sum())
        widths = [min(FLEX_VALUE_BLOCK, fh - c0) for c0 in range(0, fh, FLEX_VALUE_BLOCK)]
        executed = tiles * n * n * sum(HEAD_DIM + max(16, 1 << (w - 1).bit_length()) for w in widths)
        model = T * (T + 1) // 2 * (HEAD_DIM + fh) if full else T * W * (HEAD_DIM + fh)
        kernel, grid = f"FlexAttention {n}x{n}", (-(-T // n), B, H)
    executed, model = B * H * executed, B * H * model
    return {"executed": executed, "model": model, "ratio": executed / model, "kernel": kernel, "grid": grid}


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
# The chunked kernels compute their weights as 2^x in base-2 units (queries scaled by LOG2E, the
# log-sum-exp kept as log2): torch.exp on an AVX-512 CPU takes a slow path for masked (-inf)
# entries, torch.exp2 does not. Same values up to rounding.


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
            for r0 in range(0, L, chunk):  # CPU: in-place matmuls one chunk (and batch entry) at a time
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
    qa, ka, _ = _augment(qs, kh, b)
    if cache is not None and "k" in cache:  # decoding: append to the cached keys and gates
        ka, g = torch.cat((cache["k"], ka), 2), torch.cat((cache["g"], g), 2)
        cache["k"], cache["g"] = ka, g
    else:  # the null key and a zero gate in front (kept in the cache when decoding starts here)
        state = {} if cache is None else cache
        prefill_state(qs, kh, g, b, None, state)
        ka, g = state["k"], state["g"]
    return ChunkedCausalAttention.apply(qa, ka, g, ATTN_CHUNK)  # query i sees the null key and keys j <= i


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
    C = WINDOW_CHUNK query rows per chunk. L == S required (no cache). A window W >= T is the whole
    prefix: W is taken as T (the same function; the padding would grow with W)."""
    return WindowedAttention.apply(qs, kh, g, b, min(window, qs.shape[2]), WINDOW_CHUNK)


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
    prefill_state(qs, kh, g, b, window, cache)
    return out
