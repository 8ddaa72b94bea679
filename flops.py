"""Analytical forward cost and training FLOPs (MATH.md, "Cost").

Units: forward_macs counts multiply-accumulates (MACs) for ONE sequence of length T (batch 1);
1 MAC = 2 FLOPs. Convention (MATH.md, "Cost"; it reproduces the MAC figures of "TANGO: Treating
Tokens as Operators", §4.1): every score matrix is a full product (no causal halving),
every linear map costs (its parameters) x (tokens) at each application, plus the tied head V d T.

    linear = sum over the K applications of the matrix parameters applied there, times T
    head   = V d T
    scores / mix per application (W = min(window, T), C = min(chunk, T)):
      tango, tango-3set   scores T^2 d           mix (gate averaging) T^2 F
      tango-windowed      scores T W d           mix T W F
      loop, untied        scores (QK^T) T^2 d    mix (AV) T^2 d
      (loop-)depth-attn   as loop/untied, plus (|C(l)| + 1) T d each for depth scores and mixing
      ponder              Transformer++ over every pass's S_p T slot rows (see the section below)
      lrt, lrt-think      two Transformer++ passes over the S slot rows plus the memory maps (section below)
      gau                 scores T^2 s           mix (AV) T^2 e
      flash               scores T C s           mix T C e (local) + 2 T s e (global: K_l^T V
                                                 per chunk, then Q_l times the prefix sum;
                                                 counted only when T > chunk, else FLASH = GAU)

Matrix parameters per application: TANGO 2d^2 + 3dF (3-set: the one set in use, F = F3),
Transformer++ 4d^2 + 3dF, GAU/FLASH 3de + ds (e = cfg.width, s = cfg.gau_s). Elementwise gains
(norms, tau, b, GAU scale-offsets) are not MACs and are left out; a count of N* (which includes
them) x T K would differ by (2d + 2H) / N* = 2.4e-5 at the 70M tier, so the check values are the
same either way. Windowed TANGO's one summary source per query (T K (d + F)
elementwise work, 1/W of the window) is left out, as in the convention's T W (d + F).

Each model's formula is the function of this file that its registry row names (models.py,
ModelSpec.macs: tango_macs, transformer_macs, ..., recurrent_forward_macs); forward_macs looks it up.

counter_expected_macs gives what torch.utils.flop_counter.FlopCounterMode / 2 reports for one
forward of the default ("fast") implementation; it differs from the convention only by padding,
spelled out there. train_flops = 3 x forward x 2 FLOPs/MAC (backward ~ 2 x forward): 6 N D style.

CLI: python flops.py --size 70M --depth 4 --block_size 8192 [--vocab_size 50257] [--window W --chunk C ...]
     (each model as train.py builds it: its model flags, --window/--chunk/--gau_s/--block_size the tier's by default)
     python -m tools.flops_fit RUN_DIR [RUN_DIR ...] [--law all|depth|training|unified]   (Parcae's fits)

Parcae / RDM (MATH.md, "Parcae and RDM"): forward MACs at cfg.depth recurrences
(recurrent_forward_macs), unrolled parameter counts, effective training FLOPs (2 N1 + 6 N2) D, and
the scaling-law fits of "Parcae: Scaling Laws For Stable Looped Language Models" (arXiv 2604.12946,
§5.2 training law, §5.3 test-time and unified laws) in tools/flops_fit.py.
"""
import argparse
import math
import sys

import models
from common import VOCAB_MULTIPLE, ModelConfig, UsageError, flag_fields
from harness.cli import ExitParser, add_flags, run_command
from tango_kernels import ATTN_CHUNK, QK_PAD, WINDOW_CHUNK  # fast-path q/k width (32 score dims + null dim, padded to 40), chunks

# The TANGO paper's §4.1 figures: forward MACs, GPT-2 vocabulary, 70M tier, K = 4, T = 8192, W = 256.
PAPER_MACS = {name: spec.paper_macs for name, spec in models.REGISTRY.items() if spec.paper_macs}  # the registry's


def _gau_dims(cfg):
    return cfg.width, getattr(cfg, "gau_s", 128), getattr(cfg, "chunk", 256)  # e, s, C


def _blocks(cfg: ModelConfig, T: int, params, scores, mix) -> dict:
    """The convention's dict for K applications of one block with `params` matrix parameters and
    `scores` / `mix` MACs per application at length T, plus the tied head."""
    K = cfg.depth
    out = {"linear": params * T * K, "scores": scores * K, "mix": mix * K, "head": cfg.vocab_size * cfg.n_embd * T}
    out["total"] = sum(out.values())
    return out


def tango_macs(cfg: ModelConfig, T: int) -> dict:
    """TANGO and TANGO 3-set (one set in use per application): 2d^2 + 3dF, scores T^2 d, mix T^2 F."""
    d, F = cfg.n_embd, cfg.width
    return _blocks(cfg, T, 2 * d * d + 3 * d * F, T * T * d, T * T * F)


def tango_windowed_macs(cfg: ModelConfig, T: int) -> dict:
    """Windowed TANGO, W = min(window, T): 2d^2 + 3dF, scores T W d, mix T W F."""
    d, F, W = cfg.n_embd, cfg.width, min(cfg.window, T)
    return _blocks(cfg, T, 2 * d * d + 3 * d * F, T * W * d, T * W * F)


def transformer_macs(cfg: ModelConfig, T: int) -> dict:
    """Loop and untied Transformer++: 4d^2 + 3dF, scores (QK^T) T^2 d, mix (AV) T^2 d."""
    d, F = cfg.n_embd, cfg.width
    return _blocks(cfg, T, 4 * d * d + 3 * d * F, T * T * d, T * T * d)


def gau_macs(cfg: ModelConfig, T: int) -> dict:
    """GAU: 3de + ds, scores T^2 s, mix (AV) T^2 e."""
    e, s, _ = _gau_dims(cfg)
    return _blocks(cfg, T, 3 * cfg.n_embd * e + cfg.n_embd * s, T * T * s, T * T * e)


def flash_macs(cfg: ModelConfig, T: int) -> dict:
    """FLASH: 3de + ds, scores T C s, mix T C e (local) + 2 T s e (global, only when T > C)."""
    e, s, C = _gau_dims(cfg)
    glob = 2 * T * s * e if T > C else 0
    return _blocks(cfg, T, 3 * cfg.n_embd * e + cfg.n_embd * s, T * min(C, T) * s, T * min(C, T) * e + glob)


def forward_macs(cfg: ModelConfig, T: int) -> dict:
    """Forward MACs of one sequence of length T by the convention above: {"linear", "scores", "mix",
    "head", "total"}, by the MAC formula the model's registry row names (models.ModelSpec.macs).
    UsageError for a model without one."""
    formula = models.spec_of(cfg.model).macs
    if formula is None:
        raise UsageError(f"flops: no MAC formula for model '{cfg.model}'")
    return (formula if callable(formula) else globals()[formula])(cfg, T)


def counter_expected_macs(cfg: ModelConfig, T: int) -> int:
    """MACs that FlopCounterMode / 2 reports for one batch-1 forward of the fast implementation.

    The counter sees only matmuls (aten.mm/bmm; TANGO's fast paths also write chunks with the
    in-place baddbmm_/addmm_, which need a custom_mapping, tests/test_flops.py); norms, RoPE,
    softmax, cumsum and elementwise products are not counted. Run it with SDPA pinned to the math backend
    (torch.nn.attention.sdpa_kernel(SDPBackend.MATH)): there SDPA is two bmm's counted as full
    L x S products even when causal, so Transformer++ and GAU equal the convention. (On CPU the
    fused flash kernel has no FlopCounterMode formula in torch 2.13 and counts 0.) The
    differences, all from padding:
      every model: the head multiplies by the padded embedding, ceil(V/64) 64 rows
        (common.VOCAB_MULTIPLE), so (Vp - V) d T more head MACs.
      tango, tango-3set: one causal attention over [null key, T keys] with 40-dim padded
        queries/keys, by chunks of C = tango_kernels.ATTN_CHUNK queries [r0, r1), each scoring
        the null key and keys j < r1: sum over chunks of (r1 - r0) (r1 + 1) (40 H + F) per
        application (T (T+1) (40 H + F) when T <= C).
      tango-windowed: each chunk of C = tango_kernels.WINDOW_CHUNK queries [r0, r1) scores the keys
        [max(r0 - W, 0), r1) and averages their gates: sum over chunks of (r1 - r0) (r1 - lo) (d + F)
        per application (window, old sources in the slice, and the masked future of the chunk).
      flash (T > C): T padded to Tp = ceil(T/C) C; local Tp C (s + e), global 2 Tp s e
        (K_l^T V per chunk, Q_l times the prefix state). T <= C: one unpadded chunk, T^2 (s + e).
      plt: the G-SWA window attention is SDPA over all T keys under a band mask: T^2 d scores and
        T^2 d mix instead of T min(W, T) d each, per block of every loop >= 2.
    """
    full = forward_macs(cfg, T)
    vocab_pad = (-cfg.vocab_size % VOCAB_MULTIPLE) * cfg.n_embd * T
    fast = models.spec_of(cfg.model).counted_macs  # the fast path's own count, where it differs (its registry row)
    if fast is None:  # loop, untied, gau, depth-attn, ponder, lrt, loopstack, loopfold: the convention
        return full["total"] + vocab_pad
    return (fast if callable(fast) else globals()[fast])(cfg, T, full) + vocab_pad


def tango_counted_macs(cfg: ModelConfig, T: int, full: dict) -> int:
    """counter_expected_macs of TANGO's chunked CPU path (without the vocabulary padding)."""
    K, F, H = cfg.depth, cfg.width, cfg.n_head
    return full["linear"] + full["head"] + K * (QK_PAD * H + F) * sum(
        (min(r0 + ATTN_CHUNK, T) - r0) * (min(r0 + ATTN_CHUNK, T) + 1) for r0 in range(0, T, ATTN_CHUNK))


def tango_windowed_counted_macs(cfg: ModelConfig, T: int, full: dict) -> int:
    """counter_expected_macs of Windowed TANGO's chunked CPU path (without the vocabulary padding)."""
    K, d, F, C = cfg.depth, cfg.n_embd, cfg.width, WINDOW_CHUNK
    return full["linear"] + full["head"] + K * (d + F) * sum(
        (min(r0 + C, T) - r0) * (min(r0 + C, T) - max(r0 - cfg.window, 0)) for r0 in range(0, T, C))


def flash_counted_macs(cfg: ModelConfig, T: int, full: dict) -> int:
    """counter_expected_macs of FLASH's chunked path (without the vocabulary padding)."""
    e, s, C = _gau_dims(cfg)
    n = C if T > C else T  # flash_chunked: a single chunk is left unpadded
    Tp = math.ceil(T / n) * n
    return full["linear"] + full["head"] + cfg.depth * (Tp * n * (s + e) + (2 * Tp * s * e if T > C else 0))


def plt_counted_macs(cfg: ModelConfig, T: int, full: dict) -> int:
    """counter_expected_macs of PLT (without the vocabulary padding): the window attention is a
    full T x T product under a band mask."""
    W = min(cfg.plt_window, T)
    return full["total"] + 2 * (cfg.depth - 1) * cfg.n_core * T * (T - W) * cfg.n_embd


def train_flops(cfg: ModelConfig, T: int, tokens: float) -> float:
    """Training FLOPs for `tokens` tokens in length-T sequences: 3 x forward (backward ~ 2 x
    forward) x 2 FLOPs per MAC, i.e. 6 x MACs per token x tokens (the 6 N D rule, attention added)."""
    return 6.0 * forward_macs(cfg, T)["total"] * tokens / T


def parcae_effective_flops(N1: float, N2: float, D: float) -> float:
    """Parcae-style effective training FLOPs C = (2 N1 + 6 N2) D (MATH.md, "Cost"): N1 unrolled
    parameters run without gradients (forward only), N2 those backpropagated through; D tokens."""
    return (2.0 * N1 + 6.0 * N2) * D


# ============================================================================= the model train.py builds
# This CLI, tools.bench and tools.bench decode build their models from train.py's own flags and
# resolution (its "model" flag group, harness.config.TIER_DEFAULTS, models.model_config), so a
# model there is the one `train.py` builds for the same --model/--size/--depth/--block_size.

def train_model_flags():
    """The names of train.py's model flags a tool passes on: --width and every registry model flag
    (models.model_flags(): --window, --chunk, --gau_s, --n_core, ...)."""
    return ("width", *models.model_flags())


def add_train_model_flags(p):
    """Declare train.py's model flags (train_model_flags) on parser p as common.ModelConfig declares
    them (type, help, default; the tier's for --window, --chunk and --gau_s). An unset flag stays out
    of the parsed namespace, so given_train_flags tells the flags given from the defaults."""
    from harness.config import WIDTH_HELP, tier_default
    g = p.add_argument_group("train.py's model flags")
    g.add_argument("--width", type=int, default=argparse.SUPPRESS, help=WIDTH_HELP)
    add_flags(g.add_argument, ModelConfig, tier_default, defaults=False)


def given_train_flags(a):
    """{flag: value} of the train.py model flags given on a command line parsed with add_train_model_flags."""
    return {f: getattr(a, f) for f in train_model_flags() if hasattr(a, f)}


def flag_defaults():
    """{flag: train.py's default} of every model flag (train_model_flags; None: the tier's)."""
    return {"width": 0, **{f.name: None if f.metadata["tier"] else f.default for f in flag_fields(ModelConfig)}}


def train_flags(size, given=None):
    """{flag: value} of every train.py model flag (train_model_flags) at tier `size`: the `given`
    value, else train.py's default, resolved from the tier where that is unset (--window, --chunk,
    --gau_s: harness.config.TIER_DEFAULTS, as harness.config.resolve_args does)."""
    from harness.config import TIER_DEFAULTS
    flags = {**flag_defaults(), **(given or {})}
    for k, v in TIER_DEFAULTS[size].items():
        if k in flags and flags[k] is None:
            flags[k] = v
    return {f: flags[f] for f in train_model_flags()}


def train_config(model, size, depth, block_size, vocab_size, flags):
    """(ModelConfig, non-embedding parameter target) of the model `python train.py --model MODEL
    --size SIZE --depth DEPTH --block_size T` builds with the model flags `flags` (train_flags's
    dict) on a vocabulary of vocab_size (models.model_config: the width solved to the tier's
    target unless flags["width"]). UsageError for a value train.py refuses."""
    args = argparse.Namespace(model=model, size=size, depth=depth, block_size=block_size, **flags)
    return models.model_config(args, vocab_size)


def unread_flags_error(given, names):
    """The one-line error for a model flag in `given` that none of the models `names` reads (it
    would be silently ignored), else None."""
    users = models.model_flags()
    for flag in sorted(set(given) & set(users)):
        if not set(users[flag]) & set(names):
            return (f"--{flag}: only used with --model {', '.join(users[flag])}; none of the models run "
                    f"({', '.join(names)}) reads it (drop the flag)")
    return None


def flags_text(flags, names):
    """"train.py's model flags --window 64 --gau_s 128 --chunk 64" (for a header): the model flags
    the models `names` read whose value comes from the tier or differs from train.py's default, and
    --width when set."""
    defaults = flag_defaults()
    read = {"width"} | {f for n in names for f in models.spec_of(n).flags}
    shown = [f for f in train_model_flags() if f in read and (defaults[f] is None or flags[f] != defaults[f])]
    return ("train.py's model flags " + " ".join(f"--{f} {flags[f]}" for f in shown) if shown
            else "train.py's default model flags")


PAPER_SETTING = {"size": "70M", "depth": 4, "block_size": 8192, "vocab_size": 50257}  # and train.py's model flags


def _parse(argv):
    from harness.config import TIER_DEFAULTS, tier_default
    p = ExitParser(prog="flops.py", description="Analytical forward MACs per sequence (MATH.md, \"Cost\") of the "
                   "models train.py builds. Parcae's scaling-law fits to run logs: python -m tools.flops_fit RUN [RUN ...].")
    p.add_argument("--size", default="70M", help=f"parameter tier: {', '.join(models.TIERS)}")
    p.add_argument("--depth", type=int, default=4, help="block applications K (>= 1)")
    p.add_argument("--block_size", type=int, help="sequence length T (>= 1); " + tier_default("block_size"))
    p.add_argument("--vocab_size", type=int, default=50257, help="vocabulary V (>= 1); GPT-2's, train.py's "
                   "except at --size cpu, where it is the dataset's characters (416 for stdlib)")
    add_train_model_flags(p)
    a = p.parse_args(argv)
    if a.size not in models.TIERS:
        p.error(f"--size {a.size}: choose one of {', '.join(models.TIERS)}")
    if a.block_size is None:
        a.block_size = TIER_DEFAULTS[a.size]["block_size"]
    for flag in ("depth", "block_size", "vocab_size"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} {getattr(a, flag)}: must be >= 1")
    given = given_train_flags(a)
    a.flags = train_flags(a.size, given)
    a.configs = {}  # model -> its ModelConfig, or the UsageError train.py would stop with
    for name in models.REGISTRY:
        try:
            a.configs[name] = train_config(name, a.size, a.depth, a.block_size, a.vocab_size, a.flags)[0]
        except UsageError as e:
            if str(e).startswith(tuple(f"--{f} " for f in given)):  # a value given is wrong, not this model's choice
                p.error(str(e).replace(f" for --model {name}", f" for {name}, one of the models flops.py computes"))
            a.configs[name] = e  # e.g. three sets need K >= 3: a skipped row
    return a


def _sci(x):
    return f"{x:.2e}".replace("e+", "e")  # 9.44e12


def main(argv=None):
    """Print one row per registered model as train.py builds it (flops.train_config): width,
    non-embedding params, forward MACs, and at the paper's setting (70M, K=4, T=8192, V=50257,
    train.py's model flags, so W=256) the TANGO paper's §4.1 figure and the difference. A model
    train.py would refuse at these flags is a "skipped" row saying why; a value given that a model
    refuses (--gau_s 16, --width 100 for a width granularity of 8, ...) is a one-line error, exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    a = _parse(argv)
    d, H, target = models.TIERS[a.size]
    paper = {k: getattr(a, k) for k in PAPER_SETTING} == PAPER_SETTING and a.flags == train_flags(a.size)
    print(f"forward MACs per sequence (MATH.md, Cost): tier {a.size} (d={d}, N*={target:,}), K={a.depth}, "
          f"T={a.block_size}, V={a.vocab_size}, {flags_text(a.flags, models.REGISTRY)}")
    print(f"{'model':<16}{'width':>7}{'non-emb params':>16}{'fwd MACs':>10}" + (f"{'paper':>10}{'diff':>9}" if paper else ""))
    for name, cfg in a.configs.items():
        if isinstance(cfg, UsageError):
            print(f"{name:<16}  skipped: {cfg}")
            continue
        macs = forward_macs(cfg, a.block_size)["total"]
        row = f"{name:<16}{cfg.width:>7} {models.count_params(cfg):>15,} {_sci(macs):>9}"  # a space at any size
        if paper and name in PAPER_MACS:
            row += f"{_sci(PAPER_MACS[name]):>10}{macs / PAPER_MACS[name] - 1:>+9.2%}"
        print(row)
    return 0


# ============================================================================= Depth-Attention, PonderLM-2
# Depth-Attention (depth_attention.py): Transformer++ plus, in each layer l with candidates C(l)
# non-empty, (|C(l)| + 1) d MACs per token for the depth scores <q, k^j> and as many for mixing
# the values (counted in "scores" and "mix"; both are batched matmuls, so the counter sees them).
# PonderLM-2 (ponder.py): the training forward / prefill runs the bootstrap passes b = 1..n (b slots
# per token), N = cfg.jacobi refinements and a final pass (n + 1 slots each); every pass is a
# Transformer++ forward over S_p T slot rows: linear S_p T K (4d^2 + 3dF), scores and mix
# (S_p T)^2 d K each. Only the T last slots reach the head. (Training with jacobi_random draws
# N in {2, 3}: 2.5 on average, against cfg.jacobi = 3 here.)

def depth_attn_macs(cfg: ModelConfig, T: int) -> dict:
    """(Loop) Depth-Attention: Transformer++ plus depth_extra_macs in both scores and mix."""
    out = transformer_macs(cfg, T)
    extra = depth_extra_macs(cfg, T)
    out["scores"] += extra
    out["mix"] += extra
    out["total"] += 2 * extra
    return out


def depth_extra_macs(cfg: ModelConfig, T: int) -> int:
    """Depth-Attention's depth-score MACs (= its depth-mix MACs) of one length-T forward:
    T d sum over layers l with C(l) non-empty of (|C(l)| + 1). In closed form (any --depth at once):
    |C(l)| = a(max(0, l - r)) + min(r, l), a(m) = ceil(m / s) multiples of the stride s below m (0
    without a stride rule), as the r recent layers [l - r, l) hold a(l) - a(l - r) of those below l;
    C(0) is empty, and so is every C(l) without a stride rule and r = 0 (depth_attention.candidates)."""
    L, r = cfg.depth, cfg.da_recent
    s = cfg.da_stride if cfg.da_stride != 0 else L // 2  # (the model's default: floor(K/2))
    if L < 2 or (s < 0 and r == 0):
        return 0

    def floor_sum(n):  # sum of floor(t / s) over t = 0..n
        q, rem = divmod(n + 1, s)
        return s * q * (q - 1) // 2 + q * rem

    m = L - 1 - r  # sum over l = 1..L-1 of a(l - r) = sum over m' = 0..m of ceil(m' / s)
    strided = floor_sum(m + s - 1) if s >= 0 and m >= 0 else 0
    k = min(r, L - 1)
    recent = k * (k + 1) // 2 + (L - 1 - k) * r  # sum over l = 1..L-1 of min(r, l)
    return T * cfg.n_embd * (strided + recent + L - 1)


def ponder_slots(cfg: ModelConfig) -> list:
    """Slots per token of each pass of a PonderLM-2 forward (bootstrap, refinements, final)."""
    n = cfg.n_thoughts
    return list(range(1, n + 1)) + [n + 1] * (cfg.jacobi + 1) if n > 0 else [1]


def ponder_forward_macs(cfg: ModelConfig, T: int) -> dict:
    """Forward MACs (MATH.md, Cost) of PonderLM-2 at N = cfg.jacobi (same keys as forward_macs)."""
    d, F, K = cfg.n_embd, cfg.width, cfg.depth
    S = ponder_slots(cfg)
    out = {"linear": sum(S) * T * K * (4 * d * d + 3 * d * F), "scores": sum(s * s for s in S) * T * T * d * K,
           "mix": sum(s * s for s in S) * T * T * d * K, "head": cfg.vocab_size * d * T}
    out["total"] = sum(out.values())
    return out


# ============================================================================= ReFlux (reflux.py)
# ReFlux is a tool over a frozen Transformer++ checkpoint, not a registry row. sync, stream2 and the
# recirculation baseline run the body twice (a record traversal, then the injected one, which
# reflux.py starts at the lowest target block: the blocks below it see no write) and the head once;
# stream runs it once (its full-sequence protocol is the per-token recurrence, counted with the
# same full T x T score convention). The write costs, per position, 3 d per open edge (||p||,
# the rescale to ||h||, the accumulation) and 4 d per written target (||h||, beta h, ||h'||, the
# norm restore); the router d r + r |E| per block of w tokens plus d per token (its RMSNorm summary).

REFLUX_TRAVERSALS = {"base": 1, "sync": 2, "stream2": 2, "stream": 1, "recirc": 2}


def reflux_forward_macs(cfg: ModelConfig, T: int, schedule: str, edges: int = 1, targets: int = 1,
                        router=None, low: int = 0) -> dict:
    """Forward MACs of one length-T sequence under a ReFlux schedule (MATH.md, "ReFlux"):
    {"traversals", "body", "head", "write", "router", "total", "ratio"} with ratio = total / the
    base forward. edges, targets: open edges and written target blocks per position; router: None
    or (r, n_candidates, w); low: the lowest target block (reflux.py's injected traversal of the
    two-pass schedules starts there, the K - low blocks above it; 0 = the full 2x). Raises
    UsageError for an unknown schedule."""
    if schedule not in REFLUX_TRAVERSALS:
        raise UsageError(f"flops: unknown ReFlux schedule '{schedule}'; choose one of {', '.join(REFLUX_TRAVERSALS)}")
    base = forward_macs(cfg, T)
    n = REFLUX_TRAVERSALS[schedule]
    d, K = cfg.n_embd, cfg.depth
    body = base["total"] - base["head"]
    body = body if n == 1 else body + body * (K - low) // K
    out = {"traversals": n, "body": body, "head": base["head"],
           "write": 0 if schedule == "base" else T * d * (3 * edges + 4 * targets), "router": 0}
    if router is not None and schedule != "base":
        r, n_cand, w = router
        out["router"] = math.ceil(T / w) * (d * r + r * n_cand) + T * d
    out["total"] = out["body"] + out["head"] + out["write"] + out["router"]
    out["ratio"] = out["total"] / base["total"]
    return out


# ============================================================================= LRT, LRT with thought tokens
# LRT (latent_recurrence.py): S = (n + 1) T slot rows (n = cfg.n_thoughts for lrt-think, 0 for
# lrt). The init pass runs Transformer++ over all S rows, but for the last block's attention and MLP
# (only its keys and values are read; unless that block is the memory's source); the k refinement
# passes together run it once more over every row, each subset's n_j queries scoring all S buffered keys (a full n_j x S
# product: sum_j n_j S = S^2). The memory map W_m (d^2) is applied once per refined row; with
# lrt_kv, W_km and W_vm (2 d^2) too, and every row's private key/value costs d more score and d more
# mix MACs per block in both passes. Only the T scored rows reach the head.

def lrt_forward_macs(cfg: ModelConfig, T: int) -> dict:
    """Forward MACs (MATH.md, Cost) of LRT / LRT with thought tokens (same keys as forward_macs), with
    A = 2K - 1 block attentions (2K when the last block is the memory's source, K <= 3 by default):
    linear 2 S K (4d^2 + 3dF) - (2K - A) S (d^2 + 3dF) + S d^2 (+ 2 S d^2), scores = mix = A S^2 d
    (+ A S d), head V d T."""
    from latent_recurrence import source_block
    d, F, K = cfg.n_embd, cfg.width, cfg.depth
    S = (cfg.n_thoughts + 1 if cfg.model == "lrt-think" else 1) * T
    kv = 1 if cfg.lrt_kv else 0
    A = 2 * K - (source_block(cfg) != K - 1)  # block attentions: the init pass skips its last unless it is the source
    out = {"linear": 2 * S * K * (4 * d * d + 3 * d * F) - (2 * K - A) * S * (d * d + 3 * d * F)
           + (1 + 2 * kv) * S * d * d,
           "scores": A * S * S * d + kv * A * S * d, "mix": A * S * S * d + kv * A * S * d,
           "head": cfg.vocab_size * d * T}
    out["total"] = sum(out.values())
    return out


def lrt_decode_macs(cfg: ModelConfig, L: int) -> int:
    """Forward MACs of decoding one token of LRT / LRT with thought tokens after L cached slots:
    n + 1 single-slot passes (n = 0 for lrt), each K (4d^2 + 3dF) + d^2 (+ 2 d^2) linear and
    2 (L' + 1) d K attention over its L' earlier slots (+ 2 d K with lrt_kv), plus the head V d."""
    d, F, K = cfg.n_embd, cfg.width, cfg.depth
    slots = cfg.n_thoughts + 1 if cfg.model == "lrt-think" else 1
    kv = 1 if cfg.lrt_kv else 0
    per = K * (4 * d * d + 3 * d * F) + (1 + 2 * kv) * d * d + 2 * kv * d * K
    return sum(per + 2 * (L + s + 1) * d * K for s in range(slots)) + cfg.vocab_size * d


# ============================================================================= parallel loops
# loopstack / PLT / LoopFold (parallel_loops.py; MATH.md, "Parallel loops"): N = cfg.depth loops of the n_core
# Transformer++ blocks, N n_core block applications (4d^2 + 3dF per row, T^2 d scores and mix).
# PLT, in every block of loops >= 2: the gate w . q (d MACs per row), global attention over loop 1's
# keys (T^2 d scores and mix) and window attention over the loop's own (T min(W, T) d each).
# LoopFold: each of the N - S predicted rows costs the predictor 2 d r and its correction 2 d r.

def parallel_loops_forward_macs(cfg: ModelConfig, T: int) -> dict:
    """Forward MACs (the convention above) of loopstack, PLT or LoopFold (same keys as forward_macs)."""
    d, F, N, n = cfg.n_embd, cfg.width, cfg.depth, cfg.n_core
    apps = N * n
    out = {"linear": apps * (4 * d * d + 3 * d * F) * T, "scores": apps * T * T * d, "mix": apps * T * T * d,
           "head": cfg.vocab_size * d * T}
    if cfg.model == "plt":
        extra = (N - 1) * n * T * min(cfg.plt_window, T) * d  # window attention of loops >= 2
        out["linear"] += (N - 1) * n * d * T                  # the gates
        out["scores"] += extra
        out["mix"] += extra
    if cfg.model == "loopfold":
        r = cfg.fold_rank or d // 4
        predicted = N - (1 + -(-(N - 1) // cfg.fold))  # S = 1 + ceil((N - 1) / f) stages (parallel_loops.fold_stages)
        out["linear"] += predicted * 4 * d * r * T
    out["total"] = sum(out.values())
    return out


# ============================================================================= Parcae / RDM
# Looped models (MATH.md, "Parcae and RDM"): prelude (L_P blocks) -> core (L_R blocks) applied K = cfg.depth times
# (the evaluation recurrence) -> coda (L_C blocks), all Transformer++ / sandwich blocks with
# 4d^2 + 3dF matrix parameters and full T^2 d score and mix MACs per block application. Parcae
# computes B e once and C h once (2 d^2 per token); RDM applies its adapter W: 2d -> d at every
# recurrence (2 d^2 per token per recurrence).

RECURRENT_MODELS = models.model_flags()["n_prelude"]  # prelude -> core -> coda: the models that read --n_prelude

# models whose step is not 3x the forward (tests/test_flops.py counts it) at their default flags, so
# train_flops and MFU are nominal; train_flops_nominal(cfg) decides for a config's own flags
TRAIN_FLOPS_NOMINAL = {
    **dict.fromkeys(RECURRENT_MODELS, "a training step runs a random number of recurrences (the batch's "
                                      "largest Poisson draw), with truncated backprop"),
    "ponder": "training draws N in {2, 3} Jacobi refinements (--jacobi_random), the formula counts --jacobi",
}
LRT_DETACHED = "its init pass runs without gradients (--lrt_detach_init), so a step runs less than 3 forwards"


def train_flops_nominal(cfg: ModelConfig):
    """Why train_flops(cfg) is a nominal cost and not the work a training step of cfg runs (so its
    MFU is not comparable with other models'), or None when a step is 3 forwards' work."""
    if cfg.model == "ponder":  # (no thought slots: nothing is refined, the untied Transformer++)
        return TRAIN_FLOPS_NOMINAL["ponder"] if cfg.jacobi_random and cfg.n_thoughts > 0 else None
    if cfg.model in models.model_flags()["lrt_detach_init"] and cfg.lrt_detach_init:
        return LRT_DETACHED
    return TRAIN_FLOPS_NOMINAL.get(cfg.model)


def recurrent_forward_macs(cfg: ModelConfig, T: int) -> dict:
    """Forward MACs (the convention above) of Parcae / RDM at cfg.depth recurrences (same keys as forward_macs)."""
    d, F, K = cfg.n_embd, cfg.width, cfg.depth
    apps = cfg.n_prelude + cfg.n_coda + K * cfg.n_core  # block applications
    inject = 2 * d * d * (1 if cfg.model == "parcae" else K)
    out = {"linear": (apps * (4 * d * d + 3 * d * F) + inject) * T, "scores": apps * T * T * d,
           "mix": apps * T * T * d, "head": cfg.vocab_size * d * T}
    out["total"] = sum(out.values())
    return out


def recurrent_param_split(cfg: ModelConfig):
    """(N_core, N_noncore): non-embedding parameters applied at every recurrence (all L_R core
    blocks, and RDM's adapter W) and those applied once (prelude, coda, Parcae's injection B and
    output C, norms), from a meta-device build (body.recurrence_parameters)."""
    model = models.build_model(cfg, device="meta")
    core = sum(p.numel() for p in model.body.recurrence_parameters())
    return core, model.num_params() - core


def unembedding_params(cfg: ModelConfig) -> int:
    """V d: the output head's parameters. Parcae counts them in N (it excludes the embedding but
    includes the unembedding, as nanoGPT does; Parcae's effective-FLOPs paragraph); here the head
    is the tied E, which num_params() leaves out, so they are added back once."""
    return cfg.vocab_size * cfg.n_embd


def unrolled_params(cfg: ModelConfig, mu_rec=None) -> int:
    """N(mu_rec): non-embedding parameters with the core unrolled mu_rec times (default: the
    config's mu_rec, parcae.resolve_recurrence), plus the unembedding V d (unembedding_params).
    The N of Parcae's scaling laws."""
    import parcae
    core, rest = recurrent_param_split(cfg)
    mu = mu_rec if mu_rec is not None else parcae.resolve_recurrence(cfg)[0]
    return rest + mu * core + unembedding_params(cfg)


def parcae_train_flops(cfg: ModelConfig, tokens: float, T=None) -> float:
    """Parcae's effective training FLOPs C = (2 N1 + 6 N2) D of a looped model at its nominal
    mu_rec and mu_bwd: N1 = N_core (mu_rec - mu_bwd), N2 = N_noncore + N_core mu_bwd + V d, the
    embedding excluded and the unembedding V d included (unembedding_params); attention added as
    2 T d MACs per token per block application (QK^T and AV, full T x T convention) in the same
    split. T defaults to cfg.block_size."""
    import parcae
    mu_rec, mu_bwd = parcae.resolve_recurrence(cfg)
    mu_bwd = min(mu_bwd, mu_rec)
    T = cfg.block_size if T is None else T
    core, rest = recurrent_param_split(cfg)
    attn = 2 * T * cfg.n_embd  # per block application, per token
    n1 = (core + cfg.n_core * attn) * (mu_rec - mu_bwd)
    n2 = rest + unembedding_params(cfg) + (cfg.n_prelude + cfg.n_coda) * attn + (core + cfg.n_core * attn) * mu_bwd
    return parcae_effective_flops(n1, n2, tokens)


# the flags that set how much memory the command takes: its out-of-memory line names them
SIZE_FLAGS = ("--size", "--depth", "--width", "--vocab_size", "--block_size")


if __name__ == "__main__":
    run_command(main, sizes=SIZE_FLAGS)
