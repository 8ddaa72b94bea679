"""The shared model: what every architecture file builds on (MATH.md, "What every model shares").

Each architecture file (tango.py, baselines.py, ...) defines only its residual *body*
(a module mapping embeddings (B, T, d) to the final residual stream (B, T, d)); the token
embedding, the tied head, the loss, cached generation and parameter counting live here, with
ModelConfig, RMSNorm, RoPE and causal attention, so every model has the same API:

    model = build_model(cfg)                       # models.py
    logits, loss = model(idx, targets, positions)  # (B, T, V), scalar NLL in nats/token
    logits, nll = model(idx, targets, reduction="sum")  # the summed NLL (nats) training uses
    out = model.generate(idx, max_new_tokens, temperature=1.0, top_k=None)
    model.num_params()                             # non-embedding parameters

The command lines' plumbing (parsers, flag checks, signals, output files) is harness/cli.py.
"""
import functools
import inspect
import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F


class UsageError(ValueError):
    """Bad user input (a flag, a file, a checkpoint). train.py prints str(e) on one line and exits 2."""


SIZE_ERRORS = ("can't allocate memory",  # torch's CPU allocator (RuntimeError)
               "Storage size calculation overflowed",  # torch: a tensor of more than 2**63 bytes (RuntimeError)
               "array is too big")  # numpy: the same (ValueError)


def is_out_of_memory(e):
    """True for an allocation failure: MemoryError (numpy's too), CUDA's OutOfMemoryError, or torch's
    or numpy's error for a size no memory holds (SIZE_ERRORS, e.g. --batch_size 2**62)."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or any(m in str(e) for m in SIZE_ERRORS)


HEAD_DIM = 32  # d_h = 32 everywhere (MATH.md glossary)
VOCAB_MULTIPLE = 64  # the embedding/head has ceil(V / 64) * 64 rows (aligned matmul); rows >= V are padding


def flag(default, help, tier=False):
    """A dataclass field that is also a command-line flag of the same name: its default, its help
    text, and tier=True where the flag's default depends on --size (harness.config.TIER_DEFAULTS;
    the flag is then unset until resolved). harness.cli.add_flags declares these flags on a parser,
    so a field with its flag is written once: train.py, flops.py and the tools read the declaration."""
    return field(default=default, metadata={"help": help, "tier": tier})


def flag_fields(cls):
    """The fields of dataclass cls that are flags (declared with flag()), in declaration order."""
    return [f for f in fields(cls) if "help" in f.metadata]


@dataclass
class ModelConfig:
    """Every model's hyperparameters (one dataclass for all architectures, saved in checkpoints).

    model: registry name (models.py); vocab_size V; block_size: training context T;
    n_embd: residual width d; n_head: H = d / 32; depth: K block applications;
    width: expansion width F (TANGO gated width, Transformer++ feed-forward width, ...).
    The model flags (declared with flag(): train.py's "model" group, flops.py and the tools take
    their type, default and help from here; models.REGISTRY says which model reads which and its
    range) follow: Windowed TANGO's window W (MATH.md, "TANGO"); GAU/FLASH's s and chunk C
    (MATH.md, "GAU and FLASH"); tie_unit: one GAU/FLASH unit shared by all K applications.
    """
    model: str = "tango"
    vocab_size: int = 50257
    block_size: int = 256
    n_embd: int = 128
    n_head: int = 4
    depth: int = 8
    width: int = 512
    window: int = flag(256, "Windowed TANGO window W", tier=True)
    gau_s: int = flag(128, "GAU/FLASH shared dimension s", tier=True)
    chunk: int = flag(256, "FLASH chunk C", tier=True)
    tie_unit: bool = True
    # Parcae / recurrent-depth model RDM (parcae.py): prelude -> core looped -> coda.
    mu_rec: int = flag(0, "Parcae/RDM: mean training recurrence; 0: --depth (parcae.resolve_recurrence)")
    mu_bwd: int = flag(0, "Parcae/RDM: recurrences backpropagated through; 0: ceil(mu_rec/2)")
    n_prelude: int = flag(2, "Parcae/RDM: blocks before the recurrent core")
    n_core: int = flag(2, "Parcae/RDM: blocks in the recurrent core (one recurrence = n_core block applications); "
                       "loopstack/plt/loopfold: blocks per loop")
    n_coda: int = flag(2, "Parcae/RDM: blocks after the recurrent core")
    # Depth-Attention (depth_attention.py): candidate layers C(l) = {j < l: j mod da_stride == 0} U recent window
    da_stride: int = flag(0, "Depth-Attention: mix layers j mod stride == 0 (0: depth // 2, the paper's; -1: none)")
    da_recent: int = flag(0, "Depth-Attention: also mix the r layers just below")
    # PonderLM-2 (ponder.py); n_thoughts is also lrt-think's thought slots
    n_thoughts: int = flag(1, "PonderLM-2, lrt-think: thought slots per token (0: untied Transformer++, lrt)")
    jacobi: int = flag(3, "PonderLM-2: Jacobi refinements of the thoughts (evaluation, prefill; training "
                       "without --jacobi_random)")
    jacobi_random: bool = flag(True, "PonderLM-2: training draws the Jacobi refinements from {2, 3}")
    # LRT / LRT with thought tokens (latent_recurrence.py)
    lrt_src: int = flag(-1, "LRT: block whose output is the next slot's memory (-1: floor(2K/3))")
    lrt_tgt: int = flag(0, "LRT: block whose input receives the memory")
    lrt_kv: bool = flag(False, "LRT: also a private memory key/value slot in every block's attention")
    lrt_subsets: int = flag(2, "LRT: interleaved position subsets k of parallel training (>= 1)")
    lrt_detach_init: bool = flag(False, "LRT: run the init pass of parallel training without gradients")
    # Parallel loops (parallel_loops.py): loopstack / plt / loopfold run n_core blocks as depth = N loops
    plt_window: int = flag(64, "PLT: G-SWA window W over the loop's own keys (t-W < j <= t)")
    plt_shift: bool = flag(True, "PLT: cross-loop shift (loop l at t reads loop l-1 at t-1; one batched pass per "
                           "decoded token); --no-plt_shift: the release's unshifted loops")
    fold: int = flag(2, "LoopFold: fold width f (loops per stage)")
    fold_rank: int = flag(0, "LoopFold: predictor/corrector rank r (0: d/4)")
    fold_layout: str = flag("first", "LoopFold: loop 1 alone then groups of f (first), or groups then loop N "
                            "alone (last)")
    # config keys ignored on load (from_dict): nothing reads them
    DEAD_FIELDS: ClassVar[tuple] = ("kl_exit", "kl_threshold")

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k not in cls.DEAD_FIELDS}
        unknown = set(d) - names
        if unknown:
            raise UsageError(f"checkpoint config has unknown fields {sorted(unknown)}")
        return cls(**d)


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain (MATH.md, "What every model shares"). x: (..., d) -> (..., d)."""
    no_decay = ("weight",)  # a gain: no weight decay (harness.optim.no_decay_parameters)

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


def compute_dtype(x):
    """The dtype matmuls on x run in: the autocast dtype when autocast is on for x's device, else x.dtype."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


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


# ----------------------------------------------------------------------------- regional compilation
# torch.compile of the whole model would unroll the K block applications into one graph (compile
# time grows with K) and guard on the step shapes of every call. Instead each body marks its
# repeated unit (one block application, one TANGO update, one GAU unit) with @compiled_region and
# compile_regions(model) compiles those functions once: every application reuses the same graph
# (parameters are graph inputs, so untied blocks share it too), whatever K is.

def compiled_region(fn):
    """Mark a module method as a compiled region. Before compile_regions() (and for a module that
    was not passed to it) the method runs eagerly. A call with a decoding cache (the method's
    `cache` argument not None) always runs eagerly: decoding shapes change with every token, and
    one prompt is not worth a compile."""
    names = list(inspect.signature(fn).parameters)[1:]  # without self
    pos = names.index("cache") if "cache" in names else None

    @functools.wraps(fn)
    def call(self, *args, **kw):
        compiled = self.__dict__.get("_compiled_regions", {}).get(fn.__name__)
        if compiled is None or pos is None:
            return fn(self, *args, **kw)
        cache = kw["cache"] if "cache" in kw else args[pos] if pos < len(args) else None
        return fn(self, *args, **kw) if cache is not None else compiled(self, *args, **kw)

    call.region = fn
    return call


def compile_regions(model, **compile_kw):
    """Regional compilation: torch.compile(fn, **compile_kw) for each @compiled_region method of
    model's modules, one compiled function per method shared by every module that has it.
    Returns the model (modified in place; its parameters and state_dict are unchanged).
    dynamic=False unless given: every graph has static shapes (training and the padded evaluation
    batches keep one shape each, harness.evaluation), so no region compiles a symbolic dimension.
    A module whose region traces several graphs per mode says how many (compile_variants, e.g.
    Depth-Attention: one per candidate count); Dynamo's recompile limit is raised to 4 graphs
    (train, eval, ...) per variant, past which the region would run eagerly after a warning."""
    compile_kw.setdefault("dynamic", False)  # static shapes: a new batch size gets its own graph, none symbolic
    variants = max(getattr(m, "compile_variants", 1) for m in model.modules())
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * variants)
    compiled = {}
    for m in model.modules():
        for cls in reversed(type(m).__mro__):
            for name, attr in vars(cls).items():
                fn = getattr(attr, "region", None)
                if fn is not None:
                    if fn not in compiled:
                        compiled[fn] = torch.compile(fn, **compile_kw)
                    m.__dict__.setdefault("_compiled_regions", {})[name] = compiled[fn]
    return model


CE_ROWS = 8192  # tokens per cross-entropy chunk for bf16/fp16 logits (LM.head)


def _nll_sum(logits, targets):
    """Summed NLL (nats) of logits (N, V) widened to float32 or wider, over targets != -1."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> float32; float64 stays
    return F.cross_entropy(wide, targets, ignore_index=-1, reduction="sum")


class LM(nn.Module):
    """Token embedding E (V x d) -> body -> RMSNorm -> tied head x E^T (MATH.md, "What every model shares").

    E is stored with ceil(V / 64) * 64 rows (VOCAB_MULTIPLE: the head matmul gets an aligned
    size); the padding rows are zero, never looked up, their logits are -inf in the loss (a fixed
    bias) and sliced off the returned logits, so they are never predicted, sampled, trained or
    counted in num_params.

    The body is any module with forward(x, cos, sin, cache) -> x on (B, T, d) tensors; cache is
    None (training) or a dict the body keeps its decoding state in (keys per application, ...).
    """

    def __init__(self, cfg: ModelConfig, body: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.body = body
        self.norm_f = RMSNorm(cfg.n_embd)
        if hasattr(body, "use_final_norm"):  # a body that also applies the final norm between its loops (PLT)
            body.use_final_norm(self.norm_f)
        if not self.wte.weight.is_meta:  # meta tensors (parameter counts) hold no values: drawing them is only time
            self.apply(self._init_weights)
            # residual output projections get a smaller init, as in GPT-2 (marked by the bodies)
            for m in self.modules():
                if getattr(m, "is_residual_out", False):
                    nn.init.normal_(m.weight, std=0.02 / (2 * cfg.depth) ** 0.5)
        # pad E after the init, so the padding draws no random numbers (the same initial weights as V rows)
        pad = -cfg.vocab_size % VOCAB_MULTIPLE
        self.wte.weight = nn.Parameter(F.pad(self.wte.weight.detach(), (0, 0, 0, pad)))
        self.wte.num_embeddings = cfg.vocab_size + pad
        # the head's bias: 0 on the V real columns, -inf on the padding ones (not a parameter, not saved)
        self.register_buffer("vocab_bias", F.pad(torch.zeros(cfg.vocab_size), (0, pad), value=float("-inf")),
                             persistent=False)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def num_params(self, non_embedding=True):
        """Parameter count, each shared tensor counted once; non_embedding excludes E.
        E counts V x d (its padding rows are not parameters of the model)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() already de-duplicates shared tensors
        return n - self.wte.weight.numel() if non_embedding else n - self.wte.weight[self.cfg.vocab_size:].numel()

    def forward(self, idx, targets=None, positions=None, cache=None, reduction="mean"):
        """idx: (B, T) int64 token ids; targets: (B, T) with -1 = not scored; positions: (T,) or
        (B, T) RoPE position ids (default: 0..T-1, continuing after a cache's length).

        Returns logits (B, T, V) and the NLL over the scored targets (None without targets):
        reduction "mean" in nats/token, "sum" in nats (what training sums over micro-batches and
        divides by their count of scored targets). ValueError for another reduction.
        """
        x = self.wte(idx)
        return self.forward_embeds(x, targets, positions, cache, reduction)

    def forward_embeds(self, x, targets=None, positions=None, cache=None, reduction="mean"):
        """forward() from input embeddings x: (B, T, d) (used by latent tokens; MATH.md, "Latent tokens")."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction {reduction!r}: must be 'mean' or 'sum'")
        T = x.shape[1]
        if positions is None:
            start = cache.get("len", 0) if cache is not None else 0
            positions = torch.arange(start, start + T, device=x.device)
        dtype = compute_dtype(x)
        if getattr(self.body, "rope_float32", False):  # TANGO: its scores' precision (Tango.rope_float32)
            dtype = torch.promote_types(dtype, torch.float32)
        cos, sin = rope_cos_sin(positions, dtype=dtype)  # once per forward, for every application
        x = self.body(x, cos, sin, cache)
        if cache is not None:
            cache["len"] = cache.get("len", 0) + T
        return self.head(x, targets, cache, reduction)

    def logits(self, x):
        """Tied head on final-norm outputs x: (..., d) -> logits (..., V) (the padding rows sliced off)."""
        return (x @ self.wte.weight.t())[..., :self.cfg.vocab_size]

    @compiled_region
    def head(self, x, targets=None, cache=None, reduction="mean"):
        """Final norm, head and the NLL over targets != -1: summed (nats) for reduction "sum", that
        sum over the count of scored targets for "mean" (nats/token; None without targets).
        x: (B, T, d) -> logits (B, T, V), loss. cache only marks a decoding call (run eagerly).
        bf16/fp16 logits: the NLL by chunks of CE_ROWS tokens, each widened to float32 and
        recomputed in backward, so no float32 copy of all the logits (nor its log-softmax) is kept."""
        # (B, T, Vp): the aligned matmul over the padded rows, whose logits the bias sets to -inf, so
        # the loss reads them contiguous (no copy of a V-column slice) and they get no gradient
        padded = F.linear(self.norm_f(x), self.wte.weight, self.vocab_bias)
        loss = None
        if targets is not None:
            flat, tgt = padded.view(-1, padded.size(-1)), targets.reshape(-1)
            if padded.dtype in (torch.bfloat16, torch.float16):  # float32 only per chunk, recomputed in backward
                loss = sum(torch.utils.checkpoint.checkpoint(_nll_sum, flat[r:r + CE_ROWS], tgt[r:r + CE_ROWS],
                                                             use_reentrant=False) for r in range(0, len(tgt), CE_ROWS))
            else:  # float32 / float64: one call (chunks would change the sum's rounding)
                loss = _nll_sum(flat, tgt)
            if reduction == "mean":
                loss = loss / (targets != -1).sum()
        return padded[..., :self.cfg.vocab_size], loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, stop_token=None):
        """Sample max_new_tokens continuing idx (B, T) with a decoding cache; returns (B, T + n).

        max_new_tokens: int >= 0; temperature, top_k: as in sample_next (temperature 0 = greedy,
        top_k None = all tokens, top_k > V keeps all V). A row that emitted stop_token has stopped:
        its later positions repeat stop_token (the batch stays rectangular), and generation ends
        when every row has stopped. Raises ValueError naming the argument for a value outside these
        ranges.
        """
        check_sampling(temperature, top_k, max_new_tokens)
        cache = {}
        logits, _ = self(idx, cache=cache)
        out = idx
        done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        for i in range(max_new_tokens):
            nxt = sample_next(logits[:, -1, :].float(), temperature, top_k)
            if stop_token is not None:
                nxt = torch.where(done[:, None], stop_token, nxt)  # a stopped row samples no more
                done |= nxt[:, 0] == stop_token
            out = torch.cat((out, nxt), dim=1)
            if (stop_token is not None and bool(done.all())) or i == max_new_tokens - 1:
                break  # (the last token is not fed: nothing reads its logits)
            logits, _ = self(nxt, cache=cache)
        return out


def host_values(x):
    """x with every tensor read back as a Python float (dicts and lists walked): a diagnostics
    record taken as device tensors, read when the host syncs anyway."""
    if isinstance(x, dict):
        return {k: host_values(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [host_values(v) for v in x]
    return float(x) if torch.is_tensor(x) else x


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
