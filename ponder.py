"""PonderLM-2: the last hidden state fed back as extra "thought" inputs at the same position.

Paper: "PonderLM-2: Pretraining LLM with Latent Thoughts in Continuous Space" (arXiv 2509.23184),
sections 3.1-3.3; authors' code LUMIA-Group/PonderLM-2 (modeling_llama.py: training Jacobi path
and cached decoding). Backbone: untied Transformer++ (baselines.py), K blocks.

Each token t owns S = n + 1 slots (t,0), (t,1), ..., (t,n) (n = cfg.n_thoughts), all at RoPE
position t; the body runs ordinary causal attention over the S T slots in slot order. With H_{t,k}
the last residual stream of slot (t,k):

    input(t,0) = e(x_t)                           the token slot (plain embedding)
    input(t,k) = z_{t,k} = Norm_θ(H_{t,k-1})      k >= 1: the previous slot's final hidden state
    output for x_{t+1}:  H_{t,n}                  only the last slot is scored (LM: norm_f, head)

Norm_θ is an RMSNorm of the body (d parameters, gain initialized to 0.02, the embedding's init
std, so thoughts start at the token inputs' scale). The authors share the final norm instead and
scale token inputs by sqrt(2.5 d); the body cannot reach LM.norm_f, and with plain token inputs
n = 0 is exactly untied Transformer++.

Training solves the thoughts by Jacobi iteration (gradients through every pass):
  1. bootstrap, b = 1..n: run the sequence of the current slots 0..b-1 of every token and set
     z_{.,k} = Norm_θ(H_{.,k-1}) for k = 1..b;
  2. refine N times on the full S-slot sequence: all z_{.,k} <- Norm_θ(H_{.,k-1}) at once;
  3. a final pass on the S-slot sequence gives H_{.,n}.
N = cfg.jacobi (default 3); in training with cfg.jacobi_random, N ~ U{2, 3} per forward (the
authors' random_jacobi_iterations), drawn from the generator train.py seeds per micro-batch.
Exactness: dependencies are triangular in slot order, so Jacobi fixes at least one more thought per
refinement: the bootstrap makes token 0's thoughts exact and refinement m those of the m-th next
thought in slot order. With one thought, tokens 0..m are exact after m refinements and N >= T - 1
equals the sequential computation (`sequential_reference`); with n thoughts N >= n (T - 1) does.
With fewer iterations training and prefill approximate it.

Decoding: per new token, S sequential single-slot passes at position t, each appending one KV row
per block; the next slot's input is Norm_θ of this slot's output. Prefill runs the bootstrap and N
Jacobi refinements on the prompt (eagerly), then one cached pass over its S T slots.

Parameters: K (4d^2 + 3dF + 2d) + d + d (Norm_θ; absent when n = 0).
Forward MACs (flops.py): the passes hold R = n(n+1)/2 + (N + 1)(n + 1) slot rows per token, so
linear R T K (4d^2 + 3dF), scores and mix sum over passes of (S_p T)^2 d K each, head V d T.
"""
import torch
import torch.nn as nn

from baselines import TransformerBlock
from common import RMSNorm, UsageError
from parcae import seeded_generators


class Ponder(nn.Module):
    """PonderLM-2 body: forward(x (B, T, d), cos, sin, cache) -> H_{.,n} (B, T, d), one row per
    token. cache[l] holds block l's keys/values of every slot (S rows per token).
    Raises UsageError for n_thoughts < 0 or jacobi < 0."""

    def __init__(self, cfg):
        super().__init__()
        if cfg.n_thoughts < 0:
            raise UsageError(f"--n_thoughts {cfg.n_thoughts}: must be >= 0")
        if cfg.jacobi < 0:
            raise UsageError(f"--jacobi {cfg.jacobi}: must be >= 0")
        self.n, self.jacobi, self.jacobi_random = cfg.n_thoughts, cfg.jacobi, cfg.jacobi_random
        self.sequential_passes = self.n + 1  # single-slot passes per decoded token (bench.py decode)
        self.blocks = nn.ModuleList(TransformerBlock(cfg.n_embd, cfg.n_head, cfg.width) for _ in range(cfg.depth))
        if self.n > 0:
            self.think_norm = RMSNorm(cfg.n_embd)  # Norm_θ
            nn.init.constant_(self.think_norm.weight, 0.02)
            self.rng_seed = None  # seed of the training draw of N (parcae.seeded_generators); None: global RNG

    def init_constants(self):
        """The documented initial constants, as (value, want) pairs (tests/test_registry.py checks them): Norm_theta's gain 0.02, the embedding's init std."""
        return [(self.think_norm.weight, 0.02)] if self.n > 0 else []

    def run(self, x, cos, sin, cache=None, eager=False):
        """The K blocks on a slot sequence x: (B, L, d) with its RoPE rows cos, sin (L rows).
        eager: skip the compiled regions (prefill's Jacobi passes belong to decoding)."""
        for l, block in enumerate(self.blocks):
            c = None if cache is None else cache.setdefault(l, {})
            x = TransformerBlock.forward.region(block, x, cos, sin, c) if eager else block(x, cos, sin, c)
        return x

    def pass_(self, x, zs, cos, sin, cache=None, eager=False):
        """One pass on slots [x, z_1, ..., z_b] of every token: (B, T, d) each -> H (B, T, b+1, d)."""
        B, T, d = x.shape
        S = len(zs) + 1
        seq = torch.stack([x, *zs], dim=2).view(B, T * S, d)  # slot order (t,0), (t,1), ...
        rep = lambda r: r.repeat_interleave(S, dim=2)         # every slot of token t at position t
        return self.run(seq, rep(cos), rep(sin), cache, eager).view(B, T, S, d)

    def iterations(self):
        """N: U{2, 3} in a training forward with jacobi_random, else cfg.jacobi."""
        if self.training and self.jacobi_random and torch.is_grad_enabled():
            gen, _ = seeded_generators(self.rng_seed, "cpu")
            return int(torch.randint(2, 4, (1,), generator=gen))
        return self.jacobi

    def solve_thoughts(self, x, cos, sin, N, eager=False):
        """Bootstrap (b = 1..n) and N Jacobi refinements -> thought inputs [z_1, ..., z_n]."""
        zs = []
        for b in range(1, self.n + 1):
            H = self.pass_(x, zs, cos, sin, eager=eager)
            zs = [self.think_norm(H[:, :, k]) for k in range(b)]
        for _ in range(N):
            H = self.pass_(x, zs, cos, sin, eager=eager)
            zs = [self.think_norm(H[:, :, k]) for k in range(self.n)]
        return zs

    def forward(self, x, cos, sin, cache=None):
        if self.n == 0:  # untied Transformer++
            return self.run(x, cos, sin, cache)
        if cache is None:
            zs = self.solve_thoughts(x, cos, sin, self.iterations())
            return self.pass_(x, zs, cos, sin)[:, :, -1]
        if 0 not in cache:  # prefill: Jacobi on the prompt, then one cached pass
            zs = self.solve_thoughts(x, cos, sin, self.jacobi, eager=True)
            return self.pass_(x, zs, cos, sin, cache)[:, :, -1]
        outs = []
        for t in range(x.shape[1]):  # decoding: S sequential single-slot passes per token
            inp, row = x[:, t:t + 1], (cos[:, :, t:t + 1], sin[:, :, t:t + 1])
            for k in range(self.n + 1):
                h = self.run(inp, *row, cache)
                inp = self.think_norm(h)
            outs.append(h)
        return torch.cat(outs, 1)


def sequential_reference(body, x, cos, sin):
    """The exact PonderLM-2 computation, slot by slot (no Jacobi, no cache; for tests): every slot's
    input is computed from a full recomputation of all earlier slots. x: (B, T, d) -> (B, T, d)."""
    B, T, d = x.shape
    slots, pos, outs = [], [], []
    for t in range(T):
        inp = x[:, t]
        for k in range(body.n + 1):
            slots.append(inp)
            pos.append(t)
            idx = torch.tensor(pos)
            h = body.run(torch.stack(slots, 1), cos[:, :, idx], sin[:, :, idx])[:, -1]
            if k < body.n:
                inp = body.think_norm(h)
        outs.append(h)
    return torch.stack(outs, 1)


def ponder(cfg):
    """PonderLM-2 on untied Transformer++ (arXiv 2509.23184). Non-embedding parameters:
    K (4d^2 + 3dF + 2d) + d + (d if n_thoughts > 0)."""
    return Ponder(cfg)
