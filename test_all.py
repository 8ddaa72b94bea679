"""Tests for the spine: TANGO family, Transformer++ baselines, width solving, train.py end to end.

Run everything with `python -m pytest -q` (this file plus the per-topic tests/test_*.py files).
GPT-2 BPE comes from GPT2_BPE_FILE (defaulting to ../shared/data/gpt2.tiktoken); nothing downloads.
"""
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

import tango_kernels
import train
from common import ModelConfig, UsageError
from harness.optim import Schedule
from models import REGISTRY, TIERS, build_model, count_params, solve_width, width_multiple
from tango import tango_reference, windowed_reference
from tango_kernels import tango_fast, windowed_fast

HERE = os.path.dirname(os.path.abspath(__file__))
BPE = os.environ.get("GPT2_BPE_FILE") or os.path.join(HERE, "..", "shared", "data", "gpt2.tiktoken")
SMALL = dict(n_embd=64, n_head=2, vocab_size=61, block_size=32, window=5, chunk=8,
             jacobi=32,  # PonderLM-2's Jacobi prefill is exact (cached = full forward) at jacobi >= n_thoughts (T - 1)
             lrt_subsets=64)  # LRT's parallel prefill is exact at one slot per subset (lrt-think: 2 T slots)


def small(model, depth=3, width=16, **kw):
    return ModelConfig(**{**SMALL, "model": model, "depth": depth, "width": width, **kw})


def randomize(model, std=0.3):
    """Larger random weights than the init, so that every path of the model matters."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model


@pytest.fixture
def f64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


# ----------------------------------------------------------------------------- TANGO math

def qkgb(B=2, H=3, T=19, fh=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    qs = 4 * torch.nn.functional.normalize(torch.randn(B, H, T, 32, generator=g), dim=-1)
    kh = torch.nn.functional.normalize(torch.randn(B, H, T, 32, generator=g), dim=-1)
    gates = torch.randn(B, H, T, fh, generator=g)
    b = torch.randn(H, generator=g)
    return [t.double().requires_grad_() for t in (qs, kh, gates, b)]


def test_tango_reference_is_the_formula(f64):
    """The reference equals a per-(i, a) loop over the formula (MATH.md, "TANGO"), null option included."""
    qs, kh, g, b = qkgb(B=1, H=2, T=6, fh=3)
    G = tango_reference(qs, kh, g, b)
    for a in range(2):
        for i in range(6):
            m = [torch.exp(qs[0, a, i] @ kh[0, a, j]) for j in range(i + 1)]
            w = torch.stack(m) / (torch.exp(b[a]) + sum(m))
            assert torch.allclose(G[0, a, i], (w[:, None] * g[0, a, :i + 1]).sum(0), atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 4, 7, 256])
def test_tango_fast_equals_reference_outputs_and_gradients(f64, monkeypatch, chunk):
    """Memory-linear chunked attention (any query-chunk size) == the plain formula."""
    monkeypatch.setattr(tango_kernels, "ATTN_CHUNK", chunk)
    args = qkgb()
    out_f, out_r = tango_fast(*args), tango_reference(*args)
    assert (out_f - out_r).abs().max() < 1e-10
    w = torch.randn_like(out_f)
    gf = torch.autograd.grad((out_f * w).sum(), args)
    gr = torch.autograd.grad((out_r * w).sum(), args)
    for a, b in zip(gf, gr):
        assert (a - b).abs().max() < 1e-10


@pytest.mark.parametrize("heads_outermost", [False, True])
@pytest.mark.parametrize("group_rows", [1, 12, 4096])
@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
@pytest.mark.parametrize("window", [1, 4, 7, 19, 40, 2**62])
def test_windowed_fast_equals_reference_outputs_and_gradients(f64, monkeypatch, window, chunk, group_rows, heads_outermost):
    """WindowedAttention (any chunk size, chunks alone or in groups) == the plain formula, outputs
    and gradients of qs, kh, g, b. T = 19: W = 4 and 7 do not divide T and leave most queries with
    old sources (T > 2 W), W = 1 has only the own token in the window, W >= T is full-prefix TANGO
    (2**62: a window no tensor could pad to).
    B H = 6 rows per chunk row: group_rows 1 puts every chunk alone, 12 up to 2 chunks of 1 row
    together, 4096 all. Gates (B, H, T, F/H) as given, or heads outermost as the update makes them."""
    monkeypatch.setattr(tango_kernels, "WINDOW_CHUNK", chunk)
    monkeypatch.setattr(tango_kernels, "WINDOW_GROUP_ROWS", group_rows)
    args = qkgb()
    if heads_outermost:
        args[2] = args[2].detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    out_f, out_r = windowed_fast(*args, window), windowed_reference(*args, window)
    assert (out_f - out_r).abs().max() < 1e-10
    w = torch.randn_like(out_f)
    for a, b in zip(torch.autograd.grad((out_f * w).sum(), args), torch.autograd.grad((out_r * w).sum(), args)):
        assert (a - b).abs().max() < 1e-10


@pytest.mark.parametrize("T, W, C, n_max", [(19, 4, 3, 2), (100, 32, 8, 5), (64, 64, 8, 3), (7, 30, 4, 9), (50, 1, 1, 50)])
def test_windowed_groups_cover_every_row_with_its_window(T, W, C, n_max):
    """tango_kernels._groups: the chunks cover rows 0..T-1 once, in order, C rows each (fewer only at the
    end), at most n_max per group, and each chunk meets exactly its window: keys [r0 - W, r1)
    clipped at 0 (forward) or queries [r0, r1 + W) clipped at T (backward). Views from
    tango_kernels._windows are those rows of the tensor, without a copy."""
    x = torch.arange(T, dtype=torch.float64).view(1, 1, T, 1)
    for by_keys in (False, True):
        rows_seen = []
        for r0, n, rows, w0, ws, L in tango_kernels._groups(T, W, C, n_max, by_keys=by_keys):
            assert 1 <= n <= n_max and (n == 1 or rows == C)
            windows = tango_kernels._windows(x, w0, ws, n, L)
            assert windows.data_ptr() == x.data_ptr() + w0 * x.element_size()
            for c in range(n):
                a, z = r0 + c * C, r0 + c * C + rows
                rows_seen += range(a, z)
                want = range(a, min(z + W, T)) if by_keys else range(max(a - W, 0), z)
                assert windows[0, 0, c, :, 0].tolist() == list(want)
        assert rows_seen == list(range(T))


@pytest.mark.parametrize("T, W, C", [(70, 16, 8), (9, 4, 3), (40, 40, 8)])
def test_windowed_masks_on_their_columns_are_the_whole_masks(T, W, C):
    """tango_kernels._masks gives the window mask and the old-source mask only on the runs of columns
    where some row needs one; put back into full tiles they are: -inf where the distance between
    query and key positions lies outside [0, W), 0 elsewhere, and old sources where it is >= W."""
    for by_keys in (False, True):
        for r0, n, rows, w0, ws, L in tango_kernels._groups(T, W, C, 4, by_keys=by_keys):
            band, old = torch.zeros(n, rows, L, dtype=torch.float64), torch.zeros(n, rows, L, dtype=torch.float64)
            runs = tango_kernels._masks(n, rows, L, w0 - r0 if by_keys else r0 - w0, ws - C if by_keys else C - ws,
                                        W, by_keys, torch.float64, torch.device("cpu"))
            for cs, b, o in runs:
                band[..., cs] = b
                if o is not None:
                    old[..., cs] = o
            for c in range(n):
                for i in range(rows):
                    for j in range(L):
                        query, key = (w0 + c * ws + j, r0 + c * C + i) if by_keys else (r0 + c * C + i, w0 + c * ws + j)
                        dist = query - key
                        assert band[c, i, j] == (0.0 if 0 <= dist < W else -math.inf)
                        assert old[c, i, j] == float(dist >= W)
            assert sum(cs.stop - cs.start for cs, _, _ in runs) < L or L <= 2 * C  # inner tiles: only 2 C columns


@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("mixed", [False, True])
def test_matmul_into_equals_beta_out_plus_product(beta, mixed):
    """tango_kernels._matmul_into, which writes the fast paths' chunk products: out = beta out + a @ b for
    strided (B, H, m, n) views (the (B, T, H, F/H) layout of the gates; B = 2), in place on CPU,
    through a temporary when out's dtype differs from the factors'; beta = 0 ignores NaN in out."""
    g = torch.Generator().manual_seed(0)
    out = torch.randn(2, 7, 3, 5, generator=g, dtype=torch.float64).transpose(1, 2)  # (2, 3, 7, 5), strided
    a = torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64)
    b = torch.randn(2, 9, 3, 5, generator=g, dtype=torch.float64).transpose(1, 2)[:, :, 2:6]  # a slice along T
    if mixed:  # the products in the gates' dtype, out in float64 (e.g. bfloat16 products into a float32 sum)
        a, b = a.float(), b.float()
    if beta == 0:
        out.fill_(float("nan"))
    want = a.double() @ b.double() + (beta * out if beta else 0)
    ptr = out.data_ptr()
    tango_kernels._matmul_into(out, a, b, beta=beta)
    assert out.data_ptr() == ptr and (out - want).abs().max() < (1e-6 if mixed else 1e-12)


def test_matmul_into_reads_overlapping_windows_in_place():
    """_matmul_into with 5-dim operands: chunk weights (B, H, n, m, L) times overlapping windows of
    the gates (tango_kernels._windows, B = 2, H = 3, stride 4 < L = 9) into strided chunks of the output,
    as WindowedAttention uses it: equal to the product of copies, nothing reallocated."""
    g = torch.Generator().manual_seed(0)
    gates = torch.randn(3, 2, 30, 5, generator=g, dtype=torch.float64).transpose(0, 1)  # heads outermost
    a = torch.randn(2, 3, 4, 4, 9, generator=g, dtype=torch.float64)
    out = torch.full((3, 2, 30, 5), float("nan"), dtype=torch.float64).transpose(0, 1)
    win = tango_kernels._windows(gates, 2, 4, 4, 9)  # rows [2 + 4 c, 11 + 4 c), c < 4
    want = a @ torch.stack([gates[:, :, 2 + 4 * c:11 + 4 * c] for c in range(4)], 2)
    chunks = out[:, :, 8:24].unflatten(2, (4, 4))
    ptr = out.data_ptr()
    tango_kernels._matmul_into(chunks, a, win, beta=0.0)
    assert out.data_ptr() == ptr and (chunks - want).abs().max() < 1e-12
    assert out[:, :, :8].isnan().all() and out[:, :, 24:].isnan().all()  # nothing outside the chunks written


@pytest.mark.parametrize("fast", ["tango", "tango-windowed"])
def test_fast_paths_save_only_inputs_output_and_lse(fast, monkeypatch):
    """What autograd keeps for backward from TANGO's averages: the inputs (queries, keys and gates;
    full-prefix: padded to 40 dims and with the null key/gate), the output and one log-sum-exp per
    query, nothing of size T x W or T x T (weights are recomputed in backward)."""
    monkeypatch.setattr(tango_kernels, "WINDOW_CHUNK", 8)
    monkeypatch.setattr(tango_kernels, "ATTN_CHUNK", 8)
    B, H, T, fh = 2, 3, 37, 5
    qs, kh, g, b = qkgb(B=B, H=H, T=T, fh=fh)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        if fast == "tango":
            tango_fast(qs, kh, g, b)
        else:
            windowed_fast(qs, kh, g, b, 4)
    if fast == "tango":  # q (T x 40), [null, keys] ((T+1) x 40), [0, gates] ((T+1) x fh), out, lse
        expected = B * H * (T * 40 + (T + 1) * 40 + (T + 1) * fh + T * fh + T)
    else:  # q, k (T x 32), g (T x fh), b (H), out (T x fh), lse (T)
        expected = B * H * (2 * T * 32 + 2 * T * fh + T) + H
    assert sum(saved) == expected


@pytest.mark.parametrize("fast", ["tango", "tango-windowed"])
def test_fast_paths_write_heads_outermost(fast, monkeypatch):
    """Both fast paths return (B, H, T, F/H) laid out as (H, B, T, F/H), so the update's per-group
    view of G, G.transpose(0, 1).reshape(H, B T, F/H), is a view: no copy of the widest activation."""
    monkeypatch.setattr(tango_kernels, "WINDOW_CHUNK", 8)
    monkeypatch.setattr(tango_kernels, "ATTN_CHUNK", 8)
    qs, kh, g, b = qkgb(B=2, H=3, T=37, fh=5)
    G = tango_fast(qs, kh, g, b) if fast == "tango" else windowed_fast(qs, kh, g, b, 4)
    assert G.shape == (2, 3, 37, 5) and G.transpose(0, 1).is_contiguous()
    per_group = G.transpose(0, 1).reshape(3, 2 * 37, 5)
    assert per_group.data_ptr() == G.data_ptr()


def test_windowed_with_large_window_equals_full_tango(f64):
    full = randomize(build_model(small("tango")))
    win = build_model(small("tango-windowed", window=32))
    win.load_state_dict(full.state_dict())
    x = torch.randint(0, 61, (2, 29))
    assert (full(x)[0] - win(x)[0]).abs().max() <= 1e-6
    small_win = build_model(small("tango-windowed", window=4))
    small_win.load_state_dict(full.state_dict())
    assert (full(x)[0] - small_win(x)[0]).abs().max() > 1e-3  # the window really changes the model


@pytest.mark.parametrize("name", ["tango", "tango-windowed", "tango-3set"])
def test_tango_models_fast_equal_reference(f64, name):
    fast = randomize(build_model(small(name, depth=4)))
    ref = build_model(small(name, depth=4), impl="reference")
    ref.load_state_dict(fast.state_dict())
    x = torch.randint(0, 61, (2, 23))
    lf, loss_f = fast(x, x)
    lr, loss_r = ref(x, x)
    assert (lf - lr).abs().max() < 1e-9
    for (n, a), b in zip(fast.named_parameters(), torch.autograd.grad(loss_r, list(ref.parameters()))):
        ga = torch.autograd.grad(loss_f, a, retain_graph=True)[0]
        assert (ga - b).abs().max() < 1e-9, n


def test_three_set_uses_first_middle_last_sets():
    model = build_model(small("tango-3set", depth=5))
    calls, update = [], model.body.update
    sets = list(model.body.sets)

    def record(x, cos, sin, gset, cache=None):  # which set each update is given
        calls.append([s is gset for s in sets].index(True))
        return update(x, cos, sin, gset, cache)
    model.body.update = record
    model(torch.randint(0, 61, (1, 8)))
    assert calls == [0, 1, 1, 1, 2]
    with pytest.raises(UsageError, match="depth"):
        build_model(small("tango-3set", depth=2))


# ----------------------------------------------------------------------------- every model

@pytest.mark.parametrize("name", list(REGISTRY))
@pytest.mark.parametrize("prefill", [1, 3, 9])  # below, at and past window - 1 (window=5)
def test_cached_decoding_equals_full_forward(f64, name, prefill):
    model = randomize(build_model(small(name)), std=0.2).eval()
    x = torch.randint(0, 61, (2, 21))
    full, _ = model(x)
    cache = {}
    steps = [prefill, prefill + 2] + list(range(prefill + 3, 22))  # prefill, one 2-token step, then 1 at a time
    parts = [model(x[:, :prefill], cache=cache)[0]]
    parts += [model(x[:, a:b], cache=cache)[0] for a, b in zip(steps, steps[1:])]
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-9


@pytest.mark.parametrize("name", list(REGISTRY))
def test_generate_greedy_equals_uncached_greedy(f64, name):
    model = randomize(build_model(small(name)), std=0.2).eval()
    x = torch.randint(0, 61, (2, 5))
    out = model.generate(x, max_new_tokens=7, temperature=0)
    ref = x
    for _ in range(7):  # no cache: rerun the whole sequence each step
        ref = torch.cat((ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)), 1)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_causality(f64, name):
    model = randomize(build_model(small(name)), std=0.2).eval()  # eval: deterministic depth/state
    x = torch.randint(0, 61, (2, 20))
    y = x.clone()
    y[:, 11] = (y[:, 11] + 7) % 61
    a, b = model(x)[0], model(y)[0]
    assert (a[:, :11] - b[:, :11]).abs().max() == 0
    assert (a[:, 11:] - b[:, 11:]).abs().max() > 1e-6


@pytest.mark.parametrize("tier", ["70M", "160M"])
@pytest.mark.parametrize("depth", [4, 8, 16])
@pytest.mark.parametrize("name", list(REGISTRY))
def test_paper_tier_widths_within_tolerance(name, tier, depth):
    d, H, target = TIERS[tier]
    cfg = solve_width(ModelConfig(model=name, n_embd=d, n_head=H, depth=depth), target)
    assert cfg.width % width_multiple(cfg) == 0 and width_multiple(cfg) in (8, H)
    assert abs(count_params(cfg) / target - 1) <= 0.002


def test_parameter_formulas():
    d, H, F, K = 64, 2, 16, 3
    per_tpp = 4 * d * d + 3 * d * F + 2 * d
    assert build_model(small("untied", width=F)).num_params() == K * per_tpp + d
    assert build_model(small("loop", width=F)).num_params() == per_tpp + d
    tango_shared = 2 * d * d + d + 2 * H
    assert build_model(small("tango", width=F)).num_params() == tango_shared + 3 * d * F + d
    assert build_model(small("tango-windowed", width=F)).num_params() == tango_shared + 3 * d * F + d
    assert build_model(small("tango-3set", width=F)).num_params() == tango_shared + 9 * d * F + d
    assert solve_width(ModelConfig(model="tango", n_embd=512, n_head=16, depth=4), 44_270_000).width == 28480


def test_unknown_model_and_bad_depth_raise():
    with pytest.raises(UsageError, match="--model"):
        build_model(small("nope"))
    with pytest.raises(UsageError, match="--depth"):
        build_model(small("tango", depth=0))


# ----------------------------------------------------------------------------- train.py

def test_lr_schedule():
    A = Schedule(learning_rate=1e-3, warmup_iters=10, max_iters=100, min_lr_ratio=0.1)
    assert 0 < A.lr_at(0) < 1e-3
    assert A.lr_at(10) == pytest.approx(1e-3)
    assert A.lr_at(99) == pytest.approx(1e-4)
    assert all(A.lr_at(i) >= A.lr_at(i + 1) for i in range(10, 99))
    A = replace(A, warmup_iters=100)  # warmup as long as the run: no division by zero, still positive
    assert 0 < A.lr_at(99) <= 1e-3
    A = replace(A, max_iters=0, warmup_iters=0)  # no warmup and a schedule of no length: past it, the floor
    assert A.lr_at(0) == pytest.approx(1e-4)
    A = replace(A, max_iters=1, warmup_iters=0)  # one update, no warmup: the peak
    assert A.lr_at(0) == 1e-3


def run_train(tmp_path, *flags, env_extra=None, check=True):
    env = {**os.environ, "GPT2_BPE_FILE": BPE, "OMP_NUM_THREADS": "1", **(env_extra or {})}  # 1 thread: 2 cores, shared
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--data_root", str(tmp_path / "data"),
           "--out_dir", str(tmp_path / "out"), "--quiet", *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


TINY = ["--max_iters", "4", "--eval_interval", "2", "--block_size", "32", "--batch_size", "2",
        "--eval_windows", "4", "--sample_tokens", "5"]


@pytest.fixture(scope="module")
def text_dir(gpt2_bpe, tmp_path_factory):  # a GPT-2 BPE corpus: its tests skip without the vocabulary
    d = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "(", ")", ":", "\n"]
    for i in range(12):
        (d / f"f{i}.txt").write_text(" ".join(rng.choice(words, 400)))
    return d


def test_train_end_to_end_on_text(tmp_path, text_dir):
    p = run_train(tmp_path, "--model", "tango-windowed", "--depth", "2", "--dataset", str(text_dir), *TINY)
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["best_iter"] in (2, 4) and np.isfinite(s["test_nll"]) and s["dev_nll"] < 11
    assert "test NLL" in p.stdout and "unigram entropy" in p.stdout and "sample" in p.stdout
    log = [json.loads(l) for l in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in log if r["event"] == "eval"] == [2, 4]
    ck = torch.load(tmp_path / "out" / "ckpt_best.pt", map_location="cpu", weights_only=True)
    assert ck["config"]["model"] == "tango-windowed"


def test_eval_does_not_depend_on_batch_size(text_dir, tmp_path):
    import data as data_mod
    os.environ.setdefault("GPT2_BPE_FILE", BPE)
    d = data_mod.Data(data_mod.prepare(str(text_dir), out_root=str(tmp_path)))
    model = build_model(small("loop", vocab_size=d.vocab_size))
    starts = d.eval_windows("dev", 16, 6)
    ctx = torch.autocast("cpu", enabled=False)
    a = train.evaluate(model, d, "dev", starts, 16, 4, "cpu", ctx)
    b = train.evaluate(model, d, "dev", starts, 16, 8, "cpu", ctx)
    assert a == pytest.approx(b, rel=1e-6)


def main_in_process(tmp_path, *flags, capsys):
    """train.main in this process on one thread; returns (exit code, stdout, stderr)."""
    capsys.readouterr()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.main(["--data_root", str(tmp_path / "data"), "--out_dir", str(tmp_path / "out"), "--quiet", *flags])
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_eval_depths_sweep_and_diagnostics(tmp_path, text_dir, capsys, monkeypatch):
    """--eval_depths evaluates the best checkpoint at each depth (here Parcae: the depth-2 value
    equals the dev NLL it was selected on, since it trains and evaluates at --depth 2), and the
    looped models log their recurrent-state diagnostics."""
    monkeypatch.setenv("GPT2_BPE_FILE", BPE)
    code, out, err = main_in_process(tmp_path, "--model", "parcae", "--depth", "2", "--n_prelude", "1", "--n_core",
                                     "1", "--n_coda", "1", "--dataset", str(text_dir), "--eval_depths", "1,2,4",
                                     *TINY, capsys=capsys)
    assert code == 0, err
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    curve = s["depth_sweep"]["dev_nll"]
    assert s["depth_sweep"]["depths"] == [1, 2, 4] and len(set(curve)) == 3
    assert curve[1] == pytest.approx(s["dev_nll"], rel=1e-9)
    assert "K=4" in out
    log = [json.loads(l) for l in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    diag = [r["diag"] for r in log if r["event"] == "eval"]
    assert diag and all(0 < d["abar_max"] < 1 and len(d["state_norm"]) == 2 for d in diag)
    code, _, err = main_in_process(tmp_path / "bad", "--model", "untied", "--dataset", str(text_dir),
                                   "--eval_depths", "1,2", *TINY, capsys=capsys)
    assert code == 2 and "--eval_depths" in err and not (tmp_path / "bad" / "out").exists()


def test_train_on_the_dmmath_sample_reports_exact_match(dmmath_sample, tmp_path, capsys):
    """Plumbing smoke test on the real DeepMind Mathematics sample (the default --data_dir): the
    run reports test NLL on interpolate and exact match on both held-out splits. (The scorer's
    values are pinned in tests/test_values.py.)"""
    code, out, err = main_in_process(tmp_path, "--model", "loop", "--depth", "2", "--dataset", "dmmath",
                                     *TINY[:-4], "--block_size", "256", "--eval_windows", "2", "--em_samples", "3",
                                     "--sample_tokens", "8", capsys=capsys)
    assert code == 0, err
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["test_split"] == "interpolate" and np.isfinite(s["test_nll"])
    for split in ("interpolate", "extrapolate"):
        assert s[f"exact_match_{split}"] in (0.0, 1 / 3, 2 / 3, 1.0)  # 3 problems
    assert "exact match interpolate" in out and "exact match extrapolate" in out


def test_readme_results_table_regenerates_from_committed_summaries():
    """results/readme/README.md's CPU-tier table is `python -m tools.sweep report --root results/readme`, byte for byte."""
    from tools import sweep_report
    readme = open(os.path.join(HERE, "results", "readme", "README.md")).read()
    begin, end = "<!-- sweep report --root results/readme -->\n", "<!-- end of sweep report -->"
    table = readme[readme.index(begin) + len(begin):readme.index(end, readme.index(begin))]
    assert table == sweep_report.report(os.path.join(HERE, "results", "readme"))
    assert table.count("| tango |") == 2  # stdlib and dmmath rows are there


def test_readme_reproduction_grid_regenerates_from_committed_results():
    """results/grid/README.md's reproduction tables are `python -m tools.sweep report --grid --root results/grid`,
    byte for byte, from the committed summaries; every grid run is there (7 models x 2 datasets
    x (K in {4, 8} x 3 seeds + K = 16 x 1 seed)) and its plots are committed PNGs."""
    from tools import sweep_report
    readme = open(os.path.join(HERE, "results", "grid", "README.md")).read()
    begin, end = "<!-- sweep report --grid --root results/grid -->\n", "<!-- end of grid report -->"
    table = readme[readme.index(begin) + len(begin):readme.index(end, readme.index(begin))]
    root = os.path.join(HERE, "results", "grid")
    assert table == sweep_report.grid_report(root)
    runs = sweep_report.load_runs(root)  # K = 16 has one seed (README: the two-hour budget)
    assert len(runs) == 2 * 7 * 3 and all(len(v) == (1 if k[2] == 16 else 3) for k, v in runs.items())
    for ds in ("stdlib", "dmmath"):
        with open(os.path.join(root, f"{ds}.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert f"]({ds}.png)" in readme  # the plots sit beside the README
