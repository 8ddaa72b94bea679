"""Tests for parcae.py (Parcae and the recurrent-depth model RDM) and the Parcae paper's
scaling-law fits (flops_fit.py). Small shapes; the whole file runs in well under a minute on 1 CPU."""
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

import flops
from tools import flops_fit
import models
import parcae
from common import ModelConfig, rope_cos_sin

torch.set_num_threads(1)


def small(name, **kw):
    base = dict(model=name, vocab_size=61, block_size=32, n_embd=64, n_head=2, depth=3, width=96,
                n_prelude=1, n_core=2, n_coda=1)
    base.update(kw)
    return ModelConfig(**base)


def build(name, seed=0, **kw):
    torch.manual_seed(seed)
    return models.build_model(small(name, **kw))


def body_logits(model, idx, **body_kw):
    """The LM forward with keyword arguments passed to the body (depths / n_steps / h0)."""
    x = model.wte(idx)
    cos, sin = rope_cos_sin(torch.arange(idx.shape[1]), dtype=x.dtype)
    return model.norm_f(model.body(x, cos, sin, None, **body_kw)) @ model.wte.weight.t()


def manual_parcae(body, x, cos, sin, T, k, h0):
    """Parcae forward of one sequence from the equations (parcae.py docstring, Alg. 1), written
    apart from the body's own step: T - k recurrences under no_grad, the state detached, k with grad."""
    for blk in body.prelude:
        x = blk(x, cos, sin)
    e = body.prelude_norm(x)
    delta = F.softplus(body.dt_bias)
    abar = torch.exp(-delta * torch.exp(body.A_log))  # exp(Delta * A), A = -exp(A_log)
    inj, h = delta * (e @ body.B.t()), h0

    def step(h):
        u = abar * h + inj
        for blk in body.core:
            u = blk(u, cos, sin)
        return u
    with torch.no_grad():
        for _ in range(T - k):
            h = step(h)
    h = h.detach()
    for _ in range(k):
        h = step(h)
    y = h @ body.C.t()
    for blk in body.coda:
        y = blk(y, cos, sin)
    return y


# ----------------------------------------------------------------------------- Parcae: parameters
def test_abar_strictly_inside_unit_interval_for_any_parameters():
    body = build("parcae").body  # d = 64 channels: the 144 value pairs go in, 64 at a time
    vals = torch.tensor([-1e4, -300.0, -100.0, -20.0, -15.0, -1.0, 0.0, 1.0, 20.0, 88.0, 100.0, 1e4])
    a_log, dt = torch.meshgrid(vals, vals, indexing="ij")
    n = a_log.numel()
    for chunk in range(0, n, 64):
        with torch.no_grad():
            m = min(64, n - chunk)
            body.A_log[:m] = a_log.reshape(-1)[chunk:chunk + m]
            body.dt_bias[:m] = dt.reshape(-1)[chunk:chunk + m]
        abar = body.abar()
        assert torch.isfinite(abar).all()
        assert (abar > 0).all() and (abar < 1).all(), abar
        abar.sum().backward()
        assert torch.isfinite(body.A_log.grad).all() and torch.isfinite(body.dt_bias.grad).all()
        body.zero_grad()
    with torch.no_grad():  # random values
        body.A_log.normal_(0, 10)
        body.dt_bias.normal_(0, 10)
    assert ((body.abar() > 0) & (body.abar() < 1)).all()


def test_special_inits_survive_the_lm_init_and_no_decay():
    model = build("parcae")
    b = model.body
    assert torch.allclose(b.abar(), torch.full((64,), math.sqrt(1 / 5)), atol=1e-6)
    assert torch.allclose(b.delta(), torch.full((64,), 0.5 * math.log(5)), atol=1e-6)
    assert torch.equal(b.B, torch.eye(64))
    assert torch.allclose(b.C.t() @ b.C, 0.4 * torch.eye(64), atol=1e-5)
    names = {id(getattr(b, n)) for n in b.no_decay}  # harness.optim.no_decay_parameters reads this declaration
    assert names == {id(b.A_log), id(b.dt_bias), id(b.B), id(b.C)}
    diag = model.body.diagnostics()
    assert diag["state_norm"] == [] and diag["bbar_spectral_norm"] == pytest.approx(0.5 * math.log(5), rel=1e-5)
    assert diag["c_spectral_norm"] == pytest.approx(math.sqrt(0.4), rel=1e-5)
    assert "c_spectral_norm" not in model.body.diagnostics(spectral=False)


@pytest.mark.parametrize("name,block", [("parcae", 4 * 64 * 64 + 3 * 64 * 96 + 2 * 64),
                                        ("rdm", 4 * 64 * 64 + 3 * 64 * 96 + 4 * 64)])
def test_parameter_formula(name, block):
    cfg = small(name)
    extra = 2 * 64 * 64 + (3 * 64 if name == "parcae" else 0) + 64  # B, C / adapter; A_log, dt, prelude norm; final norm
    assert models.count_params(cfg) == 4 * block + extra
    assert models.count_params(small(name, depth=7)) == models.count_params(cfg)  # independent of depth


@pytest.mark.parametrize("name", ["parcae", "rdm"])
@pytest.mark.parametrize("tier", ["70M", "160M"])
def test_width_solver_paper_tiers(name, tier):
    d, H, target = models.TIERS[tier]
    for depth in (4, 8, 16):
        cfg = ModelConfig(model=name, vocab_size=50257, n_embd=d, n_head=H, depth=depth)
        cfg = models.solve_width(cfg, target)  # strict: raises outside 0.20 %
        assert abs(models.count_params(cfg) / target - 1) <= 0.002


# ----------------------------------------------------------------------------- Parcae: depth schedule
@pytest.mark.parametrize("depths, message", [
    (torch.tensor([1.7, 2.9]), "got dtype torch.float32"), ([2.0, 3.0], "got dtype torch.float32"),
    (torch.tensor([True, True]), "got dtype torch.bool"), (torch.tensor([0, 2]), "got (2,)"),
    (torch.tensor([2, 2, 2]), "got (3,)")])
def test_depths_not_positive_integers_per_row_raise(depths, message):
    """recur's depths are (batch,) integers >= 1: fractions are refused, not truncated (1.7 ran 1 step)."""
    model = build("parcae")
    with pytest.raises(ValueError, match=re.escape(message)):
        body_logits(model, torch.randint(0, 61, (2, 5)), depths=depths)


def test_mixed_depths_equal_each_sequence_alone(f64):
    model = build("parcae", mu_bwd=2)
    model.train()
    idx = torch.randint(0, 61, (4, 10))
    h0 = 0.05 * torch.randn(4, 10, 64)
    depths = torch.tensor([3, 1, 5, 2])
    batched = body_logits(model, idx, depths=depths, h0=h0)
    assert model.body.diagnostics()["steps"] == 5
    for i in range(4):
        alone = body_logits(model, idx[i:i + 1], depths=depths[i:i + 1], h0=h0[i:i + 1])
        assert torch.allclose(batched[i:i + 1], alone, rtol=0, atol=1e-12), i
        model.eval()  # the fixed-depth evaluation path at depth T_i gives the same
        model.body.depth = int(depths[i])
        fixed = body_logits(model, idx[i:i + 1], h0=h0[i:i + 1])
        model.train()
        assert torch.allclose(fixed, alone, rtol=0, atol=1e-12), i


def test_gradients_only_from_the_last_k_steps(f64):
    model = build("parcae", mu_bwd=2)
    body = model.body
    model.train()
    idx = torch.randint(0, 61, (3, 9))
    x = model.wte(idx).detach()
    cos, sin = rope_cos_sin(torch.arange(9), dtype=torch.float64)
    h0 = (0.05 * torch.randn(3, 9, 64)).requires_grad_(True)
    w = torch.randn(3, 9, 64)
    depths = torch.tensor([1, 4, 6])  # k = 1, 2, 2; no-grad steps 0, 2, 4
    (body(x, cos, sin, None, depths=depths, h0=h0) * w).sum().backward()
    batched = {n: p.grad.clone() for n, p in body.named_parameters()}
    g_h0 = h0.grad.clone()
    # the state entering the gradient steps of rows 1, 2 came from no-grad steps: no gradient to h0
    assert g_h0[0].abs().sum() > 0
    assert torch.equal(g_h0[1:], torch.zeros_like(g_h0[1:]))
    body.zero_grad()
    for i, T in enumerate(depths.tolist()):
        y = manual_parcae(body, x[i:i + 1], cos, sin, T, min(T, 2), h0[i:i + 1].detach())
        (y * w[i:i + 1]).sum().backward()
    for n, p in body.named_parameters():
        assert torch.allclose(batched[n], p.grad, rtol=1e-10, atol=1e-12), n
    # the no-grad steps' computation contributes nothing: with k = 2 the gradients are those of a
    # model whose first T - k steps are replaced by any constant state with the same value
    assert batched["core.0.mlp.w2.weight"].abs().sum() > 0


def test_training_forward_samples_per_sequence_depths():
    model = build("parcae", mu_rec=4)
    model.train()
    idx = torch.randint(0, 61, (8, 6))
    torch.manual_seed(5)
    _, loss = model(idx, idx)
    d1 = model.body.diagnostics()
    torch.manual_seed(5)
    expect = parcae.parcae_sample_depths(8, 4)
    torch.manual_seed(5)
    _, loss2 = model(idx, idx)
    assert loss.item() == loss2.item()  # train.py's seed governs the sampled depths and h_0
    assert d1["steps"] == int(expect.max()) and d1["depth_mean"] == pytest.approx(expect.double().mean().item())
    assert len(d1["state_norm"]) == d1["steps"] and 0 < d1["abar_max"] < 1
    with torch.no_grad():  # without autograd (FLOP counting, evaluation): exactly `depth` steps
        model(idx)
    assert model.body.diagnostics()["steps"] == 3


def test_depth_samplers_means():
    torch.manual_seed(0)
    t = parcae.parcae_sample_depths(10_000, 8)
    assert t.min() >= 1 and abs(t.double().mean().item() / 8 - 1) < 0.02  # E = 8 + e^-8
    r = parcae.rdm_sample_depths(10_000, 8)
    assert r.min() >= 1 and abs(r.double().mean().item() / 9 - 1) < 0.02  # E = mu_rec + 1


def test_no_recompile_per_sampled_depth():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = build("parcae", mu_rec=3)
    model.train()
    step = torch.compile(model, backend=backend)
    idx = torch.randint(0, 61, (4, 8))
    seen = set()
    counts = []
    for i in range(8):
        torch.manual_seed(i)
        _, loss = step(idx, idx)
        loss.backward()
        seen.add(model.body.diagnostics()["steps"])
        counts.append(len(graphs))
    assert len(seen) >= 3  # several batch depths ...
    assert counts[-1] == counts[1]  # ... and no new graph after the first two batches


# ----------------------------------------------------------------------------- RDM
def test_rdm_truncated_backprop_and_sandwich():
    model = build("rdm", mu_bwd=2)
    body = model.body
    model.train()
    idx = torch.randint(0, 61, (2, 7))
    for T, grad_to_h0 in ((5, False), (2, True)):
        h0 = (0.5 * torch.randn(2, 7, 64)).requires_grad_(True)
        body_logits(model, idx, n_steps=T, h0=h0).square().sum().backward()
        assert (h0.grad is not None and h0.grad.abs().sum() > 0) == grad_to_h0
        assert body.diagnostics()["steps"] == T
        model.zero_grad()
    # sandwich: the state is normalized at the end of every recurrence (n4 gain = 1 at init)
    assert body.diagnostics()["state_norm_max"] == pytest.approx(8.0, rel=1e-3)
    assert body.diagnostics()["w1_spectral_norm"] > 0


def test_rdm_kl_exit_stops_early_when_distributions_agree():
    model = build("rdm", depth=8)
    model.eval()
    idx = torch.randint(0, 61, (2, 9))
    with torch.no_grad():  # W [h; e] = W_2 e: the core no longer depends on h, so p_t = p_1
        model.body.adapter.weight[:, :64] = 0
    logits, steps = parcae.rdm_generate_depths(model, idx, max_depth=8, threshold=5e-4)
    assert (steps == 2).all()
    model.body.depth = 2
    assert torch.allclose(logits, model(idx)[0], atol=1e-5)
    # never exiting (negative threshold) runs the full depth and equals the fixed-depth forward
    model2 = build("rdm", depth=4)
    model2.eval()
    logits, steps = parcae.rdm_generate_depths(model2, idx, threshold=-1.0)
    assert (steps == 4).all() and torch.allclose(logits, model2(idx)[0], atol=1e-5)
    _, steps = parcae.rdm_generate_depths(model2, idx, threshold=1e9)
    assert (steps == 2).all()


# ----------------------------------------------------------------------------- both: decoding, causality
@pytest.mark.parametrize("name", ["parcae", "rdm"])
def test_cached_decoding_equals_full_forward(name):
    model = build(name, depth=3)
    model.eval()
    idx = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        full, _ = model(idx)
        cache = {}
        parts = [model(idx[:, :7], cache=cache)[0]]
        for t in range(7, 12):
            parts.append(model(idx[:, t:t + 1], cache=cache)[0])
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)
    assert ("core", 2, 1) in cache and ("prelude", 0) in cache and ("coda", 0) in cache
    # evaluation is deterministic and independent of the batch composition
    assert torch.allclose(model(idx[1:])[0], full[1:], atol=1e-5)
    out = model.generate(idx[:, :4], 5, temperature=0)
    assert out.shape == (2, 9)


@pytest.mark.parametrize("name", ["parcae", "rdm"])
def test_causality(name):
    model = build(name)
    model.eval()
    idx = torch.randint(0, 61, (1, 10))
    idx2 = idx.clone()
    idx2[0, 6] = (idx[0, 6] + 1) % 61
    with torch.no_grad():
        a, b = model(idx)[0], model(idx2)[0]
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:])
    if name == "parcae":  # also in training with mixed per-sequence depths
        model.train()
        h0 = 0.05 * torch.randn(2, 10, 64)
        with torch.no_grad():
            a = body_logits(model, torch.cat((idx, idx)), depths=torch.tensor([2, 4]), h0=h0)
            b = body_logits(model, torch.cat((idx2, idx2)), depths=torch.tensor([2, 4]), h0=h0)
        assert torch.allclose(a[:, :6], b[:, :6], atol=1e-6)


# ----------------------------------------------------------------------------- flops and fits
def test_forward_macs_and_effective_flops():
    p, r = small("parcae", depth=5), small("rdm", depth=5)
    blk = 4 * 64 * 64 + 3 * 64 * 96
    m = flops.forward_macs(p, 10)
    assert m["linear"] == ((2 + 5 * 2) * blk + 2 * 64 * 64) * 10
    assert m["scores"] == m["mix"] == 12 * 100 * 64
    assert flops.forward_macs(r, 10)["linear"] == ((2 + 5 * 2) * blk + 5 * 2 * 64 * 64) * 10
    core, rest = flops.recurrent_param_split(p)
    assert core == 2 * (blk + 2 * 64) and core + rest == models.count_params(p)
    head = p.vocab_size * 64  # the unembedding, counted in N (the embedding is not)
    assert flops.unrolled_params(p) == rest + 5 * core + head
    attn = 2 * 32 * 64  # 2 T d per block application and token, T = block_size 32
    n1 = (core + 2 * attn) * (5 - 3)  # mu_bwd = ceil(5 / 2) = 3
    n2 = rest + head + 2 * attn + (core + 2 * attn) * 3
    assert flops.parcae_train_flops(p, 1000) == (2 * n1 + 6 * n2) * 1000
    # mu_bwd above mu_rec: every recurrence carries gradients (N1 = 0), never a negative N1
    q = small("parcae", depth=5, mu_rec=2, mu_bwd=4)
    assert flops.parcae_train_flops(q, 1000) == 6 * (rest + head + 2 * attn + (core + 2 * attn) * 2) * 1000
    # RDM's adapter W (2d -> d) runs at every recurrence, as its MACs count it: N unrolls it with the core
    body = models.build_model(r, device="meta").body
    r_core, r_rest = flops.recurrent_param_split(r)
    assert r_core == sum(p.numel() for p in body.core.parameters()) + 2 * 64 * 64
    assert r_core + r_rest == models.count_params(r)
    assert flops.unrolled_params(r) - flops.unrolled_params(r, mu_rec=1) == (5 - 1) * r_core  # mu_rec = depth


def _rel_ok(fit, true, tol=0.02):
    for k, v in true.items():
        assert abs(fit[k] / v - 1) < tol, (k, fit[k], v)


def test_fit_depth_law_recovers_parameters():
    T = torch.tensor([1, 2, 3, 4, 6, 8, 12, 16, 24, 32], dtype=torch.float64)
    true = {"L_inf": 3.1, "Z": 1.7, "z": 0.23}
    L = true["L_inf"] + true["Z"] * torch.exp(-true["z"] * T)
    _rel_ok(flops_fit.fit_depth_law(T, L, restarts=8), true)


def _training_grid():
    N = torch.tensor([1e7, 3e7, 1e8, 3e8, 1e9], dtype=torch.float64)
    D = torch.tensor([1e9, 4e9, 1.6e10, 6.4e10], dtype=torch.float64)
    return torch.cartesian_prod(N, D).unbind(1)


def test_fit_training_law_recovers_parameters():
    N, D = _training_grid()
    true = {"E": 1.69, "A": 406.4, "a": 0.34, "B": 410.7, "b": 0.28}
    L = true["E"] + true["A"] * N ** -true["a"] + true["B"] * D ** -true["b"]
    _rel_ok(flops_fit.fit_training_law(N, D, L, restarts=8), true)


def test_fit_unified_law_recovers_parameters():
    N, D = _training_grid()
    mu = torch.tensor([4.0, 8.0, 16.0]).repeat(7)[:len(N)]
    T = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    N, D, mu, T = *(t.repeat_interleave(6) for t in (N, D, mu)), T.repeat(len(N))
    true = {"E": 1.5, "X": 300.0, "x": 0.3, "Y": 500.0, "y": 0.3, "Z": 2.0, "z": 1.3}
    L = (true["E"] + true["X"] * N ** -true["x"] + true["Y"] * D ** -true["y"]
         + true["Z"] * torch.exp(-true["z"] * T / mu))
    _rel_ok(flops_fit.fit_unified_law(N, D, T, mu, L, restarts=8), true)


def test_fit_cli_reads_train_logs(tmp_path, capsys):
    true = {"L_inf": 2.5, "Z": 1.2, "z": 0.4}
    depths = [1, 2, 4, 8, 16, 32]
    cfg = small("parcae", depth=8)
    for i, iters in enumerate((100, 200)):
        run = tmp_path / f"run{i}"
        run.mkdir()
        nll = [true["L_inf"] + true["Z"] * math.exp(-true["z"] * t) for t in depths]
        recs = [{"event": "start", "config": cfg.to_dict(), "non_embedding_params": 1,
                 "args": {"batch_size": 4, "gradient_accumulation_steps": 2}},
                {"event": "train", "iter": 1, "loss": 9.0},
                {"event": "summary", "model": "parcae", "best_iter": iters, "dev_nll": 3.0},
                {"event": "depth_sweep", "depths": depths, "dev_nll": nll}]
        (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = flops_fit.read_run(str(tmp_path / "run1"))
    assert r["D"] == 200 * 4 * 2 * 32 and r["N"] == flops.unrolled_params(cfg) and r["mu_rec"] == 8
    out = tmp_path / "fits.json"
    assert flops_fit.main([str(tmp_path / "run0"), str(tmp_path / "run1"), "--law", "depth",
                       "--restarts", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2
    for row in rows:
        _rel_ok(row["params"], true)
    assert "depth" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        flops_fit.main([str(tmp_path / "missing")])
    assert e.value.code == 2


@pytest.mark.parametrize("kw, needle", [(dict(mu_rec=-1), "--mu_rec -1 / --mu_bwd 0: must be >= 1"),
                                        (dict(mu_bwd=-2), "--mu_rec 0 / --mu_bwd -2"),
                                        (dict(n_core=0), "--n_prelude 1 / --n_core 0 / --n_coda 1: need --n_core >= 1"),
                                        (dict(n_coda=-1), "--n_coda -1")])
def test_bad_recurrence_settings_name_their_flags(kw, needle):
    from common import UsageError
    cfg = ModelConfig(**{**dict(model="parcae", n_embd=64, n_head=2, depth=2, width=64, n_prelude=1, n_core=1,
                                n_coda=1), **kw})
    with pytest.raises(UsageError, match=needle):
        parcae.resolve_recurrence(cfg)
