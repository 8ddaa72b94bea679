"""Model registry, size tiers and width solving (MATH.md, "What every model shares"; the 70M and
160M tiers are the TANGO paper's, "TANGO: Treating Tokens as Operators", §3 "Models and optimization").

REGISTRY maps a --model name to its ModelSpec: the body constructor and everything the harness
needs to know about the model (width granularity, shared block, the model flags it reads with
their meaningful ranges, its MAC formula). build_model(cfg) wraps the body in the shared LM
(embedding, tied head, loss, generation); model_config(args) turns train.py's flags into a ModelConfig.

Adding a model (a checklist; tests/test_registry.py registers a toy model by it and runs train.py,
flops.py, the benchmark's plan and the sweep report over it; no other list of models exists to join,
tests/test_layout.py checks that)
  1. yourmodel.py: the body, an nn.Module with forward(x (B, T, d), cos, sin, cache) -> (B, T, d)
     (cache None in training, else a dict of its decoding state), and a constructor
     `def yourmodel(cfg) -> body` whose docstring gives the non-embedding parameter count and the
     source (paper title, arXiv id, section). Module attributes the harness reads, if they apply:
     `no_decay` (names of the class's own gain/scale parameters: no weight decay),
     `is_residual_out = True` on a Linear (smaller init), `init_constants()` and `own_init` (the
     documented initial values, checked by the tests), `rng_seed` (the seed of training draws, set
     per micro-batch) and `diagnostics(spectral, read)` on the body (logged per update; read=False
     returns device tensors, read later).
  2. models.py: a REGISTRY row `"yourmodel": ModelSpec(yourmodel.yourmodel, width_multiple=8,
     shared_block=..., flags={"your_flag": Range(lo, hi)}, macs=...)`. flags lists every model flag
     the body reads (the others are refused for --model yourmodel) with its meaningful values (and,
     as idle=, when another flag's value leaves it doing nothing, so a given value is refused);
     macs is a function (cfg, T) -> {"linear", "scores", "mix", "head", "total"} MACs of one length-T
     sequence by the convention of flops.py (the built-in models' formulas live there, by name);
     counted_macs where its fast path computes other MACs than the convention (see ModelSpec);
     min_depth where it needs more than one block application (three-set TANGO: 3).
     A new hyperparameter is one field of common.ModelConfig declared with common.flag(default,
     help): train.py's flag, flops.py's and the tools' come from it.
  3. MATH.md: its section (equations, source, choices); README.md: its row of the models table.
  4. tests: the float64 hand computation in tests/test_equations.py (HAND); the registry-wide tests
     (cached decoding equal to the full forward, fast path against reference, gradients, init,
     weight decay, parameter counts) pick the model up by themselves.
"""
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

import baselines
import depth_attention
import latent_recurrence
import parcae
import parallel_loops
import ponder
import tango
from common import LM, ModelConfig, UsageError


@dataclass(frozen=True)
class Range:
    """The meaningful values lo <= v of an integer model flag, and v <= hi(cfg) where hi is given:
    a function cfg -> (bound, what the bound is), e.g. lambda c: (c.n_embd, "the residual width d").
    idle: cfg -> why the flag does nothing at cfg's other flags, or None (check_idle_flags)."""
    lo: int
    hi: Callable = None
    idle: Callable = None

    def error(self, flag, v, cfg):
        """None if v is in range, else the one-line message naming --flag and the range."""
        if v < self.lo:
            return f"--{flag} {v}: must be >= {self.lo}"
        if self.hi is not None:
            bound, what = self.hi(cfg)
            if v > bound:
                return f"--{flag} {v}: must be <= {bound} ({what}) for --model {cfg.model}"
        return None


@dataclass(frozen=True)
class Choice:
    """A model flag that takes one of a few values (booleans, --fold_layout); idle as Range's."""
    values: tuple
    idle: Callable = None

    def error(self, flag, v, cfg):
        if v not in self.values:
            return f"--{flag} {v}: choose one of {', '.join(map(str, self.values))}"
        return None


@dataclass(frozen=True)
class ModelSpec:
    """What the harness knows about a registered model.

    build: cfg -> body (common.LM wraps it); width_multiple: granularity of the solved expansion
    width, an int or a function of cfg; shared_block: one block (unit, core) that can be applied
    any number of times (--eval_depths); flags: model flag -> Range/Choice of the flags the body
    reads (ModelConfig field = train.py flag); macs: (cfg, T) -> forward MAC dict (flops.py's
    convention) or the name of such a function in flops.py; None: no formula (flops raises);
    counted_macs: (cfg, T, macs dict) -> the MACs torch's FlopCounterMode counts in the fast path,
    without the vocabulary padding (or such a function's name in flops.py), where the fast path
    does other work than the convention (chunks, padding, a masked full product); None: the
    convention's total (flops.counter_expected_macs); paper_macs: the TANGO paper's §4.1 forward MACs
    of the model at 70M, K = 4, T = 8192 (flops.py prints its own beside it); paper_grid: one of the
    six models of the TANGO paper's §4.1 grid, whose claims the sweep report recomputes; bench_long:
    tools.bench --quick also times it at the long block size (T = 8192 on a GPU); min_depth: the
    smallest --depth it is built at and the smallest test-time depth (--eval_depths) it is run at."""
    build: Callable
    width_multiple: object = 8
    shared_block: bool = False
    flags: dict = field(default_factory=dict)
    macs: object = None
    counted_macs: object = None
    paper_macs: float = None
    paper_grid: bool = False
    bench_long: bool = False
    min_depth: int = 1


HEADS = lambda cfg: cfg.n_head  # TANGO splits its gated width into H groups (one per score head)
BOOL = Choice((False, True))
# Ranges: a rank or dimension above d adds parameters but no rank (--fold_rank 9999 would build 2.6M
# non-embedding parameters at the tiny tier's 400k); a block index past the last.
# Windows (--window, --chunk, --plt_window), LRT's subsets and --fold have no upper bound: above --block_size
# a window equals it in training, but it still bounds decoding past T, and the tier defaults exceed
# short runs' T; subsets beyond a sequence's slot rows are as many as its rows, at any length; a
# --fold past the loops puts all but the first (--fold_layout last: the last) in one stage, as the default
# 2 does at --depth 3.
_D = lambda c: (c.n_embd, "the residual width d; a larger one adds parameters, not rank")
_LAST_BLOCK = lambda c: (c.depth - 1, "the last block, --depth - 1")
_DEPTH = lambda c: (c.depth, "--depth; a larger value selects no other layer")
GAU_S = {"gau_s": Range(1, _D)}
RECURRENT = {"mu_rec": Range(0), "mu_bwd": Range(0), "n_prelude": Range(0), "n_core": Range(1), "n_coda": Range(0)}
# idle rules (check_idle_flags): the other flags' values at which a flag does nothing
NO_THOUGHTS = lambda c: "with --n_thoughts 0 (no thought slots to refine)" if c.n_thoughts == 0 else None
ONE_LAYER = lambda c: "at --depth 1 (no earlier layer to attend to)" if c.depth == 1 else None
ONE_LOOP = lambda c: "at --depth 1 (one loop: no loop >= 2 to gate or shift)" if c.depth == 1 else None
_STAGES = lambda c, layout: parallel_loops.fold_stages(c.depth, c.fold, layout)
_FOLDED = lambda c: any(len(s) > 1 for layout in ("first", "last") for s in _STAGES(c, layout))
NO_FOLD = lambda c: (None if _FOLDED(c) else f"at --depth {c.depth} --fold {c.fold} (no stage of two loops or "
                     "more: the loop stack)")
NO_FOLD_AT = lambda c: f"at --depth {c.depth} (loop 2 is a stage alone at any --fold)" if c.depth <= 2 else None
DEPTH_ATTN = {"da_stride": Range(-1, _DEPTH, idle=ONE_LAYER), "da_recent": Range(0, _DEPTH, idle=ONE_LAYER)}
LRT = {"lrt_src": Range(-1, _LAST_BLOCK), "lrt_tgt": Range(0, _LAST_BLOCK), "lrt_kv": BOOL, "lrt_subsets": Range(1)}
LOOPS = {"n_core": Range(1)}

# Width granularity: TANGO's gated width is a multiple of H. The feed-forward width of
# Transformer++ and GAU/FLASH's e have no head structure; there we use multiples of 8, because
# multiples of H cannot meet the paper's 0.20 % for every depth (untied Transformer++ at 70M,
# K = 8: the nearest multiples of 16 give -0.203 % / +0.24 %).
REGISTRY = {
    "tango": ModelSpec(tango.tango, HEADS, shared_block=True, macs="tango_macs", counted_macs="tango_counted_macs",
                       paper_macs=9.44e12, paper_grid=True, bench_long=True),
    "tango-windowed": ModelSpec(tango.tango_windowed, HEADS, shared_block=True, flags={"window": Range(1)},
                                macs="tango_windowed_macs", counted_macs="tango_windowed_counted_macs",
                                paper_macs=1.90e12, paper_grid=True, bench_long=True),
    # one application per gated-projection set at least: first, middle, last (tango.Tango.set_index)
    "tango-3set": ModelSpec(tango.tango_3set, HEADS, shared_block=True, macs="tango_macs",
                            counted_macs="tango_counted_macs", bench_long=True, min_depth=3),
    "loop": ModelSpec(baselines.loop_transformer, shared_block=True, macs="transformer_macs", paper_macs=1.94e12,
                      paper_grid=True, bench_long=True),
    "untied": ModelSpec(baselines.untied_transformer, macs="transformer_macs", paper_macs=0.85e12, paper_grid=True),
    "gau": ModelSpec(baselines.gau, shared_block=True, flags=GAU_S, macs="gau_macs", paper_grid=True),
    "flash": ModelSpec(baselines.flash, shared_block=True, flags={"chunk": Range(1), **GAU_S}, macs="flash_macs",
                       counted_macs="flash_counted_macs", paper_grid=True),
    "parcae": ModelSpec(parcae.parcae, HEADS, shared_block=True, flags=RECURRENT, macs="recurrent_forward_macs"),
    "rdm": ModelSpec(parcae.rdm, HEADS, shared_block=True, flags=RECURRENT, macs="recurrent_forward_macs"),
    "depth-attn": ModelSpec(depth_attention.depth_attn, flags=DEPTH_ATTN, macs="depth_attn_macs"),
    "loop-depth-attn": ModelSpec(depth_attention.loop_depth_attn, flags=DEPTH_ATTN, macs="depth_attn_macs"),
    "ponder": ModelSpec(ponder.ponder, flags={"n_thoughts": Range(0), "jacobi": Range(0, idle=NO_THOUGHTS),
                                              "jacobi_random": Choice((False, True), idle=NO_THOUGHTS)},
                        macs="ponder_forward_macs"),
    "lrt": ModelSpec(latent_recurrence.lrt, flags={**LRT, "lrt_detach_init": BOOL}, macs="lrt_forward_macs"),
    "lrt-think": ModelSpec(latent_recurrence.lrt_think, flags={**LRT, "n_thoughts": Range(0), "lrt_detach_init": BOOL},
                           macs="lrt_forward_macs"),
    "loopstack": ModelSpec(parallel_loops.loopstack, shared_block=True, flags=LOOPS, macs="parallel_loops_forward_macs"),
    "plt": ModelSpec(parallel_loops.plt, flags={**LOOPS, "plt_window": Range(1, idle=ONE_LOOP),
                                                "plt_shift": Choice((False, True), idle=ONE_LOOP)},
                     macs="parallel_loops_forward_macs", counted_macs="plt_counted_macs"),
    "loopfold": ModelSpec(parallel_loops.loopfold, flags={**LOOPS, "fold": Range(1, idle=NO_FOLD_AT),
                                                          "fold_rank": Range(0, _D, idle=NO_FOLD),
                                                          "fold_layout": Choice(("first", "last"), idle=NO_FOLD)},
                          macs="parallel_loops_forward_macs"),
}


def model_flags():
    """flag -> the models that read it (registry order), from the specs' flags; the order of the
    flags is that of their first reader. Every other model ignores the flag (train.py refuses it)."""
    out = {}
    for name, spec in REGISTRY.items():
        for flag in spec.flags:
            out.setdefault(flag, ())
            out[flag] += (name,)
    return out


def shared_block_models():
    """The models whose one block (unit, recurrent core) can be applied any number of times."""
    return tuple(name for name, spec in REGISTRY.items() if spec.shared_block)


# name -> (d, n_head, non-embedding parameter target N*). 70M/160M are the paper's tiers; "cpu"
# is this project's small tier (the default without a GPU) and "tiny" the one of the
# character-level reproduction grid (results/chargrid: 126 runs in about 1.5 hours on 2 cores),
# solved by the same rule.
TIERS = {
    "tiny": (64, 2, 400_000),
    "cpu": (128, 4, 1_000_000),
    "70M": (512, 16, 44_270_000),
    "160M": (768, 24, 121_400_000),
}

TOLERANCE = 0.002  # realized count within 0.20 % of the target (paper)


def spec_of(name) -> ModelSpec:
    """The ModelSpec of --model name; UsageError naming the choices for an unknown one."""
    if name not in REGISTRY:
        raise UsageError(f"--model: unknown model '{name}'; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def build_model(cfg: ModelConfig, device=None, **body_kwargs):
    """Instantiate cfg.model; raises UsageError for an unknown name or a depth below its min_depth."""
    spec = spec_of(cfg.model)
    if cfg.depth < spec.min_depth:
        raise UsageError(f"--depth {cfg.depth}: --model {cfg.model} needs depth >= {spec.min_depth}")
    if cfg.n_embd % 32 or cfg.n_head != cfg.n_embd // 32:
        raise UsageError(f"n_embd {cfg.n_embd} / n_head {cfg.n_head}: heads must have dimension 32")
    with torch.device(device or "cpu"):
        return LM(cfg, spec.build(cfg, **body_kwargs))


def check_flag_ranges(cfg: ModelConfig):
    """UsageError (one line naming the flag and its range) for a value of a flag cfg.model reads
    outside the range its ModelSpec declares."""
    for flag, allowed in spec_of(cfg.model).flags.items():
        msg = allowed.error(flag, getattr(cfg, flag), cfg)
        if msg:
            raise UsageError(msg)


def idle_flags(cfg):
    """{flag: why} of cfg.model's flags that do nothing at cfg's other flags (their ModelSpec entry's
    idle rule, e.g. --jacobi with --n_thoughts 0). cfg: a ModelConfig or train.py's parsed flags."""
    rules = spec_of(cfg.model).flags
    return {flag: why for flag in rules if rules[flag].idle and (why := rules[flag].idle(cfg))}


def check_idle_flags(cfg: ModelConfig, given):
    """UsageError for a model flag given explicitly (given: the names typed) that idle_flags finds
    idle at cfg: it would be silently ignored."""
    idle = idle_flags(cfg)
    for flag in sorted(set(given) & set(idle)):
        raise UsageError(f"--{flag}: does nothing for --model {cfg.model} {idle[flag]}; drop the flag")


def checkpoint_config(saved, where) -> ModelConfig:
    """The ModelConfig a checkpoint stores (saved: its "config" entry), held to what train.py's flags
    allow: its fields known, vocab_size, block_size and width ints >= 1, the model's own checks
    (build_model on the meta device) and its flag ranges (check_flag_ranges). UsageError
    "<where>: not a readable model config (...)" otherwise: a damaged or hand-edited file, so the
    message names the file, not a flag."""
    try:
        cfg = ModelConfig.from_dict(saved)
        for name in ("vocab_size", "block_size", "width"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} {v!r}: must be an int >= 1")
        build_model(cfg, device="meta")
        check_flag_ranges(cfg)
    except (TypeError, AttributeError, KeyError, ValueError, UsageError) as e:
        raise UsageError(f"{where}: not a readable model config ({e})") from None
    return cfg


def count_params(cfg: ModelConfig) -> int:
    """Non-embedding parameter count of cfg, from meta builds (no parameter memory) of at most 2
    AFFINE_FROM + 1 blocks per block count (BLOCK_COUNTS: --depth, --n_core, ...), or about twice a
    block index that needs more: each count above k is set to k, and to k + 1 one at a time, and the
    count is extrapolated along each. k is AFFINE_FROM, doubled until the model builds there
    (--lrt_tgt 5 needs 6 blocks: builds of 6 and 7). Exact: each model's count is affine in each
    block count from AFFINE_FROM on, without cross terms (test_registry); below it, stages and
    cross-loop terms appear (PLT, LoopFold; TANGO with three sets needs 3). A whole meta build of
    100,000 blocks takes minutes. Raises the model's UsageError (from the whole build when no k
    builds)."""
    counts = {f: getattr(cfg, f) for f in block_counts(cfg)}
    if max(counts.values()) <= 2 * AFFINE_FROM:
        return build_model(cfg, device="meta").num_params()  # as cheap as the builds at k and k + 1
    k = AFFINE_FROM
    while big := {f: v for f, v in counts.items() if v > k + 1}:  # k doubles until the model builds at k
        at = {f: k for f in big}
        try:
            base = build_model(_with(cfg, **at), device="meta").num_params()
            slopes = {f: build_model(_with(cfg, **{**at, f: k + 1}), device="meta").num_params() - base for f in big}
        except UsageError:
            k *= 2
            continue
        return base + sum((v - k) * slopes[f] for f, v in big.items())
    return build_model(cfg, device="meta").num_params()


def solve_width(cfg: ModelConfig, target: int, strict: bool = True) -> ModelConfig:
    """Return cfg with the expansion width (a multiple of width_multiple(cfg)) whose non-embedding
    count is closest to target. The count is affine in the width, so two evaluations give the slope.

    Raises UsageError when no width lands within 0.20 % of the target and strict is set (the
    paper tiers); the small tiny/cpu tiers are too coarse for that at large depth (untied K >= 8 moves
    in steps of ~1 %), so there train.py reports the error instead of failing.
    """
    m = width_multiple(cfg)
    c1 = count_params(_with(cfg, width=m))
    c2 = count_params(_with(cfg, width=2 * m))
    slope = (c2 - c1) / m  # parameters per unit of width
    guess = max(1, round((m + (target - c1) / slope) / m))
    best = min((k * m for k in range(max(1, guess - 2), guess + 3)),
               key=lambda w: abs(count_params(_with(cfg, width=w)) - target))
    out = _with(cfg, width=best)
    n = count_params(out)
    reason = mismatch_reason(out, n, target)  # "" within the tolerance
    if strict and reason:
        raise UsageError(f"--size: cannot reach {target:,} non-embedding parameters with {cfg.model} "
                         f"at d={cfg.n_embd}, depth {cfg.depth} (closest {n:,}, {n / target - 1:+.2%}: {reason})")
    return out


def mismatch_reason(cfg: ModelConfig, n: int, target: int) -> str:
    """Why cfg's solved width, with n non-embedding parameters, misses target by more than
    TOLERANCE ("" within it): the smallest width already has more (attention, norms and other
    parameters that do not scale with the width: untied Transformer++ at --size tiny --depth 64), or
    the width's steps are coarser than the tolerance."""
    if abs(n / target - 1) <= TOLERANCE:
        return ""
    if cfg.width == width_multiple(cfg) and n > target:
        larger = any(t > target for _, _, t in TIERS.values())
        return (f"the smallest width ({cfg.width}) already has {n:,}: the parameters that do not scale with "
                "the width exceed the target (give " + ("a larger --size, or " if larger else "") + "fewer blocks)")
    return "the width's steps are coarser than 0.20 % at this tier and depth"


def width_multiple(cfg: ModelConfig) -> int:
    """The granularity of the solved width: the spec's width_multiple (TANGO, Parcae, RDM: n_head)."""
    m = spec_of(cfg.model).width_multiple
    return m(cfg) if callable(m) else m


def flags_config(args, vocab_size) -> ModelConfig:
    """The ModelConfig of train.py's flags before its width is set (ModelConfig's default)."""
    d, H, _ = TIERS[args.size]
    return ModelConfig(model=args.model, vocab_size=vocab_size, block_size=args.block_size, n_embd=d, n_head=H,
                       depth=args.depth, **{flag: getattr(args, flag) for flag in model_flags()})


AFFINE_FROM = 3  # every registered model's count is affine in each block count from here on (test_registry)
BLOCK_COUNTS = ("depth", "n_prelude", "n_core", "n_coda")  # the flags that add blocks (count_params)


def block_counts(cfg) -> tuple:
    """The block counts (BLOCK_COUNTS) that cfg.model reads (cfg: a ModelConfig or train.py's
    flags): --depth, and Parcae's, RDM's and the loop stacks' blocks per stage."""
    return tuple(f for f in BLOCK_COUNTS if f == "depth" or f in spec_of(cfg.model).flags)


def params_lower_bound(cfg: ModelConfig, width: int) -> int:
    """At most the non-embedding parameters of cfg (flags_config's, before its width is set) with
    --width `width` (0: solved), without solving the width: the count at `width`, or at the smallest
    width (the count grows with the width). Checked as model_config checks them, --width first, the
    model's own checks (count_params's builds) before the ranges (UsageError: --width off its
    granularity, a flag outside its range)."""
    check_width(cfg, width)
    n = count_params(_with(cfg, width=width or width_multiple(cfg)))
    check_flag_ranges(cfg)  # (--gau_s 320000000 builds: its range error, not a count from it)
    return n


def check_width(cfg, width):
    """UsageError unless --width (0: solved) is a positive multiple of the model's granularity."""
    m = width_multiple(cfg)
    if width and (width < 0 or width % m):
        raise UsageError(f"--width {width}: must be a positive multiple of {m} for --model {cfg.model} "
                         "(0: solve it to the tier's parameter target)")


def model_config(args, vocab_size):
    """The ModelConfig of train.py's flags (args: its parsed, resolved flags), its width solved
    to the tier's parameter target (or --width, taken as given: equal block shape instead of
    equal parameters); returns (config, target non-embedding parameter count). UsageError for a
    --width that is not a positive multiple of the model's width granularity, a value the model
    rejects, or a model flag outside its declared range (check_flag_ranges)."""
    cfg, target = flags_config(args, vocab_size), TIERS[args.size][2]
    if args.width:
        check_width(cfg, args.width)
        cfg = replace(cfg, width=args.width)
        count_params(cfg)  # the model's own checks first, as solve_width's builds do
    else:
        cfg = solve_width(cfg, target, strict=args.size not in ("tiny", "cpu"))
    check_flag_ranges(cfg)
    return cfg, target


def _with(cfg, **kw):
    d = cfg.to_dict()
    d.update(kw)
    return ModelConfig(**d)
