"""Parallel loops (parallel_loops.py): loopstack, PLT (arXiv 2510.24824) and LoopFold (reconstructed from its
abstract). Cached decoding equals the training forward (PLT: one batched pass per token), the off
switches (LoopFold f = 1 and an oracle predictor = loopstack; PLT N = 1 unshifted = untied
Transformer++), the cross-loop shift, the G-SWA window and gate, parameter counts, causality, MACs
and the flags."""
import math

import pytest
import torch

from harness import checkpoint
from harness import config
import flops
import models
import parallel_loops
import train
from common import ModelConfig, UsageError, causal_attention
import checks
from checks import assert_causal, embed, tokens

NAMES = ("loopstack", "plt", "loopfold")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def cfg(name="plt", **kw):
    base = dict(model=name, vocab_size=61, block_size=32, n_embd=64, n_head=2, depth=4, n_core=2, width=48,
                plt_window=3)
    return ModelConfig(**{**base, **kw})


def build(c, seed=0, dtype=torch.float32, scale=0.05, **kw):
    """The model with every parameter moved off its init (zero-init predictor/corrector and gates
    included), so no term of the equations hides behind an init value."""
    torch.manual_seed(seed)
    m = models.build_model(c, **kw).to(dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


# ----------------------------------------------------------------------------- decoding = training forward

@pytest.mark.parametrize("name,kw", [("loopstack", {}), ("plt", {}), ("plt", dict(plt_shift=False)),
                                     ("loopfold", {}), ("loopfold", dict(fold=3, fold_layout="last", depth=5))])
def test_cached_decode_equals_full_forward(name, kw):
    """Prefill of 1, 4 or 9 tokens, then one token per step (a two-token step included): the logits
    equal the full forward's (fp32, atol 1e-5); T = 12 > W = 3, so PLT's window cache slides."""
    m = build(cfg(name, **kw))
    idx = tokens()
    with torch.no_grad():
        full = m(idx)[0]
        for split in (1, 4, 9):
            cache = {}
            parts = [m(idx[:, :split], cache=cache)[0]]
            t = split
            while t < 12:
                n = 2 if t == split and t + 2 <= 12 else 1
                parts.append(m(idx[:, t:t + n], cache=cache)[0])
                t += n
            torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)
        greedy = m.generate(idx[:, :3], 6, temperature=0)
    # generate (cached) continues with the argmax of the full forward on its own output
    with torch.no_grad():
        again = m(greedy[:, :-1])[0].argmax(-1)
    assert greedy[:, 3:].tolist() == again[:, 2:].tolist()


@pytest.mark.parametrize("shift,passes", [(True, 1), (False, 4)])
def test_plt_decode_runs_one_batched_pass_per_token(shift, passes, monkeypatch):
    """With the shift every decoded token is one call of the stack on all N = 4 loop rows; without it,
    N calls of one row; the window caches hold W keys, the shared loop-1 cache all of them."""
    m = build(cfg(plt_shift=shift))
    calls = []
    step = m.body.step
    monkeypatch.setattr(m.body, "step", lambda rows, l0, rope, cache: calls.append((rows.shape[0], l0))
                        or step(rows, l0, rope, cache))
    idx = tokens(B=1)
    cache = {}
    with torch.no_grad():
        m(idx[:, :5], cache=cache)
        for t in range(5, 8):
            m(idx[:, t:t + 1], cache=cache)
    assert len(calls) == 3 * passes and m.body.sequential_passes == passes
    assert calls[:passes] == ([(4, 1)] if shift else [(1, 1), (1, 2), (1, 3), (1, 4)])
    assert cache[1][0]["k"].shape == (1, 2, 8, 32)  # loop 1: every position
    assert all(cache[l][i]["k"].shape == (1, 2, 3, 32) for l in (2, 3, 4) for i in (0, 1))  # W = 3
    assert cache["carry"].shape == (3, 1, 1, 64)


# ----------------------------------------------------------------------------- off switches

@pytest.mark.parametrize("layout", ["first", "last"])
def test_loopfold_fold_1_equals_loopstack(layout):
    fold = build(cfg("loopfold", fold=1, fold_layout=layout), dtype=torch.float64)
    stack = build(cfg("loopstack"), seed=3, dtype=torch.float64)
    stack.load_state_dict(fold.state_dict())  # the same parameters: no predictor or corrector at f = 1
    assert fold.body.stages == [[0], [1], [2], [3]]
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(fold(idx)[0], stack(idx)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fold,layout,depth", [(2, "first", 5), (3, "first", 5), (2, "last", 4), (4, "last", 4)])
def test_loopfold_oracle_predictor_equals_loopstack(fold, layout, depth):
    """P(r) := R(r) (sequential): every error is 0 and LoopFold is the loop stack, for any f, in the full
    forward and in cached decoding; the learned (perturbed) predictor is not."""
    c = cfg("loopfold", fold=fold, fold_layout=layout, depth=depth)
    oracle = build(c, dtype=torch.float64, predictor="oracle")
    learned = build(c, dtype=torch.float64)
    stack = build(cfg("loopstack", depth=depth), seed=3, dtype=torch.float64)
    stack.load_state_dict(oracle.state_dict(), strict=False)
    learned.load_state_dict(oracle.state_dict())
    idx = tokens()
    with torch.no_grad():
        ref = stack(idx)[0]
        torch.testing.assert_close(oracle(idx)[0], ref, rtol=1e-12, atol=1e-12)
        cache = {}
        parts = [oracle(idx[:, :4], cache=cache)[0]] + [oracle(idx[:, t:t + 1], cache=cache)[0] for t in range(4, 12)]
        torch.testing.assert_close(torch.cat(parts, 1), ref, rtol=1e-12, atol=1e-12)
        assert (learned(idx)[0] - ref).abs().max() > 1e-4


def test_loopfold_correction_is_applied_to_the_predicted_rows():
    """Stages [loop 1], [loops 2, 3] by hand: u = R(e), then y = R(P(u)) + C(R(u) - P(u)), with the
    module's own P, C and R."""
    m = build(cfg("loopfold", depth=3, fold=2), dtype=torch.float64)
    x, cos, sin = embed(m, tokens())
    body = m.body
    with torch.no_grad():
        R = lambda r: body.run(r, cos, sin, 0, 1, None, None)
        u = R(x)
        r2 = body.predict(u)
        expected = R(r2) + body.correct(R(u) - r2)
        torch.testing.assert_close(body(x, cos, sin), expected, rtol=1e-12, atol=1e-12)
        # at init P and C are the identity maps
        fresh = models.build_model(cfg("loopfold")).body
        v = torch.randn(3, 64)
        assert torch.equal(fresh.predict(v), v + 0 * v) and torch.equal(fresh.correct(v), v)


@pytest.mark.parametrize("depth,fold,layout,stages", [(4, 3, "first", [[0], [1, 2, 3]]),
                                                      (6, 4, "first", [[0], [1, 2, 3, 4], [5]]),
                                                      (5, 4, "last", [[0, 1, 2, 3], [4]])])
def test_loopfold_wide_stages_equal_the_plain_recurrence(depth, fold, layout, stages):
    """f >= 3, where a wrong recurrence of the predicted rows shows (at f = 2 a stage has one
    predicted row): per stage (written out here, not from fold_stages), r_1 = u, r_{i+1} = P(r_i),
    o_i = R(r_i), y_1 = o_1, y_{i+1} = o_{i+1} + C(y_i - r_{i+1}); P, C and R as in the docstring,
    from the raw weights; every parameter moved off its init. Predicting every row from r_1, or
    correcting with o_i instead of y_i, passed every other test."""
    m = build(cfg("loopfold", depth=depth, fold=fold, fold_layout=layout), dtype=torch.float64, scale=0.2)
    assert m.body.stages == stages
    x, cos, sin = embed(m, tokens())
    b = m.body
    lin = torch.nn.functional.linear
    rms = lambda u, g: u / u.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * g
    P = lambda u: u + lin(torch.nn.functional.silu(lin(rms(u, b.pred_norm.weight), b.pred_w1)), b.pred_w2)
    C = lambda e: e + lin(lin(e, b.corr_v), b.corr_u)

    def R(h):
        for block in b.blocks:
            h = block(h, cos, sin)
        return h

    with torch.no_grad():
        u = x
        for stage in stages:
            r = [u]
            for _ in stage[1:]:
                r.append(P(r[-1]))
            o = [R(ri) for ri in r]
            y = o[0]
            for i in range(1, len(stage)):
                y = o[i] + C(y - r[i])
            u = y
        torch.testing.assert_close(b(x, cos, sin), u, rtol=1e-12, atol=1e-12)


def test_plt_unshifted_single_loop_equals_untied():
    m = build(cfg(plt_shift=False, depth=1), dtype=torch.float64)
    base = build(cfg("untied", depth=2), seed=3, dtype=torch.float64)  # untied Transformer++ on n_core = 2 blocks
    missing, _ = base.load_state_dict(m.state_dict(), strict=False)
    assert not missing
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(m(idx)[0], base(idx)[0], rtol=1e-12, atol=1e-12)
        assert m.generate(idx[:, :3], 5, temperature=0).tolist() == base.generate(idx[:, :3], 5, temperature=0).tolist()


# ----------------------------------------------------------------------------- the cross-loop shift

def loop2_inputs(m, idx):
    """The input rows x^2 of loop 2 (what block 0 receives there), (B, T, d)."""
    seen = []
    block = m.body.blocks[0]
    later = block.later
    block.later = lambda x, *a, **k: seen.append(x) or later(x, *a, **k)
    with torch.no_grad():
        m(idx)
    del block.later
    return seen[0]


@pytest.mark.parametrize("shift", [True, False])
def test_plt_shift_perturbation(shift):
    """Perturb token t = 5: the carried part x^2 - a e of loop 2 moves first at t + 1 with the shift
    (loop 2 at t + 1 reads loop 1 at t), at t without it; a, b are the learned scalars (init 1, 0.02)."""
    m = build(cfg(plt_shift=shift), scale=0.0)
    assert m.body.clp_a.item() == 1.0 and abs(m.body.clp_b.item() - 0.02) < 1e-9
    idx = tokens()
    other = idx.clone()
    other[:, 5] = (other[:, 5] + 7) % 61
    carried = lambda i: loop2_inputs(m, i) - m.body.clp_a * m.wte(i)
    with torch.no_grad():
        diff = (carried(idx) - carried(other)).abs().amax((0, 2))
        first = 6 if shift else 5
        assert diff[:first].max() < 1e-7 and diff[first:].min() > 1e-6, diff
        if shift:  # position 0 reads h_{-1} := 0: x^2_0 = a e_0
            torch.testing.assert_close(loop2_inputs(m, idx)[:, 0], m.wte(idx)[:, 0])


def test_plt_fixed_constant_scales():
    """clp_scales=(0.707, 0.053), the release's constants: buffers, not parameters; x^2_t =
    0.707 e_t + 0.053 Norm_loop(h^1_{t-1})."""
    c = cfg(depth=2)
    m = build(c, clp_scales=(0.707, 0.053))
    assert models.count_params(c) - m.num_params() == 2 and "body.clp_a" not in dict(m.named_parameters())
    idx = tokens()
    x, cos, sin = embed(m, idx)
    with torch.no_grad():
        h = x
        for block in m.body.blocks:
            h = block.first(h, cos, sin)[0]
        z = m.body.norm_loop(h)
        expected = 0.707 * x[:, 1:] + 0.053 * z[:, :-1]
        torch.testing.assert_close(loop2_inputs(m, idx)[:, 1:], expected)


def test_plt_norm_loop_is_the_final_norm():
    """Norm_loop is LM.norm_f (the LoopCoder-v2 release normalizes between loops with the model's final
    norm): one gain, saved once; after training moves it, the loop-2 input follows the final norm."""
    m = build(cfg(depth=2))
    assert m.body.norm_loop is m.norm_f and not any("norm_loop" in k for k in m.state_dict())
    idx = tokens()
    x, cos, sin = embed(m, idx)
    with torch.no_grad():
        m.norm_f.weight.mul_(torch.linspace(0.5, 2.0, 64))
        h = x
        for block in m.body.blocks:
            h = block.first(h, cos, sin)[0]
        z = torch.nn.functional.rms_norm(h, (64,), m.norm_f.weight, 1e-6)
        expected = m.body.clp_a * x[:, 1:] + m.body.clp_b * z[:, :-1]
        torch.testing.assert_close(loop2_inputs(m, idx)[:, 1:], expected)


# ----------------------------------------------------------------------------- G-SWA

def test_window_mask_allows_exactly_W_keys_including_self():
    for W in (1, 3, 20):
        mask = parallel_loops.window_mask(10, 10, W)
        assert mask.sum(1).tolist() == [min(W, i + 1) for i in range(10)]
        assert all(mask[i, i] and not mask[i, i + 1:].any() for i in range(10))
        assert all(mask[i, j] == (i - W < j <= i) for i in range(10) for j in range(10))
    # decoding alignment: 2 new queries after 5 cached keys, W = 3
    assert parallel_loops.window_mask(2, 7, 3).tolist() == [[False, False, False, True, True, True, False],
                                                 [False, False, False, False, True, True, True]]


def test_window_attention_fast_equals_reference_float64():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 32, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 3, 9, 32, generator=g, dtype=torch.float64)
    for W in (1, 4, 9):
        fast = parallel_loops.window_attention(q, k, v, W)
        ref = parallel_loops.window_attention_reference(q, k, v, W)
        torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
        gf = torch.autograd.grad(fast, (q, k, v), dout)
        gr = torch.autograd.grad(ref, (q, k, v), dout)
        for a, b in zip(gf, gr):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # W >= T: ordinary causal attention; W = 1: each query reads its own value
    torch.testing.assert_close(parallel_loops.window_attention(q, k, v, 9), causal_attention(q, k, v), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(parallel_loops.window_attention(q, k, v, 1), v, rtol=1e-12, atol=1e-12)


def test_gate_one_is_pure_global_attention_over_loop_1():
    m = build(cfg(), dtype=torch.float64)
    x, cos, sin = embed(m, tokens())
    block = m.body.blocks[0]
    with torch.no_grad():
        _, k1, v1 = block.first(x, cos, sin)
        h = x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(4), dtype=x.dtype)
        q = block.project(h, cos, sin)[0]
        g = block.gate(q)
        torch.testing.assert_close(g[..., 0], torch.sigmoid(torch.einsum("bhtc,hc->bht", q, block.gate_w)
                                                            + block.gate_b[:, None]))
        block.gate_b.fill_(100.0)  # sigmoid(100 + w . q) == 1 in float64
        assert torch.equal(block.gate(q), torch.ones_like(g))
        out = block.later(h, cos, sin, k1, v1, 3)
        torch.testing.assert_close(out, block.finish(h, causal_attention(q, k1, v1)), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(block.later(h, cos, sin, k1, v1, 1), out, rtol=1e-12, atol=1e-12)  # W irrelevant


def test_plt_gate_on_the_rotated_query_depends_on_absolute_position():
    """g = sigmoid(w . R_t q + c) reads the post-RoPE query (as specified), so shifting all positions
    by 37 changes PLT's logits; with w = 0 (constant gates) they are shift-invariant again."""
    m = build(cfg(), dtype=torch.float64, scale=0.3)
    idx = tokens()
    with torch.no_grad():
        moved = lambda: (m(idx, positions=torch.arange(12) + 37)[0] - m(idx)[0]).abs().max()
        assert moved() > 1e-4
        for block in m.body.blocks:
            block.gate_w.zero_()
        assert moved() < 1e-10


# ----------------------------------------------------------------------------- counts, stages, causality

def test_fold_stages():
    assert parallel_loops.fold_stages(9, 2) == [[0], [1, 2], [3, 4], [5, 6], [7, 8]]  # the seed: nine loops, five stages
    assert parallel_loops.fold_stages(9, 2, "last") == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
    assert parallel_loops.fold_stages(5, 3) == [[0], [1, 2, 3], [4]] and parallel_loops.fold_stages(1, 2) == parallel_loops.fold_stages(1, 2, "last") == [[0]]
    for N in range(1, 10):
        for f in (1, 2, 3):
            for layout in ("first", "last"):
                st = parallel_loops.fold_stages(N, f, layout)
                assert sum(st, []) == list(range(N)) and len(st) == 1 + math.ceil((N - 1) / f)
                assert max(map(len, st)) <= f


@pytest.mark.parametrize("name,kw", [("loopstack", {}), ("plt", {}), ("loopfold", {}), ("loopfold", dict(fold_rank=8)),
                                     ("plt", dict(n_core=3, depth=2))])
def test_parameter_count_formulas(name, kw):
    d, F, H = 64, 48, 2
    c = cfg(name, **kw)
    n, r = c.n_core, c.fold_rank or d // 4
    stack = n * (4 * d * d + 3 * d * F + 2 * d) + d
    expected = {"loopstack": stack, "plt": stack + n * (d + H) + 2, "loopfold": stack + 2 * d * r + d + 2 * d * r}
    assert models.count_params(c) == expected[name]
    assert models.width_multiple(c) == 8
    assert models.count_params(cfg(name, depth=7, **{k: v for k, v in kw.items() if k != "depth"})) == expected[name]


@pytest.mark.parametrize("name", NAMES)
def test_causality(name):
    assert_causal(build(cfg(name)), tokens(), 7)


def test_sequential_passes():
    body = lambda **kw: models.build_model(cfg(**kw), device="meta").body
    assert body(model="loopstack", depth=9).sequential_passes == 9
    assert body(depth=9).sequential_passes == 1 and body(depth=9, plt_shift=False).sequential_passes == 9
    assert body(model="loopfold", depth=9).sequential_passes == 5
    assert body(model="loopfold", depth=9, fold=3).sequential_passes == 4


def test_loopstack_depth_sweep_and_other_loop_counts_refused():
    """--eval_depths: loopstack's loop count can change at evaluation (one R: N = 1 is R once);
    train.py refuses it for plt and loopfold, whose loop count is fixed at training."""
    from harness import evaluation
    m = build(cfg("loopstack"))
    idx = tokens()
    with torch.no_grad():
        x, cos, sin = embed(m, idx)
        once = m.logits(m.norm_f(m.body.run(x, cos, sin)))
        curve = evaluation.depth_sweep(m, [1, 4], lambda: m(idx)[0])
        torch.testing.assert_close(curve[0], once)
        torch.testing.assert_close(curve[1], m(idx)[0])
    assert m.body.depth == 4
    for name in ("plt", "loopfold"):
        args = train.parse_args(["--model", name, "--size", "tiny", "--eval_depths", "1,2", "--device", "cpu"])
        with pytest.raises(UsageError, match="--eval_depths"):
            config.resolve_args(args)


def test_macs_literal():
    d, F, V, T, N, n = 64, 48, 61, 10, 4, 2
    blk = 4 * d * d + 3 * d * F
    stack = flops.forward_macs(cfg("loopstack"), T)
    assert stack == {"linear": N * n * blk * T, "scores": N * n * T * T * d, "mix": N * n * T * T * d,
                     "head": V * d * T, "total": N * n * blk * T + 2 * N * n * T * T * d + V * d * T}
    p = flops.forward_macs(cfg(plt_window=3), T)  # loops 2..4: gates d T, window T W d
    assert p["linear"] - stack["linear"] == 3 * n * d * T
    assert p["scores"] - stack["scores"] == p["mix"] - stack["mix"] == 3 * n * T * 3 * d
    f = flops.forward_macs(cfg("loopfold"), T)  # stages [0], [1, 2], [3]: one predicted row, r = 16
    assert f["linear"] - stack["linear"] == 1 * (2 * d * 16 + 2 * d * 16) * T
    assert flops.forward_macs(cfg("loopfold", fold=1), T) == stack


def test_flop_counter_sees_the_window_attention_as_full_product():
    """flops.counter_expected_macs models the band-masked SDPA (T^2 per window attention) exactly."""
    import sys, os
    sys.path.insert(0, os.path.dirname(__file__))
    from test_flops import counted_macs
    c = cfg(plt_window=4, vocab_size=128)
    assert counted_macs(c, 13) == flops.counter_expected_macs(c, 13)
    assert flops.counter_expected_macs(c, 13) - flops.forward_macs(c, 13)["total"] == 2 * 3 * 2 * 13 * (13 - 4) * 64


# ----------------------------------------------------------------------------- flags

@pytest.mark.parametrize("kw,flag", [(dict(model="plt", plt_window=0), "--plt_window"), (dict(model="loopfold", fold=0), "--fold"),
                                     (dict(model="loopfold", fold_rank=-1), "--fold_rank"),
                                     (dict(model="loopfold", fold_layout="middle"), "--fold_layout"),
                                     (dict(model="loopstack", n_core=0), "--n_core")])
def test_bad_flags(kw, flag):
    with pytest.raises(UsageError, match=flag):
        models.build_model(cfg(**kw))


def test_train_flags_reach_the_config():
    args = train.parse_args(["--model", "plt", "--size", "tiny", "--plt_window", "16", "--no-plt_shift", "--fold", "3",
                             "--fold_rank", "8", "--fold_layout", "last", "--n_core", "3", "--block_size", "32",
                             "--window", "8", "--chunk", "8", "--gau_s", "32"])
    c, _ = config.model_config(args, 61)
    assert (c.plt_window, c.plt_shift, c.fold, c.fold_rank, c.fold_layout, c.n_core) == (16, False, 3, 8, "last", 3)
    assert {"plt_window", "plt_shift", "fold", "fold_rank", "fold_layout"} <= set(checkpoint.IDENTITY_FLAGS)
    assert train.parse_args(["--model", "plt"]).plt_shift is True


def test_bench_decode_rows(tmp_path):
    """bench.py decode (not a timed test): one row per model with its sequential passes per token
    (loopstack N, PLT 1, LoopFold S) and N rows; the table and JSON are written."""
    import json
    from tools import bench
    out = tmp_path / "d.json"
    assert bench.main(["decode", "--size", "tiny", "--depth", "5", "--width", "64", "--prompt", "4", "--tokens", "2",
                       "--warmup", "0", "--vocab_size", "64", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["passes"], r["rows"], r["width"]) for r in rows] == [
        ("loopstack", 5, 5, 64), ("plt", 1, 5, 64), ("loopfold", 3, 5, 64)]
    assert all(r["ms_per_token"] > 0 for r in rows)
    assert "| plt | 5 | 2 | 64 | 1 | 5 |" in (tmp_path / "d.md").read_text()
    with pytest.raises(SystemExit) as e:
        bench.main(["decode", "--models", "nope"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv, idle", [
    (["--model", "plt", "--depth", "1", "--plt_window", "8"], "--plt_window: does nothing for --model plt at --depth 1"),
    (["--model", "plt", "--depth", "1", "--no-plt_shift"], "--plt_shift: does nothing for --model plt at --depth 1"),
    (["--model", "plt", "--depth", "2", "--plt_window", "8", "--no-plt_shift"], None),
    (["--model", "loopfold", "--depth", "4", "--fold", "1", "--fold_rank", "4"],
     "--fold_rank: does nothing for --model loopfold at --depth 4 --fold 1 (no stage of two loops or more"),
    (["--model", "loopfold", "--depth", "2", "--fold", "3"], "--fold: does nothing for --model loopfold at --depth 2"),
    (["--model", "loopfold", "--depth", "2", "--fold_layout", "last"],
     "--fold_layout: does nothing for --model loopfold at --depth 2 --fold 2 (no stage of two loops or more"),
    (["--model", "loopfold", "--depth", "3", "--fold", "2", "--fold_layout", "last", "--fold_rank", "4"], None)])
def test_a_flag_the_other_flags_leave_idle_is_refused(argv, idle):
    """One line naming the flag and why it would do nothing (no loop >= 2; no stage of two loops or
    more under either layout (parallel_loops.fold_stages), where P and C are not built and the layouts
    are alike); the settings where each acts pass."""
    got = checks.idle_check(argv)
    assert (got.startswith(idle) and got.endswith("; drop the flag")) if idle else not isinstance(got, str), got
