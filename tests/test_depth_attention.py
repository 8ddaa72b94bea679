"""Depth-Attention (depth_attention.py; arXiv 2606.05014): off switch, fast vs reference in float64,
cached decoding, the mixed values in the cache, gradients through the depth scores, parameter
counts, causality, candidate sets, MACs and a bf16 training step."""
import math

import pytest
import torch

from harness import checkpoint
from harness import config
import depth_attention as da
import flops
import models
import train
from common import ModelConfig, UsageError
from checks import assert_causal, assert_finite_differences, tokens

TIED = {"depth-attn": "untied", "loop-depth-attn": "loop"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def cfg(name="depth-attn", **kw):
    base = dict(model=name, vocab_size=61, block_size=32, n_embd=64, n_head=2, depth=4, width=48)
    return ModelConfig(**{**base, **kw})


def build(c, seed=0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    return models.build_model(c, **kw).to(dtype).eval()


def test_candidate_sets():
    # paper default, K = 8: stride floor(8/2) = 4 -> C(l) = {0} for 0 < l <= 4, {0, 4} above
    assert [da.candidates(l, 4, 0) for l in range(8)] == [[], [0], [0], [0], [0], [0, 4], [0, 4], [0, 4]]
    assert [da.candidates(l, 1, 0) for l in range(4)] == [[], [0], [0, 1], [0, 1, 2]]  # stride 1: all j < l
    assert [da.candidates(l, 0, 0) for l in range(3)] == [[], [0], [0, 1]]
    assert [da.candidates(l, 3, 1) for l in range(6)] == [[], [0], [0, 1], [0, 2], [0, 3], [0, 3, 4]]
    assert [da.candidates(l, -1, 2) for l in range(4)] == [[], [0], [0, 1], [1, 2]]
    assert all(da.candidates(l, -1, 0) == [] for l in range(8))
    rule = lambda l, s, r: sorted({j for j in range(l) if s >= 0 and (s <= 1 or j % s == 0) or j >= l - r})
    assert all(da.candidates(l, s, r) == rule(l, s, r) for l in range(20) for s in range(-1, 22) for r in range(22))
    body = build(cfg(depth=8)).body
    assert body.candidates[7] == [0, 4]  # da_stride 0 -> floor(K/2)


@pytest.mark.parametrize("name", list(TIED))
def test_off_switch_equals_transformer_pp(name):
    """da_stride = -1, da_recent = 0: no candidates anywhere, the same weights give the same logits."""
    m = build(cfg(name, da_stride=-1))
    base = build(cfg(TIED[name]), seed=5)
    base.load_state_dict(m.state_dict())  # same parameter names as Transformer++
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(m(idx)[0], base(idx)[0])
        # and the method is on by default: different logits
        on = build(cfg(name))
        on.load_state_dict(m.state_dict())
        assert (on(idx)[0] - base(idx)[0]).abs().max() > 1e-4


def test_depth_mix_fast_equals_reference_and_weights_sum_to_one():
    g = torch.Generator().manual_seed(0)
    r = lambda: torch.randn(2, 3, 7, 32, generator=g, dtype=torch.float64)
    q, k, v, sk, sv = r(), r(), r(), [r(), r()], [r(), r()]
    out, w = da.depth_mix(q, k, v, sk, sv)
    ref, wr = da.depth_mix_reference(q, k, v, sk, sv)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w, wr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 7, dtype=torch.float64))
    # a literal position: w = softmax(<q, k_j> / sqrt(32)), v~ = sum_j w_j v_j
    s = torch.stack([q[1, 2, 4] @ kk[1, 2, 4] for kk in (sk[0], sk[1], k)]) / math.sqrt(32)
    ww = torch.exp(s) / torch.exp(s).sum()
    torch.testing.assert_close(out[1, 2, 4], ww[0] * sv[0][1, 2, 4] + ww[1] * sv[1][1, 2, 4] + ww[2] * v[1, 2, 4])


@pytest.mark.parametrize("name", list(TIED))
def test_fast_equals_reference_float64_outputs_and_gradients(name):
    c = cfg(name, da_recent=1, da_stride=2)
    fast = build(c, dtype=torch.float64)
    ref = build(c, dtype=torch.float64, impl="reference")
    ref.load_state_dict(fast.state_dict())
    idx = tokens()
    lf, lossf = fast(idx, idx)
    lr, lossr = ref(idx, idx)
    torch.testing.assert_close(lf, lr, rtol=1e-10, atol=1e-10)
    lossf.backward()
    lossr.backward()
    for (n, a), b in zip(fast.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11, msg=n)


@pytest.mark.parametrize("name", list(TIED))
@pytest.mark.parametrize("split", [1, 5, 11])
def test_cached_decode_equals_full_forward(name, split):
    m = build(cfg(name, depth=5, da_recent=1))  # C = {0, 2} U recent: up to 3 candidates
    idx = tokens(T=14)
    with torch.no_grad():
        full = m(idx)[0]
        cache = {}
        parts = [m(idx[:, :split], cache=cache)[0]]
        for t in range(split, 14, 2):  # two tokens per step, then one at the end
            parts.append(m(idx[:, t:t + 2], cache=cache)[0])
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(TIED))
def test_cache_holds_the_mixed_values(name):
    m = build(cfg(name))
    idx = tokens()
    with torch.no_grad():
        m.body.record = True
        m(idx)
        mixed = m.body.mixed  # v~^l of the full forward
        cache = {}
        m(idx, cache=cache)
    assert set(cache) == {"len", 0, 1, 2, 3} and all(set(cache[l]) == {"k", "v"} for l in range(4))
    for l in range(4):
        torch.testing.assert_close(cache[l]["v"], mixed[l], rtol=0, atol=1e-6)
    # layer 0 has no candidates (its value is v); the others do mix, so v~ != v
    u = m.body.blocks[0].norm1(m.wte(idx))
    _, _, v = m.body.blocks[0].attn.qkv(u).split(64, -1)
    torch.testing.assert_close(cache[0]["v"], v.view(2, 12, 2, 32).transpose(1, 2))
    # per-layer depth weights sum to one (the experiment reports their means)
    assert len(m.body.weights) == 3 and all(torch.allclose(w.sum(-1), torch.ones(())) for w in m.body.weights)


def test_gradient_reaches_earlier_keys_through_depth_scores():
    """T = 1: layer 0's attention has one key (softmax weight 1), so in Transformer++ its W_k gets
    no gradient; with Depth-Attention its key enters the depth scores of layers 1..3, and the
    gradient is non-zero and equals a central finite difference (float64)."""
    c = cfg(depth=4)
    m = build(c, dtype=torch.float64)
    base = build(cfg("untied"), dtype=torch.float64)
    base.load_state_dict(m.state_dict())
    idx = tokens(B=1, T=1)
    proj = torch.randn(1, 1, 61, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    f = lambda model: (model(idx)[0] * proj).sum()  # a fixed projection of the float64 logits
    for model in (m, base):
        f(model).backward()
    wk = lambda model: model.body.blocks[0].attn.qkv.weight  # rows [q; k; v]
    assert wk(base).grad[64:128].abs().max() < 1e-15  # zero up to rounding
    g = wk(m).grad[64:128]
    assert g.abs().max() > 1e-8
    assert_finite_differences(lambda: f(m), [wk(m)], at=64 * 64 + int(g.abs().argmax()), rtol=1e-6)  # a key row


@pytest.mark.parametrize("name", list(TIED))
def test_parameter_count_literal(name):
    c = cfg(name)
    d, F, K = 64, 48, 4
    blocks = K if name == "depth-attn" else 1
    expected = blocks * (4 * d * d + 3 * d * F + 2 * d) + d
    assert models.count_params(c) == expected == models.count_params(cfg(TIED[name]))
    assert models.width_multiple(c) == 8


@pytest.mark.parametrize("name", list(TIED))
def test_causality(name):
    assert_causal(build(cfg(name)), tokens(), 7)


def test_depth_macs_literal():
    c = cfg(depth=8, width=48)  # C = {0}x4, {0,4}x3: sum (|C| + 1) = 4*2 + 3*3 = 17
    T, d = 10, 64
    assert flops.depth_extra_macs(c, T) == 17 * T * d
    base = flops.forward_macs(cfg("untied", depth=8), T)
    got = flops.forward_macs(c, T)
    assert got["scores"] - base["scores"] == got["mix"] - base["mix"] == 17 * T * d
    assert got["total"] - base["total"] == 2 * 17 * T * d
    assert flops.depth_extra_macs(cfg(depth=8, da_stride=-1), T) == 0


@pytest.mark.parametrize("kw,flag", [(dict(da_stride=-2), "--da_stride"), (dict(da_recent=-1), "--da_recent")])
def test_bad_flags(kw, flag):
    with pytest.raises(UsageError, match=flag):
        models.build_model(cfg(**kw))


def test_train_flags_reach_the_config():
    args = train.parse_args(["--model", "loop-depth-attn", "--size", "tiny", "--da_stride", "3", "--da_recent", "2",
                             "--block_size", "32", "--window", "8", "--chunk", "8", "--gau_s", "32"])
    c, _ = config.model_config(args, 61)
    assert (c.da_stride, c.da_recent) == (3, 2)
    assert "da_stride" in checkpoint.IDENTITY_FLAGS and "da_recent" in checkpoint.IDENTITY_FLAGS


@pytest.mark.parametrize("name", ["depth-attn", "loop-depth-attn"])
@pytest.mark.parametrize("flag", ["--da_recent", "--da_stride"])
def test_depth_flags_at_one_layer_are_refused(name, flag):
    """At --depth 1 no layer has an earlier one (C(0) is empty): --da_recent and --da_stride would do
    nothing, a one-line refusal; at --depth 2 they act."""
    import checks
    got = checks.idle_check(["--model", name, "--depth", "1", flag, "1"])
    assert got == f"{flag}: does nothing for --model {name} at --depth 1 (no earlier layer to attend to); drop the flag"
    assert not isinstance(checks.idle_check(["--model", name, "--depth", "2", flag, "1"]), str)
