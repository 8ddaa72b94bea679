"""Analytical forward cost and training FLOPs (SPEC.md section 7).

Units: forward_macs counts multiply-accumulates (MACs) for ONE sequence of length T (batch 1);
1 MAC = 2 FLOPs. Convention (SPEC 7): every score matrix is a full product (no causal halving),
every linear map costs (its parameters) x (tokens) at each application, plus the tied head V d T.

    linear = sum over the K applications of the matrix parameters applied there, times T
    head   = V d T
    scores / mix per application (W = min(window, T), C = min(chunk, T)):
      tango, tango-3set   scores T^2 d           mix (gate averaging) T^2 F
      tango-windowed      scores T W d           mix T W F
      loop, untied        scores (QK^T) T^2 d    mix (AV) T^2 d
      gau                 scores T^2 s           mix (AV) T^2 e
      flash               scores T C s           mix T C e (local) + 2 T s e (global: K_l^T V
                                                 per chunk, then Q_l times the prefix sum;
                                                 counted only when T > chunk, else FLASH = GAU)

Matrix parameters per application: TANGO 2d^2 + 3dF (3-set: the one set in use, F = F3),
Transformer++ 4d^2 + 3dF, GAU/FLASH 3de + ds (e = cfg.width, s = cfg.gau_s). Elementwise gains
(norms, tau, b, GAU scale-offsets) are not MACs and are left out; SPEC's derivation multiplies
N* (which includes them) by T K, but they are (2d + 2H) / N* = 2.4e-5 of it at the 70M tier, so
the check values are unchanged. Windowed TANGO's one summary source per query (T K (d + F)
elementwise work, 1/W of the window) is left out, as in SPEC's T W (d + F).

counter_expected_macs gives what torch.utils.flop_counter.FlopCounterMode / 2 reports for one
forward of the default ("fast") implementation; it differs from the convention only by padding,
spelled out there. train_flops = 3 x forward x 2 FLOPs/MAC (backward ~ 2 x forward): 6 N D style.

CLI: python flops.py --size 70M --depth 4 --block_size 8192 [--vocab_size 50257] [--window 256]
"""
import argparse
import math
import sys

import models
from common import ModelConfig, UsageError
from tango import QK_PAD  # fast-path query/key width (32 score dims + null dim, padded to 40)

# SPEC 7 check values: forward MACs, GPT-2 vocabulary, 70M tier, K = 4, T = 8192, W = 256.
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
    if m in ("loop", "untied"):
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
    """Forward MACs of one sequence of length T by SPEC 7: {"linear", "scores", "mix", "head", "total"}."""
    params, scores, mix = _per_application(cfg, T)
    K = cfg.depth
    out = {"linear": params * T * K, "scores": scores * K, "mix": mix * K, "head": cfg.vocab_size * cfg.n_embd * T}
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
      tango, tango-3set: one causal attention over [null key, T keys] with 40-dim padded
        queries/keys: per application T (T+1) (40 H) score + T (T+1) F gate MACs.
      tango-windowed: T padded to Tp = ceil(T/W) W; each W-query chunk scores a W x 2W band
        (its own and the previous chunk's keys): Tp 2W (d + F) per application.
      flash (T > C): T padded to Tp = ceil(T/C) C; local Tp C (s + e), global 2 Tp s e
        (K_l^T V per chunk, Q_l times the prefix state). T <= C: one unpadded chunk, T^2 (s + e).
    """
    full = forward_macs(cfg, T)
    base = full["linear"] + full["head"]
    K, d, F, H = cfg.depth, cfg.n_embd, cfg.width, cfg.n_head
    m = cfg.model
    if m in ("tango", "tango-3set"):
        return base + K * T * (T + 1) * (QK_PAD * H + F)
    if m == "tango-windowed":
        W = min(cfg.window, T)
        return base + K * math.ceil(T / W) * W * 2 * W * (d + F)
    if m == "flash":
        e, s, C = _gau_dims(cfg)
        n = C if T > C else T  # flash_chunked: a single chunk is left unpadded
        Tp = math.ceil(T / n) * n
        return base + K * (Tp * n * (s + e) + (2 * Tp * s * e if T > C else 0))
    return full["total"]  # loop, untied, gau: the implementation computes exactly the convention


def train_flops(cfg: ModelConfig, T: int, tokens: float) -> float:
    """Training FLOPs for `tokens` tokens in length-T sequences: 3 x forward (backward ~ 2 x
    forward) x 2 FLOPs per MAC, i.e. 6 x MACs per token x tokens (the 6 N D rule, attention added)."""
    return 6.0 * forward_macs(cfg, T)["total"] * tokens / T


def parcae_effective_flops(N1: float, N2: float, D: float) -> float:
    """Parcae-style effective training FLOPs C = (2 N1 + 6 N2) D (SPEC 5 and 7): N1 unrolled
    parameters run without gradients (forward only), N2 those backpropagated through; D tokens."""
    return (2.0 * N1 + 6.0 * N2) * D


PAPER_SETTING = {"size": "70M", "depth": 4, "block_size": 8192, "vocab_size": 50257, "window": 256}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, exit 2 (no usage block)
        self.exit(2, f"flops.py: error: {message}\n")


def _parse(argv):
    p = _Parser(description="Analytical forward MACs per sequence (SPEC.md section 7).")
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
    at the paper's setting (70M, K=4, T=8192, V=50257, W=256) the SPEC 7 figure and the difference."""
    a = _parse(argv)
    d, H, target = models.TIERS[a.size]
    paper = vars(a) == PAPER_SETTING
    print(f"forward MACs per sequence (SPEC 7): tier {a.size} (d={d}, N*={target:,}), K={a.depth}, "
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


if __name__ == "__main__":
    sys.exit(main())
