"""PonderLM-2 (ponder.py; arXiv 2509.23184): zero thoughts = untied Transformer++, slot layout,
Jacobi exactness at N >= T - 1 against the sequential reference and cached decoding, the gap at
small N, gradients in float64, parameter counts, causality, MACs and a bf16 training step."""

import functools

import pytest
import torch

import checks
from harness import checkpoint
from harness import config
import flops
import models
import ponder
import train
from common import ModelConfig, UsageError, rope_cos_sin
from checks import assert_causal


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def cfg(**kw):
    base = dict(model="ponder", vocab_size=61, block_size=32, n_embd=64, n_head=2, depth=3, width=48)
    return ModelConfig(**{**base, **kw})


def build(c, seed=0, dtype=torch.float32, think_gain=None):
    torch.manual_seed(seed)
    m = models.build_model(c).to(dtype).eval()
    if think_gain is not None and c.n_thoughts > 0:  # thoughts at the token-input scale: a visible effect
        with torch.no_grad():
            m.body.think_norm.weight.fill_(think_gain)
    return m


tokens = functools.partial(checks.tokens, T=8)


def body_out(m, idx):
    T = idx.shape[1]
    cos, sin = rope_cos_sin(torch.arange(T), dtype=m.wte.weight.dtype)
    return m.wte(idx), cos, sin


def test_thought_norm_gain_starts_at_the_embedding_scale():
    """Norm_θ's gain starts at 0.02, the embedding's init std (the LM's init leaves it), so a thought
    input z = Norm_θ(H) starts with RMS 0.02, the scale of a token input; a gain of 1 (RMSNorm's
    default) would make thoughts 50x louder than tokens."""
    m = models.build_model(cfg(n_thoughts=2))
    assert torch.equal(m.body.think_norm.weight, torch.full((64,), 0.02))
    h = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        z = m.body.think_norm(h)
    torch.testing.assert_close(z.pow(2).mean(-1).sqrt(), torch.full((3, 5), 0.02), rtol=1e-4, atol=0)
    assert abs(m.wte.weight[:61].std().item() - 0.02) < 1e-3


def test_zero_thoughts_equals_untied():
    m = build(cfg(n_thoughts=0))
    base = build(cfg(model="untied"), seed=3)
    base.load_state_dict(m.state_dict())
    assert m.num_params() == base.num_params()
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(m(idx)[0], base(idx)[0])
        assert m.generate(idx[:, :3], 5, temperature=0).tolist() == base.generate(idx[:, :3], 5, temperature=0).tolist()


def test_slot_layout_order_positions_and_scored_slot():
    """Hand-built: n = 2 thoughts, T = 3. The pass sees slots (t,0), (t,1), (t,2) in that order, all at
    position t; the body returns the last slot's rows."""
    m = build(cfg(n_thoughts=2))
    body = m.body
    seen = []
    run = body.run

    def spy(x, cos, sin, cache=None, eager=False):
        seen.append((x.detach().clone(), cos.detach().clone()))
        return run(x, cos, sin, cache, eager)

    body.run = spy
    x = torch.arange(3, dtype=torch.float32).view(1, 3, 1).expand(1, 3, 64).contiguous()  # token t: all t
    z1, z2 = x + 10, x + 20
    cos, sin = rope_cos_sin(torch.tensor([5, 6, 7]))
    H = body.pass_(x, [z1, z2], cos, sin)
    seq, c = seen[-1]
    assert seq[0, :, 0].tolist() == [0, 10, 20, 1, 11, 21, 2, 12, 22]  # (t,0), (t,1), (t,2)
    torch.testing.assert_close(c[0, 0], rope_cos_sin(torch.tensor([5, 5, 5, 6, 6, 6, 7, 7, 7]))[0][0, 0])
    assert H.shape == (1, 3, 3, 64)
    # the forward returns H_{t,2}: the last pass's last slot of every token
    out = body(x, cos, sin)
    last = seen[-1][0]
    torch.testing.assert_close(out, run(last, seen[-1][1], rope_cos_sin(torch.tensor([5, 5, 5, 6, 6, 6, 7, 7, 7]))[1])
                               .view(1, 3, 3, 64)[:, :, 2])
    # passes: bootstrap 1 and 2 slots, N = 3 refinements and the final pass with 3 slots
    assert [s.shape[1] // 3 for s, _ in seen[1:]] == flops.ponder_slots(body_cfg := m.cfg) == [1, 2, 3, 3, 3, 3]
    assert body_cfg.jacobi == 3


@pytest.mark.parametrize("n", [1, 2])
def test_jacobi_at_n_T_minus_1_equals_sequential_reference_and_cached_generation(n):
    """Exact at N = n (T - 1) refinements (T - 1 for one thought); one fewer is not exact."""
    T = 7
    m = build(cfg(n_thoughts=n, jacobi=n * (T - 1) - 1), dtype=torch.float64, think_gain=1.0)
    idx = tokens(T=T)
    with torch.no_grad():
        x, cos, sin = body_out(m, idx)
        assert (m.body(x, cos, sin) - ponder.sequential_reference(m.body, x, cos, sin)).abs().max() > 1e-8
    m.body.jacobi = n * (T - 1)
    idx = tokens(T=T)
    with torch.no_grad():
        x, cos, sin = body_out(m, idx)
        ref = ponder.sequential_reference(m.body, x, cos, sin)
        full = m(idx)[0]
        torch.testing.assert_close(m.body(x, cos, sin), ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(full, m.logits(m.norm_f(ref)), rtol=1e-10, atol=1e-10)
        for split in (1, 3, 6):  # prefill (Jacobi, exact at T-1 >= split-1) then per-token decoding
            cache = {}
            parts = [m(idx[:, :split], cache=cache)[0]] + [m(idx[:, t:t + 1], cache=cache)[0] for t in range(split, T)]
            torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)
            assert set(cache[0]) == {"k", "v"} and cache[0]["k"].shape[2] == (n + 1) * T  # n + 1 KV rows per token


def test_small_jacobi_differs_and_gap_shrinks():
    T = 8
    errs = []
    for N in (0, 1, 2, 4, 7):
        m = build(cfg(jacobi=N), dtype=torch.float64, think_gain=1.0)
        idx = tokens(T=T)
        with torch.no_grad():
            x, cos, sin = body_out(m, idx)
            errs.append(float((m.body(x, cos, sin) - ponder.sequential_reference(m.body, x, cos, sin)).abs().max()))
    assert errs[0] > 1e-3 and errs[-1] < 1e-10, errs
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    # after the bootstrap and N refinements, tokens 0..N are exact, later ones are not (N = 2)
    m = build(cfg(jacobi=2), dtype=torch.float64, think_gain=1.0)
    with torch.no_grad():
        x, cos, sin = body_out(m, tokens(T=T))
        d = (m.body(x, cos, sin) - ponder.sequential_reference(m.body, x, cos, sin)).abs().amax((0, 2))
    assert d[:3].max() < 1e-10 and d[3:].min() > 1e-8, d


def test_training_draws_N_from_2_or_3():
    m = build(cfg()).train()
    seen = set()
    for s in range(12):
        m.body.rng_seed = s
        seen.add(m.body.iterations())
    assert seen == {2, 3}
    m.body.jacobi_random = False
    assert m.body.iterations() == 3
    m.eval()
    m.body.jacobi_random = True
    assert m.body.iterations() == 3


def test_gradients_float64_against_finite_differences():
    """Gradients through every Jacobi pass (the objective: a fixed random projection of the float64 logits)."""
    m = build(cfg(jacobi=2), dtype=torch.float64, think_gain=1.0)
    idx = tokens(B=1, T=5)
    proj = torch.randn(1, 5, 61, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    f = lambda: (m(idx)[0] * proj).sum()
    f().backward()
    checks.assert_finite_differences(f, (m.body.think_norm.weight, m.body.blocks[0].attn.qkv.weight, m.body.blocks[2].mlp.w2.weight))


@pytest.mark.parametrize("n", [0, 1, 3])
def test_parameter_count_literal(n):
    d, F, K = 64, 48, 3
    assert models.count_params(cfg(n_thoughts=n)) == K * (4 * d * d + 3 * d * F + 2 * d) + d + (d if n else 0)


def test_causality():
    assert_causal(build(cfg(), think_gain=1.0), tokens(), 5)


def test_macs_literal():
    d, F, K, T, V = 64, 48, 3, 10, 61
    blk = 4 * d * d + 3 * d * F
    m = flops.forward_macs(cfg(), T)  # n = 1, N = 3: passes with 1, 2, 2, 2, 2 slots: R = 9
    assert m["linear"] == 9 * T * K * blk
    assert m["scores"] == m["mix"] == (1 + 4 * 4) * T * T * d * K
    assert m["head"] == V * d * T
    assert flops.forward_macs(cfg(n_thoughts=0), T) == flops.forward_macs(cfg(model="untied"), T)


@pytest.mark.parametrize("kw,flag", [(dict(n_thoughts=-1), "--n_thoughts"), (dict(jacobi=-1), "--jacobi")])
def test_bad_flags(kw, flag):
    with pytest.raises(UsageError, match=flag):
        models.build_model(cfg(**kw))


def test_train_flags_reach_the_config():
    args = train.parse_args(["--model", "ponder", "--size", "tiny", "--n_thoughts", "2", "--jacobi", "5",
                             "--no-jacobi_random", "--block_size", "32", "--window", "8", "--chunk", "8",
                             "--gau_s", "32"])
    c, _ = config.model_config(args, 61)
    assert (c.n_thoughts, c.jacobi, c.jacobi_random) == (2, 5, False)
    assert {"n_thoughts", "jacobi"} <= set(checkpoint.IDENTITY_FLAGS) and "jacobi_random" not in checkpoint.IDENTITY_FLAGS


def test_bench_decode_rows_report_sequential_passes():
    """bench.py decode's PonderLM-2 row: n + 1 = 2 passes per token (one thought), and a positive
    median ms/token (the speed itself is benchmark output)."""
    from tools import bench_decode
    row = bench_decode.decode_row("ponder", "tiny", 2, 0, 4, 2, 1, vocab_size=61)
    assert row["passes"] == 2 and row["ms_per_token"] > 0


@pytest.mark.parametrize("extra, idle", [(["--n_thoughts", "0", "--jacobi", "5"], "jacobi"),
                                         (["--n_thoughts", "0", "--jacobi_random"], "jacobi_random"),
                                         (["--n_thoughts", "1", "--jacobi", "5"], None),
                                         (["--n_thoughts", "0"], None)])
def test_jacobi_flags_without_thoughts_are_refused(extra, idle):
    """--jacobi and --jacobi_random refine thought slots: given with --n_thoughts 0 (PonderLM-2 without
    thoughts is Transformer++) they would do nothing, so train.py refuses them in one line (the
    registry row's idle rule); with thoughts, or left at their defaults, they pass."""
    import train
    from harness.config import check_flags
    argv = ["--model", "ponder", "--size", "tiny", "--depth", "2", "--device", "cpu", *extra]
    run = lambda: check_flags(train.parse_args(argv), train.given_flags(argv))
    if idle is None:
        assert run().n_thoughts == int(extra[1])
    else:
        with pytest.raises(UsageError, match=rf"^--{idle}: does nothing for --model ponder with --n_thoughts 0 "
                                             r"\(no thought slots to refine\); drop the flag$"):
            run()
