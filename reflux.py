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
κ is the mean count of open edges per block. Training ("calibration", reflux_cli.train_router): the
backbone frozen, soft gates, schedule sync, loss = NLL + λ mean(g) with λ = 1e-3, AdamW lr 1e-3 (no weight
decay on c and a). Parameters d r + r |E| + 2 |E|.

Decoding: ReFluxBody has the body contract (forward(x (B, T, d), cos, sin, cache) -> (B, T, d)),
so common.LM.generate runs it unchanged through a view (reflux_lm). Caches: sync and stream2 keep
two KV caches (record and injected; 2x KV memory) and stream2 the last record payload; stream keeps
one KV cache and each edge's last payload (B, 1, d); the router keeps its running block sum and the
current block's gates. Cached decoding equals the full-sequence protocol of each schedule (tested).
Prompt processing for stream (`prefill`): "parallel" (default; the paper's parallel-prefill
stream) runs one clean traversal of the prompt and chains from its last payload; "strict" runs the
recurrence over the prompt token by token. Without a cache (evaluation) stream is always strict.

Cost (flops.reflux_forward_macs): sync, stream2 and recirc run the blocks (1 + (K - low) / K) times
(low: the lowest target block) and the head once, at most 2x the base forward MACs; stream 1x; plus
O(d) per open edge and position for the write and (d r + r |E|) per block of w tokens for the router.
No write reaches the blocks below the lowest target, so the injected traversal starts there (from
the record traversal's stream), and stream runs those blocks once over all rows, not per token.

    python -m studies.reflux_cli --base out/ckpt_best.pt --schedule stream --edge 4:2 --alpha 0.2 --beta 0.9
    python -m studies.reflux_cli --base CKPT --schedule sync --recirc --alpha 0.15            # the baseline
    python -m studies.reflux_cli --base CKPT --router --block 16 --xi 0.6 --router_rank 64 --max_iters 200
    python -m studies.reflux_cli sweep --base CKPT --json results/reflux/sweep.json

Bad input (flag, checkpoint, data): one line "error: ..." on stderr, exit code 2. Loading the checkpoint,
evaluation, router training and the command line are in reflux_cli.py.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import baselines
from common import LM, UsageError

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


def is_transformer_pp(model_name):
    """True for a registered model whose body is Transformer++ blocks (untied, loop: its registry
    row builds baselines' Transformer++), the checkpoints ReFlux steps."""
    import models  # (models imports the model files; this one is a tool on top of them)
    return models.spec_of(model_name).build in (baselines.untied_transformer, baselines.loop_transformer)


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
        # batch carry different values (reflux_cli.grid_nll: one batch for a whole α x β grid)
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
        if not hasattr(base.body, "blocks") or not is_transformer_pp(base.cfg.model):
            raise UsageError(f"--base: ReFlux steps Transformer++ blocks (untied or loop); this checkpoint "
                             f"is a '{base.cfg.model}' model")
        self.cfg = base.cfg
        self.wte, self.norm_f = base.wte, base.norm_f
        self.register_buffer("vocab_bias", base.vocab_bias, persistent=False)  # the head's -inf padding columns
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
                    rows[e][b][0] = lm.wte.weight.new_zeros(lm.cfg.n_embd)
        edit = _write_rows(edges, settings.alpha, settings.beta, settings.preserve_norm, rows, skip_before=prompt_len)
        logits, z = _hooked(lm, idx[:, :t + 1], edit)
        out.append(logits[:, t:t + 1])
        if t + 1 < T:
            for s, d in edges:
                for b in range(B):
                    rows[(s, d)][b][t + 1] = z[s][b, t] - (0 if settings.payload == "state" else z[d][b, t])
    return torch.cat(out, 1)
