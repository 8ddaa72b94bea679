"""Shared plumbing for every model: errors, RMSNorm, RoPE, the LM wrapper, width solving.

Each architecture file (tango.py, baselines.py, ...) defines only its residual *body*
(a module mapping embeddings (B, T, d) to the final residual stream (B, T, d)); the token
embedding, the tied head, the loss, cached generation and parameter counting live here
(SPEC.md section 1), so every model has the same API:

    model = build_model(cfg)                       # models.py
    logits, loss = model(idx, targets, positions)  # (B, T, V), scalar NLL in nats/token
    out = model.generate(idx, max_new_tokens, temperature=1.0, top_k=None)
    model.num_params()                             # non-embedding parameters
"""
import numbers
from dataclasses import dataclass, asdict, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


class UsageError(ValueError):
    """Bad user input (a flag, a file, a checkpoint). train.py prints str(e) on one line and exits 2."""


HEAD_DIM = 32  # d_h = 32 everywhere (SPEC notation)


@dataclass
class ModelConfig:
    """Every model's hyperparameters (one dataclass for all architectures, saved in checkpoints).

    model: registry name (models.py); vocab_size V; block_size: training context T;
    n_embd: residual width d; n_head: H = d / 32; depth: K block applications;
    width: expansion width F (TANGO gated width, Transformer++ feed-forward width, ...);
    window: Windowed TANGO window W (SPEC section 3).
    gau_s, chunk, tie_unit: GAU/FLASH shared dim s, FLASH chunk C, one unit shared by all K applications (SPEC section 4).
    """
    model: str = "tango"
    vocab_size: int = 50257
    block_size: int = 256
    n_embd: int = 128
    n_head: int = 4
    depth: int = 8
    width: int = 512
    window: int = 256
    gau_s: int = 128
    chunk: int = 256
    tie_unit: bool = True
    # Parcae / recurrent-depth model RDM (SPEC section 5): prelude -> core looped -> coda.
    n_prelude: int = 2          # L_P Transformer++ (RDM: sandwich) blocks before the loop
    n_core: int = 2             # L_R blocks in the recurrent core (one recurrence = L_R block applications)
    n_coda: int = 2             # L_C blocks after the loop
    mu_rec: int = 0             # mean training recurrence; 0 = use depth (depth = eval recurrences)
    mu_bwd: int = 0             # recurrences backpropagated through; 0 = ceil(mu_rec / 2)
    kl_exit: bool = False       # RDM: evaluate with the KL early exit (baselines.rdm_generate_depths)
    kl_threshold: float = 5e-4  # RDM: exit when KL(p_{t-1} || p_t) < kl_threshold

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise UsageError(f"checkpoint config has unknown fields {sorted(unknown)}")
        return cls(**d)


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain (SPEC section 1). x: (..., d) -> (..., d)."""
    no_decay = ("weight",)  # a gain: no weight decay (train.no_decay_parameters)

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_cos_sin(positions, head_dim=HEAD_DIM, base=10000.0, dtype=torch.float32):
    """Rotary tables for integer positions (T,) or (B, T) -> cos, sin of shape (B|1, 1, T, head_dim/2)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    ang = positions.to(torch.float64)[..., None] * inv_freq  # (..., T, hd/2), float64 so long positions stay exact
    if ang.dim() == 2:
        ang = ang[None]
    ang = ang[:, None]  # (B|1, 1, T, hd/2)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate pairs (x[..., :hd/2], x[..., hd/2:]) of x: (B, H, T, hd) by the angles in cos/sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def causal_attention(q, k, v, scale=None):
    """Causal softmax attention of L new queries over S >= L keys (the last L keys are the queries' own).

    q: (B, H, L, dk), k: (B, H, S, dk), v: (B, H, S, dv) -> (B, H, L, dv). Query i sees keys
    j <= i + (S - L) (lower-right alignment), which covers training (L = S), prefill and
    single-token decoding with a cache.
    """
    L, S = q.shape[-2], k.shape[-2]
    if L == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if L == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(diagonal=S - L)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class LM(nn.Module):
    """Token embedding E (V x d) -> body -> RMSNorm -> tied head x E^T (SPEC section 1).

    The body is any module with forward(x, cos, sin, cache) -> x on (B, T, d) tensors; cache is
    None (training) or a dict the body keeps its decoding state in (keys per application, ...).
    """

    def __init__(self, cfg: ModelConfig, body: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.body = body
        self.norm_f = RMSNorm(cfg.n_embd)
        self.apply(self._init_weights)
        # residual output projections get a smaller init, as in GPT-2 (marked by the bodies)
        for m in self.modules():
            if getattr(m, "is_residual_out", False):
                nn.init.normal_(m.weight, std=0.02 / (2 * cfg.depth) ** 0.5)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def num_params(self, non_embedding=True):
        """Parameter count, each shared tensor counted once; non_embedding excludes E (SPEC section 1)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() already de-duplicates shared tensors
        return n - self.wte.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None, positions=None, cache=None):
        """idx: (B, T) int64 token ids; targets: (B, T) with -1 = not scored; positions: (T,) or
        (B, T) RoPE position ids (default: 0..T-1, continuing after a cache's length).

        Returns logits (B, T, V) and the mean NLL over scored targets in nats/token (or None).
        """
        x = self.wte(idx)
        return self.forward_embeds(x, targets, positions, cache)

    def forward_embeds(self, x, targets=None, positions=None, cache=None):
        """forward() from input embeddings x: (B, T, d) (used by latent tokens, SPEC section 6)."""
        T = x.shape[1]
        if positions is None:
            start = cache.get("len", 0) if cache is not None else 0
            positions = torch.arange(start, start + T, device=x.device)
        cos, sin = rope_cos_sin(positions, dtype=x.dtype)
        x = self.body(x, cos, sin, cache)
        if cache is not None:
            cache["len"] = cache.get("len", 0) + T
        x = self.norm_f(x)
        logits = x @ self.wte.weight.t()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, stop_token=None):
        """Sample max_new_tokens continuing idx (B, T) with a decoding cache; returns (B, T + n).

        max_new_tokens: int >= 0; temperature, top_k: as in sample_next (temperature 0 = greedy,
        top_k None = all tokens, top_k > V keeps all V). Generation stops early when every row
        emitted stop_token. Raises ValueError naming the argument for a value outside these ranges.
        """
        check_sampling(temperature, top_k, max_new_tokens)
        cache = {}
        logits, _ = self(idx, cache=cache)
        out = idx
        done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            nxt = sample_next(logits[:, -1, :].float(), temperature, top_k)
            out = torch.cat((out, nxt), dim=1)
            if stop_token is not None:
                done |= nxt[:, 0] == stop_token
                if bool(done.all()):
                    break
            logits, _ = self(nxt, cache=cache)
        return out


def check_sampling(temperature=1.0, top_k=None, max_new_tokens=0):
    """ValueError naming the argument unless temperature is a finite number >= 0, top_k is None
    or an int >= 1 and max_new_tokens an int >= 0 (bools are not counts)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature {temperature!r}: must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k {top_k!r}: must be None (all tokens) or an int >= 1")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens {max_new_tokens!r}: must be an int >= 0")


def sample_next(logits, temperature=1.0, top_k=None):
    """logits (B, V) -> next ids (B, 1), drawn from softmax(logits / temperature) over the top_k
    largest logits (ties at the k-th value all kept; top_k None or >= V: every token).

    temperature 0 = argmax. Any positive temperature is safe, however small: the logits are
    shifted by their row maximum and divided in float64, so 1e-30 gives the argmax (uniform over
    exact ties) instead of an overflow. Raises ValueError for a negative, infinite or NaN
    temperature or a top_k below 1 (check_sampling).
    """
    check_sampling(temperature, top_k)
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    z = logits.double()
    if top_k is not None and top_k < z.size(-1):
        v, _ = torch.topk(z, top_k)
        z = z.masked_fill(z < v[:, [-1]], float("-inf"))
    z = (z - z.amax(-1, keepdim=True)) / temperature  # <= 0, exactly 0 at the maximum: no overflow
    return torch.multinomial(F.softmax(z, dim=-1), num_samples=1)
