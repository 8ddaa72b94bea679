"""Depth-Attention: a softmax over depth inside attention, the mixed value stored in the KV cache.

Paper: "Depth-Attention" (Zeng, Hao, Wang, ..., Lin; arXiv 2606.05014), abstract and section 3;
authors' code hyq718/Depth-Attention (modeling_llama_depth_attention.py). Backbone: Transformer++
(baselines.py), untied (`depth-attn`) or looped (`loop-depth-attn`); l is the block *application*.

Before layer l attends over the sequence, its query at token t also attends over depth: over the
keys of a few earlier layers at the same token plus its own key. Per head, with q, k, v after the
usual projections and RoPE (d_h = 32):

    C(l)   = { j < l : j mod s == 0 }  U  { l-r, ..., l-1 }                   candidate layers
    s_j    = <q^l_t, k^j_t> / sqrt(d_h)   (j in C(l)),    s_self = <q^l_t, k^l_t> / sqrt(d_h)
    w      = softmax([s_j for j in C(l)], s_self)                          (in float32 at least)
    v~^l_t = sum_{j in C(l)} w_j v~^j_t  +  w_self v^l_t                     sources give their *mixed* values
    y^l_t  = Attn(q^l_t, {k^l_i, v~^l_i : i <= t}) W_o                      ordinary causal attention
    the KV cache of layer l stores (k^l, v~^l)

- s = cfg.da_stride (0: floor(K/2), the paper's default; -1: no strided candidates) and
  r = cfg.da_recent (default 0). C(0) is empty, and a layer with C(l) empty runs plain
  attention (v~^l = v^l). With the defaults C(l) = {0} for 0 < l <= K/2 and {0, K/2} above.
- Off switch: da_stride = -1, da_recent = 0 leaves every C(l) empty: exactly Transformer++.
  (With the formula above j = 0 is a candidate for every stride >= 0, so a large stride does not
  switch the method off.)
- RoPE needs no special care: the query and its candidate keys sit at the same position t, so the
  rotation cancels, <R_t q, R_t k> = <q, k>; the scores use the rotated q, k attention computes.
- No qk-norm (the authors' Qwen3-style blocks have one; our Transformer++ does not), multi-head
  without grouped queries (d_h = 32, H = d / 32), so the paper's per-KV-group and per-head mixing
  coincide.

Parameters: none beyond Transformer++, so width solving is Transformer++'s:
    depth-attn: K (4d^2 + 3dF + 2d) + d        loop-depth-attn: 4d^2 + 3dF + 2d + d
Extra forward MACs per token: 2 d (|C(l)| + 1) for each layer with C(l) non-empty (scores and
mixing; flops.py), against ~12 d^2 + 2 T d for the rest of a layer.

Decoding (the paper's cache semantics, and what the tests check): the mixed value of token t is
computed once, with t's own query, when t is processed, and cached in place of v. For the new
rows, layer l reads its candidates' (k^j, v~^j) rows produced earlier in this same forward, mixes,
appends (k^l, v~^l) to its cache and attends. So prefill + step-by-step decoding equals the full
forward; the cache keys are Transformer++'s. (The authors' HF cached path instead caches the raw
v and re-mixes cached positions with the new query; we follow the paper's description.)

Fast path `depth_mix` (one batched matmul per layer over the stacked candidates) beside the plain
per-position, per-candidate `depth_mix_reference` (the tests compare them in float64).
"""
import math

import torch
import torch.nn as nn

from baselines import Attention, TransformerBlock
from common import HEAD_DIM, UsageError, apply_rope, causal_attention, compiled_region


def candidates(l, stride, recent):
    """C(l): sorted earlier layers j < l whose (key, mixed value) layer l mixes (docstring above).
    stride -1: none from the stride rule; stride 0 or 1: all j < l."""
    strided = set() if stride < 0 else set(range(0, l, max(stride, 1)))  # the multiples of stride below l
    return sorted(strided | set(range(max(0, l - recent), l)))


def depth_weights(q, keys):
    """w = softmax_j <q, k_j> / sqrt(32) over candidates. q: (B, H, T, 32), keys: list of n
    (B, H, T, 32) tensors (the last is the layer's own key) -> w: (B, H, T, n); scores and w in
    float32 or wider under bfloat16 autocast too."""
    acc = torch.promote_types(q.dtype, torch.float32)
    kc = torch.stack(keys, dim=-2).to(acc)                                # (B, H, T, n, 32)
    with torch.autocast(q.device.type, enabled=False):  # a bfloat16 matmul would round the scores to 1/256
        s = (q.to(acc).unsqueeze(-2) @ kc.transpose(-1, -2)).squeeze(-2)  # (B, H, T, n)
    return (s / math.sqrt(HEAD_DIM)).softmax(-1)


def depth_mix(q, k, v, src_k, src_v):
    """Fast path: v~ = sum_j w_j v~^j + w_self v. q, k, v: (B, H, T, 32); src_k, src_v: lists of the
    candidates' keys and mixed values (B, H, T, 32) -> (v~ (B, H, T, 32), w (B, H, T, n))."""
    w = depth_weights(q, list(src_k) + [k])
    vc = torch.stack(list(src_v) + [v], dim=-2)                       # (B, H, T, n, 32)
    return (w.to(v.dtype).unsqueeze(-2) @ vc).squeeze(-2), w


def depth_mix_reference(q, k, v, src_k, src_v):
    """The equations one position and one candidate at a time (for tests); same signature/outputs."""
    keys, vals = list(src_k) + [k], list(src_v) + [v]
    out, ws = torch.empty_like(v), []
    for t in range(q.shape[2]):
        s = torch.stack([(q[:, :, t] * kj[:, :, t]).sum(-1) / math.sqrt(HEAD_DIM) for kj in keys], -1)
        w = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), -1)  # (B, H, n)
        out[:, :, t] = sum(w[..., j, None].to(v.dtype) * vj[:, :, t] for j, vj in enumerate(vals))
        ws.append(w)
    return out, torch.stack(ws, 2)


class DepthAttention(Attention):
    """Attention (fused qkv, W_o; the same parameters as Transformer++) whose values are first mixed
    over depth. forward(u (B, T, d), cos, sin, cache, src_k, src_v) -> (y (B, T, d), k, v~), k and
    v~ the rows of this call (B, H, T, 32), for the layers above."""

    def __init__(self, d, n_head, impl="fast"):
        super().__init__(d, n_head)
        self.mix = {"fast": depth_mix, "reference": depth_mix_reference}[impl]
        self.last_weights = None  # the depth weights w (B, H, T, n) of the last call, when recording

    def forward(self, u, cos, sin, cache=None, src_k=(), src_v=(), record=False):
        B, T, d = u.shape
        heads = lambda t: t.view(B, T, self.n_head, HEAD_DIM).transpose(1, 2)  # (B, H, T, 32)
        q, k, v = self.qkv(u).split(d, dim=-1)
        q, k, v = apply_rope(heads(q), cos, sin), apply_rope(heads(k), cos, sin), heads(v)
        if len(src_k):  # C(l) non-empty: v~ replaces v (also in the cache)
            v, w = self.mix(q, k, v, src_k, src_v)
            if record:
                self.last_weights = w.detach()
        k_new, v_new = k, v
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat((cache["k"], k), dim=2), torch.cat((cache["v"], v), dim=2)
            cache["k"], cache["v"] = k, v
        y = causal_attention(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(B, T, d)), k_new, v_new


class DepthBlock(TransformerBlock):
    """Transformer++ block with DepthAttention: x <- x + Attn~(Norm x); x <- x + SwiGLU(Norm x).
    Parameters 4d^2 + 3dF + 2d (named as in TransformerBlock).

    forward(x (B, T, d), cos, sin, cache, src_k, src_v: the candidate layers' keys and values,
    record) -> (x (B, T, d), k, v~: this layer's keys and mixed values, as DepthAttention returns)."""

    def __init__(self, d, n_head, width, impl="fast"):
        super().__init__(d, n_head, width)
        self.attn = DepthAttention(d, n_head, impl)

    @compiled_region  # one block application (graphs differ only by the number of candidates)
    def forward(self, x, cos, sin, cache=None, src_k=(), src_v=(), record=False):
        a, k, v = self.attn(self.norm1(x), cos, sin, cache, src_k, src_v, record)
        x = x + a
        return x + self.mlp(self.norm2(x)), k, v


class DepthAttentionPP(nn.Module):
    """Depth-Attention body on Transformer++: K applications of K untied blocks or one looped block.

    forward(x (B, T, d), cos, sin, cache) -> (B, T, d). cache[l] holds application l's keys and
    *mixed* values (the Transformer++ cache layout). impl="reference" mixes with
    depth_mix_reference. record=True keeps each attention's depth weights in .last_weights.
    Raises UsageError for da_stride < -1 or da_recent < 0.
    """

    def __init__(self, cfg, tied, impl="fast"):
        super().__init__()
        if cfg.da_stride < -1:
            raise UsageError(f"--da_stride {cfg.da_stride}: must be >= -1 (0: floor(depth/2), -1: none)")
        if cfg.da_recent < 0:
            raise UsageError(f"--da_recent {cfg.da_recent}: must be >= 0")
        if impl not in ("fast", "reference"):
            raise ValueError(f"impl must be 'fast' or 'reference', not {impl!r}")
        self.depth = cfg.depth
        stride = cfg.da_stride if cfg.da_stride != 0 else cfg.depth // 2
        self.candidates = [candidates(l, stride, cfg.da_recent) for l in range(cfg.depth)]
        self.compile_variants = len({len(c) for c in self.candidates})  # DepthBlock's graphs: one per candidate count
        self.record = False
        n_blocks = 1 if tied else cfg.depth
        self.blocks = nn.ModuleList(DepthBlock(cfg.n_embd, cfg.n_head, cfg.width, impl) for _ in range(n_blocks))

    def forward(self, x, cos, sin, cache=None):
        ks, vs, self.weights = [], [], []
        for l in range(self.depth):
            block = self.blocks[l % len(self.blocks)]
            c = self.candidates[l]
            x, k, v = block(x, cos, sin, None if cache is None else cache.setdefault(l, {}),
                            [ks[j] for j in c], [vs[j] for j in c], self.record)
            ks.append(k)
            vs.append(v)
            if self.record and c:
                self.weights.append(block.attn.last_weights)
        if self.record:
            self.mixed = vs  # v~^l of every application (tests: the cache holds these)
        return x


def depth_attn(cfg, impl="fast"):
    """Untied Transformer++ with Depth-Attention (arXiv 2606.05014). Non-embedding parameters:
    K (4d^2 + 3dF + 2d) + d, as `untied`."""
    return DepthAttentionPP(cfg, tied=False, impl=impl)


def loop_depth_attn(cfg, impl="fast"):
    """Loop Transformer++ (one block applied K times) with Depth-Attention over the applications.
    Non-embedding parameters: 4d^2 + 3dF + 2d + d, as `loop`."""
    return DepthAttentionPP(cfg, tied=True, impl=impl)
