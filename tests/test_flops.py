"""Tests for flops.py: the TANGO paper's §4.1 MAC figures, CLI, and agreement with torch's FlopCounterMode.

FlopCounterMode counts 2 FLOPs per MAC of every matmul (aten.mm/bmm, and here also the in-place
baddbmm_/addmm_ with which TANGO's fast paths write their chunks, registered through its
custom_mapping); elementwise work (norms, RoPE, softmax, cumsum, gating) is not counted. SDPA on CPU: when the fused CPU flash kernel is
chosen (aten._scaled_dot_product_flash_attention_for_cpu; e.g. Transformer++ with equal 32-dim
q/k/v) torch 2.13's counter has no formula for it and counts 0, while shapes it rejects (TANGO's
40-dim q/k with F/H-dim values) fall back to the math path and are counted. So every count here
runs under sdpa_kernel(SDPBackend.MATH): SDPA decomposes into two bmm's, counted as full L x S
products even when causal (the mask is applied elementwise), which is the convention of MATH.md, "Cost". Linear maps and the tied head therefore count exactly params x T and V d T, and the only
differences from that convention are the implementations' padding, modelled exactly in
flops.counter_expected_macs (not a tolerance):
  tango / tango-3set (fast path): keys are [null key, T keys] and q/k are padded to 40 dims, and
      each chunk of tango_kernels.ATTN_CHUNK queries [r0, r1) scores the keys before r1, so per
      application sum (r1 - r0) (r1 + 1) (40 H + F) over chunks (T (T+1) (40 H + F) for one
      chunk) instead of T^2 (32 H + F);
  tango-windowed: every chunk of C queries [r0, r1) scores the keys [max(r0 - W, 0), r1), so
      sum (r1 - r0) (r1 - lo) (d + F) over chunks instead of T W (d + F);
  flash: T padded to a multiple of C; local Tp C (s + e), global 2 Tp s e;
  loop / untied / gau: none (SDPA and GAU's explicit matmuls are full T x T products).
The reference TANGO path computes exactly the convention, so there the counter equals forward_macs.
"""
import math
import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import flops
import models
from common import ModelConfig


def _matmul_flops(self_shape, a_shape, b_shape, out_shape=None, **kwargs):
    """FLOPs of out += a @ b (2 per MAC, as the counter's own bmm/addmm formulas)."""
    return 2 * math.prod(a_shape) * b_shape[-1]


IN_PLACE = {torch.ops.aten.baddbmm_: _matmul_flops, torch.ops.aten.addmm_: _matmul_flops}


def counted_macs(cfg, T, **body_kwargs):
    """FlopCounterMode total / 2 for one batch-1 forward of cfg at length T (SDPA on the math path)."""
    torch.manual_seed(0)
    model = models.build_model(cfg, **body_kwargs)
    idx = torch.randint(0, cfg.vocab_size, (1, T))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, custom_mapping=IN_PLACE) as fc:
        model(idx)
    flops_total = fc.get_total_flops()
    assert flops_total % 2 == 0
    return flops_total // 2


def small(name, **kw):
    # T = 60 below is not a multiple of window 16 or chunk 16, so the padding terms are exercised
    base = dict(model=name, vocab_size=97, block_size=60, n_embd=64, n_head=2, depth=3, width=96,
                window=16)
    if "gau_s" in ModelConfig.__dataclass_fields__:
        base.update(gau_s=32, chunk=16)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("name", list(models.REGISTRY))
@pytest.mark.parametrize("T", [60, 13])
def test_counter_matches_expected_exactly(name, T):
    cfg = small(name)
    assert counted_macs(cfg, T) == flops.counter_expected_macs(cfg, T)


@pytest.mark.parametrize("name", ["tango", "tango-3set"])
def test_counter_matches_expected_over_several_chunks(name):
    """T = 300 > tango_kernels.ATTN_CHUNK = 256: the second chunk of queries scores only the keys
    before its last row, so the count is below T (T+1) (40 H + F) per application."""
    cfg = small(name, depth=3 if name == "tango-3set" else 1, block_size=300)
    assert counted_macs(cfg, 300) == flops.counter_expected_macs(cfg, 300)


@pytest.mark.parametrize("name", [n for n, spec in models.REGISTRY.items() if spec.counted_macs is None])
def test_counter_equals_convention_without_padding(name):
    """A model whose registry row names no counted_macs is counted as the convention by FlopCounterMode."""
    cfg = small(name, vocab_size=128)  # a multiple of 64: no vocabulary padding
    assert counted_macs(cfg, 60) == flops.forward_macs(cfg, 60)["total"]


@pytest.mark.parametrize("name", ["tango", "tango-3set"])
def test_reference_tango_counts_the_convention(name):
    cfg = small(name, vocab_size=128)  # a multiple of 64: no vocabulary padding
    assert counted_macs(cfg, 60, impl="reference") == flops.forward_macs(cfg, 60)["total"]


@pytest.mark.parametrize("kw", [dict(model="depth-attn", da_recent=2, da_stride=-1),
                                dict(model="loop-depth-attn", depth=6, da_stride=2, da_recent=1),
                                dict(model="ponder", n_thoughts=2, jacobi=1), dict(model="ponder", n_thoughts=0)])
def test_counter_covers_depth_attention_and_ponder_settings(kw):
    """The depth scores/mixing and every PonderLM-2 pass are matmuls the counter sees: with no
    vocabulary padding it equals forward_macs exactly, and the method's extra over Transformer++
    is visible in it."""
    cfg = small(kw.pop("model"), vocab_size=128, **kw)
    counted = counted_macs(cfg, 13)
    assert counted == flops.forward_macs(cfg, 13)["total"]
    plain = small("untied" if cfg.model != "loop-depth-attn" else "loop", vocab_size=128, depth=cfg.depth)
    assert (counted > counted_macs(plain, 13)) == (cfg.model != "ponder" or cfg.n_thoughts > 0)


def test_depth_attention_closed_form_is_the_per_layer_count():
    """depth_extra_macs' closed form equals T d sum over layers with C(l) non-empty of (|C(l)| + 1),
    counted from depth_attention.candidates, at every depth, stride and recent window up to 40."""
    import depth_attention
    from types import SimpleNamespace
    for L in range(1, 41):
        for stride in range(-1, L + 3):
            s = stride if stride != 0 else L // 2
            cs = [depth_attention.candidates(l, s, r) for r in range(L + 3) for l in range(L)]
            for r in range(L + 3):
                n = sum(len(c) + 1 for c in cs[r * L:(r + 1) * L] if c)
                cfg = SimpleNamespace(depth=L, da_stride=stride, da_recent=r, n_embd=3)
                assert flops.depth_extra_macs(cfg, 5) == 5 * 3 * n, (L, stride, r)


def test_untied_gau_same_macs_as_tied():
    tied, untied = small("gau"), small("gau", tie_unit=False)
    assert flops.forward_macs(tied, 60) == flops.forward_macs(untied, 60)
    assert counted_macs(untied, 60) == flops.counter_expected_macs(untied, 60)


def test_limits_reduce_to_full_models():
    T = 40
    for extra in (0, 7):  # a window or chunk longer than the sequence is capped at T
        assert flops.forward_macs(small("tango-windowed", window=T + extra), T) == flops.forward_macs(small("tango"), T)
        if "flash" in models.REGISTRY:  # one chunk: FLASH = GAU (MATH.md), no global part
            assert flops.forward_macs(small("flash", chunk=T + extra), T) == flops.forward_macs(small("gau"), T)


def paper_cfg(name):
    d, H, target = models.TIERS["70M"]
    cfg = ModelConfig(model=name, vocab_size=50257, block_size=8192, n_embd=d, n_head=H, depth=4, window=256)
    return models.solve_width(cfg, target)


@pytest.mark.parametrize("name", list(flops.PAPER_MACS))
def test_spec7_check_values(name):
    macs = flops.forward_macs(paper_cfg(name), 8192)["total"]
    assert abs(macs / flops.PAPER_MACS[name] - 1) < 0.005


def test_spec7_tango_derivation_terms():
    cfg = paper_cfg("tango")
    assert cfg.width == 28480
    m = flops.forward_macs(cfg, 8192)
    for key, ref in (("linear", 1.451e12), ("scores", 0.137e12), ("mix", 7.645e12), ("head", 0.211e12)):
        assert abs(m[key] / ref - 1) < 0.005, key


@pytest.mark.parametrize("name,kw", [(name, {}) for name in models.REGISTRY]
                         + [("ponder", {"jacobi_random": False}), ("ponder", {"n_thoughts": 0}),
                            ("lrt", {"lrt_detach_init": True}),
                            ("lrt-think", {"lrt_detach_init": True})])
def test_a_training_step_runs_three_forwards_unless_its_flops_are_nominal(name, kw):
    """train_flops (the MFU's model FLOPs) is 3 x the forward: FlopCounterMode over a training step
    (forward, backward) at several seeds counts 3x the counted forward (TANGO's kernels up to 3.13x,
    the backward of the padded score products), except for the configs flops.train_flops_nominal
    gives a reason for, where some step differs."""
    cfg = small(name, depth=4, **kw)
    torch.manual_seed(0)
    model = models.build_model(cfg).train()
    idx, y = torch.randint(0, 97, (2, 60)), torch.randint(0, 97, (2, 60))
    ratios = set()
    for seed in range(4):  # the random draws of Parcae, RDM and PonderLM-2
        for m in model.modules():
            if hasattr(m, "rng_seed"):
                m.rng_seed = seed
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, custom_mapping=IN_PLACE) as fc:
            model(idx, y)[1].backward()
        ratios.add(round(fc.get_total_flops() / 2 / (2 * flops.counter_expected_macs(cfg, 60)), 4))
    if flops.train_flops_nominal(cfg):
        assert any(not 3.0 <= r < 3.13 for r in ratios), ratios
    else:
        assert all(3.0 <= r < 3.13 for r in ratios), ratios


def test_train_and_parcae_flops():
    cfg = small("loop")
    assert flops.train_flops(cfg, 60, 600) == 6 * 10 * flops.forward_macs(cfg, 60)["total"]
    assert flops.parcae_effective_flops(3, 5, 7) == (2 * 3 + 6 * 5) * 7


def test_cli_paper_rows(capsys):
    """The paper's four figures, and results/cost/README.md's table is this command's output, byte
    for byte (the block after the command's own)."""
    assert flops.main(["--size", "70M", "--depth", "4", "--block_size", "8192"]) == 0
    out = capsys.readouterr().out
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "cost",
                           "README.md")) as f:
        doc = f.read()
    command = "```\npython flops.py --size 70M --depth 4 --block_size 8192\n```\n```\n"
    start = doc.index(command) + len(command)
    assert doc[start:doc.index("```", start)] == out, (
        "results/cost/README.md is not this output (a model added or changed?): regenerate its block with "
        "`python flops.py --size 70M --depth 4 --block_size 8192` and paste the output under that command")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert rows["tango"][3] == rows["tango"][4] == "9.44e12"
    assert rows["tango-windowed"][3] == "1.90e12"
    assert rows["loop"][3] == "1.94e12"
    assert set(rows) == set(models.REGISTRY)


@pytest.mark.parametrize("argv, message", [
    (["--size", "7M"], "--size 7M: choose one of tiny, cpu, 70M, 160M"), (["--depth", "0"], "--depth 0: must be >= 1"),
    (["--block_size", "0"], "--block_size 0: must be >= 1"), (["--depth", "x"], "argument --depth: invalid int value"),
    (["--vocab_size", "0"], "--vocab_size 0: must be >= 1"), (["--window", "0"], "--window 0: must be >= 1"),
    (["--chunk", "0"], "--chunk 0: must be >= 1"), (["--gau_s", "0"], "--gau_s 0: must be a positive multiple of 32"),
    (["--gau_s", "16"], "--gau_s 16: must be a positive multiple of 32"),
    (["--size", "tiny", "--gau_s", "96"], "--gau_s 96: must be <= 64 (the residual width d"),
    (["--width", "-8"], "--width -8: must be a positive multiple of 16 for tango, one of the models flops.py computes "
                        "(0: solve"),  # flops.py has no --model
    (["--width", str(2**63)], f"argument --width: {2**63}: beyond a 64-bit integer (at most 2**63 - 1)"),
    (["--n_core", "0"], "--n_core 0: must be >= 1"), (["--plt_window", "0"], "--plt_window 0: must be >= 1"),
    (["--size", "tiny", "--fold_rank", "65"], "--fold_rank 65: must be <= 64"),
    (["--lrt_subsets", "0"], "--lrt_subsets 0: must be >= 1"), (["--mu_rec", "-1"], "--mu_rec -1 / --mu_bwd 0: must be >= 1 (0 = default)"),
])
def test_cli_bad_flags(argv, message, capsys):
    """Every numeric flag out of range is one line naming it and what is allowed, exit code 2 (a
    value a model refuses, e.g. --gau_s 16, was a "skipped" row for GAU and FLASH, exit 0)."""
    with pytest.raises(SystemExit) as e:
        flops.main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"flops.py: error: {message}"), err


def test_cli_help_shows_the_defaults(capsys):
    """flops.py --help gives each flag's default, the tier-dependent ones per tier (as train.py's
    help does, from harness.config.TIER_DEFAULTS)."""
    with pytest.raises(SystemExit) as e:
        flops.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--size SIZE parameter tier: tiny, cpu, 70M, 160M (default: 70M)", "(default: 4)",
                 "default: tiny 128 / cpu 128 / 70M 2048 / 160M 2048", "(default: 50257)",
                 "Windowed TANGO window W; default: tiny 32 / cpu 64 / 70M 256 / 160M 256",
                 "FLASH chunk C; default: tiny 32 / cpu 64", "--n_core N_CORE", "(default: 2)"):
        assert text in out, text


def test_cli_defaults_are_the_tiers(capsys):
    """`flops.py --size tiny` uses the tiny tier's T = 128, W = C = s = 32 (not T = 8192, W = 256)."""
    assert flops.main(["--size", "tiny", "--depth", "2"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "tier tiny (d=64, N*=400,000), K=2, T=128, V=50257, train.py's model flags --window 32 --gau_s 32 --chunk 32" in header


@pytest.mark.parametrize("kw", [dict(model="lrt"), dict(model="lrt", lrt_kv=True, lrt_subsets=3),
                                dict(model="lrt-think"), dict(model="lrt-think", n_thoughts=2, lrt_kv=True),
                                dict(model="lrt", depth=4), dict(model="lrt", depth=4, lrt_kv=True, lrt_subsets=3),
                                dict(model="lrt-think", depth=4, lrt_kv=True), dict(model="lrt", depth=5, lrt_src=4),
                                dict(model="lrt", depth=4, lrt_src=0)])
def test_counter_covers_lrt_settings(kw):
    """LRT's init pass, every refinement (n_j x S masked products), W_m and the private memory slot
    are matmuls the counter sees: without vocabulary padding it equals forward_macs exactly. At
    depth 3 the source block floor(2K/3) is the last, so the init pass runs it whole; at depth 4
    (source 2) and with --lrt_src 0 it skips the last block's attention and MLP; at depth 5 with
    --lrt_src 4 the source is the last block again."""
    cfg = small(kw.pop("model"), vocab_size=128, **kw)
    assert counted_macs(cfg, 13) == flops.forward_macs(cfg, 13)["total"]


def test_every_registered_model_names_a_mac_formula():
    """Every registry row names its MAC formula (models.ModelSpec.macs), a function of flops.py, so
    forward_macs never raises for a registered model (its values: test_counter_matches_expected_exactly)."""
    for name, spec in models.REGISTRY.items():
        fn = spec.macs if callable(spec.macs) else getattr(flops, spec.macs, None)
        assert callable(fn) and fn.__module__ == "flops", name


# ----------------------------------------------------------------------------- the model train.py builds

def train_py_config(model, size, depth, block_size, vocab_size, tmp_path, *flags):
    """The ModelConfig train.py builds for these flags, through its own parsing, flag checks, tier
    defaults (harness.config.resolve_args) and models.model_config; independent of flops.train_config."""
    import train
    from harness.config import check_model_flags, resolve_args
    argv = ["--model", model, "--size", size, "--depth", str(depth), "--block_size", str(block_size), "--device", "cpu",
            "--out_dir", str(tmp_path / "out"), "--data_root", str(tmp_path / "data"), *flags]
    args = train.parse_args(argv)
    check_model_flags(model, train.given_flags(argv))
    return models.model_config(resolve_args(args), vocab_size)[0]


def flags_for(model, flags):
    """The flag/value pairs of `flags` that train.py accepts for --model model (it refuses a model
    flag the model does not read): --width and the model's own flags."""
    read = {"--width"} | {f"--{f}" for f in models.spec_of(model).flags}
    return [x for k, v in zip(flags[::2], flags[1::2]) if k in read for x in (k, v)]


def cli_rows(out):
    """flops.main's printed rows: model -> (width, non-embedding params), and the header line."""
    lines = out.splitlines()
    return {ln.split()[0]: (int(ln.split()[1]), int(ln.split()[2].replace(",", ""))) for ln in lines[2:]}, lines[0]


@pytest.mark.parametrize("size, flags", [("tiny", []), ("cpu", []), ("tiny", ["--chunk", "16", "--gau_s", "64"]),
                                         ("cpu", ["--window", "8", "--width", "512"])])
def test_cli_builds_the_models_train_py_builds(size, flags, tmp_path, capsys):
    """Every row is the model `train.py --size SIZE --depth 4 --block_size 128` builds (same flags),
    with the tier's s, C and W rather than ModelConfig's 128, 256, 256 (tiny: GAU width 2072 /
    400,128 parameters, not 2040 / 400,512), and the header states the tier's --window/--chunk/--gau_s."""
    from harness.config import TIER_DEFAULTS
    assert flops.main(["--size", size, "--depth", "4", "--block_size", "128", "--vocab_size", "100", *flags]) == 0
    rows, header = cli_rows(capsys.readouterr().out)
    assert list(rows) == list(models.REGISTRY)
    for m in rows:
        cfg = train_py_config(m, size, 4, 128, 100, tmp_path, *flags_for(m, flags))
        assert rows[m] == (cfg.width, models.count_params(cfg)), m
    given = dict(zip(flags[::2], flags[1::2]))
    for flag in ("window", "chunk", "gau_s"):
        assert f"--{flag} {given.get('--' + flag, TIER_DEFAULTS[size][flag])}" in header
    assert "T=128, V=100" in header


@pytest.mark.parametrize("name", list(models.REGISTRY))
def test_a_parameter_count_draws_no_weights_and_equals_the_built_models(name, monkeypatch):
    """count_params builds on the meta device, where drawing the model's initial weights is only
    time (17 of flops.py --depth 100's 22 s); its count equals that of the model built on the CPU."""
    import common
    cfg = small(name)
    on_cpu = models.build_model(cfg).num_params()
    drawn = []
    monkeypatch.setattr(common.LM, "_init_weights", staticmethod(drawn.append))
    assert models.count_params(cfg) == on_cpu and drawn == []


def test_the_table_keeps_its_columns_apart_at_any_count(capsys):
    """A count of 16 characters or more (untied Transformer++ at --depth 1,000,000) ran into the
    width column ("4096" then "1,638,656,000,128" read as one number); the columns keep a space."""
    assert flops.main(["--size", "cpu", "--depth", "1000000", "--width", "4096"]) == 0
    rows, _ = cli_rows(capsys.readouterr().out)
    d, F = 128, 4096  # K (4 d^2 + 3 d F + 2 d) + d: attention, SwiGLU and two norms per block, the final norm
    assert rows["untied"] == (4096, 10**6 * (4 * d * d + 3 * d * F + 2 * d) + d) == (4096, 1_638_656_000_128)


def test_cli_model_flags_are_train_py_s_with_the_same_help():
    """flops.py declares train.py's model flags from the same declarations (--width's help included):
    each flag's help text and type are train.py's (flops.py writes the default into the text, as its
    flags have no default of their own)."""
    import argparse
    import re
    import train
    own = argparse.ArgumentParser()
    flops.add_train_model_flags(own)
    actions = lambda p: {a.dest: a for a in p._actions}
    mine, theirs = actions(own), actions(train.build_parser())
    for flag in flops.train_model_flags():
        text = re.sub(r" \(default: [^()]*\)$", "", mine[flag].help)
        assert (text, mine[flag].type) == (theirs[flag].help, theirs[flag].type), flag
