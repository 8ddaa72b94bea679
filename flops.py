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

counter_expected_macs gives what torch.utils.flop_counter.FlopCounterMode / 2 reports for one
forward of the default ("fast") implementation; it differs from the convention only by padding,
spelled out there. train_flops = 3 x forward x 2 FLOPs/MAC (backward ~ 2 x forward): 6 N D style.

CLI: python flops.py --size 70M --depth 4 --block_size 8192 [--vocab_size 50257] [--window 256]
     python flops.py fit RUN_DIR [RUN_DIR ...] [--law all|depth|training|unified]   (Parcae's fits)

Parcae / RDM (MATH.md, "Parcae and RDM"): forward MACs at cfg.depth recurrences
(recurrent_forward_macs), unrolled parameter counts, effective training FLOPs (2 N1 + 6 N2) D, and
the scaling-law fits of "Parcae: Scaling Laws For Stable Looped Language Models" (arXiv 2604.12946,
§5.2 training law, §5.3 test-time and unified laws): see the section at the end.
"""
import argparse
import math
import sys

import models
from common import VOCAB_MULTIPLE, ModelConfig, UsageError
from tango import QK_PAD, WINDOW_CHUNK  # fast-path query/key width (32 score dims + null dim, padded to 40), windowed chunk

# The TANGO paper's §4.1 figures: forward MACs, GPT-2 vocabulary, 70M tier, K = 4, T = 8192, W = 256.
PAPER_MACS = {"tango": 9.44e12, "tango-windowed": 1.90e12, "loop": 1.94e12, "untied": 0.85e12}


def _gau_dims(cfg):
    return cfg.width, getattr(cfg, "gau_s", 128), getattr(cfg, "chunk", 256)  # e, s, C


def _per_application(cfg: ModelConfig, T: int):
    """(matrix parameters, score MACs, mix MACs) of one block application at length T."""
    d, F = cfg.n_embd, cfg.width
    m = cfg.model
    if m in ("tango", "tango-3set"):
        return 2 * d * d + 3 * d * F, T * T * d, T * T * F
    if m == "tango-windowed":
        W = min(cfg.window, T)
        return 2 * d * d + 3 * d * F, T * W * d, T * W * F
    if m in ("loop", "untied", "depth-attn", "loop-depth-attn"):  # depth mixing: depth_extra_macs
        return 4 * d * d + 3 * d * F, T * T * d, T * T * d
    if m == "gau":
        e, s, _ = _gau_dims(cfg)
        return 3 * d * e + d * s, T * T * s, T * T * e
    if m == "flash":
        e, s, C = _gau_dims(cfg)
        glob = 2 * T * s * e if T > C else 0
        return 3 * d * e + d * s, T * min(C, T) * s, T * min(C, T) * e + glob
    raise UsageError(f"flops: no MAC formula for model '{m}'")


def forward_macs(cfg: ModelConfig, T: int) -> dict:
    """Forward MACs of one sequence of length T by the convention above: {"linear", "scores", "mix", "head", "total"}."""
    if cfg.model in RECURRENT_MODELS:  # Parcae / RDM: prelude + K x core + coda (section below)
        return recurrent_forward_macs(cfg, T)
    if cfg.model == "ponder":  # PonderLM-2: several passes over thought slots (section below)
        return ponder_forward_macs(cfg, T)
    if cfg.model in LRT_MODELS:  # LRT: an init pass and the refinement of every slot (section below)
        return lrt_forward_macs(cfg, T)
    if cfg.model in PARALLEL_LOOPS:  # loopstack, PLT, LoopFold (section below)
        return parallel_loops_forward_macs(cfg, T)
    params, scores, mix = _per_application(cfg, T)
    K = cfg.depth
    out = {"linear": params * T * K, "scores": scores * K, "mix": mix * K, "head": cfg.vocab_size * cfg.n_embd * T}
    if cfg.model in ("depth-attn", "loop-depth-attn"):  # depth scores and depth mixing
        out["scores"] += depth_extra_macs(cfg, T)
        out["mix"] += depth_extra_macs(cfg, T)
    out["total"] = sum(out.values())
    return out


def counter_expected_macs(cfg: ModelConfig, T: int) -> int:
    """MACs that FlopCounterMode / 2 reports for one batch-1 forward of the fast implementation.

    The counter sees only matmuls (aten.mm/bmm); norms, RoPE, softmax, cumsum and elementwise
    products are not counted. Run it with SDPA pinned to the math backend
    (torch.nn.attention.sdpa_kernel(SDPBackend.MATH)): there SDPA is two bmm's counted as full
    L x S products even when causal, so Transformer++ and GAU equal the convention. (On CPU the
    fused flash kernel has no FlopCounterMode formula in torch 2.13 and counts 0.) The
    differences, all from padding:
      every model: the head multiplies by the padded embedding, ceil(V/64) 64 rows
        (common.VOCAB_MULTIPLE), so (Vp - V) d T more head MACs.
      tango, tango-3set: one causal attention over [null key, T keys] with 40-dim padded
        queries/keys: per application T (T+1) (40 H) score + T (T+1) F gate MACs.
      tango-windowed: each chunk of C = tango.WINDOW_CHUNK queries [r0, r1) scores the keys
        [max(r0 - W, 0), r1) and averages their gates: sum over chunks of (r1 - r0) (r1 - lo) (d + F)
        per application (window, old sources in the slice, and the masked future of the chunk).
      flash (T > C): T padded to Tp = ceil(T/C) C; local Tp C (s + e), global 2 Tp s e
        (K_l^T V per chunk, Q_l times the prefix state). T <= C: one unpadded chunk, T^2 (s + e).
      plt: the G-SWA window attention is SDPA over all T keys under a band mask: T^2 d scores and
        T^2 d mix instead of T min(W, T) d each, per block of every loop >= 2.
    """
    full = forward_macs(cfg, T)
    vocab_pad = (-cfg.vocab_size % VOCAB_MULTIPLE) * cfg.n_embd * T
    base = full["linear"] + full["head"] + vocab_pad
    K, d, F, H = cfg.depth, cfg.n_embd, cfg.width, cfg.n_head
    m = cfg.model
    if m in ("tango", "tango-3set"):
        return base + K * T * (T + 1) * (QK_PAD * H + F)
    if m == "tango-windowed":
        C = WINDOW_CHUNK
        return base + K * (d + F) * sum((min(r0 + C, T) - r0) * (min(r0 + C, T) - max(r0 - cfg.window, 0))
                                        for r0 in range(0, T, C))
    if m == "flash":
        e, s, C = _gau_dims(cfg)
        n = C if T > C else T  # flash_chunked: a single chunk is left unpadded
        Tp = math.ceil(T / n) * n
        return base + K * (Tp * n * (s + e) + (2 * Tp * s * e if T > C else 0))
    if m == "plt":  # the window attention is a full T x T product under a band mask
        W = min(cfg.plt_window, T)
        return full["total"] + vocab_pad + 2 * (cfg.depth - 1) * cfg.n_core * T * (T - W) * d
    return full["total"] + vocab_pad  # loop, untied, gau, depth-attn, ponder, lrt, loopstack, loopfold: the convention plus the vocabulary padding


def train_flops(cfg: ModelConfig, T: int, tokens: float) -> float:
    """Training FLOPs for `tokens` tokens in length-T sequences: 3 x forward (backward ~ 2 x
    forward) x 2 FLOPs per MAC, i.e. 6 x MACs per token x tokens (the 6 N D rule, attention added)."""
    return 6.0 * forward_macs(cfg, T)["total"] * tokens / T


def parcae_effective_flops(N1: float, N2: float, D: float) -> float:
    """Parcae-style effective training FLOPs C = (2 N1 + 6 N2) D (MATH.md, "Cost"): N1 unrolled
    parameters run without gradients (forward only), N2 those backpropagated through; D tokens."""
    return (2.0 * N1 + 6.0 * N2) * D


PAPER_SETTING = {"size": "70M", "depth": 4, "block_size": 8192, "vocab_size": 50257, "window": 256}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, exit 2 (no usage block)
        self.exit(2, f"flops.py: error: {message}\n")


def _parse(argv):
    p = _Parser(description="Analytical forward MACs per sequence (MATH.md, \"Cost\"). "
                "`python flops.py fit RUN [RUN ...]` fits Parcae's scaling laws to run logs instead "
                "(see python flops.py fit --help).")
    p.add_argument("--size", default="70M", help=f"parameter tier: {', '.join(models.TIERS)}")
    p.add_argument("--depth", type=int, default=4, help="block applications K (>= 1)")
    p.add_argument("--block_size", type=int, default=8192, help="sequence length T (>= 1)")
    p.add_argument("--vocab_size", type=int, default=50257, help="vocabulary V (>= 1)")
    p.add_argument("--window", type=int, default=256, help="Windowed TANGO window W (>= 1)")
    a = p.parse_args(argv)
    if a.size not in models.TIERS:
        p.error(f"--size {a.size}: choose one of {', '.join(models.TIERS)}")
    for flag in ("depth", "block_size", "vocab_size", "window"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} {getattr(a, flag)}: must be >= 1")
    return a


def _sci(x):
    return f"{x:.2e}".replace("e+", "e")  # 9.44e12


def main(argv=None):
    """Print one row per registered model: solved width, non-embedding params, forward MACs, and
    at the paper's setting (70M, K=4, T=8192, V=50257, W=256) the TANGO paper's §4.1 figure and the
    difference. `python flops.py fit RUN ...` fits Parcae's scaling laws instead (fit_main)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fit"]:
        return fit_main(argv[1:])
    a = _parse(argv)
    d, H, target = models.TIERS[a.size]
    paper = vars(a) == PAPER_SETTING
    print(f"forward MACs per sequence (MATH.md, Cost): tier {a.size} (d={d}, N*={target:,}), K={a.depth}, "
          f"T={a.block_size}, V={a.vocab_size}, W={a.window}")
    print(f"{'model':<16}{'width':>7}{'non-emb params':>16}{'fwd MACs':>10}" + (f"{'paper':>10}{'diff':>9}" if paper else ""))
    for name in models.REGISTRY:
        cfg = ModelConfig(model=name, vocab_size=a.vocab_size, block_size=a.block_size, n_embd=d,
                          n_head=H, depth=a.depth, window=a.window)
        try:
            cfg = models.solve_width(cfg, target, strict=False)  # the CPU tier cannot always hit 0.20 %
        except UsageError as e:  # e.g. three sets need K >= 3
            print(f"{name:<16}  skipped: {e}")
            continue
        macs = forward_macs(cfg, a.block_size)["total"]
        row = f"{name:<16}{cfg.width:>7}{models.count_params(cfg):>16,}{_sci(macs):>10}"
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

def depth_extra_macs(cfg: ModelConfig, T: int) -> int:
    """Depth-Attention's depth-score MACs (= its depth-mix MACs) of one length-T forward:
    T d sum over layers with C(l) non-empty of (|C(l)| + 1)."""
    import depth_attention
    stride = cfg.da_stride if cfg.da_stride != 0 else cfg.depth // 2
    n = sum(len(c) + 1 for c in (depth_attention.candidates(l, stride, cfg.da_recent) for l in range(cfg.depth)) if c)
    return T * cfg.n_embd * n


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
# lrt). The init pass runs Transformer++ over all S rows; the k refinement passes together run it
# once more over every row, each subset's n_j queries scoring all S buffered keys (a full n_j x S
# product: sum_j n_j S = S^2). The memory map W_m (d^2) is applied once per refined row; with
# lrt_kv, W_km and W_vm (2 d^2) too, and every row's private key/value costs d more score and d more
# mix MACs per block in both passes. Only the T scored rows reach the head.

LRT_MODELS = ("lrt", "lrt-think")


def lrt_forward_macs(cfg: ModelConfig, T: int) -> dict:
    """Forward MACs (MATH.md, Cost) of LRT / LRT with thought tokens (same keys as forward_macs):
    linear 2 S K (4d^2 + 3dF) + S d^2 (+ 2 S d^2), scores = mix = 2 S^2 d K (+ 2 S d K), head V d T."""
    d, F, K = cfg.n_embd, cfg.width, cfg.depth
    S = (cfg.n_thoughts + 1 if cfg.model == "lrt-think" else 1) * T
    kv = 1 if cfg.lrt_kv else 0
    out = {"linear": 2 * S * K * (4 * d * d + 3 * d * F) + (1 + 2 * kv) * S * d * d,
           "scores": 2 * S * S * d * K + kv * 2 * S * d * K, "mix": 2 * S * S * d * K + kv * 2 * S * d * K,
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
# loopstack / PLT / LoopFold (plt.py; MATH.md, "Parallel loops"): N = cfg.depth loops of the n_core
# Transformer++ blocks, N n_core block applications (4d^2 + 3dF per row, T^2 d scores and mix).
# PLT, in every block of loops >= 2: the gate w . q (d MACs per row), global attention over loop 1's
# keys (T^2 d scores and mix) and window attention over the loop's own (T min(W, T) d each).
# LoopFold: each of the N - S predicted rows costs the predictor 2 d r and its correction 2 d r.

PARALLEL_LOOPS = ("loopstack", "plt", "loopfold")


def parallel_loops_forward_macs(cfg: ModelConfig, T: int) -> dict:
    """Forward MACs (the convention above) of loopstack, PLT or LoopFold (same keys as forward_macs)."""
    import plt
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
        predicted = N - len(plt.fold_stages(N, cfg.fold, cfg.fold_layout))
        out["linear"] += predicted * 4 * d * r * T
    out["total"] = sum(out.values())
    return out


# ============================================================================= Parcae / RDM
# Looped models (MATH.md, "Parcae and RDM"): prelude (L_P blocks) -> core (L_R blocks) applied K = cfg.depth times
# (the evaluation recurrence) -> coda (L_C blocks), all Transformer++ / sandwich blocks with
# 4d^2 + 3dF matrix parameters and full T^2 d score and mix MACs per block application. Parcae
# computes B e once and C h once (2 d^2 per token); RDM applies its adapter W: 2d -> d at every
# recurrence (2 d^2 per token per recurrence).

import torch  # noqa: E402  (only this section needs it: meta builds and the L-BFGS fits)

RECURRENT_MODELS = ("parcae", "rdm")


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
    """(N_core, N_noncore): non-embedding parameters of the recurrent core (all L_R blocks) and of
    everything else (prelude, coda, injection, norms), from a meta-device build."""
    model = models.build_model(cfg, device="meta")
    core = sum(p.numel() for p in model.body.core.parameters())
    return core, model.num_params() - core


def unrolled_params(cfg: ModelConfig, mu_rec=None) -> int:
    """N(mu_rec): non-embedding parameters with the core unrolled mu_rec times (default: the
    config's mu_rec, parcae.resolve_recurrence). The N of Parcae's scaling laws."""
    import parcae
    core, rest = recurrent_param_split(cfg)
    mu = mu_rec if mu_rec is not None else parcae.resolve_recurrence(cfg)[0]
    return rest + mu * core


def parcae_train_flops(cfg: ModelConfig, tokens: float, T=None) -> float:
    """Parcae's effective training FLOPs C = (2 N1 + 6 N2) D of a looped model at its nominal
    mu_rec and mu_bwd: N1 = N_core (mu_rec - mu_bwd), N2 = N_noncore + N_core mu_bwd, embeddings
    excluded; attention added as 2 T d MACs per token per block application (QK^T and AV, full
    T x T convention) in the same split. T defaults to cfg.block_size."""
    import parcae
    mu_rec, mu_bwd = parcae.resolve_recurrence(cfg)
    mu_bwd = min(mu_bwd, mu_rec)
    T = cfg.block_size if T is None else T
    core, rest = recurrent_param_split(cfg)
    attn = 2 * T * cfg.n_embd  # per block application, per token
    n1 = (core + cfg.n_core * attn) * (mu_rec - mu_bwd)
    n2 = rest + (cfg.n_prelude + cfg.n_coda) * attn + (core + cfg.n_core * attn) * mu_bwd
    return parcae_effective_flops(n1, n2, tokens)


# ----------------------------------------------------------------------------- scaling-law fits
# All fits minimize sum_i Huber_delta(log pred_i - log L_i) (delta = 1e-3, Hoffmann et al.) with
# torch.optim.LBFGS (float64, strong Wolfe line search). Positive coefficients are fitted in log
# space and every power / exponential term is written relative to a reference point of the data
# (the geometric mean of N and of D, the mean of T): A N^-a = exp(a' - a log(N / N0)) with
# A = exp(a') N0^a, which decouples coefficient and exponent (the fit is badly conditioned
# otherwise). "Many restarts": the objective is evaluated on a grid of initializations at once,
# and L-BFGS runs from the `restarts` best grid points; the lowest final loss wins. Huber_delta(r)
# = delta^2 Huber_1(r / delta), so Huber_1(r / delta) is minimized (same minimizer, gradients of a
# sensible scale for L-BFGS's tolerances).

HUBER_DELTA = 1e-3


def _huber(r, delta):
    a = (r / delta).abs()
    return torch.where(a <= 1, 0.5 * a * a, a - 0.5)


def _grid(*axes):
    mesh = torch.meshgrid(*[torch.as_tensor(a, dtype=torch.float64) for a in axes], indexing="ij")
    return torch.stack([m.reshape(-1) for m in mesh], -1)


def _minimize(objective, grid, restarts, max_iter):
    """objective: theta (R, P) -> (R,) losses. L-BFGS from the `restarts` best grid rows; returns
    (theta (P,), loss)."""
    with torch.no_grad():
        vals = objective(grid)
    vals = torch.where(torch.isfinite(vals), vals, torch.full_like(vals, float("inf")))
    best_theta, best_val = None, float("inf")
    for i in torch.argsort(vals)[:restarts].tolist():
        theta = grid[i].clone().requires_grad_(True)
        opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=max_iter, max_eval=2 * max_iter,
                                tolerance_grad=1e-12, tolerance_change=1e-16, history_size=50,
                                line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = objective(theta[None])[0]
            loss.backward()
            return loss

        try:
            opt.step(closure)
        except RuntimeError:  # a line search that hit a non-finite value: keep the best so far
            pass
        with torch.no_grad():
            v = float(objective(theta[None])[0])
        if math.isfinite(v) and v < best_val:
            best_theta, best_val = theta.detach().clone(), v
    if best_theta is None:
        raise UsageError("scaling-law fit: no initialization converged to a finite loss")
    return best_theta, best_val


def _as64(*xs):
    return [torch.as_tensor(x, dtype=torch.float64).reshape(-1) for x in xs]


def _check_points(n_points, n_params, law):
    if n_points < n_params:
        raise UsageError(f"{law} law: {n_points} points cannot determine {n_params} parameters")


def _check_varies(law, **variables):
    """UsageError unless every variable a law fits an exponent (or a rate) for takes >= 3 distinct
    values in the given points: with fewer, the fit returns numbers the runs cannot determine."""
    for name, values in variables.items():
        n = len(set(values.tolist()))
        if n < 3:
            raise UsageError(f"{law} law: {name} takes {n} distinct value{'s' * (n != 1)} in these runs; "
                             f"fitting its exponent needs >= 3")


def fit_depth_law(T, L, restarts=32, max_iter=500, delta=HUBER_DELTA):
    """Test-time depth law L(T) = L_inf + Z exp(-z T) (Parcae §5.3) from recurrences T and losses L.
    Returns {"L_inf", "Z", "z", "huber"}; UsageError for fewer than 3 distinct T."""
    T, L = _as64(T, L)
    _check_points(len(T), 3, "depth")
    _check_varies("depth", T=T)
    T0, logL = T.mean(), L.log()

    def objective(th):  # th: (R, 3) = [log L_inf, log(Z exp(-z T0)), log z]
        terms = torch.stack([th[:, :1].expand(-1, len(T)),
                             th[:, 1:2] - th[:, 2:3].exp() * (T - T0)], 0)
        return _huber(torch.logsumexp(terms, 0) - logL, delta).sum(-1)

    lmin, spread = float(L.min()), float(L.max() - L.min()) + 1e-6
    grid = _grid([math.log(lmin * f) for f in (0.5, 0.7, 0.85, 0.95, 0.99)],
                 [math.log(spread * f) for f in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)],
                 [math.log(z) for z in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)])
    th, v = _minimize(objective, grid, restarts, max_iter)
    z = float(th[2].exp())
    return {"L_inf": float(th[0].exp()), "Z": float((th[1] + z * T0).exp()), "z": z, "huber": v}


def fit_training_law(N, D, L, restarts=32, max_iter=1000, delta=HUBER_DELTA):
    """Training law L = E + A N^-a + B D^-b (Parcae §5.2; N: unrolled parameters N(mu_rec), D: tokens).
    Returns {"E", "A", "a", "B", "b", "huber"}; UsageError for fewer than 3 distinct N or D."""
    N, D, L = _as64(N, D, L)
    _check_points(len(L), 5, "training")
    _check_varies("training", N=N, D=D)
    lN, lD = N.log(), D.log()
    cN, cD, logL = lN.mean(), lD.mean(), L.log()

    def objective(th):  # [log E, a', a, b', b]
        terms = torch.stack([th[:, :1].expand(-1, len(L)), th[:, 1:2] - th[:, 2:3] * (lN - cN),
                             th[:, 3:4] - th[:, 4:5] * (lD - cD)], 0)
        return _huber(torch.logsumexp(terms, 0) - logL, delta).sum(-1)

    lm = math.log(float(L.mean()))
    levels = [lm + s for s in (-3.0, -2.0, -1.0, -0.3)]
    grid = _grid([lm + s for s in (-2.0, -1.0, -0.5, -0.2)], levels, (0.05, 0.2, 0.4, 0.8, 1.5),
                 levels, (0.05, 0.2, 0.4, 0.8, 1.5))
    th, v = _minimize(objective, grid, restarts, max_iter)
    a, b = float(th[2]), float(th[4])
    return {"E": float(th[0].exp()), "A": float((th[1] + a * cN).exp()), "a": a,
            "B": float((th[3] + b * cD).exp()), "b": b, "huber": v}


def fit_unified_law(N, D, T, mu_rec, L, restarts=32, max_iter=1500, delta=HUBER_DELTA):
    """Unified law L = E + X N^-x + Y D^-y + Z exp(-z T / mu_rec) (Parcae §5.3): N unrolled parameters
    N(mu_rec), D tokens, T test-time recurrences, mu_rec the training mean recurrence.
    Returns {"E", "X", "x", "Y", "y", "Z", "z", "huber"}; UsageError for fewer than 3 distinct
    N, D or T / mu_rec."""
    N, D, T, M, L = _as64(N, D, T, mu_rec, L)
    _check_points(len(L), 7, "unified")
    _check_varies("unified", N=N, D=D, T_over_mu_rec=T / M)
    lN, lD, R = N.log(), D.log(), T / M
    cN, cD, cR, logL = lN.mean(), lD.mean(), R.mean(), L.log()

    def objective(th):  # [log E, x', x, y', y, z', log z]
        terms = torch.stack([th[:, :1].expand(-1, len(L)), th[:, 1:2] - th[:, 2:3] * (lN - cN),
                             th[:, 3:4] - th[:, 4:5] * (lD - cD), th[:, 5:6] - th[:, 6:7].exp() * (R - cR)], 0)
        return _huber(torch.logsumexp(terms, 0) - logL, delta).sum(-1)

    lm = math.log(float(L.mean()))
    levels = [lm + s for s in (-3.0, -1.5, -0.5)]
    grid = _grid([lm + s for s in (-1.0, -0.5, -0.2)], levels, (0.1, 0.4, 1.0), levels, (0.1, 0.4, 1.0),
                 levels, [math.log(z) for z in (0.1, 0.5, 2.0, 8.0)])
    th, v = _minimize(objective, grid, restarts, max_iter)
    x, y, z = float(th[2]), float(th[4]), float(th[6].exp())
    return {"E": float(th[0].exp()), "X": float((th[1] + x * cN).exp()), "x": x,
            "Y": float((th[3] + y * cD).exp()), "y": y, "Z": float((th[5] + z * cR).exp()), "z": z,
            "huber": v}


def read_run(path):
    """One training run from train.py's JSON log (a run directory or its log.jsonl): the first
    "start" event, the last "summary" and the last "depth_sweep". Returns {"path", "model",
    "config", "mu_rec", "N" (unrolled non-embedding parameters), "D" (tokens seen at the
    evaluated checkpoint: best_iter x tokens per update), "dev_nll", "sweep_depths",
    "sweep_nll"}; UsageError if the log is missing or has no summary."""
    import parcae
    import json
    import os
    f = os.path.join(path, "log.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(f):
        raise UsageError(f"{path}: no log.jsonl")
    start = summary = sweep = None
    with open(f) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise UsageError(f"{f}: not a JSON-lines log") from None
            ev = rec.get("event")
            if ev == "start" and start is None:
                start = rec
            elif ev == "summary":
                summary = rec
            elif ev == "depth_sweep":
                sweep = rec
    if start is None or summary is None:
        raise UsageError(f"{f}: needs a 'start' and a 'summary' event (run not finished?)")
    cfg = ModelConfig.from_dict(start["config"])
    args = start.get("args", {})
    per_update = args.get("batch_size", 1) * args.get("gradient_accumulation_steps", 1) * cfg.block_size
    looped = cfg.model in RECURRENT_MODELS
    return {"path": path, "model": cfg.model, "config": cfg,
            "mu_rec": parcae.resolve_recurrence(cfg)[0] if looped else cfg.depth,
            "N": unrolled_params(cfg) if looped else start.get("non_embedding_params"),
            "D": float(summary.get("tokens", summary["best_iter"] * per_update)),
            "dev_nll": float(summary["dev_nll"]),
            "sweep_depths": sweep["depths"] if sweep else None, "sweep_nll": sweep["dev_nll"] if sweep else None}


def fit_runs(runs, law="all", restarts=32):
    """Fit the laws to runs (read_run dicts): depth law per run with a sweep; training and
    unified laws per model over its runs. Returns a list of {"law", "model", "label", "points",
    "params" | "error"}."""
    out = []
    by_model = {}
    for r in runs:
        by_model.setdefault(r["model"], []).append(r)
    if law in ("all", "depth"):
        for r in runs:
            if r["sweep_depths"]:
                row = {"law": "depth", "model": r["model"], "label": str(r["path"]), "points": len(r["sweep_depths"])}
                try:
                    row["params"] = fit_depth_law(r["sweep_depths"], r["sweep_nll"], restarts)
                except UsageError as e:
                    row["error"] = str(e)
                out.append(row)
    for model, rs in by_model.items():
        if law in ("all", "training"):
            row = {"law": "training", "model": model, "label": model, "points": len(rs)}
            try:
                row["params"] = fit_training_law([r["N"] for r in rs], [r["D"] for r in rs],
                                                 [r["dev_nll"] for r in rs], restarts)
            except UsageError as e:
                row["error"] = str(e)
            out.append(row)
        if law in ("all", "unified"):
            pts = [(r["N"], r["D"], t, r["mu_rec"], l) for r in rs if r["sweep_depths"]
                   for t, l in zip(r["sweep_depths"], r["sweep_nll"])]
            row = {"law": "unified", "model": model, "label": model, "points": len(pts)}
            try:
                row["params"] = fit_unified_law(*zip(*pts), restarts=restarts) if pts else None
                if row["params"] is None:
                    raise UsageError("unified law: no run has a depth_sweep event")
            except UsageError as e:
                row.pop("params", None)
                row["error"] = str(e)
            out.append(row)
    return out


def fit_main(argv):
    """python flops.py fit RUN [RUN ...] [--law all|depth|training|unified] [--restarts R] [--out F]"""
    import json
    p = _Parser(prog="flops.py fit", description="Fit Parcae's scaling laws to train.py run logs.")
    p.add_argument("runs", nargs="+", help="run directories (or their log.jsonl)")
    p.add_argument("--law", default="all", choices=("all", "depth", "training", "unified"))
    p.add_argument("--restarts", type=int, default=64, help="L-BFGS restarts (best grid points)")
    p.add_argument("--out", default=None, help="also write the fits as JSON here")
    a = p.parse_args(argv)
    if a.restarts < 1:
        p.error(f"--restarts {a.restarts}: must be >= 1")
    try:
        rows = fit_runs([read_run(r) for r in a.runs], a.law, a.restarts)
    except UsageError as e:
        p.exit(2, f"flops.py fit: error: {e}\n")
    for row in rows:
        if "params" in row:
            vals = "  ".join(f"{k}={v:.4g}" for k, v in row["params"].items())
            print(f"{row['law']:<9}{row['model']:<8}{row['points']:>4} pts  {vals}  [{row['label']}]")
        else:
            print(f"{row['law']:<9}{row['model']:<8}{row['points']:>4} pts  skipped: {row['error']}  [{row['label']}]")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
