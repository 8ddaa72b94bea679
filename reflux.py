"""ReFlux: the depth increment of a frozen decoder written back into the input of an earlier block.

Source: *ReFlux* (cited by name: we had the paper's abstract, figure captions and tables, not its
full text, title page or arXiv id): abstract, Fig. 4 and Fig. 10 (execution schedules), Table 4
(cost), Table 9 (prefill), Tables 10-11 (block length w, threshold ξ), Table 13 (router); the
authors' code gooogleshanghai/reflux (`reflux/write.py`, `streaming.py`, `sync.py`,
`recirculation_v1.py`). The recirculation baseline is "Recirculation-v1" (Mozer et al. 2026) as
that code reproduces it.
MATH.md ("ReFlux") collects the equations and our reconstruction choices.

Backbone: a trained Transformer++ of this project (`untied` or `loop`; baselines.py), frozen. Blocks
(applications) l = 0..K-1; a_l is the residual stream entering block l, z_l the stream leaving it
(a_0 = token embedding, a_{l+1} = z_l, z_{K-1} goes to the final norm and the tied head).

Payload of an edge e = (s, d), 0 <= d < s <= K-1, at position t, from some traversal τ:

    Δ_e^τ(t) = z_s^τ(t) - z_d^τ(t)                 the updates of blocks d+1..s
    (payload "state", the recirculation baseline: p = z_s^τ(t), the full deep state)

Write onto the stream h = a_d(t) entering block d (per position, in float32 or wider):

    N(p; h) = p ||h|| / (||p|| + 1e-6)                                    payload at the target's norm
    h'      = β h + Σ_{e: d_e = d} g_e α_e N(p_e; h)                      all edges into d in one write
    h''     = h' ||h|| / max(||h'||, 1e-6)        if preserve_norm           (the write only rotates h)
    an edge with α_e g_e <= 0 does not write; a row with no writing edge keeps h exactly (β unused)

Targets are written in increasing d within one traversal. Schedules (what is written at t):

    sync     Δ^rec(t)     of a clean record traversal (no writes); then the injected traversal    2x
    stream2  Δ^rec(t-1)   record payload shifted by one, 0 at t = 0 (the code's perplexity protocol) 2x
    stream   Δ^inj(t-1)   measured in token t-1's own injected traversal, 0 at t = 0: one traversal
                          per token; the full-sequence protocol is this recurrence ("strict")       1x
    recirc   sync with payload "state", β = 1 - α, no norm restore (Recirculation-v1)              2x

Defaults from the authors' code: α = 0.2, β = 0.9, preserve_norm on; recirculation α = 0.15. Default
single edge for K blocks: s = floor(0.6 K), d = floor(0.3 K) (4:2 at K = 8).

Router (the full method; reconstructed, the authors' code has none). Candidate edges E = all pairs
d < s (|E| = K(K-1)/2). Tokens are cut into blocks of w by position; block b+1 is decided from
block b alone, block 0 from the constant part (r_{-1} = 0):

    r_b     = mean_{t in block b} RMSNorm(z_m(t)),  m = floor(K/2)  (record traversal for sync and
              stream2, the actual traversal for stream; RMSNorm without a gain)
    g_{b+1} = sigmoid(W_2 SiLU(W_1 r_b) + c)        W_1: d x r, W_2: r x |E|, c: |E|
    α_e     = α_max sigmoid(a_e)                     a_e: |E|, initialized so that α_e = 0.2

Evaluation uses hard gates: edge e is open for a block iff g_e >= ξ and then writes with g_e := 1;
κ is the mean count of open edges per block. Training ("calibration", train_router): the backbone
frozen, soft gates, schedule sync, loss = NLL + λ mean(g) with λ = 1e-3, AdamW lr 1e-3 (no weight
decay on c and a). Parameters d r + r |E| + 2 |E|.

Decoding: ReFluxBody has the body contract (forward(x (B, T, d), cos, sin, cache) -> (B, T, d)),
so common.LM.generate runs it unchanged through a view (reflux_lm). Caches: sync and stream2 keep
two KV caches (record and injected; 2x KV memory) and stream2 the last record payload; stream keeps
one KV cache and each edge's last payload (B, 1, d); the router keeps its running block sum and the
current block's gates. Cached decoding equals the full-sequence protocol of each schedule (tested).
Prompt processing for stream (`prefill`): "parallel" (default; the paper's parallel-prefill
stream) runs one clean traversal of the prompt and chains from its last payload; "strict" runs the
recurrence over the prompt token by token. Without a cache (evaluation) stream is always strict.

Cost (flops.reflux_forward_macs): sync, stream2 and recirc 2x the base forward MACs, stream 1x, plus
O(d) per open edge and position for the write and (d r + r |E|) per block of w tokens for the router.
No write reaches the blocks below the lowest target, so the injected traversal starts there (from
the record traversal's stream), and stream runs those blocks once over all rows, not per token.

    python reflux.py --base out/ckpt_best.pt --schedule stream --edge 4:2 --alpha 0.2 --beta 0.9
    python reflux.py --base CKPT --schedule sync --recirc --alpha 0.15            # the baseline
    python reflux.py --base CKPT --router --block 16 --xi 0.6 --router_rank 64 --max_iters 200
    python reflux.py sweep --base CKPT --json results/reflux/sweep.json

Bad input (flag, checkpoint, data): one line "error: ..." on stderr, exit code 2.
"""
import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import data as data_mod
from checkpoint import load_checkpoint
from common import LM, ModelConfig, UsageError
from datacheck import check_data, data_signature
from evaluation import eval_mode, evaluate

EPS = 1e-6
SCHEDULES = ("sync", "stream2", "stream")
PAYLOADS = ("delta", "state")
PREFILLS = ("parallel", "strict")


# =============================================================================== edges and settings

def all_edges(K):
    """Every forward pair (s, d), 0 <= d < s <= K-1, in (s, d) order: the router's candidates."""
    return [(s, d) for s in range(1, K) for d in range(s)]


def default_edge(K):
    """(floor(0.6 K), floor(0.3 K)): inside the paper configs' range (s at 0.42-0.73 K, d at 0.15-0.36 K)."""
    return (int(0.6 * K), int(0.3 * K))


def parse_edge(spec, K, flag="--edge"):
    """'S:D' -> (S, D); UsageError naming the flag unless 0 <= D < S <= K-1."""
    try:
        s, d = (int(v) for v in spec.split(":"))
    except ValueError:
        raise UsageError(f"{flag} {spec}: write it S:D (source block S, target block D), e.g. 4:2") from None
    if not 0 <= d < s <= K - 1:
        raise UsageError(f"{flag} {spec}: need 0 <= D < S <= {K - 1} (the base has {K} blocks)")
    return (s, d)


@dataclass(frozen=True)
class Settings:
    """One ReFlux configuration. edges: ((s, d), ...) open with gate 1 (ignored under a router);
    alpha, beta: the write's α (every edge) and β; payload: delta | state; prefill: parallel |
    strict (stream's cached prompt)."""
    schedule: str = "stream"
    edges: tuple = ()
    alpha: float = 0.2
    beta: float = 0.9
    preserve_norm: bool = True
    payload: str = "delta"
    prefill: str = "parallel"

    def check(self, K):
        """UsageError naming the flag for a value outside its range."""
        if self.schedule not in SCHEDULES:
            raise UsageError(f"--schedule {self.schedule}: choose one of {', '.join(SCHEDULES)}")
        if self.payload not in PAYLOADS:
            raise UsageError(f"--payload {self.payload}: choose one of {', '.join(PAYLOADS)}")
        if self.prefill not in PREFILLS:
            raise UsageError(f"--prefill {self.prefill}: choose one of {', '.join(PREFILLS)}")
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not math.isfinite(v):
                raise UsageError(f"--{name} {v}: must be a finite number")
        for s, d in self.edges:
            parse_edge(f"{s}:{d}", K)
        return self


def recirc(alpha=0.15, **kw):
    """The recirculation baseline: payload z_s, β = 1 - α, no norm restore (sync by default)."""
    return Settings(**{"schedule": "sync", **kw, "alpha": alpha, "beta": 1.0 - alpha,
                       "preserve_norm": False, "payload": "state"})


# =============================================================================== the write operator

def write(h, weights, payloads, beta, preserve_norm=True):
    """The write onto h: (..., d) from edges with weights w_e = g_e α_e and payloads p_e: (..., d).

    h' = β h + Σ_e w_e N(p_e; h), N(p; h) = p ||h|| / (||p|| + 1e-6); with preserve_norm
    h'' = h' ||h|| / max(||h'||, 1e-6). A weight is a float (edges with w <= 0 are dropped) or a
    tensor broadcastable to (..., 1); when every weight is a tensor, rows where all of them are 0
    keep h exactly. Computed in float32 or wider, returned in h's dtype.
    """
    pairs = [(w, p) for w, p in zip(weights, payloads) if torch.is_tensor(w) or w > 0]
    if not pairs:
        return h
    dt = torch.promote_types(h.dtype, torch.float32)
    hf = h.to(dt)
    norm = hf.norm(dim=-1, keepdim=True)
    out = beta * hf
    for w, p in pairs:
        pf = p.to(dt)
        out = out + w * pf * (norm / (pf.norm(dim=-1, keepdim=True) + EPS))
    if preserve_norm:
        out = out * (norm / out.norm(dim=-1, keepdim=True).clamp_min(EPS))
    if all(torch.is_tensor(w) for w, _ in pairs):
        on = torch.stack([torch.broadcast_to(w, norm.shape) > 0 for w, _ in pairs]).any(0)
        out = torch.where(on, out, hf)
    return out.to(h.dtype)


# =============================================================================== the router

class Router(nn.Module):
    """Gates for every candidate edge, per block of w tokens, from the previous block's summary.

    gate(r (B, d)) -> g (B, |E|) = sigmoid(W_2 SiLU(W_1 r) + c); alphas() -> α_e (|E|,).
    Hard gates (g >= ξ -> 1, else 0) outside training mode. Parameters d r + r |E| + 2 |E|.
    """

    def __init__(self, d, K, rank=64, block=32, xi=0.6, alpha_max=0.5, alpha_init=0.2):
        super().__init__()
        if not 0 < alpha_init < alpha_max:
            raise UsageError(f"--alpha_max {alpha_max}: must exceed the initial α {alpha_init}")
        self.edges, self.K, self.block, self.xi, self.alpha_max = all_edges(K), K, block, xi, alpha_max
        self.m = K // 2
        E = len(self.edges)
        self.w1 = nn.Linear(d, rank, bias=False)
        self.w2 = nn.Linear(rank, E, bias=False)
        nn.init.normal_(self.w1.weight, std=0.02)
        nn.init.normal_(self.w2.weight, std=0.02)
        self.c = nn.Parameter(torch.zeros(E))
        q = alpha_init / alpha_max
        self.a = nn.Parameter(torch.full((E,), math.log(q / (1 - q))))
        self.reset_stats()

    def gate(self, r):
        return torch.sigmoid(self.w2(F.silu(self.w1(r))) + self.c)

    def alphas(self):
        return self.alpha_max * torch.sigmoid(self.a)

    def reset_stats(self):
        self.open_sum, self.blocks_seen = 0.0, 0

    def kappa(self):
        """Mean number of open edges per (sequence, block) decided since reset_stats (hard gates)."""
        return self.open_sum / max(self.blocks_seen, 1)

    def _new_block(self, state, r):
        g = self.gate(r)
        if not self.training:
            g = (g >= self.xi).to(g.dtype)
            self.open_sum += float(g.sum())
            self.blocks_seen += g.shape[0]
        state["g"] = g

    def current(self, state, like):
        """The gates (B, |E|) of the block the next row belongs to (block 0: the constant part)."""
        if "g" not in state:
            B, d = like.shape[0], self.w1.in_features
            state["sum"] = like.new_zeros(B, d)
            self._new_block(state, like.new_zeros(B, d))
        return state["g"]

    def update(self, state, zm, start):
        """Add rows start..start+L-1 of z_m (zm: (B, L, d)) to the running block sum; a completed
        block sets the next block's gates."""
        u = F.rms_norm(zm.detach(), (zm.shape[-1],), eps=EPS)
        i, L = 0, zm.shape[1]
        while i < L:
            n = min(L - i, self.block - (start + i) % self.block)
            state["sum"] = state["sum"] + u[:, i:i + n].sum(1)
            i += n
            if (start + i) % self.block == 0:
                self._new_block(state, state["sum"] / self.block)
                state["sum"] = torch.zeros_like(state["sum"])

    def row_gates(self, state, zm, start):
        """Gates (B, L, |E|) of rows start..start+L-1 whose z_m rows zm (B, L, d) are all known
        (record traversal): each row takes its block's gates; state is updated."""
        out, i, L = [], 0, zm.shape[1]
        while i < L:
            n = min(L - i, self.block - (start + i) % self.block)
            g = self.current(state, zm)
            out.append(g[:, None, :].expand(-1, n, -1))
            self.update(state, zm[:, i:i + n], start + i)
            i += n
        return torch.cat(out, 1)


# =============================================================================== the body

def run_blocks(body, x, cos, sin, cache=None, write_at=None, keep=(), start=0, stop=None):
    """Blocks start..stop-1 (default all K) of the Transformer++ body: a_start = x,
    a_l <- write_at(l, a_l), z_l = block_l(a_l). x: (B, L, d); cache: a dict of per-application KV
    caches or None. Returns z_{stop-1} and {l: z_l for l in keep}."""
    zs = {}
    for l in range(start, body.depth if stop is None else stop):
        if write_at is not None:
            x = write_at(l, x)
        block = body.blocks[l % len(body.blocks)]
        x = block(x, cos, sin, None if cache is None else cache.setdefault(l, {}))
        if l in keep:
            zs[l] = x
    return x, zs


class ReFluxBody(nn.Module):
    """ReFlux over a frozen Transformer++ body: forward(x (B, T, d), cos, sin, cache) -> (B, T, d).

    cache None: the full-sequence protocol of the schedule; a dict: cached decoding (rows after
    cache["len"], which common.LM maintains). router: a Router (edges and α from it) or None (the
    settings' edges, all open, with the settings' α).
    """

    def __init__(self, body, settings, router=None):
        super().__init__()
        self.body, self.s, self.router = body, settings.check(body.depth), router
        self.edges = list(router.edges) if router is not None else list(dict.fromkeys(settings.edges))
        self.off = router is None and (not self.edges or settings.alpha <= 0)  # nothing can write
        # blocks below the lowest target see no write: the injected traversal starts there, from the
        # record traversal's stream (sync, stream2), or they run once over all rows (stream)
        self.low = 0 if router is not None or self.off else min(d for _, d in self.edges)
        self.keep = {l for e in self.edges for l in e} | ({router.m} if router is not None else set())
        self.keep |= {self.low - 1} if self.low > 0 else set()
        self.mean_gate = None  # mean soft gate of the last training forward (the router's penalty)
        # the write's α and β: the settings' floats, or (rows, 1, 1) tensors when the rows of one
        # batch carry different values (grid_nll: one batch for a whole α x β grid)
        self.alpha, self.beta = settings.alpha, settings.beta

    # --------------------------------------------------------------------------- pieces
    def payload(self, zs):
        """{edge: p (B, L, d)} from one traversal's kept z_l: z_s - z_d, or z_s (payload state)."""
        if self.s.payload == "state":
            return {(s, d): zs[s] for s, d in self.edges}
        return {(s, d): zs[s] - zs[d] for s, d in self.edges}

    def weights(self, g):
        """{edge: w_e} from gates g (B, L, |E|) (router), or α for every edge."""
        if self.router is None:
            return {e: self.alpha for e in self.edges}
        a = self.router.alphas().to(g.dtype)
        return {e: (g[..., i] * a[i]).unsqueeze(-1) for i, e in enumerate(self.edges)}

    def writer(self, payloads, weights):
        """write_at(l, h) for run_blocks: all edges into target l in one write."""
        by_target = {}
        for e in self.edges:
            by_target.setdefault(e[1], []).append(e)

        def write_at(l, h):
            es = by_target.get(l)
            if not es:
                return h
            return write(h, [weights[e] for e in es], [payloads[e] for e in es], self.beta, self.s.preserve_norm)
        return write_at

    # --------------------------------------------------------------------------- schedules
    def forward(self, x, cos, sin, cache=None):
        if self.off:  # no edge can write: the base traversal
            return run_blocks(self.body, x, cos, sin, None if cache is None else cache.setdefault("inj", {}))[0]
        if self.s.schedule == "stream":
            return self.stream(x, cos, sin, cache)
        return self.two_pass(x, cos, sin, cache)

    def two_pass(self, x, cos, sin, cache):
        """sync and stream2: a clean record traversal, then the injected one (two KV caches)."""
        c = {} if cache is None else cache
        start = c.get("len", 0)
        with torch.no_grad():  # the backbone is frozen; the payload carries no gradient
            _, zs = run_blocks(self.body, x, cos, sin, None if cache is None else c.setdefault("rec", {}),
                               keep=self.keep)
        p = self.payload(zs)
        if self.s.schedule == "stream2":  # Δ^rec(t-1), 0 at t = 0 (or the cached last row)
            prev = c.get("prev_rec") or {e: torch.zeros_like(v[:, :1]) for e, v in p.items()}
            c["prev_rec"] = {e: v[:, -1:] for e, v in p.items()}
            p = {e: torch.cat((prev[e], v[:, :-1]), 1) for e, v in p.items()}
        g = None
        if self.router is not None:
            g = self.router.row_gates(c.setdefault("router", {}), zs[self.router.m], start)
            self.mean_gate = g.mean() if self.router.training else None
        a = zs[self.low - 1] if self.low > 0 else x  # a_low: no write below the lowest target
        out, _ = run_blocks(self.body, a, cos, sin, None if cache is None else c.setdefault("inj", {}),
                            write_at=self.writer(p, self.weights(g)), start=self.low)
        return out

    def stream(self, x, cos, sin, cache):
        """The one-traversal recurrence: row t writes Δ^inj(t-1) (0 at t = 0) and measures its own."""
        c = {} if cache is None else cache
        start, L = c.get("len", 0), x.shape[1]
        kv, rstate = c.setdefault("inj", {}), c.setdefault("router", {})
        if cache is not None and start == 0 and self.s.prefill == "parallel":  # one clean prompt traversal
            out, zs = run_blocks(self.body, x, cos, sin, kv, keep=self.keep)
            c["prev"] = {e: v[:, -1:] for e, v in self.payload(zs).items()}
            if self.router is not None:
                self.router.current(rstate, x)
                self.router.update(rstate, zs[self.router.m], start)
            return out
        prev = c.get("prev") or {e: x.new_zeros(x.shape[0], 1, x.shape[2]) for e in self.edges}
        if self.low > 0:  # blocks below the lowest target: no write reaches them, all rows at once
            x, _ = run_blocks(self.body, x, cos, sin, kv, stop=self.low)
        outs = []
        for i in range(L):
            g = self.router.current(rstate, x)[:, None, :] if self.router is not None else None
            out, zs = run_blocks(self.body, x[:, i:i + 1], cos[:, :, i:i + 1], sin[:, :, i:i + 1], kv,
                                 write_at=self.writer(prev, self.weights(g)), keep=self.keep, start=self.low)
            prev = self.payload(zs)
            if self.router is not None:
                self.router.update(rstate, zs[self.router.m], start + i)
            outs.append(out)
        c["prev"] = prev
        return torch.cat(outs, 1)


class ReFluxLM(LM):
    """A view of a trained common.LM with its body replaced by a ReFluxBody: the same embedding,
    final norm and head (shared, not copied), so forward, evaluation.evaluate and generate work
    unchanged. forward(idx (B, T)) -> logits (B, T, V), mean NLL in nats/token."""

    def __init__(self, base, settings, router=None):
        nn.Module.__init__(self)
        if not hasattr(base.body, "blocks") or base.cfg.model not in ("untied", "loop"):
            raise UsageError(f"--base: ReFlux steps Transformer++ blocks (untied or loop); this checkpoint "
                             f"is a '{base.cfg.model}' model")
        self.cfg = base.cfg
        self.wte, self.norm_f = base.wte, base.norm_f
        self.body = ReFluxBody(base.body, settings, router)


def reflux_lm(base, settings=None, router=None, **kw):
    """ReFluxLM over base with Settings(**kw) (or settings); the base is frozen (requires_grad False)."""
    for p in base.parameters():
        p.requires_grad_(False)
    return ReFluxLM(base, settings or Settings(**kw), router)


# =============================================================================== naive reference (tests)

class _Hooks:
    """Forward hooks on a Transformer++ LM counting block applications: record z_l, edit a_l."""

    def __init__(self, lm, edit=None):
        self.z, self.app, self.edit = {}, 0, edit
        mods = list(dict.fromkeys(lm.body.blocks))
        self.handles = [m.register_forward_pre_hook(self._pre) for m in mods]
        self.handles += [m.register_forward_hook(self._post) for m in mods]

    def _pre(self, module, args):
        if self.edit is None:
            return None
        return (self.edit(self.app, args[0]),) + tuple(args[1:])

    def _post(self, module, args, out):
        self.z[self.app] = out
        self.app += 1

    def close(self):
        for h in self.handles:
            h.remove()


def _hooked(lm, idx, edit=None):
    """(logits, {l: z_l}) of lm(idx) with the pre-block edit(l, a_l) -> a_l."""
    hooks = _Hooks(lm, edit)
    try:
        logits, _ = lm(idx)
    finally:
        hooks.close()
    return logits, hooks.z


def _write_rows(edges, alpha, beta, preserve_norm, payload_rows, skip_before=0):
    """edit(l, a) writing, one (batch, position) at a time, P[e][b][t] into a_l for edges into l."""
    def edit(l, a):
        es = [e for e in edges if e[1] == l]
        if not es or alpha <= 0:
            return a
        a = a.clone()
        for b in range(a.shape[0]):
            for t in range(skip_before, a.shape[1]):
                h = a[b, t]
                n = torch.sqrt((h * h).sum())
                new = beta * h
                for e in es:
                    p = payload_rows[e][b][t]
                    new = new + alpha * p * (n / (torch.sqrt((p * p).sum()) + 1e-6))
                if preserve_norm:
                    new = new * (n / max(torch.sqrt((new * new).sum()), torch.tensor(1e-6, dtype=h.dtype)))
                a[b, t] = new
        return a
    return edit


def reference(lm, idx, settings, prompt_len=0):
    """The settings' schedule (single edges, no router) on lm, a plain common.LM, by forward hooks
    and per-position loops, independent of ReFluxBody: sync and stream2 (a record traversal, then
    the injected one) or stream (reference_stream). Returns logits (B, T, V)."""
    if settings.schedule == "stream":
        return reference_stream(lm, idx, settings, prompt_len)
    edges, B, T = list(settings.edges), idx.shape[0], idx.shape[1]
    _, z = _hooked(lm, idx)
    rows = {}
    for s, d in edges:
        rows[(s, d)] = [[None] * T for _ in range(B)]
        for b in range(B):
            for t in range(T):
                src = t if settings.schedule == "sync" else t - 1
                if src < 0:
                    rows[(s, d)][b][t] = torch.zeros_like(z[s][b, 0])
                else:
                    rows[(s, d)][b][t] = z[s][b, src] - (0 if settings.payload == "state" else z[d][b, src])
    edit = _write_rows(edges, settings.alpha, settings.beta, settings.preserve_norm, rows)
    return _hooked(lm, idx, edit)[0]


def reference_stream(lm, idx, settings, prompt_len=0):
    """stream without a cache: for t = 0..T-1, lm(idx[:, :t+1]) with rows t' <= t written with
    Δ^inj(t'-1) (0 at t' = 0) and no writes before prompt_len (parallel prefill of a prompt of
    that length); Δ^inj(t) is read from that same run. Returns logits (B, T, V)."""
    edges, B, T = list(settings.edges), idx.shape[0], idx.shape[1]
    rows = {e: [[None] * T for _ in range(B)] for e in edges}
    out = []
    for t in range(T):
        for e in edges:
            for b in range(B):
                if t == 0:
                    rows[e][b][0] = torch.zeros(lm.cfg.n_embd, dtype=lm.wte.weight.dtype)
        edit = _write_rows(edges, settings.alpha, settings.beta, settings.preserve_norm, rows, skip_before=prompt_len)
        logits, z = _hooked(lm, idx[:, :t + 1], edit)
        out.append(logits[:, t:t + 1])
        if t + 1 < T:
            for s, d in edges:
                for b in range(B):
                    rows[(s, d)][b][t + 1] = z[s][b, t] - (0 if settings.payload == "state" else z[d][b, t])
    return torch.cat(out, 1)


# =============================================================================== loading, evaluation, router training

def load(path, data_root=None):
    """(frozen base LM, data.Data of its training run, checkpoint args) from a train.py checkpoint.
    The dataset is found (or prepared) from the checkpoint's data flags; data_root overrides the
    folder it was cached in. UsageError for anything unusable."""
    ck = load_checkpoint(path, keys=("model", "config", "data"), flag="--base")
    try:
        cfg = ModelConfig.from_dict(ck["config"])
    except Exception as e:  # noqa: BLE001 - whatever is wrong with it, the config is unusable
        raise UsageError(f"--base {path}: not a readable checkpoint config ({type(e).__name__})") from None
    if cfg.model not in ("untied", "loop"):
        raise UsageError(f"--base {path}: ReFlux needs a Transformer++ checkpoint (untied or loop), not '{cfg.model}'")
    from models import build_model
    base = build_model(cfg)
    try:
        base.load_state_dict(ck["model"])
    except RuntimeError as e:
        raise UsageError(f"--base {path}: weights do not fit its config ({str(e).splitlines()[0][:200]})") from None
    base.eval()
    saved = ck.get("args") if isinstance(ck.get("args"), dict) else {}
    p = argparse.ArgumentParser()
    data_mod.add_arguments(p.add_argument)
    dargs = p.parse_args([])
    for k, v in saved.items():
        if hasattr(dargs, k):
            setattr(dargs, k, v)
    dargs.num_proc = 1
    if data_root is not None:
        dargs.data_root = data_root
    data = data_mod.Data(data_mod.prepare(dargs.dataset, dargs.data_dir, dargs.data_root, **data_mod.flag_options(dargs)))
    check_data(data)
    if data_signature(data) != ck["data"]:
        raise UsageError(f"--base {path}: trained on other data than {data.folder} (tokenizer, vocabulary or "
                         f"split sizes differ); give --data_root where its dataset was prepared")
    data.check_block_size(cfg.block_size)
    return base, data, saved


def nll(model, data, split, n_windows, T, batch_size=16):
    """Mean NLL (nats/token) of model on train.py's fixed windows of split (evaluation.evaluate)."""
    starts = data.eval_windows(split, T, n_windows)
    return evaluate(model, data, split, starts, T, batch_size, "cpu", contextlib.nullcontext())


@torch.no_grad()
def grid_nll(base, data, split, n_windows, T, settings, alphas, betas, batch_size=16):
    """{(α, β): mean NLL (nats/token)} of one schedule and edge set over the α x β grid, as
    nll(reflux_lm(base, replace(settings, alpha=α, beta=β)), ...) computes each, but with every grid
    point's copy of a batch of windows in one forward (rows carry their own α, β): the per-token
    stream recurrence runs once per batch instead of once per grid point. Per-window NLL sums in
    float64, reduced in window order, as evaluation.evaluate."""
    combos = [(al, be) for al in alphas for be in betas]
    if any(al <= 0 for al in alphas):
        raise UsageError(f"--alphas {alphas}: a grid needs alpha > 0 (alpha <= 0 is the base itself)")
    view = reflux_lm(base, replace(settings, alpha=max(alphas)))
    starts = data.eval_windows(split, T, n_windows)
    sums = np.zeros((len(combos), len(starts)))
    counts = np.zeros(len(starts))
    with eval_mode(view):
        for i in range(0, len(starts), batch_size):
            x, y = data.window_batch(split, starts[i:i + batch_size], T)
            B, C = x.shape[0], len(combos)
            view.body.alpha = torch.tensor([al for al, _ in combos]).repeat_interleave(B)[:, None, None]
            view.body.beta = torch.tensor([be for _, be in combos]).repeat_interleave(B)[:, None, None]
            logits, _ = view(x.repeat(C, 1))
            ce = F.cross_entropy(logits.float().flatten(0, 1), y.repeat(C, 1).flatten(), ignore_index=-1,
                                 reduction="none").view(C, B, T).double().sum(-1)
            sums[:, i:i + B] = ce.numpy()
            counts[i:i + B] = (y != -1).sum(1).double().numpy()
    total = max(float(counts.sum()), 1.0)
    return {c: float(sums[j].sum()) / total for j, c in enumerate(combos)}


def train_router(base, router, data, T, max_iters=200, batch_size=8, lr=1e-3, lam=1e-3, seed=0, log=None):
    """Calibrate the router with the backbone frozen: soft gates under sync, loss = NLL + λ mean(g)
    (nats/token), AdamW (weight decay 0.1 on W_1, W_2; none on c, a), random train windows drawn
    from np.random.default_rng(seed). Returns the list of losses."""
    torch.manual_seed(seed)
    view = reflux_lm(base, Settings(schedule="sync"), router)
    opt = torch.optim.AdamW([{"params": [router.w1.weight, router.w2.weight], "weight_decay": 0.1},
                             {"params": [router.c, router.a], "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    rng, losses = np.random.default_rng(seed), []
    base.eval()
    router.train()
    try:
        for it in range(max_iters):
            x, y = data.train_batch(rng, batch_size, T)
            _, loss = view(x, y)
            total = loss + lam * view.body.mean_gate
            opt.zero_grad(set_to_none=True)
            total.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if not math.isfinite(losses[-1]):
                raise RuntimeError(f"router training: non-finite loss at update {it}")
            if log and (it % 50 == 0 or it == max_iters - 1):
                log(f"  router update {it}: NLL {losses[-1]:.4f}, mean gate {float(view.body.mean_gate.detach()):.3f}")
    finally:
        router.eval()
    return losses


# =============================================================================== command line

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (no usage block)
        raise UsageError(message)


def _common(p):
    p.add_argument("--base", required=True, help="a train.py checkpoint of an untied or loop Transformer++")
    p.add_argument("--data_root", default=None, help="where its dataset is prepared (default: the checkpoint's)")
    p.add_argument("--split", default="dev", help="dev, or test (the dataset's test split)")
    p.add_argument("--eval_windows", type=int, default=0, help="fixed windows evaluated (default: the checkpoint's)")
    p.add_argument("--batch_size", type=int, default=16, help="windows per evaluation batch")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--block", type=int, default=0, help="router block length w (default: block_size / 8)")
    p.add_argument("--xi", type=float, default=0.6, help="router threshold ξ (open iff gate >= ξ)")
    p.add_argument("--router_rank", type=int, default=64, help="router hidden width r")
    p.add_argument("--alpha_max", type=float, default=0.5, help="router α_e = alpha_max sigmoid(a_e)")
    p.add_argument("--max_iters", type=int, default=200, help="router training updates")
    p.add_argument("--router_batch", type=int, default=8, help="router training windows per update")
    p.add_argument("--lr", type=float, default=1e-3, help="router learning rate (AdamW)")
    p.add_argument("--lam", type=float, default=1e-3, help="λ of the gate penalty λ mean(g)")
    p.add_argument("--seed", type=int, default=0, help="router init and training windows")
    p.add_argument("--json", default=None, help="write the results here as JSON")


def parse(argv):
    sweep = argv[:1] == ["sweep"]
    p = _Parser(prog="reflux.py" + (" sweep" if sweep else ""),
                description="ReFlux on a frozen Transformer++ checkpoint: dev NLL of the base and of ReFlux.")
    _common(p)
    if sweep:
        p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated schedules")
        p.add_argument("--edges", default="all", help="all, or comma-separated S:D")
        p.add_argument("--alphas", default="0.05,0.1,0.2,0.3", help="comma-separated α")
        p.add_argument("--betas", default="0.9,1.0", help="comma-separated β")
        p.add_argument("--no_router", action="store_true", help="skip the router (edges only)")
    else:
        p.add_argument("--schedule", default="stream", help="sync, stream2 or stream")
        p.add_argument("--edge", action="append", default=None, help="S:D (repeatable; default floor(0.6K):floor(0.3K))")
        p.add_argument("--alpha", type=float, default=None, help="write strength α (default 0.2; --recirc 0.15)")
        p.add_argument("--beta", type=float, default=0.9, help="write β (--recirc: 1 - α)")
        p.add_argument("--no_preserve_norm", action="store_true", help="no norm restore after the write")
        p.add_argument("--payload", default="delta", help="delta (z_s - z_d) or state (z_s)")
        p.add_argument("--recirc", action="store_true", help="recirculation baseline: payload state, β = 1 - α, no restore")
        p.add_argument("--router", action="store_true", help="train the router (backbone frozen) and evaluate it")
        p.add_argument("--prefill", default="parallel", help="stream's prompt in --sample: parallel or strict")
        p.add_argument("--sample", type=int, default=0, help="also generate this many tokens greedily")
        p.add_argument("--prompt", default="def ", help="the --sample prompt")
    a = p.parse_args(argv[1:] if sweep else argv)
    a.sweep = sweep
    for flag in ("batch_size", "router_rank", "max_iters", "router_batch"):
        if getattr(a, flag) < 1:
            raise UsageError(f"--{flag} {getattr(a, flag)}: must be >= 1")
    for flag in ("eval_windows", "block", "threads") + (() if sweep else ("sample",)):
        if getattr(a, flag) < 0:
            raise UsageError(f"--{flag} {getattr(a, flag)}: must be >= 0")
    if not 0 < a.xi < 1:
        raise UsageError(f"--xi {a.xi}: must lie in (0, 1)")
    if not os.path.isfile(a.base):
        raise UsageError(f"--base: no checkpoint at {a.base}")
    if sweep:
        a.schedules = [s for s in a.schedules.split(",") if s]
        for s in a.schedules:
            if s not in SCHEDULES:
                raise UsageError(f"--schedules {s}: choose from {', '.join(SCHEDULES)}")
        a.alphas, a.betas = _floats(a.alphas, "--alphas"), _floats(a.betas, "--betas")
    else:
        if a.recirc and a.payload != "delta":
            raise UsageError("--recirc: sets --payload state itself; drop --payload")
        if a.router and (a.edge or a.recirc):
            flag = "--edge" if a.edge else "--recirc"
            raise UsageError(f"{flag}: not used with --router, which gates every pair (s, d) itself; drop {flag}")
        Settings(schedule=a.schedule, payload=a.payload, prefill=a.prefill).check(1)
    return a


def _floats(text, flag):
    try:
        out = [float(v) for v in text.split(",") if v]
    except ValueError:
        raise UsageError(f"{flag} {text}: comma-separated numbers") from None
    if not out or not all(math.isfinite(v) for v in out):
        raise UsageError(f"{flag} {text}: need finite numbers")
    return out


def _setup(a):
    if a.threads:
        torch.set_num_threads(a.threads)
    base, data, saved = load(a.base, a.data_root)
    split = data.test_split if a.split == "test" else a.split
    if split not in ("dev", data.test_split):
        raise UsageError(f"--split {a.split}: dev or test")
    n = a.eval_windows or int(saved.get("eval_windows") or 32)
    T = base.cfg.block_size
    w = a.block or max(1, T // 8)
    return base, data, split, n, T, w


def _router(a, base, data, T, w, log):
    torch.manual_seed(a.seed)
    router = Router(base.cfg.n_embd, base.cfg.depth, a.router_rank, w, a.xi, a.alpha_max)
    t0 = time.time()
    losses = train_router(base, router, data, T, a.max_iters, a.router_batch, a.lr, a.lam, a.seed, log)
    return router, {"router_params": sum(p.numel() for p in router.parameters()), "train_s": time.time() - t0,
                    "first_loss": losses[0], "last_loss": losses[-1], "block": w, "xi": a.xi, "rank": a.router_rank,
                    "max_iters": a.max_iters, "lr": a.lr, "lam": a.lam}


def run_one(a, log=print):
    base, data, split, n, T, w = _setup(a)
    K = base.cfg.depth
    edges = tuple(parse_edge(e, K) for e in a.edge) if a.edge else (default_edge(K),)
    if a.recirc:
        s = recirc(0.15 if a.alpha is None else a.alpha, schedule=a.schedule, edges=edges, prefill=a.prefill)
    else:
        s = Settings(a.schedule, edges, 0.2 if a.alpha is None else a.alpha, a.beta, not a.no_preserve_norm,
                     a.payload, a.prefill)
    s.check(K)
    router, info = None, {}
    if a.router:
        log(f"training the router ({a.max_iters} updates, sync, soft gates; backbone frozen)")
        router, info = _router(a, base, data, T, w, log)
    view = reflux_lm(base, s, router)
    t0 = time.time()
    base_nll = nll(base, data, split, n, T, a.batch_size)
    t1 = time.time()
    if router is not None:
        router.reset_stats()
    rf_nll = nll(view, data, split, n, T, a.batch_size)
    t2 = time.time()
    what = "router" if router is not None else ("recirc " if a.recirc else "") + " ".join(f"{x}:{y}" for x, y in edges)
    res = {"base": a.base, "split": split, "windows": n, "block_size": T, "schedule": s.schedule, "edges": what,
           "alpha": s.alpha, "beta": s.beta, "preserve_norm": s.preserve_norm, "payload": s.payload,
           "base_nll": base_nll, "reflux_nll": rf_nll, "change": rf_nll - base_nll,
           "base_eval_s": t1 - t0, "reflux_eval_s": t2 - t1, **info}
    if router is not None:
        res["kappa"] = router.kappa()
    extra = f"  (κ = {res['kappa']:.2f} open edges per block)" if router is not None else ""
    log(f"{split} NLL over {n} windows of {T} tokens (nats/token):  base {base_nll:.4f}   "
        f"ReFlux {s.schedule} [{what}{'' if router else f', α {s.alpha:g} β {s.beta:g}'}] {rf_nll:.4f}   "
        f"change {rf_nll - base_nll:+.4f}{extra}")
    if a.sample:
        prompt = torch.tensor([data.encode(a.prompt)], dtype=torch.long)
        with eval_mode(view), eval_mode(base):
            out_b = base.generate(prompt, a.sample, temperature=0)
            out_r = view.generate(prompt, a.sample, temperature=0)
        res["sample_base"], res["sample_reflux"] = data.decode(out_b[0].tolist()), data.decode(out_r[0].tolist())
        log(f"--- greedy sample, base ---\n{res['sample_base']}\n--- greedy sample, ReFlux ---\n{res['sample_reflux']}")
    return res


def run_sweep(a, log=print):
    """Edges x α x β for each schedule (dev NLL change against the base), then the router (hard
    gates, each schedule) against the best single edge of that schedule; the chosen
    configurations are also evaluated on the test split."""
    base, data, split, n, T, w = _setup(a)
    K = base.cfg.depth
    edges = all_edges(K) if a.edges == "all" else [parse_edge(e, K, "--edges") for e in a.edges.split(",") if e]
    test = data.test_split
    t_start = time.time()
    base_nll = {split: nll(base, data, split, n, T, a.batch_size), test: nll(base, data, test, n, T, a.batch_size)}
    log(f"base: {split} {base_nll[split]:.4f}, {test} {base_nll[test]:.4f} nats/token ({n} windows of {T})")
    grid = []
    for sched in a.schedules:
        t0 = time.time()
        for e in edges:
            res = grid_nll(base, data, split, n, T, Settings(sched, (e,)), a.alphas, a.betas, a.batch_size)
            for (al, be), v in res.items():
                grid.append({"schedule": sched, "edge": f"{e[0]}:{e[1]}", "alpha": al, "beta": be,
                             "nll": v, "change": v - base_nll[split]})
        best = min((r for r in grid if r["schedule"] == sched), key=lambda r: r["nll"])
        log(f"{sched}: {len(edges) * len(a.alphas) * len(a.betas)} settings in {time.time() - t0:.0f} s; best "
            f"{best['edge']} α {best['alpha']:g} β {best['beta']:g}: {best['nll']:.4f} ({best['change']:+.4f})")
    best = {}
    for sched in a.schedules:
        b = min((r for r in grid if r["schedule"] == sched), key=lambda r: r["nll"])
        e = parse_edge(b["edge"], K)
        tv = nll(reflux_lm(base, Settings(sched, (e,), b["alpha"], b["beta"])), data, test, n, T, a.batch_size)
        best[sched] = {**b, "test_nll": tv, "test_change": tv - base_nll[test]}
    recirc_rows = []
    for sched in a.schedules:
        if sched == "stream":
            continue
        for e in edges:
            v = nll(reflux_lm(base, recirc(0.15, schedule=sched, edges=(e,))), data, split, n, T, a.batch_size)
            recirc_rows.append({"schedule": sched, "edge": f"{e[0]}:{e[1]}", "alpha": 0.15, "nll": v,
                                "change": v - base_nll[split]})
    router_res = None
    if not a.no_router:
        log(f"router: training {a.max_iters} updates (sync, soft gates), w = {w}, ξ = {a.xi}")
        router, info = _router(a, base, data, T, w, log)
        router_res = {**info, "per_schedule": {}}
        for sched in a.schedules:
            view = reflux_lm(base, Settings(sched), router)
            out = {}
            for sp in (split, test):
                router.reset_stats()
                v = nll(view, data, sp, n, T, a.batch_size)
                out[sp] = {"nll": v, "change": v - base_nll[sp], "kappa": router.kappa()}
            router_res["per_schedule"][sched] = out
            log(f"router {sched}: {split} {out[split]['nll']:.4f} ({out[split]['change']:+.4f}, κ {out[split]['kappa']:.2f}); "
                f"best single edge {best[sched]['nll']:.4f} ({best[sched]['change']:+.4f})")
    return {"base": a.base,
            "split": split, "test_split": test, "windows": n, "block_size": T, "depth": K, "base_nll": base_nll,
            "grid": grid, "best_single_edge": best, "recirc": recirc_rows, "router": router_res,
            "wall_s": time.time() - t_start, "threads": torch.get_num_threads()}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse(argv)
    res = run_sweep(a) if a.sweep else run_one(a)
    res["command"] = "python reflux.py " + " ".join(argv)
    if a.json:
        if os.path.dirname(a.json):
            os.makedirs(os.path.dirname(a.json), exist_ok=True)
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, a.json)
        print(f"wrote {a.json}")
    return res


def cli(argv=None):
    """main() for the command line: bad input prints one line "error: ..." on stderr and exits 2."""
    try:
        main(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
