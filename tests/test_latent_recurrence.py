"""LRT and LRT with thought tokens (latent_recurrence.py; arXiv 2605.26797 and the seed paper,
reconstructed): off switches (W_m = 0), slot layout, exactness of the parallel training forward at
one slot per subset (= sequential reference = cached decoding) and at k = 1 (= the two-pass
reference), causality, gradients in float64, parameter counts, MACs and flags."""

import functools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import checks
from harness import checkpoint
from harness import config
import flops
import latent_recurrence as lr
import models
import train
from common import VOCAB_MULTIPLE, ModelConfig, UsageError, rope_cos_sin
from checks import assert_causal, embed

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
F64 = torch.float64


def cfg(name="lrt", **kw):
    base = dict(model=name, vocab_size=61, block_size=32, n_embd=64, n_head=2, depth=3, width=48)
    return ModelConfig(**{**base, **kw})


def build(c, seed=0, dtype=F64, w_m=0.3):
    """A model of c whose memory map W_m is drawn with std w_m (0 keeps its zero init)."""
    torch.manual_seed(seed)
    m = models.build_model(c).to(dtype).eval()
    if w_m:
        with torch.no_grad():
            m.body.w_m.normal_(0, w_m)
    return m


tokens = functools.partial(checks.tokens, T=7)


# ----------------------------------------------------------------------------- off switches

def test_lrt_with_zero_memory_map_equals_untied():
    m = build(cfg(), w_m=0)  # W_m = 0: its init
    base = build(cfg(model="untied"), seed=3, w_m=0)
    missing, unexpected = base.load_state_dict(m.state_dict(), strict=False)
    assert missing == [] and sorted(unexpected) == ["body.mem_norm.weight", "body.w_m"]
    idx = tokens(T=9)
    with torch.no_grad():
        torch.testing.assert_close(m(idx)[0], base(idx)[0], rtol=1e-12, atol=1e-12)
        assert m.generate(idx[:, :3], 5, temperature=0).tolist() == base.generate(idx[:, :3], 5, temperature=0).tolist()
    assert m.num_params() == base.num_params() + 64 * 64 + 64


def test_lrt_think_with_zero_memory_map_is_a_two_slot_transformer():
    """W_m = 0: Transformer++ over the slots [e(x_0), e_θ, e(x_1), e_θ, ...] at positions 0, 0, 1, 1, ...,
    scored at the thought slots (their content arrives through attention only)."""
    m = build(cfg("lrt-think"), w_m=0)
    base = build(cfg(model="untied"), seed=3, w_m=0)
    base.load_state_dict(m.state_dict(), strict=False)
    idx = tokens(T=6)
    with torch.no_grad():
        x = m.wte(idx)
        seq = torch.stack((x, m.body.thought[0].expand_as(x)), 2).reshape(2, 12, 64)
        cos, sin = rope_cos_sin(torch.arange(6).repeat_interleave(2), dtype=F64)
        want = base.body(seq, cos, sin)[:, 1::2]
        torch.testing.assert_close(m.body(*embed(m, idx)), want, rtol=1e-12, atol=1e-12)
        assert (want - base.body(seq, cos, sin)[:, 0::2]).abs().max() > 1e-3  # the slots differ


# ----------------------------------------------------------------------------- slot layout

def test_slot_layout_order_positions_and_scored_slot():
    """Hand-built: n = 2 thoughts, T = 3, positions 5, 6, 7. The init pass sees the rows
    (t,0) = token t, (t,1) = e_θ,1, (t,2) = e_θ,2, all at position t; the body returns slot (t,2)."""
    m = build(cfg("lrt-think", n_thoughts=2), dtype=torch.float32, w_m=0)
    body = m.body
    with torch.no_grad():
        body.thought.copy_(torch.tensor([[10.0], [20.0]]).expand(2, 64))
    seen = []
    rows = body.rows

    def spy(x, cos, sin, *a, **k):
        seen.append((x.detach().clone(), cos.detach().clone()))
        return rows(x, cos, sin, *a, **k)

    body.rows = spy
    x = torch.arange(3, dtype=torch.float32).view(1, 3, 1).expand(1, 3, 64).contiguous()
    cos, sin = rope_cos_sin(torch.tensor([5, 6, 7]))
    out = body(x, cos, sin)
    init, c = seen[0]
    assert init[0, :, 0].tolist() == [0, 10, 20, 1, 10, 20, 2, 10, 20]
    torch.testing.assert_close(c, rope_cos_sin(torch.tensor([5, 5, 5, 6, 6, 6, 7, 7, 7]))[0])
    # k = 2 refinements: the even rows, then the odd rows
    assert [s[0][0, :, 0].tolist() for s in seen[1:]] == [[0, 20, 10, 2, 20], [10, 1, 20, 10]]
    full = rows(init, c, rope_cos_sin(torch.tensor([5, 5, 5, 6, 6, 6, 7, 7, 7]))[1])[0]  # W_m = 0: one pass
    torch.testing.assert_close(out, full.view(1, 3, 3, 64)[:, :, 2])


# ----------------------------------------------------------------------------- exactness

@pytest.mark.parametrize("name,kv", [("lrt", False), ("lrt-think", False), ("lrt", True), ("lrt-think", True)])
def test_one_slot_per_subset_equals_sequential_reference_and_cached_decoding(name, kv):
    T = 6
    m = build(cfg(name, lrt_kv=kv, lrt_subsets=2 * T))  # S <= 2T slots: one per subset
    idx = tokens(T=T)
    with torch.no_grad():
        x, cos, sin = embed(m, idx)
        ref = lr.sequential_reference(m.body, x, cos, sin)
        torch.testing.assert_close(m.body(x, cos, sin), ref, rtol=1e-10, atol=1e-10)
        full = m(idx)[0]
        torch.testing.assert_close(full, m.logits(m.norm_f(ref)), rtol=1e-10, atol=1e-10)
        for split in (1, 4):  # prefill (parallel, exact at k >= S) then one token at a time
            cache = {}
            parts = [m(idx[:, :split], cache=cache)[0]] + [m(idx[:, t:t + 1], cache=cache)[0] for t in range(split, T)]
            torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)
            slots = T * (2 if name == "lrt-think" else 1)
            assert all(k.shape[2] == slots for k, _ in cache["kv"])  # one KV row per slot and block
        m.body.subsets = 2  # the default k is an approximation: it differs from the exact model
        assert (m.body(x, cos, sin) - ref).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["lrt", "lrt-think"])
def test_one_subset_equals_the_two_pass_reference(name):
    m = build(cfg(name, lrt_subsets=1))
    idx = tokens(T=6)
    with torch.no_grad():
        x, cos, sin = embed(m, idx)
        two = lr.two_pass_reference(m.body, x, cos, sin)
        torch.testing.assert_close(m.body(x, cos, sin), two, rtol=1e-12, atol=1e-12)
        assert (two - lr.sequential_reference(m.body, x, cos, sin)).abs().max() > 1e-4


def test_sequential_reference_memory_by_hand():
    """Two tokens of lrt at K = 1 (src = tgt = 0): slot 1's input is e(x_1) + W_m RMSNorm_m(z_0(slot 0))."""
    m = build(cfg(depth=1))
    idx = tokens(B=1, T=2)
    with torch.no_grad():
        x, cos, sin = embed(m, idx)
        z0, _ = lr.with_memory(m.body, x[:, :1], cos[:, :, :1], sin[:, :, :1], None)
        m1 = m.body.mem_norm(z0[:, 0])
        x1 = x.clone()
        x1[:, 1] = x[:, 1] + m1 @ m.body.w_m.t()
        plain, _ = lr.with_memory(m.body, x1, cos, sin, None)
        torch.testing.assert_close(lr.sequential_reference(m.body, x, cos, sin), plain, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- causality, gradients

@pytest.mark.parametrize("name", ["lrt", "lrt-think"])
def test_causality(name):
    assert_causal(build(cfg(name, lrt_kv=True)), tokens(T=9), 5)


def test_gradients_float64_against_finite_differences():
    """Gradients through the init pass and the refinements (objective: a random projection of the logits)."""
    m = build(cfg("lrt-think", lrt_kv=True))
    idx = tokens(B=1, T=4)
    proj = torch.randn(1, 4, 61, generator=torch.Generator().manual_seed(0), dtype=F64)
    f = lambda: (m(idx)[0] * proj).sum()
    f().backward()
    checks.assert_finite_differences(f, (m.body.w_m, m.body.thought, m.body.mem_norm.weight, m.body.w_km.weight, m.body.blocks[0].attn.qkv.weight))


def test_detach_init_same_values_fewer_gradient_paths():
    idx = tokens(T=6)
    outs, grads = [], []
    for detach in (False, True):
        m = build(cfg(lrt_detach_init=detach)).train()
        logits, loss = m(idx, idx)
        loss.backward()
        outs.append(logits.detach())
        grads.append(m.body.blocks[2].mlp.w2.weight.grad.clone())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert (grads[0] - grads[1]).abs().max() > 1e-8


# ----------------------------------------------------------------------------- counts

@pytest.mark.parametrize("name,kw,extra", [("lrt", {}, 0), ("lrt", dict(lrt_kv=True), 2 * 64 * 64),
                                           ("lrt-think", {}, 64), ("lrt-think", dict(n_thoughts=3), 3 * 64),
                                           ("lrt-think", dict(n_thoughts=0), 0)])
def test_parameter_count_literal(name, kw, extra):
    d, F, K = 64, 48, 3
    assert models.count_params(cfg(name, **kw)) == K * (4 * d * d + 3 * d * F + 2 * d) + d + d * d + d + extra


def test_macs_literal():
    d, F, K, T, V = 64, 48, 3, 10, 61
    blk = 4 * d * d + 3 * d * F
    m = flops.forward_macs(cfg(), T)  # lrt: S = T rows, init pass + refinement
    assert m == {"linear": 2 * T * K * blk + T * d * d, "scores": 2 * T * T * d * K, "mix": 2 * T * T * d * K,
                 "head": V * d * T, "total": m["total"]} and m["total"] == sum(v for k, v in m.items() if k != "total")
    t = flops.forward_macs(cfg("lrt-think", lrt_kv=True), T)  # S = 2T rows, private memory slot
    assert t["linear"] == 4 * T * K * blk + 3 * 2 * T * d * d
    assert t["scores"] == t["mix"] == 2 * (2 * T) ** 2 * d * K + 2 * (2 * T) * d * K


@pytest.mark.parametrize("name,kv", [("lrt", False), ("lrt-think", True)])
def test_decode_macs_match_the_flop_counter(name, kv):
    """One decoded token after a 5-token prompt: FlopCounterMode (SDPA on the math path) sees
    flops.lrt_decode_macs, the head's vocabulary padding added."""
    c = cfg(name, lrt_kv=kv)
    m = build(c, dtype=torch.float32)
    idx = tokens(B=1, T=6)
    cache = {}
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        m(idx[:, :5], cache=cache)
        with FlopCounterMode(display=False) as fc:
            m(idx[:, 5:], cache=cache)
    L = 5 * (2 if name == "lrt-think" else 1)
    pad = (-61 % VOCAB_MULTIPLE) * 64
    assert fc.get_total_flops() // 2 == flops.lrt_decode_macs(c, L) + pad
    assert m.body.sequential_passes == (2 if name == "lrt-think" else 1)


# ----------------------------------------------------------------------------- flags

@pytest.mark.parametrize("kw,flag", [(dict(lrt_src=3), "--lrt_src"), (dict(lrt_src=-2), "--lrt_src"),
                                     (dict(lrt_tgt=3), "--lrt_tgt"), (dict(lrt_subsets=0), "--lrt_subsets"),
                                     (dict(model="lrt-think", n_thoughts=-1), "--n_thoughts")])
def test_bad_flags(kw, flag):
    with pytest.raises(UsageError, match=flag):
        models.build_model(cfg(**kw))


def test_default_source_block_is_upper_middle():
    assert [models.build_model(cfg(depth=K), device="meta").body.src for K in (1, 2, 3, 4, 8)] == [0, 1, 2, 2, 5]


def test_train_flags_reach_the_config():
    args = train.parse_args(["--model", "lrt-think", "--size", "tiny", "--lrt_src", "1", "--lrt_tgt", "1",
                             "--lrt_kv", "--lrt_subsets", "3", "--lrt_detach_init", "--n_thoughts", "2"])
    c, _ = config.model_config(args, 61)
    assert (c.lrt_src, c.lrt_tgt, c.lrt_kv, c.lrt_subsets, c.lrt_detach_init, c.n_thoughts) == (1, 1, True, 3, True, 2)
    assert {"lrt_src", "lrt_tgt", "lrt_kv", "lrt_subsets", "lrt_detach_init"} <= set(checkpoint.IDENTITY_FLAGS)


def test_bench_decode_rows_report_sequential_passes():
    """bench.py decode's rows for LRT: one pass per token for lrt, n + 1 for lrt-think (n = 1 thought
    slot), and a positive median ms/token (the speed itself is benchmark output; PonderLM-2's rows:
    tests/test_ponder.py)."""
    from tools import bench_decode
    rows = [bench_decode.decode_row(m, "tiny", 2, 0, 4, 2, 1, vocab_size=61) for m in ("lrt", "lrt-think")]
    assert [r["passes"] for r in rows] == [1, 2]
    assert all(r["ms_per_token"] > 0 for r in rows)
