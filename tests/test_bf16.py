"""bfloat16 autocast: every model trains under it, and TANGO's averages keep their precision.

TANGO's fast paths compute queries, keys, scores, their log-sum-exp and the normalizing sums in
float32 and only the weight x gate products in bfloat16 (tango_kernels.py, "Precision"). The bar for
"precise enough" is PyTorch's own attention in bfloat16, measured here on the same kind of inputs.
"""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tango_kernels
import train
from harness.config import resolve_args
from tango import tango_reference, windowed_reference
from checks import ONE_BLOCK_PER_LOOP
from common import ModelConfig, RMSNorm
from models import REGISTRY, build_model

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def rel_err(x, ref):
    """||x - ref|| / ||ref|| (Frobenius), computed in float64."""
    return ((x.double() - ref).norm() / ref.norm()).item()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ----------------------------------------------------------------------------- one training step

def small(name):
    return ModelConfig(model=name, n_embd=64, n_head=2, vocab_size=61, block_size=48, window=8, chunk=16,
                       depth=3, width=64, **ONE_BLOCK_PER_LOOP.get(name, {}))


@pytest.mark.parametrize("name", list(REGISTRY))
def test_residual_stream_stays_float32_under_bf16_autocast(name):
    """Under bfloat16 autocast only the matmuls run in bfloat16: every RMSNorm (each block's, the
    final one) reads a float32 residual stream. (Parcae's coda and RDM's core and coda once read the
    bfloat16 output of a d x d matmul: their residual adds rounded to bfloat16, and rms_norm fell
    back from its fused kernel.)"""
    torch.manual_seed(0)
    model = build_model(small(name))
    seen = []
    for where, m in model.named_modules():
        if isinstance(m, RMSNorm):
            m.register_forward_pre_hook(lambda mod, args, where=where: seen.append((where, args[0].dtype)))
    x = torch.randint(0, 61, (2, 48))
    with torch.autocast(**BF16):
        model(x, x)
    assert seen and [s for s in seen if s[1] != torch.float32] == []


@pytest.mark.parametrize("name", list(REGISTRY))
def test_bf16_training_step_matches_float32(name):
    """One AdamW step under bfloat16 autocast: finite loss, gradients and updated weights; the loss
    within 2 % of the float32 step's from the same weights and the same random depth draws (Parcae,
    RDM), and the gradient within 10 % (relative norm; measured 0.2-2.5 %)."""
    torch.manual_seed(0)
    model = build_model(small(name))
    with torch.no_grad():  # weights larger than the init, so the loss depends on the model (not ~log V)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    x = torch.randint(0, 61, (2, 48))
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            _, loss = model(x, x)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[dtype] = loss.item(), grads
    (loss32, g32), (loss16, g16) = results[torch.float32], results[torch.bfloat16]
    assert np.isfinite(loss16) and torch.isfinite(g16).all()
    assert abs(loss16 - loss32) <= 0.02 * loss32, (loss16, loss32)
    assert abs(loss32 - np.log(61)) > 0.05 * np.log(61)  # the weights matter: not the uniform prediction's loss
    assert rel_err(g16, g32.double()) < 0.10
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ----------------------------------------------------------------------------- precision of the averages

def inputs(B=2, H=4, T=300, fh=48, seed=0):
    """float64 TANGO inputs as the model makes them: tau = 10 scaled unit queries, unit keys,
    SiLU gates, null scores b."""
    gen = torch.Generator().manual_seed(seed)
    qs = 10 * F.normalize(torch.randn(B, H, T, 32, generator=gen, dtype=torch.float64), dim=-1)
    kh = F.normalize(torch.randn(B, H, T, 32, generator=gen, dtype=torch.float64), dim=-1)
    g = F.silu(torch.randn(B, H, T, fh, generator=gen, dtype=torch.float64))
    b = torch.randn(H, generator=gen, dtype=torch.float64)
    dout = torch.randn(B, H, T, fh, generator=gen, dtype=torch.float64)
    return [qs, kh, g, b], dout


def grads(fn, args, dout):
    args = [a.detach().requires_grad_() for a in args]
    out = fn(*args)
    return out, torch.autograd.grad(out, args, dout.to(out.dtype))


def sdpa_bf16_error():
    """PyTorch's causal SDPA in bfloat16 vs float64 on random q, k, v: (output error, gradient errors)."""
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 4, 300, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    v, dout = (torch.randn(2, 4, 300, 48, generator=gen, dtype=torch.float64) for _ in range(2))
    sdpa = lambda *a: F.scaled_dot_product_attention(*a, is_causal=True)
    ref, gref = grads(sdpa, [q, k, v], dout)
    out, g16 = grads(sdpa, [t.bfloat16() for t in (q, k, v)], dout)
    return rel_err(out, ref), [rel_err(a, b) for a, b in zip(g16, gref)]


# (name, fast path, float64 reference); T = 300 with W = 64: several chunks, W does not divide T,
# and most queries have old sources (T > 2 W)
CASES = [("tango", tango_kernels.tango_fast, tango_reference),
         ("tango-windowed", lambda *a: tango_kernels.windowed_fast(*a, 64), lambda *a: windowed_reference(*a, 64))]


@pytest.mark.parametrize("name,fast,reference", CASES, ids=[c[0] for c in CASES])
def test_bf16_averages_as_precise_as_pytorch_attention(name, fast, reference, monkeypatch):
    """Under bfloat16 autocast, with every input rounded to bfloat16, TANGO's and Windowed TANGO's
    averaged gates are within 0.5 % (relative norm) of the float64 formula, as PyTorch's causal SDPA in
    bfloat16 is of its float64 result (about 0.3 %; scores in bfloat16 made TANGO 1.2-2 % off).
    Gradients of qs, kh, g and b: within 2 % (measured 0.2-0.7 %; SDPA's 0.3-0.4 %)."""
    monkeypatch.setattr(tango_kernels, "ATTN_CHUNK", 128)  # several chunks at T = 300
    monkeypatch.setattr(tango_kernels, "WINDOW_CHUNK", 48)
    sdpa_out, sdpa_grads = sdpa_bf16_error()
    assert sdpa_out < 0.005 and max(sdpa_grads) < 0.01  # the bar
    args, dout = inputs()
    ref, gref = grads(reference, args, dout)
    with torch.autocast(**BF16):
        out, g16 = grads(fast, [t.bfloat16() for t in args], dout)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 0.005
    for which, a, b in zip(["qs", "kh", "g", "b"], g16, gref):
        assert torch.isfinite(a).all() and rel_err(a, b) < 0.02, which


def test_bf16_scores_stay_float32():
    """With queries and keys in float32 and gates in bfloat16 (as the model makes them), a score
    difference of 0.01 at tau = 10 still moves the weights: in bfloat16, scores 9.99 and 10.00 would
    be the same number (its spacing near 10 is 1/16)."""
    qs = torch.zeros(1, 1, 2, 32)
    qs[..., 0] = torch.tensor([9.99, 10.0]).view(1, 1, 2)  # two queries, same key direction
    kh = torch.zeros(1, 1, 2, 32)
    kh[..., 0] = 1
    g = torch.tensor([[1.0], [0.0]]).view(1, 1, 2, 1).bfloat16()  # average = weight of key 0
    b = torch.zeros(1)
    with torch.autocast(**BF16):
        out = tango_kernels.tango_fast(qs, kh, g, b)
    exact = tango_reference(qs.double(), kh.double(), g.double(), b.double())
    assert torch.equal(torch.tensor(9.99).bfloat16(), torch.tensor(10.0).bfloat16())
    assert (out.double() - exact).abs().max() < 2e-3


def test_depth_attention_and_lrt_kv_scores_stay_float32_under_bf16_autocast():
    """Depth-Attention's depth weights and LRT's private-slot attention (lrt_kv), which write out their
    scores, compute them in float32 under bfloat16 autocast, as PyTorch's fused attention does: on
    bfloat16 inputs with scores up to about 50 / sqrt(32), the weights are within 1e-5 of float64 on
    the same inputs (measured 3.6e-7; scores from a bfloat16 matmul: 0.022) and the private-slot
    output within 0.4 % (measured 0.2 %, its bfloat16 rounding; bfloat16 scores: 1.0 %)."""
    import math
    import depth_attention
    import latent_recurrence
    gen = torch.Generator().manual_seed(0)
    q, k, km, *keys = (torch.randn(2, 2, 50, 32, generator=gen).mul(3).bfloat16() for _ in range(6))
    v, vm = (torch.randn(2, 2, 50, 32, generator=gen).bfloat16() for _ in range(2))
    mask = torch.ones(50, 50, dtype=torch.bool).tril()
    with torch.autocast(**BF16):
        w = depth_attention.depth_weights(q, keys + [k])
        y = latent_recurrence.private_slot_attention(q, k, v, km, vm, mask)
    assert w.dtype == torch.float32 and y.dtype == torch.bfloat16
    q, k, km, v, vm, *keys = (t.double() for t in [q, k, km, v, vm] + keys)
    s = torch.stack([(q * kk).sum(-1) for kk in keys + [k]], -1) / math.sqrt(32)
    assert (w - s.softmax(-1)).abs().max() < 1e-5
    s = torch.cat(((q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")), (q * km).sum(-1, keepdim=True)), -1)
    p = (s / math.sqrt(32)).softmax(-1)
    assert rel_err(y, p[..., :-1] @ v + p[..., -1:] * vm) < 0.004


def test_tango_unit_queries_and_keys_stay_float32_under_bf16_autocast(monkeypatch):
    """Under bfloat16 autocast TANGO's queries and keys reach the average as float32 unit vectors
    (qs of norm tau = 10): the LM builds its RoPE tables in float32 for TANGO (Tango.rope_dtype)
    and the normalisation runs in float32 (bfloat16 tables or normalisation leave them off unit
    norm by bfloat16's rounding, which tau multiplies in every score)."""
    import tango
    seen = []
    real = tango.gated_update
    monkeypatch.setattr(tango, "gated_update", lambda u, qs, kh, *a: seen.append((qs, kh)) or real(u, qs, kh, *a))
    for name in ("tango", "tango-windowed", "tango-3set"):
        model = build_model(small(name))
        with torch.autocast(**BF16):
            model(torch.randint(0, 61, (2, 40)), positions=torch.arange(1000, 1040))  # large angles too
    assert len(seen) == 9
    for qs, kh in seen:
        assert qs.dtype == kh.dtype == torch.float32
        assert (kh.norm(dim=-1) - 1).abs().max() < 1e-6 and (qs.norm(dim=-1) - 10).abs().max() < 1e-5


# ----------------------------------------------------------------------------- train.py end to end

@pytest.fixture(scope="module")
def text_data(tmp_path_factory, gpt2_bpe):
    """A small text folder and a data_root prepared once for every model's run (the tiny tier's
    GPT-2 BPE: the runs skip, with the shared reason, where its file is missing)."""
    d = tmp_path_factory.mktemp("bf16_text")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "(", ")", ":", "\n"]
    for i in range(6):
        (d / f"f{i}.txt").write_text(" ".join(rng.choice(words, 300)))
    return d, tmp_path_factory.mktemp("bf16_data")


@pytest.mark.parametrize("name", list(REGISTRY))
def test_train_bf16_cpu_tiny_every_model(name, text_data, tmp_path):
    """train.py --dtype bfloat16 --device cpu --size tiny --max_iters 5, in this process: returns
    (exit code 0) and reports finite dev and test NLL."""
    text_dir, data_root = text_data
    argv = ["--model", name, "--depth", "3" if name == "tango-3set" else "2", "--dtype", "bfloat16",
            "--device", "cpu", "--size", "tiny", "--max_iters", "5", "--eval_interval", "5",
            "--block_size", "32", "--batch_size", "2", "--eval_windows", "2", "--eval_batch_size", "2",
            "--sample_tokens", "4", "--dataset", str(text_dir), "--data_root", str(data_root),
            "--out_dir", str(tmp_path / "out"), "--quiet"]
    train.main(argv)  # raises SystemExit on a non-zero exit code
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["model"] == name and np.isfinite(s["dev_nll"]) and np.isfinite(s["test_nll"])


def loop_run_flags(text_data, out):
    """train.py flags of a tiny Loop Transformer++ run on the text folder, evaluated every 2 updates."""
    text_dir, data_root = text_data
    return ["--model", "loop", "--depth", "2", "--device", "cpu", "--size", "tiny", "--eval_interval", "2",
            "--block_size", "32", "--batch_size", "2", "--eval_windows", "2", "--eval_batch_size", "2",
            "--sample_tokens", "0", "--dataset", str(text_dir), "--data_root", str(data_root),
            "--out_dir", str(out), "--quiet"]


def test_resume_and_eval_only_keep_the_checkpoints_dtype(text_data, tmp_path, capsys):
    """A bfloat16 run resumed or evaluated without --dtype keeps bfloat16 (the machine's auto would
    give float32 on a CPU): --eval_only prints the dev and test NLL the training run printed, bit
    for bit; an explicit --dtype float32 is an override, printed and logged."""
    out = tmp_path / "out"
    base = loop_run_flags(text_data, out)
    trained = train.run(train.parse_args(base + ["--max_iters", "2", "--dtype", "bfloat16"]))
    capsys.readouterr()
    evaluated = train.eval_only(train.parse_args(["--eval_only", "--out_dir", str(out)]), {"eval_only", "out_dir"})
    assert (evaluated["dev_nll"], evaluated["test_nll"]) == (trained["dev_nll"], trained["test_nll"])
    assert "; cpu bfloat16; --eval_only" in capsys.readouterr().out
    starts = lambda: [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()
                      if json.loads(line)["event"] == "start"]
    argv = ["--resume", "--out_dir", str(out), "--max_iters", "4"]
    train.run(train.parse_args(argv), train.given_flags(argv))
    assert starts()[-1]["args"]["dtype"] == "bfloat16" and starts()[-1]["resume_overrides"] == {"max_iters": [2, 4]}
    argv = ["--resume", "--out_dir", str(out), "--max_iters", "6", "--dtype", "float32"]
    train.run(train.parse_args(argv), train.given_flags(argv))
    assert starts()[-1]["args"]["dtype"] == "float32"
    assert starts()[-1]["resume_overrides"] == {"max_iters": [4, 6], "dtype": ["bfloat16", "float32"]}
    assert "; --dtype bfloat16 -> float32" in capsys.readouterr().out


def test_eval_only_repeats_a_resumed_runs_report_in_its_dtype(text_data, tmp_path, capsys):
    """A run resumed with another --dtype after its best checkpoint was written: its report gives
    dev and test NLL in the resumed run's dtype (the dev NLL recomputed), and --eval_only, which
    reads the evaluation flags from ckpt_latest.pt, prints the same numbers bit for bit."""
    out = tmp_path / "out"
    base = loop_run_flags(text_data, out)
    first = train.run(train.parse_args(base + ["--max_iters", "4", "--dtype", "bfloat16"]))
    argv = ["--resume", "--out_dir", str(out), "--max_iters", "6", "--dtype", "float32", "--learning_rate", "3"]
    resumed = train.run(train.parse_args(argv), train.given_flags(argv))
    assert resumed["best_iter"] == 4  # the steps at rate 3 made dev worse: the bfloat16 best stays
    assert resumed["dev_nll"] != first["dev_nll"]  # recomputed in float32
    capsys.readouterr()
    evaluated = train.eval_only(train.parse_args(["--eval_only", "--out_dir", str(out)]), {"eval_only", "out_dir"})
    assert (evaluated["dev_nll"], evaluated["test_nll"]) == (resumed["dev_nll"], resumed["test_nll"])
    assert "; cpu float32; --eval_only" in capsys.readouterr().out


def test_bfloat16_on_a_gpu_without_it_is_a_usage_error(monkeypatch):
    """--dtype bfloat16 (given, or a resumed checkpoint's) on a GPU without bfloat16: one line
    naming the flag and the way out, before anything runs (simulated CUDA device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * 10**9))
    args = train.parse_args(["--model", "loop", "--device", "cuda", "--dtype", "bfloat16", "--size", "tiny"])
    with pytest.raises(train.UsageError, match=r"^--dtype bfloat16: cuda does not support it natively .*use --dtype float32$"):
        resolve_args(args)
    auto = resolve_args(train.parse_args(["--model", "loop", "--device", "cuda", "--size", "tiny"]))
    assert auto.dtype == "float32"
    # emulated only (V100, T4): torch's default including_emulation=True says yes; it is not native
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    with pytest.raises(train.UsageError, match=r"^--dtype bfloat16: cuda does not support it natively"):
        resolve_args(args)
    auto = resolve_args(train.parse_args(["--model", "loop", "--device", "cuda", "--size", "tiny"]))
    assert auto.dtype == "float32"
