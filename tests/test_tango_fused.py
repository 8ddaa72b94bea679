"""TANGO's fused path (tango_kernels.fused_average, the CUDA path of tango_kernels.gated_update),
tested on CPU: the formulation against the plain formulas in float64 (SDPA's math backend, chosen
here by the test: the CPU has no fused kernel for these shapes), the column-block split, the
windowed summary keys, bfloat16, the forced kernel choice, the device switch, the model and the
compiled graph. The GPU speed check is `python -m tools.bench --quick --device cuda`.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter
from torch.nn.attention import SDPBackend

import models
import tango_kernels
from common import ModelConfig, compile_regions
from tango import tango_reference, windowed_reference

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def math_sdpa(monkeypatch):
    """The fused formulation on CPU: SDPA's math backend (the test's choice, not the library's)."""
    monkeypatch.setattr(tango_kernels, "sdpa_backends", lambda device_type: [SDPBackend.MATH])


def qkgb(B=2, H=3, T=19, fh=5, seed=0, tau=4.0):
    g = torch.Generator().manual_seed(seed)
    qs = tau * F.normalize(torch.randn(B, H, T, 32, generator=g, dtype=torch.float64), dim=-1)
    kh = F.normalize(torch.randn(B, H, T, 32, generator=g, dtype=torch.float64), dim=-1)
    gates = torch.randn(B, H, T, fh, generator=g, dtype=torch.float64)
    b = torch.randn(H, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (qs, kh, gates, b)]


def reference(window):
    return tango_reference if window is None else lambda *a: windowed_reference(*a, window)


def assert_same_outputs_and_gradients(fn, ref, args, tol):
    out, want = fn(*args), ref(*args)
    assert out.shape == want.shape and (out - want).abs().max() < tol
    w = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((out * w).sum(), args), torch.autograd.grad((want * w).sum(), args)):
        assert (a - b).abs().max() < tol


# ----------------------------------------------------------------------------- the formulation

@pytest.mark.parametrize("rows", [3, 256])
@pytest.mark.parametrize("window", [None, 1, 4, 7, 19, 40])
def test_fused_average_equals_the_formula_float64(math_sdpa, monkeypatch, window, rows):
    """fused_average == tango_reference / windowed_reference, outputs and the gradients of qs, kh,
    g, b (float64, 1e-12). T = 19: W = 4 and 7 leave most queries with old sources (the summary
    keys), W = 1 only the own token, W >= T is full-prefix TANGO; rows 3 puts several blocks (and
    blocks smaller than W) in the windowed path, 256 one block of W rows."""
    monkeypatch.setattr(tango_kernels, "FUSED_WINDOW_ROWS", rows)
    assert_same_outputs_and_gradients(lambda *a: tango_kernels.fused_average(*a, window), reference(window),
                                      qkgb(), 1e-12)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("block", [1, 2, 3, 8])
def test_column_blocks_equal_one_block(math_sdpa, monkeypatch, window, block):
    """The gates split in column blocks of at most SDPA_VALUE_BLOCK (blocks that do not divide
    F/H = 13, each padded to a multiple of 8) give the unsplit result."""
    args = qkgb(fh=13)
    whole = tango_kernels.fused_average(*args, window)
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(tango_kernels, "SDPA_VALUE_BLOCK", block)
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: calls.append(v.shape[-1]) or sdpa(q, k, v, **kw))
    split = tango_kernels.fused_average(*args, window)
    assert calls == [-(-min(block, 13 - c0) // 8) * 8 for c0 in range(0, 13, block)]
    assert (split - whole).abs().max() < 1e-14


def test_windowed_summary_keys_carry_the_old_sources(math_sdpa):
    """The older-source summary (extra keys [unit(K_i), log n_i] with the mean old gates as values)
    changes the result (T > 2 W) and is what windowed_reference computes: removing the old sources
    from the reference (a window of T) moves it by far more than the fused path's error."""
    args = qkgb(T=30)
    out = tango_kernels.fused_average(*args, 4)
    assert (out - windowed_reference(*args, 4)).abs().max() < 1e-12
    assert (out - tango_kernels.fused_average(*args, 30)).abs().max() > 1e-2


def test_fused_path_precision_under_bf16(math_sdpa):
    """Under bfloat16 autocast: the averages within 0.5 % and the gradients within 2 % of float64
    (the bars of tests/test_bf16.py, PyTorch's own attention in bfloat16), and float32 queries keep
    float32-like scores (split in a high and a low bfloat16 half): a key at cosine 0.999 (1.0 in
    bfloat16) keeps its score 9.99 at tau = 10 beside a key at score 10."""
    from tests.test_bf16 import grads, inputs, rel_err  # noqa: PLC0415  (the bf16 tests' inputs and measure)
    for window in (None, 64):
        args, dout = inputs()
        ref, gref = grads(reference(window), args, dout)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, g16 = grads(lambda *a: tango_kernels.fused_average(*a, window), [t.bfloat16() for t in args], dout)
        assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 0.005
        for which, a, b in zip(["qs", "kh", "g", "b"], g16, gref):
            assert torch.isfinite(a).all() and rel_err(a, b) < 0.02, which
    qs = torch.zeros(1, 1, 2, 32)
    qs[..., 0] = 10.0
    kh = torch.zeros(1, 1, 2, 32)
    kh[0, 0, 0, 0] = 1
    kh[0, 0, 1, :2] = torch.tensor([0.999, (1 - 0.999 ** 2) ** 0.5])  # scores 10.00 and 9.99 for query 1
    g = torch.tensor([[1.0], [-1.0]]).view(1, 1, 2, 1)  # query 1's average = w_0 - w_1 = 0.005
    b = torch.zeros(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tango_kernels.fused_average(qs, kh, g, b)
    exact = tango_reference(qs.double(), kh.double(), g.double(), b.double())
    assert torch.tensor(0.999).bfloat16().item() == 1.0  # unsplit: both scores 10, average 0 (off by 0.005)
    assert abs(out[0, 0, 1, 0].double() - exact[0, 0, 1, 0]) < 1e-4


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own, as Inductor loads
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_score_split_survives_torch_compile(dtype):
    """The split of queries and keys into a high and a low half (_hi_lo) under autocast, eager and
    compiled by Inductor (on this CPU; on CUDA the update is compiled the same way): hi + lo = x within
    2^-15 relative. With hi = round(x), Inductor elided the round trip that lo = x - hi reads, and
    lo was 0 (scores in the autocast dtype, 2^-9)."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 10

    def split(x):
        with torch.autocast("cpu", dtype=dtype):
            return tango_kernels._hi_lo(x, True)

    for fn in (split, torch.compile(split, backend="inductor", fullgraph=True)):
        hi, lo = fn(x)
        assert hi.dtype == lo.dtype == dtype
        assert ((hi.double() + lo.double() - x.double()).abs() <= 2 ** -15 * x.abs().double()).all()


# ----------------------------------------------------------------------------- the forced kernel choice

def test_cuda_backends_are_fused_only():
    """The fused path's SDPA backend list never holds MATH (which materializes the L x S scores)."""
    for device_type in ("cuda", "cpu"):
        backends = tango_kernels.sdpa_backends(device_type)
        assert backends and SDPBackend.MATH not in backends


@pytest.mark.parametrize("window", [None, 4])
def test_missing_fused_kernel_is_an_error_naming_the_shapes(window):
    """With the library's backend list (fused kernels only) on a CPU, which has no fused kernel for
    these shapes, the fused path raises, naming the kernels and shapes, instead of running the
    math backend."""
    with pytest.raises(RuntimeError, match=r"no fused attention kernel \(EFFICIENT_ATTENTION\) for q \("):
        tango_kernels.fused_average(*qkgb(), window)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory")])
def test_out_of_memory_in_the_fused_kernel_stays_an_out_of_memory_error(monkeypatch, error):
    """An allocation failure inside SDPA reaches the caller as itself (common.is_out_of_memory, the
    commands' one-line out-of-memory message), not as "no fused attention kernel"."""
    def sdpa(*a, **k):
        raise error
    monkeypatch.setattr(tango_kernels.F, "scaled_dot_product_attention", sdpa)
    with pytest.raises(type(error)) as caught:
        tango_kernels.fused_average(*qkgb(), None)
    assert caught.value is error


@pytest.mark.parametrize("window", [None, 4])
def test_every_sdpa_call_runs_with_math_disabled_and_no_t_by_t_mask(monkeypatch, window):
    """Each SDPA call of the fused path runs where the math backend is off (so no kernel can
    materialize the scores), with is_causal and no mask (full prefix) or one (C x (1 + W + 2C))
    block mask padded to 16 columns (windowed), never a T x T mask."""
    seen = []

    def spy(q, k, v, attn_mask=None, is_causal=False, scale=None):
        seen.append((torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                     None if attn_mask is None else tuple(attn_mask.shape), is_causal, scale))
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(tango_kernels, "FUSED_WINDOW_ROWS", 2)
    T = 37
    tango_kernels.fused_average(*qkgb(T=T), window)
    assert seen and all(not m and eff and sc == 1.0 for m, eff, _, _, sc in seen)
    if window is None:
        assert all(mask is None and causal for _, _, mask, causal, _ in seen)
    else:
        assert all(mask == (2, 16) and not causal for _, _, mask, causal, _ in seen)  # 1 + W + 2C = 9, 16-aligned
    assert torch.backends.cuda.math_sdp_enabled()  # restored afterwards


@pytest.mark.parametrize("window,rows", [(10, 4), (5, 3), (40, 256)])
def test_windowed_mask_columns_are_a_multiple_of_16(monkeypatch, window, rows):
    """The windowed block mask (1 + W + 2C key columns, then never-visible padding) has a multiple
    of 16 columns, one per key: 1 + 10 + 8 = 19 columns become 32 (a multiple of 8 would be 24)."""
    seen = []

    def spy(q, k, v, attn_mask=None, is_causal=False, scale=None):
        seen.append((attn_mask.shape[-1], k.shape[-2]))
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(tango_kernels, "FUSED_WINDOW_ROWS", rows)
    tango_kernels.fused_average(*qkgb(T=45), window)
    C = min(window, rows)
    assert seen and all(cols == keys == -(-(1 + window + 2 * C) // 16) * 16 for cols, keys in seen), seen


# ----------------------------------------------------------------------------- the device switch and the model

def test_device_switch():
    assert tango_kernels.choose_path(torch.device("cpu")) == "grouped"
    assert tango_kernels.choose_path(torch.device("cuda", 0)) == "fused"


def small(name, **kw):
    return ModelConfig(**{"model": name, "vocab_size": 61, "block_size": 32, "n_embd": 64, "n_head": 2,
                          "depth": 3, "width": 48, "window": 5, **kw})


@pytest.mark.parametrize("name", ["tango", "tango-windowed", "tango-3set"])
def test_model_on_the_fused_path_equals_the_cpu_path_and_decodes_the_same(math_sdpa, monkeypatch, name):
    """The whole model with gated_update on the fused path (one matmul per weight, fused averages)
    equals the CPU path (grouped layout, chunked kernels): loss and every gradient in float64 to
    1e-12; cached decoding (the prompt by the fused average, then the chunked kernels' steps)
    equals the full forward's logits and greedy tokens."""
    torch.manual_seed(0)
    model = models.build_model(small(name)).double()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    idx = torch.randint(0, 61, (2, 23))
    results = {}
    for path in ("grouped", "fused"):
        monkeypatch.setattr(tango_kernels, "choose_path", lambda device, path=path: path)
        model.zero_grad()
        loss = model(idx, idx)[1]
        loss.backward()
        results[path] = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    for a, b in zip(results["fused"], results["grouped"]):
        assert (a - b).abs().max() < 1e-12
    model.eval()
    with torch.no_grad():
        out = model.generate(idx[:1, :6], 10, temperature=0)
        for t in range(6, 16):
            assert model(out[:, :t])[0][0, -1].argmax() == out[0, t]
        full = model(idx)[0]
        for prefill in (1, 3, 9):  # the prompt on the fused path (below, at, past window - 1), then steps
            cache = {}
            parts = [model(idx[:, :prefill], cache=cache)[0]]
            parts += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(prefill, 23)]
            assert (torch.cat(parts, 1) - full).abs().max() < 1e-10, prefill


@pytest.mark.parametrize("name", ["tango", "tango-windowed"])
def test_fused_update_is_one_graph_that_does_not_grow_with_the_context(math_sdpa, monkeypatch, name):
    """On the fused path the compiled update is one graph (no graph break around the averages: no
    torch.compiler.disable, no Python loop over chunks) with as many nodes at T = 8 as at T = 64."""
    monkeypatch.setattr(tango_kernels, "choose_path", lambda device: "fused")
    sizes, frames = [], []
    for T in (8, 64):
        torch._dynamo.reset()
        nodes = [0]

        def count(gm, example_inputs):
            nodes[0] += sum(len(m.graph.nodes) for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
            return gm.forward

        cnt = CompileCounter()
        torch.manual_seed(0)
        model = models.build_model(small(name, block_size=T, window=4))
        compile_regions(model, backend=lambda gm, ex: cnt(gm, ex) and count(gm, ex))
        idx = torch.randint(0, 61, (2, T))
        model(idx, idx)[1].backward()
        sizes.append(nodes[0])
        frames.append(cnt.frame_count)
    torch._dynamo.reset()
    assert frames == [2, 2]  # the head and the update
    assert sizes[0] == sizes[1] > 0


# ----------------------------------------------------------------------------- on a GPU (skipped without one)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fused kernels themselves")
@pytest.mark.parametrize("window", [None, 256])
def test_fused_kernels_on_cuda_match_the_formula(window):
    """On CUDA, with the library's fused-only backends: the 70M tier's gate width per head (1,780,
    not a multiple of 8: column blocks), T = 1024, float32 and bfloat16 autocast, outputs and
    gradients against the float64 formula (bf16: the bars of tests/test_bf16.py)."""
    args = [t.detach().cuda().requires_grad_() for t in qkgb(B=2, H=2, T=1024, fh=1780, tau=10.0)]  # float64
    want = reference(window)(*args)
    dout = torch.randn_like(want)
    gwant = torch.autograd.grad(want, args, dout)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    for dtype, out_tol, grad_tol in ((torch.float32, 1e-4, 1e-3), (torch.bfloat16, 0.005, 0.02)):
        inp = [t.detach().float().requires_grad_() for t in args]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = tango_kernels.fused_average(*inp, window)
        assert out.dtype == dtype and rel(out, want) < out_tol, dtype
        for which, a, b in zip(["qs", "kh", "g", "b"], torch.autograd.grad(out, inp, dout.to(dtype)), gwant):
            assert rel(a, b) < grad_tol, (dtype, which)
