"""Parcae: a stable looped language model (SPEC.md section 5; paper: ../shared/seeds/002_*.txt).

Prelude -> recurrent core looped T times -> coda, all Transformer++ blocks (SPEC section 2):

    e   = Norm_prelude(P(embed(idx)))               P: L_P blocks; the "prelude norm"
    h_0 ~ TruncNormal(0, sqrt(2/(5d)), +-3 sd)      random in training, seeded at evaluation
    for t in 1..T:
        u = Abar * h + Delta * (B e)                injection (Delta * B e computed once)
        h = R(u)                                    R: L_R pre-norm blocks with their own residuals
    x_out = Coda(C h)                               L_C blocks; the LM adds the final norm and head

    A = -exp(A_log), Delta = softplus(dt_bias), Abar = exp(Delta * A)   (per channel, zero-order hold)
    init: A_log = 0, dt_bias = softplus^-1(ln sqrt 5) so Abar = sqrt(1/5); B = I; C = orthogonal * sqrt(0.4)

Abar is in (0, 1) for every parameter value: it is computed as exp(-exp(log Delta + A_log)) with
the exponent clamped to [1e-6, 80], so in float32 Abar lies in [exp(-80), exp(-1e-6)], strictly
inside (0, 1) even when softplus underflows or exp(A_log) overflows (the clamp acts only there).
A_log, dt_bias, B and C are nn.Parameters, not nn.Linear, so the LM's N(0, 0.02) re-init leaves
their special inits alone; they get no weight decay (the class attribute no_decay).

Parameters: (L_P + L_R + L_C)(4d^2 + 3dF + 2d) + 2d^2 (B, C) + 2d (A_log, dt_bias) + d (prelude
norm), plus the LM's final norm d. The count does not depend on the recurrence, so the width
solver (models.solve_width, F of the blocks) gives the same width for every depth.

Depth. cfg.depth is the number of recurrences at evaluation (self.depth, settable for the
test-time sweep) and, unless cfg.mu_rec is set, the mean training recurrence mu_rec;
mu_bwd = cfg.mu_bwd or ceil(mu_rec / 2). In training (train mode with autograd on) every sequence
draws T_i = max(Poisson(mu_rec), 1), then h_0, from generators seeded with self.rng_seed (train.py
sets it per micro-batch from --seed, the update and the micro-batch index; None: torch's global RNG); the
batch runs max_i T_i steps; sequence i is idle (identity: keeps h) for the first max T - T_i steps,
then runs its T_i steps, the last k_i = min(T_i, mu_bwd) of which carry gradients. Steps before
the last max_i k_i run under torch.no_grad for the whole batch; in the later steps a row that is
still in its no-grad part has its new state detached. A forward without autograd (evaluation,
FLOP counting, generation) runs exactly self.depth recurrences with no masks.

Compile: train.py --compile compiles the Transformer++ block application (common.compile_regions;
one graph per grad mode and batch shape, shared by prelude, core and coda blocks), so the sampled
Python-int loop length never enters a graph and a new depth never forces a recompile. The
recurrence driver (recur) is also torch.compiler.disable(recursive=False), for a whole-model
torch.compile: dynamo skips that frame and compiles only the functions it calls.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from baselines import TransformerBlock, eval_state, random_state, resolve_recurrence, seeded_generators, sub_cache
from common import RMSNorm

ABAR_INIT = math.sqrt(1 / 5)
LOG_RATE_MIN, LOG_RATE_MAX = math.log(1e-6), math.log(80.0)  # clamp of Delta * exp(A_log)


@torch.compiler.disable  # RNG / host-side work: always eager, never traced
def parcae_sample_depths(n, mu_rec, generator=None):
    """n draws of T = max(Poisson(mu_rec), 1) from a CPU generator (None: torch's global CPU RNG):
    (n,) int64. E[T] = mu_rec + P(Poisson = 0) = mu_rec + exp(-mu_rec)."""
    rate = torch.full((n,), float(mu_rec), dtype=torch.float64)
    return torch.poisson(rate, generator=generator).long().clamp_(min=1)


class Parcae(nn.Module):
    """Parcae body (SPEC section 5). forward(x, cos, sin, cache) -> (B, T, d).

    Internal API (tests): forward(..., depths=(B,) int tensor, h0=(B, T, d)) runs the masked
    per-sequence schedule with the given depths (in any mode) and initial state.
    diagnostics(): per-step mean L2 norm of the recurrent state (over channels, averaged over
    tokens and rows) of the last forward, its max, max/min Abar, steps run, mean sampled depth.
    """
    no_decay = ("A_log", "dt_bias", "B", "C")  # state-space coefficients: no weight decay (train.no_decay_parameters)

    def __init__(self, cfg):
        super().__init__()
        d, H, F_ = cfg.n_embd, cfg.n_head, cfg.width
        self.mu_rec, self.mu_bwd = resolve_recurrence(cfg)
        self.depth = cfg.depth
        self.h0_std = math.sqrt(2 / (5 * d))
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
        self._norms, self._steps, self._depth_mean = [], 0, None
        self.rng_seed = None  # seed of the training draws (baselines.seeded_generators); None: global RNG

    def delta(self):
        return F.softplus(self.dt_bias)

    def abar(self):
        """Abar = exp(Delta * A) = exp(-exp(log Delta + A_log)), per channel, strictly in (0, 1)."""
        z = self.dt_bias
        # log softplus(z), stable: softplus(z) ~ exp(z) below -15 (and underflows below ~-100)
        log_delta = torch.where(z < -15, z, F.softplus(z.clamp(min=-15)).log())
        return torch.exp(-(log_delta + self.A_log).clamp(LOG_RATE_MIN, LOG_RATE_MAX).exp())

    @torch.compiler.disable  # RNG / host-side work: always eager, never traced
    def initial_state(self, e, cache=None, generator=None):
        B, T, d = e.shape
        if self.training:
            return random_state((B, T, d), self.h0_std, e.device, e.dtype, generator)
        start = cache.get("len", 0) if cache is not None else 0
        return eval_state(start, T, d, self.h0_std, e.device, e.dtype).expand(B, T, d)

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
        norms = []
        self._depth_mean = None
        cpu_gen, gen = seeded_generators(self.rng_seed, inj.device)
        if depths is None and self.training and torch.is_grad_enabled():
            depths = parcae_sample_depths(inj.shape[0], self.mu_rec, cpu_gen)  # drawn first, then h_0
        h = self.initial_state(inj, cache, gen) if h0 is None else h0
        if depths is not None:  # per-sequence depths, masked to the identity while idle
            if cache is not None:
                raise ValueError("decoding runs a fixed depth (eval mode)")
            T_i = torch.as_tensor(depths, dtype=torch.long).cpu()
            if T_i.shape != (h.shape[0],) or bool((T_i < 1).any()):
                raise ValueError(f"depths must be (batch,) ints >= 1, got {tuple(T_i.shape)}")
            k_i = T_i.clamp(max=self.mu_bwd)
            n, n_grad = int(T_i.max()), int(k_i.max())
            s = torch.arange(n)[:, None]
            active = (s >= n - T_i).to(h.device).view(n, -1, 1, 1)  # steps n - T_i .. n - 1
            grad = (s >= n - k_i).to(h.device).view(n, -1, 1, 1)    # the last k_i of them
            self._depth_mean = float(T_i.double().mean())
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
                caches = None if cache is None else [sub_cache(cache, ("core", t, j)) for j in range(len(self.core))]
                h = self._step(h, inj, abar, cos, sin, caches=caches)
                norms.append(h.detach().norm(dim=-1).mean())
        self._norms, self._steps = norms, len(norms)
        return h

    def forward(self, x, cos, sin, cache=None, depths=None, h0=None):
        for j, blk in enumerate(self.prelude):
            x = blk(x, cos, sin, sub_cache(cache, ("prelude", j)))
        e = self.prelude_norm(x)
        abar = self.abar()
        inj = self.delta() * F.linear(e, self.B)  # Delta * (B e), fixed across recurrences
        h = self.recur(inj, abar, cos, sin, cache, depths, h0)
        y = F.linear(h, self.C)
        for j, blk in enumerate(self.coda):
            y = blk(y, cos, sin, sub_cache(cache, ("coda", j)))
        return y

    def diagnostics(self, spectral=True):
        """{"state_norm": [per step], "state_norm_max", "abar_max", "abar_min", "steps",
        "depth_mean" (mean sampled T_i; None at fixed depth)} of the last forward; with spectral
        (two d x d SVDs) also "bbar_spectral_norm" = ||diag(Delta) B||_2 and "c_spectral_norm"
        = ||C||_2 (the paper's Figure 18 quantities)."""
        norms = torch.stack(self._norms).float().tolist() if self._norms else []
        with torch.no_grad():
            a = self.abar()
            out = {"state_norm": norms, "state_norm_max": max(norms, default=0.0),
                   "abar_max": float(a.max()), "abar_min": float(a.min()), "steps": self._steps,
                   "depth_mean": self._depth_mean}
            if spectral:
                bbar = self.delta()[:, None] * self.B
                out["bbar_spectral_norm"] = float(torch.linalg.matrix_norm(bbar.float(), ord=2))
                out["c_spectral_norm"] = float(torch.linalg.matrix_norm(self.C.float(), ord=2))
        return out


def parcae(cfg):
    """Parcae (SPEC section 5). Non-embedding parameters:
    (L_P + L_R + L_C)(4d^2 + 3dF + 2d) + 2d^2 + 3d + d (final norm)."""
    return Parcae(cfg)
