"""Tests for GAU and FLASH (baselines.py; MATH.md, "GAU and FLASH"): chunked FLASH vs the explicit T x T
reference, FLASH == GAU when one chunk covers the sequence, causality, cached decoding, parameter
formulas, width solving at the paper tiers, and a short training run."""
import pytest
import torch

import baselines
import models
from common import ModelConfig, UsageError

TIERS = [(512, 16, 44_270_000), (768, 24, 121_400_000)]  # 70M, 160M (models.TIERS)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def small_cfg(model, **kw):
    base = dict(model=model, vocab_size=61, block_size=16, n_embd=64, n_head=2, depth=3,
                width=48, gau_s=64, chunk=4)
    base.update(kw)
    return ModelConfig(**base)


def build(cfg, seed=0, dtype=torch.float64, **kw):
    """Model whose mixing is far from negligible (at the default init the relu^2 kernel is small, so
    the attention part barely moves the logits and comparisons would be vacuous)."""
    torch.manual_seed(seed)
    m = models.build_model(cfg, **kw).to(dtype)
    with torch.no_grad():
        for u in m.body.units:
            u.w_in.weight.normal_(0.0, 0.2)
            u.gamma.normal_(0.0, 0.7)
            u.beta.normal_(0.0, 0.3)
            u.wo.weight.normal_(0.0, 0.05)
    return m


def tokens(cfg, B=2, T=15, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (B, T), generator=g)


def close(a, b, tol=1e-10):
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape
    scale = max(1.0, float(b.abs().max()))
    assert float((a - b).abs().max()) <= tol * scale, float((a - b).abs().max())


# ----------------------------------------------------------------------------- FLASH mixing

@pytest.mark.parametrize("T,C", [(16, 4), (13, 4), (21, 8), (3, 8), (8, 8)])
def test_flash_chunked_matches_reference(T, C):
    g = torch.Generator().manual_seed(T * 100 + C)
    B, s, e = 2, 6, 5
    xs = [torch.randn(B, T, n, generator=g, dtype=torch.float64, requires_grad=True) for n in (s, s, s, s, e)]
    ref = baselines.flash_reference(*xs, C)
    out = baselines.flash_chunked(*xs, C)
    close(out, ref, 1e-12)
    w = torch.randn(B, T, e, generator=g, dtype=torch.float64)
    g_ref = torch.autograd.grad((ref * w).sum(), xs)
    g_out = torch.autograd.grad((out * w).sum(), xs, allow_unused=True)  # one chunk: no global part
    for x, a, b in zip(xs, g_out, g_ref):
        close(torch.zeros_like(x) if a is None else a, b, 1e-12)
    if T > C:  # the global part is really exercised: dropping it changes the result
        no_global = baselines.flash_reference(*xs[:2], torch.zeros_like(xs[2]), xs[3], xs[4], C)
        assert float((no_global - ref).detach().abs().max()) > 1e-3


@pytest.mark.parametrize("tie", [True, False])
def test_flash_model_fast_matches_reference(tie):
    cfg = small_cfg("flash", tie_unit=tie)
    fast, ref = build(cfg), build(cfg, impl="reference")
    ref.load_state_dict(fast.state_dict())
    idx = tokens(cfg, T=14)  # 14 = 3 full chunks of 4 + 2 (right padding in the fast path)
    tgt = tokens(cfg, T=14, seed=2)
    lf, lossf = fast(idx, tgt)
    lr, lossr = ref(idx, tgt)
    close(lf, lr)
    lossf.backward()
    lossr.backward()
    pr = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        close(p.grad, pr[name].grad)


def test_flash_equals_gau_when_one_chunk_covers_sequence():
    C = 16
    g_cfg = small_cfg("gau", block_size=C)
    f_cfg = small_cfg("flash", chunk=C)
    gau, fl = build(g_cfg, seed=3), build(f_cfg, seed=4)  # FLASH's global heads stay random
    with torch.no_grad():
        for ug, uf in zip(gau.body.units, fl.body.units):
            uf.norm.weight.copy_(ug.norm.weight)
            uf.w_in.weight.copy_(ug.w_in.weight)
            uf.wo.weight.copy_(ug.wo.weight)
            uf.gamma[:2].copy_(ug.gamma)  # GAU (Q, K) -> FLASH local (Q_q, K_q)
            uf.beta[:2].copy_(ug.beta)
        fl.wte.weight.copy_(gau.wte.weight)
        fl.norm_f.weight.copy_(gau.norm_f.weight)
    for T in (C, 11):
        idx = tokens(g_cfg, T=T)
        close(fl(idx)[0], gau(idx)[0])


# ----------------------------------------------------------------------------- causality, RoPE

@pytest.mark.parametrize("model", ["gau", "flash"])
def test_causal(model):
    cfg = small_cfg(model)
    m = build(cfg)
    idx = tokens(cfg, B=1, T=14)
    base = m(idx)[0]
    for t in (2, 5, 7, 11):  # with C = 4, t + 1 inside a chunk and at a chunk start (8, 12)
        alt = idx.clone()
        alt[0, t + 1] = (alt[0, t + 1] + 1) % cfg.vocab_size
        out = m(alt)[0]
        close(out[:, :t + 1], base[:, :t + 1], 1e-13)
        diff = (out[0, t + 1:] - base[0, t + 1:]).detach().abs().amax(-1)
        # position t + 1 itself and later positions change (not necessarily every one: relu can
        # zero a pair's score in every application, which cuts that pair exactly)
        assert float(diff[0]) > 1e-6 and float(diff[1:].max()) > 1e-6, diff
        assert int((diff[1:] > 1e-6).sum()) >= len(diff[1:]) // 2, diff


@pytest.mark.parametrize("model", ["gau", "flash"])
def test_rope_relative_positions(model):
    """RoPE in 32-dim groups keeps scores functions of i - j: shifting all position ids is a no-op."""
    cfg = small_cfg(model)
    m = build(cfg)
    idx = tokens(cfg, T=10)
    close(m(idx, positions=torch.arange(10) + 37)[0], m(idx)[0], 1e-9)


# ----------------------------------------------------------------------------- decoding

@pytest.mark.parametrize("model", ["gau", "flash"])
@pytest.mark.parametrize("tie", [True, False])
def test_cached_decoding_matches_full_forward(model, tie):
    cfg = small_cfg(model, tie_unit=tie)
    m = build(cfg)
    idx = tokens(cfg, T=15)
    full = m(idx)[0]
    for P in (1, 3, 4, 6, 8):  # prefill shorter than, equal to, and past chunk boundaries (C = 4)
        cache = {}
        outs = [m(idx[:, :P], cache=cache)[0]]
        for t in range(P, 15):
            outs.append(m(idx[:, t:t + 1], cache=cache)[0])
        close(torch.cat(outs, 1), full)
        assert cache["len"] == 15
    cache = {}  # several new tokens in one cached call (e.g. latent tokens) also match
    outs = [m(idx[:, :5], cache=cache)[0], m(idx[:, 5:11], cache=cache)[0], m(idx[:, 11:], cache=cache)[0]]
    close(torch.cat(outs, 1), full)


def test_flash_decoding_state_is_chunked():
    cfg = small_cfg("flash", depth=1)
    m = build(cfg)
    idx = tokens(cfg, T=11)
    cache = {}
    m(idx[:, :6], cache=cache)
    st = cache[0]
    assert st["n"] == 6 and st["kq"].shape[1] == 2 and st["state"].shape == (2, cfg.gau_s, cfg.width)
    for t in range(6, 11):
        m(idx[:, t:t + 1], cache=cache)
    assert cache[0]["n"] == 11 and cache[0]["v"].shape[1] == 3  # 11 = 2 full chunks + 3


def test_generate_runs():
    cfg = small_cfg("flash")
    m = build(cfg)
    out = m.generate(tokens(cfg, T=5), 7, temperature=0)
    assert out.shape == (2, 12)


# ----------------------------------------------------------------------------- parameters, widths

@pytest.mark.parametrize("model,n_so", [("gau", 2), ("flash", 4)])
@pytest.mark.parametrize("tie", [True, False])
def test_parameter_formula(model, n_so, tie):
    for d, H, e, s, K in [(64, 2, 48, 64, 3), (128, 4, 200, 128, 4)]:
        cfg = ModelConfig(model=model, vocab_size=97, n_embd=d, n_head=H, depth=K, width=e, gau_s=s, tie_unit=tie)
        units = 1 if tie else K
        expect = units * (3 * d * e + d * s + 2 * n_so * s + d) + d
        assert models.build_model(cfg).num_params() == expect
        assert models.count_params(cfg) == expect


@pytest.mark.parametrize("model", ["gau", "flash"])
@pytest.mark.parametrize("K", [4, 8, 16])
@pytest.mark.parametrize("tie", [True, False])
def test_paper_tier_widths(model, K, tie):
    for d, H, target in TIERS:
        cfg = models.solve_width(ModelConfig(model=model, n_embd=d, n_head=H, depth=K, tie_unit=tie), target)
        assert cfg.width % 8 == 0  # e has no head structure: multiples of 8 (its models.REGISTRY row)
        assert abs(models.count_params(cfg) / target - 1) <= models.TOLERANCE


def test_bad_config():
    with pytest.raises(UsageError, match="gau_s"):
        models.build_model(small_cfg("gau", gau_s=48))
    with pytest.raises(UsageError, match="chunk"):
        models.build_model(small_cfg("flash", chunk=0))
    assert ModelConfig.from_dict(small_cfg("flash", tie_unit=False).to_dict()).tie_unit is False


# ----------------------------------------------------------------------------- training

def train(m, x, y, steps=25, lr=1e-2):
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        _, loss = m(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("model", ["gau", "flash"])
def test_training_lowers_loss(model):
    """A few AdamW steps on one fixed batch lower the loss, at the default init and with an active
    unit (larger scale-offset gains); in the second case the unit's own weights move too."""
    cfg = small_cfg(model, depth=2, width=64)
    x = tokens(cfg, B=4, T=16, seed=5)
    y = torch.roll(x, -1, 1)
    torch.manual_seed(0)
    losses = train(models.build_model(cfg), x, y)
    assert losses[-1] < losses[0] - 1.0, losses
    m = build(cfg, dtype=torch.float32)
    w0 = m.body.units[0].w_in.weight.detach().clone()
    losses = train(m, x, y)
    assert losses[-1] < losses[0] - 1.0, losses
    assert float((m.body.units[0].w_in.weight.detach() - w0).abs().max()) > 1e-3


def test_gau_unit_gets_usable_gradients_at_init():
    cfg = small_cfg("gau", depth=2, width=64, block_size=16)
    torch.manual_seed(0)
    m = models.build_model(cfg)
    x = tokens(cfg, B=4, T=16, seed=5)
    m(x, torch.roll(x, -1, 1))[1].backward()
    assert float(m.body.units[0].w_in.weight.grad.abs().max()) > 1e-6  # 3.5e-6 here; ~1e-13 with gamma ~ N(0, 0.02)
