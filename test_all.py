"""Tests for the spine: TANGO family, Transformer++ baselines, width solving, train.py end to end.

Run everything with `python -m pytest -q` (this file plus the per-issue test_*.py files).
GPT-2 BPE comes from GPT2_BPE_FILE (defaulting to ../shared/data/gpt2.tiktoken); nothing downloads.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import tango
import train
from common import ModelConfig, UsageError
from models import REGISTRY, TIERS, build_model, count_params, solve_width, width_multiple
from tango import tango_fast, tango_reference, windowed_fast, windowed_reference

HERE = os.path.dirname(os.path.abspath(__file__))
BPE = os.environ.get("GPT2_BPE_FILE") or os.path.join(HERE, "..", "shared", "data", "gpt2.tiktoken")
DMMATH = os.path.join(HERE, "..", "shared", "data", "dmmath")
SMALL = dict(n_embd=64, n_head=2, vocab_size=61, block_size=32, window=5, chunk=8)


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
    """The reference equals a per-(i, a) loop over the SPEC section 3 formula, null option included."""
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
    monkeypatch.setattr(tango, "ATTN_CHUNK", chunk)
    args = qkgb()
    out_f, out_r = tango_fast(*args), tango_reference(*args)
    assert (out_f - out_r).abs().max() < 1e-10
    w = torch.randn_like(out_f)
    gf = torch.autograd.grad((out_f * w).sum(), args)
    gr = torch.autograd.grad((out_r * w).sum(), args)
    for a, b in zip(gf, gr):
        assert (a - b).abs().max() < 1e-10


@pytest.mark.parametrize("window", [1, 4, 7, 19, 40])
def test_windowed_fast_equals_reference_outputs_and_gradients(f64, window):
    args = qkgb()
    out_f, out_r = windowed_fast(*args, window), windowed_reference(*args, window)
    assert (out_f - out_r).abs().max() < 1e-10
    w = torch.randn_like(out_f)
    for a, b in zip(torch.autograd.grad((out_f * w).sum(), args), torch.autograd.grad((out_r * w).sum(), args)):
        assert (a - b).abs().max() < 1e-10


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
    calls = []
    for i, s in enumerate(model.body.sets):
        s.wg.register_forward_hook(lambda m, inp, out, i=i: calls.append(i))
    model(torch.randint(0, 61, (1, 8)))
    assert calls == [0, 1, 1, 1, 2]
    with pytest.raises(UsageError, match="depth"):
        build_model(small("tango-3set", depth=2))


# ----------------------------------------------------------------------------- every model

@pytest.mark.parametrize("name", list(REGISTRY))
def test_cached_decoding_equals_full_forward(f64, name):
    model = randomize(build_model(small(name)), std=0.2).eval()
    x = torch.randint(0, 61, (2, 21))
    full, _ = model(x)
    cache = {}
    parts = [model(x[:, :9], cache=cache)[0]]  # prefill, then one token at a time
    parts += [model(x[:, t:t + 1], cache=cache)[0] for t in range(9, 21)]
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
    class A:
        learning_rate, warmup_iters, max_iters, min_lr_ratio = 1e-3, 10, 100, 0.1
    assert 0 < train.lr_at(0, A) < 1e-3
    assert train.lr_at(10, A) == pytest.approx(1e-3)
    assert train.lr_at(99, A) == pytest.approx(1e-4)
    assert all(train.lr_at(i, A) >= train.lr_at(i + 1, A) for i in range(10, 99))
    A.warmup_iters = 100  # warmup as long as the run: no division by zero, still positive
    assert 0 < train.lr_at(99, A) <= 1e-3
    A.max_iters = A.warmup_iters = 0
    assert train.lr_at(0, A) == 1e-3


def run_train(tmp_path, *flags, env_extra=None, check=True):
    env = {**os.environ, "GPT2_BPE_FILE": BPE, **(env_extra or {})}
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--data_root", str(tmp_path / "data"),
           "--out_dir", str(tmp_path / "out"), "--quiet", *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


TINY = ["--max_iters", "4", "--eval_interval", "2", "--block_size", "32", "--batch_size", "2",
        "--eval_windows", "4", "--sample_tokens", "5", "--em_samples", "3"]


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


def test_train_dmmath_reports_exact_match(tmp_path):
    p = run_train(tmp_path, "--model", "loop", "--depth", "2", "--dataset", "dmmath", "--data_dir", DMMATH,
                  *TINY[:-6], "--block_size", "256", "--eval_windows", "2", "--em_samples", "3", "--sample_tokens", "8")
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["test_split"] == "interpolate"
    for split in ("interpolate", "extrapolate"):
        assert 0 <= s[f"exact_match_{split}"] <= 1
    assert "exact match interpolate" in p.stdout


def test_resume_continues_exactly(tmp_path, text_dir):
    flags = ["--model", "loop", "--depth", "2", "--dataset", str(text_dir), *TINY]
    run_train(tmp_path / "a", *flags)
    run_train(tmp_path / "b", *flags[:-len(TINY)], *TINY[:1], "2", *TINY[2:])
    run_train(tmp_path / "b", *flags, "--resume")
    losses = lambda d: [r["loss"] for r in map(json.loads, (d / "out" / "log.jsonl").read_text().splitlines())
                        if r["event"] == "train"]
    assert losses(tmp_path / "a") == losses(tmp_path / "b") and len(losses(tmp_path / "a")) == 4


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


@pytest.mark.parametrize("flags,needle", [
    (["--model", "nope"], "--model"),
    (["--depth", "0"], "--depth"),
    (["--block_size", "100000"], "--block_size"),
    (["--dataset", "EMPTY"], "--dataset"),
    (["--dataset", "TEXT", "--no_vocab"], "GPT2_BPE_FILE"),
    (["--size", "1B"], "--size"),
    (["--learning_rate", "-1"], "--learning_rate"),
])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, text_dir, flags, needle):
    (tmp_path / "empty").mkdir()
    env_extra = {}
    if "--no_vocab" in flags:  # offline with no GPT-2 vocabulary: the env var points nowhere
        flags = [f for f in flags if f != "--no_vocab"]
        env_extra = {"GPT2_BPE_FILE": str(tmp_path / "missing.tiktoken")}
    flags = [str(tmp_path / "empty") if f == "EMPTY" else str(text_dir) if f == "TEXT" else f for f in flags]
    if "--dataset" not in flags:
        flags += ["--dataset", str(text_dir)]
    p = run_train(tmp_path, *TINY, *flags, env_extra=env_extra, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], p.stderr
    assert not (tmp_path / "out").exists()
    leftovers = [f for f in (tmp_path / "data").rglob("*")] if (tmp_path / "data").exists() else []
    assert all(".tmp" not in str(f) and "tmp" not in f.name for f in leftovers)


def test_eval_depths_sweep_and_diagnostics(tmp_path, text_dir):
    """--eval_depths evaluates the best checkpoint at each depth (here Parcae: the depth-2 value
    equals the dev NLL it was selected on, since it trains and evaluates at --depth 2), and the
    looped models log their recurrent-state diagnostics."""
    p = run_train(tmp_path, "--model", "parcae", "--depth", "2", "--n_prelude", "1", "--n_core", "1",
                  "--n_coda", "1", "--dataset", str(text_dir), "--eval_depths", "1,2,4", *TINY)
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    curve = s["depth_sweep"]["dev_nll"]
    assert s["depth_sweep"]["depths"] == [1, 2, 4] and len(set(curve)) == 3
    assert curve[1] == pytest.approx(s["dev_nll"], rel=1e-9)
    assert "K=4" in p.stdout
    log = [json.loads(l) for l in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    diag = [r["diag"] for r in log if r["event"] == "eval"]
    assert diag and all(0 < d["abar_max"] < 1 and len(d["state_norm"]) == 2 for d in diag)
    bad = run_train(tmp_path / "bad", "--model", "untied", "--dataset", str(text_dir), "--eval_depths", "1,2",
                    *TINY, check=False)
    assert bad.returncode == 2 and "--eval_depths" in bad.stderr


def test_readme_results_table_regenerates_from_committed_summaries():
    """The README's results table is `python sweep.py report --root results/readme`, byte for byte."""
    import sweep
    readme = open(os.path.join(HERE, "README.md")).read()
    begin, end = "<!-- sweep report --root results/readme -->\n", "<!-- end of sweep report -->"
    table = readme[readme.index(begin) + len(begin):readme.index(end)]
    assert table == sweep.report(os.path.join(HERE, "results", "readme"))
    assert table.count("| tango |") == 2  # stdlib and dmmath rows are there


def test_readme_reproduction_grid_regenerates_from_committed_results():
    """The README's reproduction tables are `python sweep.py report --grid --root results/grid`,
    byte for byte, from the committed summaries; every grid run is there (7 models x 2 datasets
    x (K in {4, 8} x 3 seeds + K = 16 x 1 seed)) and its plots are committed PNGs."""
    import sweep
    readme = open(os.path.join(HERE, "README.md")).read()
    begin, end = "<!-- sweep report --grid --root results/grid -->\n", "<!-- end of grid report -->"
    table = readme[readme.index(begin) + len(begin):readme.index(end)]
    root = os.path.join(HERE, "results", "grid")
    assert table == sweep.grid_report(root)
    runs = sweep.load_runs(root)  # K = 16 has one seed (README: the two-hour budget)
    assert len(runs) == 2 * 7 * 3 and all(len(v) == (1 if k[2] == 16 else 3) for k, v in runs.items())
    for ds in ("stdlib", "dmmath"):
        with open(os.path.join(root, f"{ds}.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert f"results/grid/{ds}.png" in readme


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory):
    """One data_root for the per-model runs below, so stdlib and dmmath are prepared once."""
    return tmp_path_factory.mktemp("shared_data")


@pytest.mark.parametrize("dataset", ["stdlib", "dmmath"])
@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_model_trains_on_stdlib_and_dmmath(request, tmp_path, shared_root, name, dataset):
    """Every registered model trains through the same flags on both datasets and reports dev/test
    NLL (and exact match on dmmath's interpolate and extrapolate)."""
    if dataset == "stdlib":
        request.getfixturevalue("gpt2_bpe")  # skips without the GPT-2 vocabulary
    depth = "3" if name == "tango-3set" else "2"
    run_train(tmp_path, "--model", name, "--depth", depth, "--dataset", dataset, "--data_root", str(shared_root),
              "--max_iters", "2", "--eval_interval", "1", "--block_size", "64" if dataset == "stdlib" else "256",
              "--batch_size", "2", "--eval_windows", "2", "--em_samples", "2", "--sample_tokens", "4",
              env_extra={"OMP_NUM_THREADS": "1"})
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["model"] == name and np.isfinite(s["dev_nll"]) and np.isfinite(s["test_nll"])
    assert s["test_split"] == ("interpolate" if dataset == "dmmath" else "test")
    if dataset == "dmmath":
        assert 0 <= s["exact_match_interpolate"] <= 1 and 0 <= s["exact_match_extrapolate"] <= 1
