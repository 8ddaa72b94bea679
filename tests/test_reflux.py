"""ReFlux (reflux.py, reflux_cli.py): the off switch per schedule, the write operator's identities, the fast path
against the hook-based per-position reference in float64, cached decoding against the full protocol,
strict vs parallel prefill for stream, causality, the router (forced gates, frozen backbone, κ,
parameters), the recirculation payload, MACs, the bench rows and the command line."""
import functools
import json
import math
import os
import re
import shutil

import pytest
import torch

from tools import bench_decode
import checks
import flops
import models
import reflux as rf
from studies import reflux_cli
from common import ModelConfig, UsageError, rope_cos_sin
from harness.evaluation import evaluate

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
MDM_SIZE = (60, 10)  # the module's mini DeepMind Mathematics (tests/conftest.py)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 61


def cfg(name="untied", **kw):
    return ModelConfig(**{**dict(model=name, vocab_size=V, block_size=32, n_embd=64, n_head=2, depth=4, width=48), **kw})


def build(name="untied", seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return models.build_model(cfg(name)).to(dtype).eval()


tokens = functools.partial(checks.tokens, T=10, vocab=V)


def forced_router(lm, open_edge, alpha=0.25, block=3, dtype=torch.float64):
    """A router whose hard gates open exactly one edge (W_2 = 0, c = +-30) with α_e = alpha."""
    r = rf.Router(lm.cfg.n_embd, lm.cfg.depth, rank=8, block=block).to(dtype)
    with torch.no_grad():
        r.w2.weight.zero_()
        r.c.copy_(torch.tensor([30.0 if e == open_edge else -30.0 for e in r.edges]))
        q = alpha / r.alpha_max
        r.a.fill_(math.log(q / (1 - q)))
    return r.eval()


def random_router(lm, block=3, seed=3, dtype=torch.float64):
    """A router with random weights whose hard gates vary between blocks (c spread around 0)."""
    torch.manual_seed(seed)
    r = rf.Router(lm.cfg.n_embd, lm.cfg.depth, rank=8, block=block, xi=0.5).to(dtype)
    with torch.no_grad():
        r.w1.weight.normal_(0, 1.0)
        r.w2.weight.normal_(0, 1.0)
        r.c.normal_(0, 1.0)
    return r.eval()


# ------------------------------------------------------------------------------ write operator

def test_write_identities():
    g = torch.Generator().manual_seed(0)
    h, p = torch.randn(5, 7, 16, generator=g, dtype=torch.float64), torch.randn(5, 7, 16, generator=g, dtype=torch.float64)
    n_h, n_p = h.norm(dim=-1, keepdim=True), p.norm(dim=-1, keepdim=True)
    # with preserve_norm the write only rotates h: ||h''|| = ||h||
    out = rf.write(h, [0.3], [p], 0.9, preserve_norm=True)
    torch.testing.assert_close(out.norm(dim=-1, keepdim=True), n_h, rtol=1e-12, atol=0)
    assert not torch.allclose(out, h)
    # ||N(p; h)|| = ||h|| ||p|| / (||p|| + eps): beta = 0, alpha = 1, no restore leaves N itself
    N = rf.write(h, [1.0], [p], 0.0, preserve_norm=False)
    torch.testing.assert_close(N.norm(dim=-1, keepdim=True), n_h * n_p / (n_p + 1e-6), rtol=1e-12, atol=0)
    torch.testing.assert_close(N, p * n_h / (n_p + 1e-6), rtol=1e-12, atol=0)
    # beta = 1, no restore: h' = h + alpha N
    torch.testing.assert_close(rf.write(h, [0.2], [p], 1.0, preserve_norm=False), h + 0.2 * N, rtol=1e-12, atol=1e-15)
    # two edges into one target compose in one write, then one restore
    q = torch.randn(5, 7, 16, generator=g, dtype=torch.float64)
    both = rf.write(h, [0.2, 0.1], [p, q], 0.9, preserve_norm=True)
    raw = 0.9 * h + 0.2 * p * n_h / (n_p + 1e-6) + 0.1 * q * n_h / (q.norm(dim=-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(both, raw * n_h / raw.norm(dim=-1, keepdim=True), rtol=1e-12, atol=1e-15)
    # alpha <= 0: no write, whatever beta; tensor weights of 0 keep those rows exactly
    assert rf.write(h, [0.0], [p], 0.5) is h and rf.write(h, [-0.1], [p], 0.5, False) is h
    w = torch.zeros(5, 7, 1, dtype=torch.float64)
    w[:, 3] = 0.3
    out = rf.write(h, [w], [p], 0.9)
    assert torch.equal(out[:, :3], h[:, :3]) and torch.equal(out[:, 4:], h[:, 4:])
    torch.testing.assert_close(out[:, 3], rf.write(h, [0.3], [p], 0.9)[:, 3], rtol=1e-14, atol=0)
    # a float32 input is written in float32 and keeps its dtype; bf16 is computed in float32
    assert rf.write(h.bfloat16(), [0.3], [p.bfloat16()], 0.9).dtype == torch.bfloat16


# ------------------------------------------------------------------------------ off switch

@pytest.mark.parametrize("schedule", rf.SCHEDULES)
def test_off_switch_every_schedule(schedule):
    """α = 0 (whatever β) and an empty edge set give the base model's logits; so does a router whose
    gates are all closed, which runs the schedule's full machinery (two traversals, the recurrence)."""
    lm, idx = build(), tokens()
    with torch.no_grad():
        want = lm(idx)[0]
        for s in (rf.Settings(schedule, ((3, 1),), 0.0, 0.5), rf.Settings(schedule, (), 0.2, 0.9),
                  rf.Settings(schedule, ((3, 1), (2, 0)), -0.1, 0.9, preserve_norm=False)):
            assert torch.equal(rf.reflux_lm(lm, s)(idx)[0], want)
        closed = forced_router(lm, open_edge=None)
        got = rf.reflux_lm(lm, rf.Settings(schedule), closed)(idx)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert closed.kappa() == 0.0 and closed.blocks_seen > 0
        # and the method is on with an open edge
        assert (rf.reflux_lm(lm, rf.Settings(schedule, ((3, 1),)))(idx)[0] - want).abs().max() > 1e-3


# ------------------------------------------------------------------------------ reference

@pytest.mark.parametrize("name", ["untied", "loop"])
@pytest.mark.parametrize("schedule", rf.SCHEDULES)
def test_fast_path_equals_per_position_reference(name, schedule):
    """Float64: ReFluxBody (batched traversals) against the hook-based reference with explicit
    per-position loops; two edges share target 1 (one write) and a third writes target 0."""
    lm, idx = build(name), tokens(T=8)
    for s in (rf.Settings(schedule, ((3, 1), (2, 1), (1, 0)), 0.3, 0.9),
              rf.Settings(schedule, ((2, 0),), 0.2, 1.0, preserve_norm=False)):
        with torch.no_grad():
            fast, ref = rf.reflux_lm(lm, s)(idx)[0], rf.reference(lm, idx, s)
        torch.testing.assert_close(fast, ref, rtol=0, atol=1e-10)
        assert (fast - lm(idx)[0]).abs().max() > 1e-3


def test_schedules_differ_and_payloads_are_as_defined():
    """sync writes Δ^rec(t), stream2 Δ^rec(t-1), stream Δ^inj(t-1): at t = 0 the two streaming
    schedules write a zero payload (with preserve_norm: h unchanged), so row 0 equals the base;
    sync differs there; stream2 and stream agree on row 1 (Δ(0) is clean in both)."""
    lm, idx = build(), tokens()
    base = lm(idx)[0]
    out = {s: rf.reflux_lm(lm, rf.Settings(s, ((3, 1),), 0.3, 0.9))(idx)[0] for s in rf.SCHEDULES}
    for s in ("stream2", "stream"):
        torch.testing.assert_close(out[s][:, 0], base[:, 0], rtol=0, atol=1e-12)
    assert (out["sync"][:, 0] - base[:, 0]).abs().max() > 1e-3
    torch.testing.assert_close(out["stream"][:, 1], out["stream2"][:, 1], rtol=0, atol=1e-12)
    assert (out["stream"][:, 2:] - out["stream2"][:, 2:]).abs().max() > 1e-6


def test_recirculation_payload():
    """recirc: payload z_s (the full deep state), β = 1 - α, no norm restore; equal to the reference."""
    s = rf.recirc(0.15, edges=((3, 1),))
    assert (s.schedule, s.payload, s.alpha, s.beta, s.preserve_norm) == ("sync", "state", 0.15, 0.85, False)
    lm, idx = build(), tokens()
    body = rf.reflux_lm(lm, s).body
    zs = {1: torch.full((1, 2, 64), 2.0), 3: torch.full((1, 2, 64), 5.0)}
    assert torch.equal(body.payload(zs)[(3, 1)], zs[3])
    assert torch.equal(rf.reflux_lm(lm, rf.Settings(edges=((3, 1),))).body.payload(zs)[(3, 1)], zs[3] - zs[1])
    with torch.no_grad():
        torch.testing.assert_close(rf.reflux_lm(lm, s)(idx)[0], rf.reference(lm, idx, s), rtol=0, atol=1e-10)


# ------------------------------------------------------------------------------ cached decoding

def _cached(view, idx, prompt):
    """Logits of a prefill of idx[:, :prompt] then one cached step per remaining token."""
    cache = {}
    outs = [view(idx[:, :prompt], cache=cache)[0]]
    for t in range(prompt, idx.shape[1]):
        outs.append(view(idx[:, t:t + 1], cache=cache)[0])
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("schedule", ["sync", "stream2"])
@pytest.mark.parametrize("routed", [False, True])
def test_cached_decode_equals_full_protocol(schedule, routed):
    """sync and stream2 (two KV caches, the last record payload) decode exactly as the
    full-sequence protocol, also with a router whose block boundaries (w = 3) fall inside the
    prompt and inside the decoded tokens."""
    lm, idx = build(dtype=torch.float32), tokens(T=11)
    router = random_router(lm, dtype=torch.float32) if routed else None
    view = rf.reflux_lm(lm, rf.Settings(schedule, ((3, 1), (2, 0))), router)
    with torch.no_grad():
        full = view(idx)[0]
        for prompt in (1, 4):
            got, cache = _cached(view, idx, prompt)
            torch.testing.assert_close(got, full, rtol=0, atol=1e-5)
    assert set(cache) >= {"rec", "inj", "len"} and cache["len"] == 11
    if routed:  # the router's gates did change between blocks
        g = router.row_gates({}, torch.randn(2, 11, 64), 0)
        assert (g[:, 0] != g[:, 3]).any()


def test_stream_strict_prefill_equals_reference():
    """stream with strict prefill (the recurrence over the prompt too) equals the no-cache reference
    that recomputes the recurrence one token at a time; so does the full protocol (no cache)."""
    lm, idx = build(), tokens(T=9)
    s = rf.Settings("stream", ((3, 1), (2, 0)), 0.3, 0.9, prefill="strict")
    view = rf.reflux_lm(lm, s)
    with torch.no_grad():
        ref = rf.reference_stream(lm, idx, s)
        torch.testing.assert_close(view(idx)[0], ref, rtol=0, atol=1e-10)
        got, cache = _cached(view, idx, prompt=4)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    assert set(cache["prev"]) == {(3, 1), (2, 0)} and cache["prev"][(3, 1)].shape == (2, 1, 64)


def test_stream_parallel_prefill_differs_only_by_the_prompt_writes():
    """Parallel prefill: the prompt rows are the base's (one clean traversal); the decoded rows equal
    the reference recurrence with no writes before the prompt's end, and differ from strict."""
    lm, idx, P = build(), tokens(T=9), 4
    s = rf.Settings("stream", ((3, 1),), 0.3, 0.9, prefill="parallel")
    with torch.no_grad():
        got, _ = _cached(rf.reflux_lm(lm, s), idx, P)
        torch.testing.assert_close(got[:, :P], lm(idx[:, :P])[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(got, rf.reference_stream(lm, idx, s, prompt_len=P), rtol=0, atol=1e-10)
        strict = rf.reference_stream(lm, idx, s)
    assert (got[:, P:] - strict[:, P:]).abs().max() > 1e-4


@pytest.mark.parametrize("schedule", rf.SCHEDULES)
def test_generate_through_the_view(schedule):
    """common.LM.generate runs unchanged on the view with its caches: greedy decoding equals the
    argmax of the full protocol recomputed on the growing sequence (stream: strict prefill)."""
    lm, idx = build(dtype=torch.float32), tokens(B=1, T=5)
    view = rf.reflux_lm(lm, rf.Settings(schedule, ((3, 1),), 0.3, 0.9, prefill="strict"))
    out = view.generate(idx, 6, temperature=0)
    seq = idx
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat((seq, view(seq)[0][:, -1:].argmax(-1)), 1)
    assert torch.equal(out, seq)


# ------------------------------------------------------------------------------ causality

@pytest.mark.parametrize("schedule", rf.SCHEDULES)
@pytest.mark.parametrize("routed", [False, True])
def test_causality(schedule, routed):
    """logits[:, :t] do not change when idx[:, t:] is perturbed (every schedule, edges and router)."""
    lm = build(dtype=torch.float32)
    router = random_router(lm, dtype=torch.float32) if routed else None
    view = rf.reflux_lm(lm, rf.Settings(schedule, ((3, 1), (2, 0))), router)
    idx = tokens(T=10)
    with torch.no_grad():
        full = view(idx)[0]
        for t in (1, 4, 7):
            other = idx.clone()
            other[:, t:] = (other[:, t:] + 7) % V
            got = view(other)[0]
            torch.testing.assert_close(got[:, :t], full[:, :t], rtol=0, atol=1e-6)
            assert (got[:, t:] - full[:, t:]).abs().max() > 1e-4


# ------------------------------------------------------------------------------ router

@pytest.mark.parametrize("schedule", rf.SCHEDULES)
def test_router_forced_gate_equals_single_edge(schedule):
    """One gate forced to 1 and all others to 0 reproduces the single-edge model (α_e = 0.25)."""
    lm, idx = build(), tokens()
    r = forced_router(lm, open_edge=(3, 1), alpha=0.25)
    alpha = float(r.alphas()[r.edges.index((3, 1))].detach())
    assert abs(alpha - 0.25) < 1e-12
    with torch.no_grad():
        routed = rf.reflux_lm(lm, rf.Settings(schedule), r)(idx)[0]
        single = rf.reflux_lm(lm, rf.Settings(schedule, ((3, 1),), alpha, 0.9))(idx)[0]
    torch.testing.assert_close(routed, single, rtol=0, atol=1e-12)
    assert r.kappa() == 1.0  # κ: one open edge per block


def test_router_parameters_and_blocks():
    """Parameters d r + r |E| + 2 |E| with |E| = K(K-1)/2; block 0 uses the constant part
    sigmoid(c); block b+1 the mean of RMSNorm(z_m) over block b only."""
    r = rf.Router(64, 4, rank=8, block=3).double()
    E = 4 * 3 // 2
    assert r.edges == [(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]
    assert sum(p.numel() for p in r.parameters()) == 64 * 8 + 8 * E + 2 * E == 572
    torch.testing.assert_close(r.alphas(), torch.full((E,), 0.2, dtype=torch.float64))
    assert torch.equal(torch.sigmoid(r.c), torch.full((E,), 0.5, dtype=torch.float64))  # c = 0: soft gates 1/2
    r.train()  # soft gates
    zm = torch.randn(2, 7, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g = r.row_gates({}, zm, 0)
    assert g.shape == (2, 7, E)
    torch.testing.assert_close(g[:, 0], torch.sigmoid(r.c).expand(2, E))
    u = zm / zm.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    for rows, blk in ((slice(3, 6), slice(0, 3)), (slice(6, 7), slice(3, 6))):
        want = r.gate(u[:, blk].mean(1))
        torch.testing.assert_close(g[:, rows], want[:, None].expand(-1, rows.stop - rows.start, -1))
    assert sum(p.numel() for p in rf.Router(64, 8, rank=64).parameters()) == 64 * 64 + 64 * 28 + 2 * 28


@pytest.mark.parametrize("schedule", ["sync", "stream2", "stream"])
def test_router_summary_reads_the_output_of_block_K_over_2(schedule, monkeypatch):
    """The router's summary r_b averages RMSNorm(z_m), m = floor(K/2): the stream leaving block m
    (0-based) of the clean record traversal; K = 4: z_2 = block_2(block_1(block_0(e))), not z_1
    (floor((K-1)/2)) nor a_2 (the stream entering block 2)."""
    lm, idx = build(), tokens()
    r = random_router(lm)
    assert r.m == 2
    if schedule == "stream":  # one pass per token with the writes in it: with every edge closed it is the clean one
        with torch.no_grad():
            r.c.fill_(-100.0)
    seen = []
    update = rf.Router.update
    monkeypatch.setattr(rf.Router, "update", lambda self, state, zm, start: seen.append(zm) or update(self, state, zm, start))
    with torch.no_grad():
        rf.reflux_lm(lm, rf.Settings(schedule), r)(idx)
        x = lm.wte(idx)
        cos, sin = rope_cos_sin(torch.arange(idx.shape[1]), dtype=x.dtype)
        z = {l: rf.run_blocks(lm.body, x, cos, sin, stop=l + 1)[0] for l in (1, 2)}
    summary = torch.cat(seen, 1)
    torch.testing.assert_close(summary, z[2], rtol=1e-12, atol=1e-12)
    assert (summary - z[1]).abs().max() > 1e-3


def test_no_gradient_reaches_the_backbone():
    """Router training: the loss (NLL + λ mean(g), sync, soft gates) gives gradients to every router
    parameter and none to the backbone (requires_grad False), whose weights stay unchanged."""
    lm = build(dtype=torch.float32)
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    r = rf.Router(64, 4, rank=8, block=3)
    view = rf.reflux_lm(lm, rf.Settings("sync"), r)
    r.train()
    idx = tokens(T=10)
    _, loss = view(idx[:, :-1], idx[:, 1:])
    (loss + 1e-3 * view.body.mean_gate).backward()
    assert all(p.grad is None and not p.requires_grad for p in lm.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in r.parameters())
    opt = torch.optim.AdamW(list(r.parameters()) + list(lm.parameters()), lr=1e-2)
    opt.step()
    assert all(torch.equal(before[k], v) for k, v in lm.state_dict().items())


@pytest.mark.parametrize("schedule", ["sync", "stream2"])  # the two-pass schedules record the gate penalty
def test_router_gradients_equal_finite_differences(schedule):
    """Float64, soft gates (training): the gradient of NLL + 1e-3 mean gate with respect to the router's
    parameters, through the fast path, equals central finite differences along random directions
    (relative 1e-6): the router is trained through this path, so its gradients are checked, not only
    its outputs (test_fast_path_equals_per_position_reference)."""
    lm = build()
    r = random_router(lm).train()
    view = rf.reflux_lm(lm, rf.Settings(schedule), r)
    idx = tokens(T=10)
    params = list(r.parameters())

    def loss():
        _, nll = view(idx[:, :-1], idx[:, 1:])
        return nll + 1e-3 * view.body.mean_gate

    grads = torch.autograd.grad(loss(), params)
    gen, eps = torch.Generator().manual_seed(0), 1e-6
    for _ in range(3):
        v = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
        with torch.no_grad():
            sides = []
            for step in (eps, -2 * eps):
                for p, d in zip(params, v):
                    p.add_(step * d)
                sides.append(loss())
            for p, d in zip(params, v):
                p.add_(eps * d)
        fd = (sides[0] - sides[1]) / (2 * eps)
        exact = sum((g * d).sum() for g, d in zip(grads, v))
        assert abs(fd - exact) <= 1e-6 * abs(exact) and abs(exact) > 1e-4, (fd, exact)


# ------------------------------------------------------------------------------ cost

def test_reflux_macs():
    """2x the body for sync / stream2 / recirc, 1x for stream, the head once; the write 3 d per
    edge and 4 d per target per position; the router per block of w tokens."""
    c = cfg(depth=8, block_size=128)
    T, d = 128, 64
    base = flops.forward_macs(c, T)
    body = base["total"] - base["head"]
    for sched, n in (("sync", 2), ("stream2", 2), ("recirc", 2), ("stream", 1)):
        m = flops.reflux_forward_macs(c, T, sched)
        assert m["body"] == n * body and m["head"] == V * d * T and m["write"] == T * d * 7
        assert m["total"] == n * body + base["head"] + 7 * T * d
    assert flops.reflux_forward_macs(c, T, "base")["total"] == base["total"]
    m = flops.reflux_forward_macs(c, T, "stream", edges=3, targets=2, router=(64, 28, 16))
    assert m["router"] == 8 * (64 * 64 + 64 * 28) + T * d and m["write"] == T * d * (9 + 8)
    assert 1.0 < m["ratio"] < 1.05
    partial = flops.reflux_forward_macs(c, 130, "stream", router=(64, 28, 16))  # a last block of 2 tokens
    assert partial["router"] == 9 * (64 * 64 + 64 * 28) + 130 * d
    with pytest.raises(UsageError, match="schedule 'loop'"):
        flops.reflux_forward_macs(c, T, "loop")


def test_counted_matmul_macs_of_the_two_pass_schedules():
    """torch.utils.flop_counter on the view: sync and stream2 count the base's body matmuls once for
    the record traversal and from the lowest target block up for the injected one, the head once
    (the write has no matmul). SDPA on the math backend (flops.py)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    lm, idx = build(dtype=torch.float32), tokens(B=1, T=16)

    def counted(model):
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            model(idx)
        return fc.get_total_flops() // 2

    head = 64 * 64 * 16  # V padded to 64 rows, d = 64, T = 16
    base = counted(lm)
    block = (base - head) // 4  # K = 4 equal blocks
    assert base == 4 * block + head
    for sched in ("sync", "stream2"):  # the injected traversal runs blocks 1..3 (the lowest target is 1)
        assert counted(rf.reflux_lm(lm, rf.Settings(sched, ((3, 1),)))) == 4 * block + 3 * block + head
        assert counted(rf.reflux_lm(lm, rf.Settings(sched, ((3, 1), (2, 0))))) == 8 * block + head
    c = cfg(block_size=16)
    m = flops.reflux_forward_macs(c, 16, "sync", low=1)
    assert m["body"] == 7 * (flops.forward_macs(c, 16)["total"] - flops.forward_macs(c, 16)["head"]) // 4


def test_bench_reflux_rows():
    """bench_decode.reflux_rows (in bench --quick): one row per schedule with positive timings, the base
    ratios exactly 1 and the MACs ratios of flops.reflux_forward_macs."""
    rows = bench_decode.reflux_rows("tiny", 4, 16, 64, reps=1)
    assert [r["schedule"] for r in rows] == ["base", "sync", "stream2", "stream"]
    assert rows[0]["forward_vs_base"] == rows[0]["decode_vs_base"] == 1.0
    assert all(r["forward_ms_per_token"] > 0 and r["decode_ms_per_token"] > 0 for r in rows)
    c = models.solve_width(cfg(vocab_size=64, block_size=16), models.TIERS["tiny"][2], strict=False)
    assert [r["macs_ratio"] for r in rows] == [flops.reflux_forward_macs(c, 16, s, low=1)["ratio"]  # edge 2:1
                                               for s in ("base", "sync", "stream2", "stream")]
    assert 1.0 < rows[3]["macs_ratio"] < 1.01 and 1.5 < rows[1]["macs_ratio"] < 1.75  # the write: O(d) per position
    assert "| stream | 16 |" in bench_decode.reflux_table(rows)
    assert {(r["device"], r["dtype"]) for r in rows} == {("cpu", "float32")}


def test_bench_reflux_rows_run_under_the_benchmarks_dtype(monkeypatch):
    """bench --dtype bfloat16 times the ReFlux rows under bfloat16 autocast, as its training rows:
    every linear layer of the timed forwards sees bfloat16 inputs, and the rows say so."""
    seen = set()
    linear = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward",
                        lambda self, x: seen.add(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                                                 else x.dtype) or linear(self, x))
    rows = bench_decode.reflux_rows("tiny", 4, 16, 64, reps=1, device="cpu", dtype="bfloat16")
    assert seen == {torch.bfloat16} and {(r["device"], r["dtype"]) for r in rows} == {("cpu", "bfloat16")}


# ------------------------------------------------------------------------------ command line

@pytest.fixture(scope="module")
def ckpt(data_root, mdm, tmp_path_factory):
    """A train.py-format checkpoint of a random tiny untied Transformer++ on the mini dmmath data."""
    import data as data_mod
    from harness.datacheck import data_signature
    folder = data_mod.prepare("dmmath", str(mdm), str(data_root))
    d = data_mod.Data(folder)
    torch.manual_seed(0)
    c = ModelConfig(model="untied", vocab_size=d.vocab_size, block_size=32, n_embd=64, n_head=2, depth=4, width=48)
    lm = models.build_model(c)
    path = tmp_path_factory.mktemp("ck") / "ckpt_best.pt"
    torch.save({"format": 2, "model": lm.state_dict(), "config": c.to_dict(), "data": data_signature(d),
                "args": {"dataset": "dmmath", "data_dir": str(mdm), "data_root": str(data_root), "tokenizer": "auto",
                         "block_size": 32, "eval_windows": 4}}, path)
    return str(path), lm, d


def test_cli_prints_base_and_reflux_side_by_side(ckpt, capsys):
    path, lm, d = ckpt
    res = reflux_cli.main(["--base", path, "--schedule", "stream", "--edge", "2:1", "--threads", "1"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    starts = d.eval_windows("dev", 32, 4)
    import contextlib
    want = evaluate(lm, d, "dev", starts, 32, 16, "cpu", contextlib.nullcontext())
    assert res["base_nll"] == want and res["windows"] == 4 and res["split"] == "dev"
    assert f"base {want:.4f}" in line and f"ReFlux stream [2:1, α 0.2 β 0.9] {res['reflux_nll']:.4f}" in line
    assert res["reflux_nll"] != want
    # default edge floor(0.6 K):floor(0.3 K) = 2:1 at K = 4; recirculation; test split; a sample
    res2 = reflux_cli.main(["--base", path, "--schedule", "sync", "--recirc", "--split", "test", "--sample", "3", "--prompt", "1"])
    assert (res2["edges"], res2["beta"], res2["payload"], res2["split"]) == ("recirc 2:1", 0.85, "state", d.test_split)
    assert len(res2["sample_reflux"]) == 4


def test_cli_router_and_sweep(ckpt, tmp_path, capsys):
    path, _, _ = ckpt
    res = reflux_cli.main(["--base", path, "--router", "--max_iters", "2", "--router_batch", "2", "--router_rank", "8",
                   "--schedule", "sync", "--block", "8"])
    assert res["router_params"] == 64 * 8 + 8 * 6 + 2 * 6 and 0 <= res["kappa"] <= 6
    assert "κ =" in capsys.readouterr().out
    out = tmp_path / "sweep.json"
    reflux_cli.main(["sweep", "--base", path, "--edges", "2:1,3:0", "--alphas", "0.1,0.3", "--betas", "1.0",
             "--max_iters", "2", "--router_rank", "8", "--eval_windows", "2", "--json", str(out)])
    res = json.loads(out.read_text())
    assert len(res["grid"]) == 3 * 2 * 2 and set(res["best_single_edge"]) == set(rf.SCHEDULES)
    assert set(res["router"]["per_schedule"]) == set(rf.SCHEDULES) and res["command"].startswith("python -m studies.reflux_cli sweep")
    # the grid's batched evaluation equals one nll() per setting
    base, data, _ = reflux_cli.load(path)
    row = next(r for r in res["grid"] if r["schedule"] == "stream" and r["edge"] == "3:0" and r["alpha"] == 0.3)
    want = reflux_cli.nll(rf.reflux_lm(base, rf.Settings("stream", ((3, 0),), 0.3, 1.0)), data, "dev", 2, 32)
    assert abs(row["nll"] - want) < 1e-5


def test_a_router_gone_non_finite_is_an_error_not_a_result(ckpt, capsys):
    """--lr 1e30 drove the gate to nan and the run still printed a ReFlux NLL with change +0.0000
    (exit 0): a non-finite loss, gate or router parameter is one line, exit 1, no result."""
    with pytest.raises(SystemExit) as e:
        reflux_cli.cli(["--base", ckpt[0], "--router", "--max_iters", "2", "--router_batch", "1", "--lr", "1e30"])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and "ReFlux" not in out
    assert re.fullmatch(r"error: router training: non-finite loss \(\S+\), mean gate \(\S+\) or router parameters at "
                        r"update \d; try a smaller --lr \(now 1e\+30\)\n", err), err


@pytest.mark.parametrize("argv, message", [
    (["--edge", "2:3"], "--edge 2:3: need 0 <= D < S <= 3"),
    (["--edge", "4"], "--edge 4: write it S:D"),
    (["--schedule", "loop"], "--schedule loop: choose one of sync, stream2, stream"),
    (["--payload", "full"], "--payload full: choose one of delta, state"),
    (["--xi", "1.5"], "--xi 1.5: must lie in (0, 1)"),
    (["--split", "train"], "--split train: dev or test"),
    (["--router", "--edge", "2:1"], "--edge: not used with --router"),
])
def test_cli_errors(ckpt, argv, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        reflux_cli.main(["--base", ckpt[0]] + argv)


def test_cli_bad_checkpoints(tmp_path, ckpt):
    with pytest.raises(UsageError, match="--base: no checkpoint at"):
        reflux_cli.main(["--base", str(tmp_path / "nope.pt")])
    run = os.path.dirname(ckpt[0])  # a train.py run's folder given for its checkpoint: the file to give
    with pytest.raises(UsageError) as e:
        reflux_cli.main(["--base", run])
    assert str(e.value) == f"--base {run}: a folder, not a checkpoint file; give its best checkpoint, {ckpt[0]}"
    only_latest = tmp_path / "stopped"  # a run with no evaluation yet has only its latest checkpoint
    only_latest.mkdir()
    shutil.copy(ckpt[0], only_latest / "ckpt_latest.pt")
    with pytest.raises(UsageError) as e:
        reflux_cli.main(["--base", str(only_latest)])
    assert str(e.value) == (f"--base {only_latest}: a folder, not a checkpoint file; give its latest checkpoint, "
                            f"{only_latest / 'ckpt_latest.pt'}")
    with pytest.raises(UsageError) as e:
        reflux_cli.main(["sweep", "--base", str(tmp_path)])
    assert str(e.value) == f"--base {tmp_path}: a folder, not a checkpoint file"
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="not a readable checkpoint"):
        reflux_cli.main(["--base", str(bad)])
    ck = torch.load(ckpt[0], weights_only=True)
    ck["config"]["model"] = "tango"
    other = tmp_path / "tango.pt"
    torch.save(ck, other)
    with pytest.raises(UsageError, match="needs a Transformer\\+\\+ checkpoint"):
        reflux_cli.main(["--base", str(other)])


def test_cli_refuses_a_one_block_base(tmp_path, ckpt):
    """No edge joins two blocks of a depth-1 base: one line naming --base, not the default edge 0:0."""
    ck = torch.load(ckpt[0], weights_only=True)
    ck["config"]["depth"] = 1
    ck["model"] = models.build_model(ModelConfig.from_dict(ck["config"])).state_dict()
    one = tmp_path / "one.pt"
    torch.save(ck, one)
    for argv in (["--base", str(one)], ["sweep", "--base", str(one)]):
        with pytest.raises(UsageError, match="a ReFlux edge joins two blocks .*; this base has 1$"):
            reflux_cli.main(argv)


def test_cli_exit_code_and_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        reflux_cli.cli(["--base", str(tmp_path / "missing.pt")])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: --base: no checkpoint at {tmp_path / 'missing.pt'}"]
    with pytest.raises(SystemExit) as e:
        reflux_cli.cli(["--bse", "x"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().startswith("error: the following arguments are required: --base")


@pytest.mark.parametrize("argv, message", [
    # the ranges of reflux.py / MATH.md: α in (0, 1] (α <= 0 writes nothing), β in [0, 1], w >= 1
    (["--alpha", "-1"], "--alpha -1: must lie in (0, 1] (α <= 0 writes nothing: the base itself)"),
    (["--alpha", "0"], "--alpha 0: must lie in (0, 1] (α <= 0 writes nothing: the base itself)"),
    (["--alpha", "5"], "--alpha 5: must lie in (0, 1] (above 1 the payload outweighs the stream)"),
    (["--beta", "1.5"], "--beta 1.5: must lie in [0, 1] (the share β of the stream the write keeps)"),
    (["sweep", "--alphas", "0.1,2"], "--alphas 2: must lie in (0, 1] (above 1 the payload outweighs the stream)"),
    (["sweep", "--betas", "-0.1"], "--betas -0.1: must lie in [0, 1] (the share β of the stream the write keeps)"),
    # an empty list was an empty grid (--schedules: the base alone, exit 0; --edges: a traceback after the base)
    (["sweep", "--schedules", ""], '--schedules "": give one or more of sync, stream2, stream'),
    (["sweep", "--edges", ","], '--edges ",": give all, or comma-separated S:D'),
    (["--router", "--block", "0"], "--block 0: must be >= 1 (leave it out for the default)"),
    (["--eval_windows", "0"], "--eval_windows 0: must be >= 1 (leave it out for the default)"),
    (["--router", "--alpha_max", "0.1"], "--alpha_max 0.1: must lie in (0.2, 1] (the router's α_e start at 0.2 "
                                         "and stay below it)"),
    # a flag the run would ignore
    (["--block", "8"], "--block: only used with --router (a router flag); drop --block"),
    (["--max_iters", "5"], "--max_iters: only used with --router (a router flag); drop --max_iters"),
    (["sweep", "--no_router", "--xi", "0.5"], "--xi: only used without --no_router (a router flag); drop --xi"),
    (["--router", "--alpha", "0.3"], "--alpha: only used without --router (the router learns each edge's α); "
                                     "drop --alpha"),
    (["--recirc", "--beta", "0.5"], "--beta: only used without --recirc (which sets β = 1 - α); drop --beta"),
    (["--prompt", "x"], "--prompt: only used with --sample; drop --prompt"),
    (["--sample", "3", "--prompt", ""], '--prompt "": give at least one character for --sample to continue'),
    # numpy's default_rng refused a negative seed with a traceback (exit 1), torch.manual_seed one of 2**64
    (["--router", "--seed", "-1"], "--seed -1: must be >= 0"),
    (["sweep", "--seed", "-1"], "--seed -1: must be >= 0"),
    (["--router", "--seed", str(2 ** 64)], f"--seed {2 ** 64}: must be < 2**64"),
    (["--schedule", "sync", "--sample", "3", "--prefill", "strict"],
     "--prefill: only used with --schedule stream and --sample; drop --prefill"),
])
def test_cli_refuses_values_out_of_range_and_ignored_flags(argv, message, tmp_path, monkeypatch, capsys):
    """--alpha -1 ran and reported "change +0.0000", --alpha 5 and --block 0 ran, --eval_windows 0 quietly
    took the checkpoint's count: each is one line, exit 2, before the checkpoint is read."""
    monkeypatch.chdir(tmp_path)
    sweep = argv[:1] == ["sweep"]
    with pytest.raises(SystemExit) as e:
        reflux_cli.cli(argv[:1] * sweep + ["--base", "x.pt"] + argv[sweep:])
    assert (e.value.code, capsys.readouterr().err) == (2, f"error: {message}\n")
    assert os.listdir(tmp_path) == []


def test_cli_refuses_a_prompt_outside_the_vocabulary(ckpt, tmp_path, capsys):
    """--prompt "🦜" was sampled from the unknown id (exit 0); refused as sample.py refuses --start, before any work."""
    out = tmp_path / "sub" / "r.json"
    with pytest.raises(SystemExit) as e:
        reflux_cli.cli(["--base", ckpt[0], "--sample", "3", "--prompt", "1🦜", "--json", str(out)])
    assert (e.value.code, capsys.readouterr()) == (2, ("", "error: --prompt: 1 character(s) not in the checkpoint's "
                                                        f"vocabulary of {ckpt[2].vocab_size} symbols: '🦜'\n"))
    assert os.listdir(tmp_path) == []


def test_cli_block_must_leave_two_blocks_per_window_and_json_must_be_a_file(ckpt, tmp_path):
    with pytest.raises(UsageError, match=r"^--block 32: must be < the base's block_size 32 \(with one block per "
                                         r"window every gate comes from the constant part alone\)$"):
        reflux_cli.main(["--base", ckpt[0], "--router", "--block", "32"])
    with pytest.raises(UsageError, match=f"^--json {tmp_path}: is a folder; give a file path$"):
        reflux_cli.main(["--base", ckpt[0], "--json", str(tmp_path)])


def test_cli_help_lists_the_sweep_subcommand(capsys):
    """results/reflux/README.md runs `reflux_cli sweep`, which --help did not mention."""
    with pytest.raises(SystemExit) as e:
        reflux_cli.cli(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    assert "subcommand: 'sweep' (edges x α x β per schedule, then the router; python -m studies.reflux_cli sweep " \
           "--help)" in out
