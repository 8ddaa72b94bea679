"""The recurrent-depth family: Parcae and its baseline, the recurrent-depth model (RDM).

Both run a prelude P (L_P blocks), then a recurrent core R (L_R blocks) looped r times, then a
coda C (L_C blocks); the LM (common.py) adds the final RMSNorm and the tied head. r counts
recurrences (the papers write T; in this repo T is the sequence length only). MATH.md, "Parcae
and RDM", has the same equations and the choices we made where the papers are silent.

Parcae ("Parcae: Scaling Laws For Stable Looped Language Models", arXiv 2604.12946: §2.1 looped
models, §4.1 the model, Alg. 1 its forward pass, §4.2 and Alg. 2 per-sequence depths, App. H the
depth sampler), built from Transformer++ blocks (baselines.py):

    e   = Norm_prelude(P(embed(idx)))               the "prelude norm"
    h_0 ~ TruncNormal(0, sqrt(2/(5d)), +-3 sd)      random in training, seeded at evaluation
    for t in 1..r:
        u = Abar * h + Delta * (B e)                injection (Delta * B e computed once)
        h = R(u)                                    L_R pre-norm blocks with their own residuals
    x_out = Coda(C h)

    A = -exp(A_log), Delta = softplus(dt_bias), Abar = exp(Delta * A)   (per channel, zero-order hold)
    init: A_log = 0, dt_bias = softplus^-1(ln sqrt 5) so Abar = sqrt(1/5); B = I; C = orthogonal * sqrt(0.4)

RDM ("Scaling up Test-Time Compute with Latent Reasoning: A Recurrent Depth Approach",
arXiv 2502.05171: §3 the model, its depth sampler and truncated backprop; §6 the KL early exit),
Parcae's baseline, built from sandwich blocks (4 RMSNorms each):

    block: x' = n2(x + Attn(n1 x));  x'' = n4(x' + SwiGLU(n3 x'))
    e   = P(sqrt(d) * embed(idx))                   the LM looks the embedding up; the body scales it
    h_0 ~ TruncNormal(0, sqrt(2/5), +-3 sd)         Parcae's h_0 times sqrt(d) (variance 2/5)
    for t in 1..r:  h = R(W [h; e])                 W: 2d -> d (the adapter), W [h; e] = W_1 h + W_2 e
    x_out = Coda(h)

W_1 plays the part of Parcae's Abar but is unconstrained: the instability Parcae studies (its §3).
Parcae's Abar is in (0, 1) for every parameter value: it is computed as exp(-exp(log Delta +
A_log)) with the rate Delta exp(A_log) clamped to [1e-6, 80], so in float32 Abar lies in
[exp(-80), exp(-1e-6)] even when softplus underflows or exp(A_log) overflows. The clamp is a
choice of this code, not the paper's: outside that band (Abar above 0.999999 or below 2e-35) Abar
is held at the bound and gets no gradient; the init (rate 0.80) is well inside.
A_log, dt_bias, B and C are nn.Parameters, not nn.Linear, so the LM's N(0, 0.02) re-init leaves
their special inits alone; they get no weight decay (the class attribute no_decay).

Parameters (non-embedding; plus the LM's final norm d). Neither count depends on the recurrence,
so the width solver (models.solve_width, F of the blocks) gives the same width for every depth:
    Parcae: (L_P + L_R + L_C)(4d^2 + 3dF + 2d) + 2d^2 (B, C) + 2d (A_log, dt_bias) + d (prelude norm)
    RDM:    (L_P + L_R + L_C)(4d^2 + 3dF + 4d) + 2d^2 (W)

Depth. cfg.depth is the number of recurrences at evaluation (body.depth, settable for the
test-time sweep) and, unless cfg.mu_rec is set, the mean training recurrence mu_rec;
mu_bwd = cfg.mu_bwd or ceil(mu_rec / 2). A forward without autograd (evaluation, FLOP counting,
generation) runs exactly body.depth recurrences. In training (train mode with autograd on):
  Parcae, per sequence: r_i = max(Poisson(mu_rec), 1). The batch runs max_i r_i steps; sequence i
    is idle (identity: keeps h) for the first max r - r_i steps, then runs its r_i steps, the last
    k_i = min(r_i, mu_bwd) of which carry gradients. Steps before the last max_i k_i run under
    torch.no_grad for the whole batch; in the later steps a row still in its no-grad part has
    its new state detached.
  RDM, per micro-batch: tau ~ N(log mu_rec - sigma^2/2, sigma), sigma = 1/2, r = Poisson(exp(tau))
    + 1, so E[r] = mu_rec + 1; the first r - k steps run under no_grad, the last k = min(r, mu_bwd)
    carry gradients. Like Parcae (App. H) we draw r first and then split it, so truncation does not
    change the distribution of r (in the RDM paper's notation: n = max(r - s, 0) steps without and
    k = min(r, s) with gradients, s = mu_bwd).
Both draw the depths first, then h_0, from generators seeded with body.rng_seed (train.py sets it
per micro-batch from --seed, the update and the micro-batch index; None: torch's global RNG).

Compile: train.py --compile compiles one block application (Transformer++ for Parcae, sandwich
for RDM; common.compile_regions): one graph per grad mode and batch shape, shared by prelude, core
and coda blocks at every recurrence, so the sampled Python-int loop length never enters a graph
and a new depth never forces a recompile. The recurrence driver (recur) is also
torch.compiler.disable(recursive=False), for a whole-model torch.compile: dynamo skips that frame
and compiles only the functions it calls.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from baselines import Attention, SwiGLU, TransformerBlock
from common import RMSNorm, UsageError, compiled_region, compute_dtype, host_values, rope_cos_sin

# ============================================================================= shared: state, depth, draws
TRUNC_SD = 3.0          # initial states are truncated at +-3 standard deviations
EVAL_STATE_SEED = 1234  # evaluation draws h_0 from generators seeded from this
_EVAL_CHUNK = 256       # eval h_0 table: positions in chunks of 256, chunk c seeded EVAL_STATE_SEED + c
_eval_tables = {}


def sub_cache(cache, key):
    """The decoding-cache dict of one block application (None when not decoding)."""
    return None if cache is None else cache.setdefault(key, {})


@torch.compiler.disable  # RNG / host-side work: always eager, never traced
def seeded_generators(seed, device):
    """The generators of one training forward's random draws: (CPU generator for the recurrence
    depths, generator on `device` for h_0), both seeded with seed; (None, None) when seed is None,
    which means torch's global RNG. train.py sets a body's rng_seed per micro-batch
    (train.step_seed: a function of --seed, the update and the micro-batch's global index), so the
    draws do not depend on the number of processes."""
    if seed is None:
        return None, None
    cpu = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    return cpu, (cpu if device.type == "cpu" else torch.Generator(device).manual_seed(seed))


@torch.compiler.disable  # RNG / host-side work: always eager, never traced
def random_state(shape, std, device, dtype, generator=None):
    """h_0 ~ TruncNormal(0, std, +-3 std) from generator (None: torch's global RNG) (training)."""
    h = torch.empty(shape, device=device, dtype=torch.float32)
    nn.init.trunc_normal_(h, 0.0, std, -TRUNC_SD * std, TRUNC_SD * std, generator=generator)
    return h.to(dtype)


@torch.compiler.disable  # RNG / host-side work: always eager, never traced
def eval_state(start, T, d, std, device, dtype):
    """Deterministic h_0 for sequence indices start..start+T-1: (1, T, d), the same for every row.

    Row i depends only on its index i (chunk i // 256 is drawn from a CPU generator seeded
    EVAL_STATE_SEED + chunk), so evaluation NLL is independent of batch size and device, and
    cached decoding (which asks for one index at a time) sees exactly the h_0 of a full forward.
    """
    rows = []
    for c in range(start // _EVAL_CHUNK, (start + T - 1) // _EVAL_CHUNK + 1):
        key = (c, d, float(std))
        if key not in _eval_tables:
            g = torch.Generator().manual_seed(EVAL_STATE_SEED + c)
            t = torch.empty(_EVAL_CHUNK, d)
            nn.init.trunc_normal_(t, 0.0, std, -TRUNC_SD * std, TRUNC_SD * std, generator=g)
            _eval_tables[key] = t
        rows.append(_eval_tables[key])
    table = torch.cat(rows)
    off = start - (start // _EVAL_CHUNK) * _EVAL_CHUNK
    return table[off:off + T].to(device=device, dtype=dtype)[None]


def resolve_recurrence(cfg):
    """(mu_rec, mu_bwd) of a config: mu_rec = cfg.mu_rec or cfg.depth, mu_bwd = cfg.mu_bwd or
    ceil(mu_rec / 2). Raises UsageError for counts < 0 / < 1."""
    mu_rec = cfg.mu_rec or cfg.depth
    mu_bwd = cfg.mu_bwd or math.ceil(mu_rec / 2)
    if cfg.mu_rec < 0 or cfg.mu_bwd < 0 or mu_rec < 1 or mu_bwd < 1:
        raise UsageError(f"--mu_rec {cfg.mu_rec} / --mu_bwd {cfg.mu_bwd}: must be >= 1 (0 = default)")
    if cfg.n_prelude < 0 or cfg.n_coda < 0 or cfg.n_core < 1:
        raise UsageError(f"--n_prelude {cfg.n_prelude} / --n_core {cfg.n_core} / --n_coda {cfg.n_coda}: "
                         "need --n_core >= 1 and --n_prelude, --n_coda >= 0")
    return mu_rec, mu_bwd


class LoopedBody(nn.Module):
    """What Parcae and RDM share: the depth settings, the initial state h_0 and the per-step state
    norms of the last forward. Holds no parameters (the subclasses' state-dict keys are their own).

    depth: evaluation recurrences; mu_rec, mu_bwd: training sampler (resolve_recurrence);
    h0_std: the std of h_0; rng_seed: seed of the training draws (seeded_generators).
    """

    def __init__(self, cfg, h0_std):
        super().__init__()
        self.mu_rec, self.mu_bwd = resolve_recurrence(cfg)
        self.depth = cfg.depth
        self.h0_std = h0_std
        self._norms, self._steps = [], 0
        self.rng_seed = None

    @torch.compiler.disable  # RNG / host-side work: always eager, never traced
    def initial_state(self, e, cache=None, generator=None):
        """h_0 shaped like e (B, T, d): random_state in training, else eval_state from the cache's
        position on (cache["len"], 0 without a cache)."""
        B, T, d = e.shape
        if self.training:
            return random_state((B, T, d), self.h0_std, e.device, e.dtype, generator)
        start = cache.get("len", 0) if cache is not None else 0
        return eval_state(start, T, d, self.h0_std, e.device, e.dtype).expand(B, T, d)

    def recurrence_parameters(self):
        """The parameters applied at every recurrence: the core's blocks (RDM adds its adapter W)."""
        return list(self.core.parameters())

    @torch.compiler.disable  # host-side dict work: always eager, never traced
    def core_caches(self, cache, t):
        """The decoding caches of the core's blocks at recurrence t (None when not decoding)."""
        return None if cache is None else [sub_cache(cache, ("core", t, j)) for j in range(len(self.core))]


# ============================================================================= Parcae
ABAR_INIT = math.sqrt(1 / 5)
LOG_RATE_MIN, LOG_RATE_MAX = math.log(1e-6), math.log(80.0)  # clamp of Delta * exp(A_log)


@torch.compiler.disable  # RNG / host-side work: always eager, never traced
def parcae_sample_depths(n, mu_rec, generator=None):
    """n draws of r = max(Poisson(mu_rec), 1) from a CPU generator (None: torch's global CPU RNG):
    (n,) int64. E[r] = mu_rec + P(Poisson = 0) = mu_rec + exp(-mu_rec)."""
    rate = torch.full((n,), float(mu_rec), dtype=torch.float64)
    return torch.poisson(rate, generator=generator).long().clamp_(min=1)


class Parcae(LoopedBody):
    """Parcae body. forward(x (B, T, d), cos, sin, cache) -> (B, T, d).

    Internal API (tests): forward(..., depths=(B,) int tensor, h0=(B, T, d)) runs the masked
    per-sequence schedule with the given depths (in any mode) and initial state.
    diagnostics(): per-step state norms of the last forward, their max, max/min Abar, steps run,
    mean sampled depth.
    """
    no_decay = ("A_log", "dt_bias", "B", "C")  # state-space coefficients: no weight decay (harness.optim.no_decay_parameters)

    def __init__(self, cfg):
        d, H, F_ = cfg.n_embd, cfg.n_head, cfg.width
        super().__init__(cfg, h0_std=math.sqrt(2 / (5 * d)))
        self.prelude = nn.ModuleList(TransformerBlock(d, H, F_) for _ in range(cfg.n_prelude))
        self.prelude_norm = RMSNorm(d)
        self.core = nn.ModuleList(TransformerBlock(d, H, F_) for _ in range(cfg.n_core))
        self.coda = nn.ModuleList(TransformerBlock(d, H, F_) for _ in range(cfg.n_coda))
        delta0 = -math.log(ABAR_INIT)  # Abar = exp(-Delta) with A = -1
        self.A_log = nn.Parameter(torch.zeros(d))
        self.dt_bias = nn.Parameter(torch.full((d,), math.log(math.expm1(delta0))))
        self.B = nn.Parameter(torch.eye(d))
        self.C = nn.Parameter(torch.empty(d, d))
        nn.init.orthogonal_(self.C)
        with torch.no_grad():
            self.C.mul_(math.sqrt(0.4))
        self._depth_mean = None

    own_init = ("B", "C")  # matrices not drawn from N(0, 0.02)

    def init_constants(self):
        """The documented initial constants, as (value, want) pairs (tests/test_registry.py checks them):
        Abar = sqrt(1/5) per channel (ABAR_INIT), B = I, C orthogonal scaled by sqrt(0.4) (C C^T = 0.4 I)."""
        d = self.B.shape[0]
        return [(self.abar(), math.sqrt(1 / 5)), (self.B, torch.eye(d)), (self.C @ self.C.T, 0.4 * torch.eye(d))]

    def delta(self):
        """Delta = softplus(dt_bias), the per-channel step size of the zero-order hold, (d,) > 0."""
        return F.softplus(self.dt_bias)

    def abar(self):
        """Abar = exp(Delta * A) = exp(-exp(log Delta + A_log)), per channel, strictly in (0, 1)."""
        z = self.dt_bias
        # log softplus(z), stable: softplus(z) ~ exp(z) below -15 (and underflows below ~-100)
        log_delta = torch.where(z < -15, z, F.softplus(z.clamp(min=-15)).log())
        return torch.exp(-(log_delta + self.A_log).clamp(LOG_RATE_MIN, LOG_RATE_MAX).exp())

    def _step(self, h, inj, abar, cos, sin, active=None, grad_rows=None, caches=None):
        """One recurrence h <- R(Abar h + inj); rows outside `active` keep h, rows outside
        `grad_rows` get a detached new state (both (B, 1, 1) bool or None)."""
        u = abar * h + inj
        for j, blk in enumerate(self.core):
            u = blk(u, cos, sin, None if caches is None else caches[j])
        if grad_rows is not None:
            u = torch.where(grad_rows, u, u.detach())
        if active is not None:
            u = torch.where(active, u, h)
        return u

    @torch.compiler.disable(recursive=False)
    def recur(self, inj, abar, cos, sin, cache=None, depths=None, h0=None):
        """The looped core: r recurrences h_t = R(Abar * h_{t-1} + inj) from h_0; returns h_r (B, T, d).

        inj: Delta * (B e), (B, T, d), computed once by forward; abar: (d,) in (0, 1); cos, sin:
        RoPE tables; cache: decoding state (core block t's KV cache under key ("core", t, j)).
        Parcae, arXiv 2604.12946, §4.1 Alg. 1 (the loop) and §4.2 Alg. 2 (per-sequence depths).

        Which schedule runs:
        - fixed depth (evaluation, generation, or no autograd): body.depth steps for every row, each
          with the caches of its recurrence, so a cached decode runs the same steps as the full forward;
        - per-sequence depths (training with autograd, drawn here by parcae_sample_depths, or `depths`
          given): the batch runs n = max_i r_i steps and row i is the identity (keeps h) for its
          first n - r_i, so every row ends after its own r_i steps. The steps before the last
          max_i k_i (k_i = min(r_i, mu_bwd)) run under no_grad for the whole batch; later, a row
          still outside its last k_i steps gets a detached new state (truncated backprop). A row
          still idle when gradients start holds h_0 computed without autograd, so its link to h_0
          is restored first.
        The draws come from seeded_generators(body.rng_seed): depths first, then h_0. Records each
        step's mean state norm (its L2 norm over channels, averaged over tokens and rows) and the
        mean sampled depth, both read by diagnostics.
        Raises ValueError for depths with a cache (decoding runs a fixed depth), or depths not
        (B,) integers >= 1.
        """
        norms = []
        self._depth_mean = None
        cpu_gen, gen = seeded_generators(self.rng_seed, inj.device)
        if depths is None and self.training and torch.is_grad_enabled():
            depths = parcae_sample_depths(inj.shape[0], self.mu_rec, cpu_gen)  # drawn first, then h_0
        h = self.initial_state(inj, cache, gen) if h0 is None else h0
        if depths is not None:  # per-sequence depths, masked to the identity while idle
            if cache is not None:
                raise ValueError("decoding runs a fixed depth (eval mode)")
            r_i = torch.as_tensor(depths).cpu()
            if r_i.is_floating_point() or r_i.is_complex() or r_i.dtype == torch.bool:  # 1.7 would run 1 step
                raise ValueError(f"depths must be (batch,) ints >= 1, got dtype {r_i.dtype}")
            r_i = r_i.long()
            if r_i.shape != (h.shape[0],) or bool((r_i < 1).any()):
                raise ValueError(f"depths must be (batch,) ints >= 1, got {tuple(r_i.shape)}")
            k_i = r_i.clamp(max=self.mu_bwd)
            n, n_grad = int(r_i.max()), int(k_i.max())
            s = torch.arange(n)[:, None]
            # built on the host, where the depths are drawn; a non-blocking copy does not wait for the GPU's queue
            active = (s >= n - r_i).to(h.device, non_blocking=True).view(n, -1, 1, 1)  # steps n - r_i .. n - 1
            grad = (s >= n - k_i).to(h.device, non_blocking=True).view(n, -1, 1, 1)    # the last k_i of them
            self._depth_mean = float(r_i.double().mean())
            h_init = h
            for t in range(n):
                if t < n - n_grad:
                    with torch.no_grad():
                        h = self._step(h, inj, abar, cos, sin, active[t])
                else:
                    if t == n - n_grad and t > 0:  # rows still idle hold h_0: restore its autograd link
                        h = torch.where(active[t - 1], h, h_init)
                    h = self._step(h, inj, abar, cos, sin, active[t], grad[t])
                norms.append(h.detach().norm(dim=-1).mean())
        else:
            for t in range(self.depth):
                h = self._step(h, inj, abar, cos, sin, caches=self.core_caches(cache, t))
                norms.append(h.detach().norm(dim=-1).mean())
        self._norms, self._steps = norms, len(norms)
        return h

    def forward(self, x, cos, sin, cache=None, depths=None, h0=None):
        """Prelude -> prelude norm -> recur (the looped core) -> C -> coda: (B, T, d) -> (B, T, d)."""
        for j, blk in enumerate(self.prelude):
            x = blk(x, cos, sin, sub_cache(cache, ("prelude", j)))
        e = self.prelude_norm(x)
        abar = self.abar()
        inj = self.delta() * F.linear(e, self.B)  # Delta * (B e), fixed across recurrences
        h = self.recur(inj, abar, cos, sin, cache, depths, h0)
        y = F.linear(h, self.C).to(h.dtype)  # the coda's residual stream stays in h's dtype (float32 under autocast)
        for j, blk in enumerate(self.coda):
            y = blk(y, cos, sin, sub_cache(cache, ("coda", j)))
        return y

    def diagnostics(self, spectral=True, read=True):
        """{"state_norm": [per step], "state_norm_max", "abar_max", "abar_min", "steps",
        "depth_mean" (mean sampled r_i; None at fixed depth)} of the last forward; with spectral
        (two d x d SVDs) also "bbar_spectral_norm" = ||diag(Delta) B||_2 and "c_spectral_norm"
        = ||C||_2 (the Parcae paper's Figure 18 quantities). Floats; read=False: 0-dim device
        tensors where a float needs a host sync (common.host_values reads them later)."""
        norms = [n.float() for n in self._norms]
        with torch.no_grad():
            a = self.abar()
            out = {"state_norm": norms, "state_norm_max": torch.stack(norms).max() if norms else 0.0,
                   "abar_max": a.max(), "abar_min": a.min(), "steps": self._steps,
                   "depth_mean": self._depth_mean}
            if spectral:
                bbar = self.delta()[:, None] * self.B
                out["bbar_spectral_norm"] = torch.linalg.matrix_norm(bbar.float(), ord=2)
                out["c_spectral_norm"] = torch.linalg.matrix_norm(self.C.float(), ord=2)
        return host_values(out) if read else out


def parcae(cfg):
    """Parcae. Non-embedding parameters:
    (L_P + L_R + L_C)(4d^2 + 3dF + 2d) + 2d^2 + 3d + d (final norm)."""
    return Parcae(cfg)


# ============================================================================= RDM
class SandwichBlock(nn.Module):
    """x' = n2(x + Attn(n1 x)); x'' = n4(x' + SwiGLU(n3 x')). Parameters: 4d^2 + 3dF + 4d.

    forward(x (B, T, d), cos, sin, cache) -> (B, T, d), as TransformerBlock."""

    def __init__(self, d, n_head, width):
        super().__init__()
        self.n1, self.n2, self.n3, self.n4 = RMSNorm(d), RMSNorm(d), RMSNorm(d), RMSNorm(d)
        self.attn = Attention(d, n_head)
        self.mlp = SwiGLU(d, width)

    @compiled_region  # one block application: the repeated unit of RDM
    def forward(self, x, cos, sin, cache=None):
        x = self.n2(x + self.attn(self.n1(x), cos, sin, cache))
        return self.n4(x + self.mlp(self.n3(x)))


@torch.compiler.disable  # RNG / host-side work: always eager, never traced
def rdm_sample_depths(n, mu_rec, sigma=0.5, generator=None):
    """n draws of RDM's depth r = Poisson(exp(tau)) + 1, tau ~ N(log mu_rec - sigma^2/2, sigma),
    from a CPU generator (None: torch's global CPU RNG): (n,) int64 with E[r] = mu_rec + 1."""
    tau = torch.randn(n, dtype=torch.float64, generator=generator) * sigma + (math.log(mu_rec) - sigma ** 2 / 2)
    return torch.poisson(tau.exp(), generator=generator).long() + 1


class RecurrentDepth(LoopedBody):
    """RDM body. forward(x (B, T, d), cos, sin, cache) -> (B, T, d).

    Internal API (tests): forward(..., n_steps=r, h0=tensor) runs r recurrences with
    truncated backprop through the last min(r, mu_bwd) and the given initial state.
    diagnostics(): per-step state norms of the last forward, their max, steps run.
    """

    def __init__(self, cfg):
        d, H, F_ = cfg.n_embd, cfg.n_head, cfg.width
        super().__init__(cfg, h0_std=math.sqrt(2 / 5))
        self.sigma = 0.5
        self.emb_scale = math.sqrt(d)
        self.prelude = nn.ModuleList(SandwichBlock(d, H, F_) for _ in range(cfg.n_prelude))
        self.adapter = nn.Linear(2 * d, d, bias=False)  # W [h; e]
        self.core = nn.ModuleList(SandwichBlock(d, H, F_) for _ in range(cfg.n_core))
        self.coda = nn.ModuleList(SandwichBlock(d, H, F_) for _ in range(cfg.n_coda))

    def encode(self, x, cos, sin, cache=None):
        """Scaled embedding -> prelude -> e."""
        x = x * self.emb_scale
        for j, blk in enumerate(self.prelude):
            x = blk(x, cos, sin, sub_cache(cache, ("prelude", j)))
        return x

    def decode(self, h, cos, sin, cache=None):
        """Coda: the final state h (B, T, d) through the coda's blocks (no output matrix, unlike Parcae's C)."""
        for j, blk in enumerate(self.coda):
            h = blk(h, cos, sin, sub_cache(cache, ("coda", j)))
        return h

    def recurrence_parameters(self):
        """The core's blocks and the adapter W: both run at every recurrence."""
        return list(self.adapter.parameters()) + list(self.core.parameters())

    def _step(self, h, e, cos, sin, caches=None):
        """One recurrence: h <- Core(W [h; e])."""
        u = self.adapter(torch.cat((h, e), -1)).to(e.dtype)  # the residual stream stays in e's dtype (float32 under autocast)
        for j, blk in enumerate(self.core):
            u = blk(u, cos, sin, None if caches is None else caches[j])
        return u

    @torch.compiler.disable(recursive=False)
    def recur(self, e, cos, sin, cache=None, n_steps=None, h0=None):
        """The looped core: r recurrences h_t = Core(W [h_{t-1}; e]) from h_0; returns h_r (B, T, d).

        e: the prelude's output (B, T, d); cos, sin: RoPE tables; cache: decoding state (core block
        t's KV cache under key ("core", t, j)). RDM, arXiv 2502.05171, §3 (sampler and truncation).

        Which schedule runs:
        - fixed depth (evaluation, generation, or no autograd): body.depth steps, each with the
          caches of its recurrence, so a cached decode runs the same steps as the full forward;
        - one depth for the whole micro-batch (training with autograd, drawn here by
          rdm_sample_depths, or `n_steps` given): the first r - k steps under no_grad, the last
          k = min(r, mu_bwd) with gradients (truncated backprop through depth).
        The draws come from seeded_generators(body.rng_seed): the depth first, then h_0. Records
        each step's mean state norm (read by diagnostics).
        Raises ValueError for n_steps with a cache (decoding runs a fixed depth).
        """
        norms = []
        cpu_gen, gen = seeded_generators(self.rng_seed, e.device)
        if n_steps is None and self.training and torch.is_grad_enabled():
            n_steps = int(rdm_sample_depths(1, self.mu_rec, self.sigma, cpu_gen)[0])  # drawn first, then h_0
        h = self.initial_state(e, cache, gen) if h0 is None else h0
        if n_steps is not None:  # training-style: truncated backprop through depth
            if cache is not None:
                raise ValueError("decoding runs a fixed depth (eval mode)")
            k = min(n_steps, self.mu_bwd)
            for t in range(n_steps):
                if t < n_steps - k:
                    with torch.no_grad():
                        h = self._step(h, e, cos, sin)
                else:
                    h = self._step(h, e, cos, sin)
                norms.append(h.detach().norm(dim=-1).mean())
        else:
            for t in range(self.depth):
                h = self._step(h, e, cos, sin, self.core_caches(cache, t))
                norms.append(h.detach().norm(dim=-1).mean())
        self._norms, self._steps = norms, len(norms)
        return h

    def forward(self, x, cos, sin, cache=None, n_steps=None, h0=None):
        """encode (scaled embedding, prelude) -> recur (the looped core) -> decode (coda): (B, T, d) -> (B, T, d)."""
        e = self.encode(x, cos, sin, cache)
        h = self.recur(e, cos, sin, cache, n_steps, h0)
        return self.decode(h, cos, sin, cache)

    def diagnostics(self, spectral=True, read=True):
        """{"state_norm": [per recurrence], "state_norm_max", "steps"} of the last forward; with
        spectral (one d x d SVD) also "w1_spectral_norm" = ||W_1||_2 of the adapter's state half,
        W [h; e] = W_1 h + W_2 e: the linear recurrence matrix Parcae constrains (Abar) and RDM
        leaves free. Floats; read=False: 0-dim device tensors where a float needs a host sync."""
        norms = [n.float() for n in self._norms]
        out = {"state_norm": norms, "state_norm_max": torch.stack(norms).max() if norms else 0.0,
               "steps": self._steps}
        if spectral:
            with torch.no_grad():
                w1 = self.adapter.weight[:, :self.adapter.weight.shape[0]].float()
                out["w1_spectral_norm"] = torch.linalg.matrix_norm(w1, ord=2)
        return host_values(out) if read else out


def rdm(cfg):
    """Recurrent-depth model. Non-embedding parameters:
    (L_P + L_R + L_C)(4d^2 + 3dF + 4d) + 2d^2 + d (final norm)."""
    return RecurrentDepth(cfg)


@torch.no_grad()
def rdm_generate_depths(model, idx, max_depth=None, threshold=5e-4):
    """RDM evaluation with the KL early exit (arXiv 2502.05171, §6), full sequence.

    model: an LM with an RDM body (eval mode is set by the caller); idx: (B, T) token ids.
    Recurrence t = 1..max_depth (default body.depth); after each, every position's next-token
    distribution p_t = softmax(head(norm_f(Coda(h_t)))) is read out; a position exits at the first
    t >= 2 with KL(p_{t-1} || p_t) < threshold; its state is frozen
    from then on (later recurrences leave it unchanged; later positions still attend to it) and its
    logits are those of step t. Positions that never exit use step max_depth.

    Returns (logits (B, T, V), exit_step (B, T) int64 in 1..max_depth).
    """
    body = model.body
    max_depth = body.depth if max_depth is None else max_depth
    x = model.wte(idx)
    B, T = idx.shape
    cos, sin = rope_cos_sin(torch.arange(T, device=idx.device), dtype=compute_dtype(x))
    e = body.encode(x, cos, sin)
    h = body.initial_state(e)
    done = torch.zeros(B, T, dtype=torch.bool, device=idx.device)
    exit_step = torch.full((B, T), max_depth, dtype=torch.long, device=idx.device)
    out = prev = None
    for t in range(1, max_depth + 1):
        h = torch.where(done[..., None], h, body._step(h, e, cos, sin))
        logits = model.logits(model.norm_f(body.decode(h, cos, sin)))
        logp = F.log_softmax(logits.float(), -1)
        if prev is not None:
            kl = (prev.exp() * (prev - logp)).sum(-1)  # KL(p_{t-1} || p_t)
            newly = ~done & (kl < threshold)
            exit_step[newly] = t
            done |= newly
        keep = (done & (exit_step < t))[..., None]  # exited at an earlier step: keep those logits
        out = logits if out is None else torch.where(keep, out, logits)
        prev = logp
        if bool(done.all()):
            break
    return out, exit_step
