"""TANGO's fused path (tango_kernels.fused_average, the CUDA path of tango_kernels.gated_update),
tested on CPU: the formulation against the plain formulas in float64 (full prefix: SDPA's math
backend, chosen here by the test: the CPU has no fused kernel for these shapes; windowed:
FlexAttention's eager forward, and its dense stand-in window_dense for gradients, which
FlexAttention lacks on CPU), the window's tiles, the column-block split, the windowed summary,
bfloat16, the forced kernel choice, the device switch, the model and the compiled graph. The GPU speed check is `python -m tools.bench --quick --device cuda`.
"""
import gc

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode

import models
import tango_kernels
from common import ModelConfig, compile_regions
from tango import tango_reference, windowed_reference

pytestmark = [pytest.mark.usefixtures("one_thread"),  # tests/conftest.py
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]  # eager on CPU: the tests' choice


@pytest.fixture
def math_sdpa(monkeypatch):
    """The fused formulation on CPU: SDPA's math backend (the test's choice, not the library's)."""
    monkeypatch.setattr(tango_kernels, "sdpa_backends", lambda *a: [SDPBackend.MATH])


@pytest.fixture
def dense_window(monkeypatch):
    """The window's (O, lse) by window_dense: FlexAttention has no backward on CPU."""
    monkeypatch.setattr(tango_kernels, "window_kernel", tango_kernels.window_dense)


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

@pytest.mark.parametrize("window", [None, 1, 4, 7, 19, 40])
def test_fused_average_equals_the_formula_float64(math_sdpa, dense_window, window):
    """fused_average == tango_reference / windowed_reference, outputs and the gradients of qs, kh,
    g, b (float64, 1e-12). T = 19: W = 4 and 7 leave most queries with old sources (the summary
    joined through the log-sum-exp), W = 1 only the own token, W >= T is full-prefix TANGO."""
    assert_same_outputs_and_gradients(lambda *a: tango_kernels.fused_average(*a, window), reference(window),
                                      qkgb(), 1e-12)


@pytest.mark.parametrize("T", [19, 37])
@pytest.mark.parametrize("window", [1, 2, 4, 7, 8, 9, 19, 36, 40])
def test_windowed_fused_average_by_flexattention_equals_the_formula(monkeypatch, window, T):
    """The window by FlexAttention itself (eager forward on CPU) with the window's block mask in
    tiles of 8 (T = 19, 37: not a multiple; W below, at and past a tile; W >= T), merged with the
    null option and the older-source summary: windowed_reference's average to 3e-15 (float64)."""
    monkeypatch.setattr(tango_kernels, "FLEX_BLOCK", 8)
    args = [t.detach() for t in qkgb(T=T, fh=9)]
    parts, finish = tango_kernels._fused_windowed(*args, window)  # W >= T too (fused_average takes SDPA there)
    assert (finish(parts) - windowed_reference(*args, window)).abs().max() < 3e-15


def test_full_prefix_by_flexattention_equals_the_formula(dense_window, monkeypatch):
    """FULL_PREFIX_KERNEL "flex": the full prefix as the window of all T keys (FlexAttention's
    causal band, the null option through the log-sum-exp) equals tango_reference: FlexAttention's
    eager forward to 3e-15, outputs and gradients through the dense stand-in to 1e-12 (float64)."""
    monkeypatch.setattr(tango_kernels, "FULL_PREFIX_KERNEL", "flex")
    assert_same_outputs_and_gradients(lambda *a: tango_kernels.fused_average(*a, None), tango_reference, qkgb(), 1e-12)
    monkeypatch.setattr(tango_kernels, "window_kernel", tango_kernels.window_flex)
    monkeypatch.setattr(tango_kernels, "FLEX_BLOCK", 8)
    args = [t.detach() for t in qkgb(T=37)]
    assert (tango_kernels.fused_average(*args, None) - tango_reference(*args)).abs().max() < 3e-15


@pytest.mark.parametrize("T, W, n", [(37, 4, 8), (37, 8, 8), (37, 9, 8), (64, 256, 16), (100, 33, 16), (5, 1, 4)])
def test_window_tiles_cover_the_window_and_full_tiles_hold_only_it(T, W, n):
    """window_blocks, the tiles FlexAttention runs: every pair (i, j) with 0 <= i - j < W lies in a
    listed tile, every full tile (run without the mask) holds only such pairs, no tile is listed
    twice and none lies wholly outside the window: the tiles are the band's, and their count is
    linear in T."""
    kv_num, kv_idx, full_num, full_idx = tango_kernels.window_blocks(T, W, n)
    nb = -(-T // n)
    covered = torch.zeros(nb, nb, dtype=torch.int64)
    full = torch.zeros(nb, nb, dtype=torch.bool)
    for m in range(nb):
        for j in kv_idx[0, 0, m, :kv_num[0, 0, m]].tolist():
            covered[m, j] += 1
        for j in full_idx[0, 0, m, :full_num[0, 0, m]].tolist():
            covered[m, j] += 1
            full[m, j] = True
    i = torch.arange(nb * n)
    dist = i.view(-1, 1) - i
    inside = ((dist >= 0) & (dist < W)).view(nb, n, nb, n)
    assert covered.max() == 1
    assert (covered.bool() == inside.any(3).any(1)).all()  # listed iff some pair of the tile is in the window
    assert (inside.all(3).all(1)[full]).all()  # a full tile: all its pairs in the window
    assert (full == inside.all(3).all(1) & covered.bool()).all()  # every such tile run as full


@pytest.mark.parametrize("block", [1, 2, 3, 8])
def test_column_blocks_equal_one_block(math_sdpa, monkeypatch, block):
    """The gates split in column blocks of at most SDPA_VALUE_BLOCK (blocks that do not divide
    F/H = 13, each padded to a multiple of 8) give the unsplit result (full prefix)."""
    args = qkgb(fh=13)
    whole = tango_kernels.fused_average(*args, None)
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(tango_kernels, "SDPA_VALUE_BLOCK", block)
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: calls.append(v.shape[-1]) or sdpa(q, k, v, **kw))
    split = tango_kernels.fused_average(*args, None)
    assert calls == [-(-min(block, 13 - c0) // 8) * 8 for c0 in range(0, 13, block)]
    assert (split - whole).abs().max() < 1e-14


@pytest.mark.parametrize("block", [1, 2, 3, 8])
def test_windowed_column_blocks_equal_one_block(monkeypatch, block):
    """Windowed: the gates in FlexAttention calls of at most FLEX_VALUE_BLOCK columns (F/H = 13)
    give the unsplit result; one call per block, each with the whole window W."""
    args = [t.detach() for t in qkgb(fh=13)]
    whole = tango_kernels.fused_average(*args, 4)
    calls = []
    monkeypatch.setattr(tango_kernels, "FLEX_VALUE_BLOCK", block)
    monkeypatch.setattr(tango_kernels, "window_kernel",
                        lambda q, k, v, W: calls.append((v.shape[-1], W)) or tango_kernels.window_flex(q, k, v, W))
    split = tango_kernels.fused_average(*args, 4)
    assert calls == [(min(block, 13 - c0), 4) for c0 in range(0, 13, block)]
    assert (split - whole).abs().max() < 1e-14


def test_windowed_summary_carries_the_old_sources(math_sdpa):
    """The older-source summary (logit <q, unit(K_i)> + log n_i, value the mean old gate, merged
    through the log-sum-exp) changes the result (T > 2 W) and is what windowed_reference computes:
    removing the old sources from the reference (a window of T) moves it by far more than the
    fused path's error."""
    args = [t.detach() for t in qkgb(T=30)]
    out = tango_kernels.fused_average(*args, 4)
    assert (out - windowed_reference(*args, 4)).abs().max() < 1e-12
    assert (out - tango_kernels.fused_average(*args, 30)).abs().max() > 1e-2


def test_fused_path_precision_under_bf16(math_sdpa, dense_window, monkeypatch):
    """Under bfloat16 autocast: the averages within 0.5 % and the gradients within 2 % of float64
    (the bars of tests/test_bf16.py, PyTorch's own attention in bfloat16). Scores come from q, k
    rounded to bfloat16 (fused_plan's default): a key at cosine 0.999 (1.0 in bfloat16) scores
    10.00 like a key at 1.0 at tau = 10, so the average w_0 - w_1 = 0.005 comes out 0 (off by
    0.005); with SCORE_SPLIT (q, k in a high and a low bfloat16 half) it stays within 1e-4."""
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
    exact = tango_reference(qs.double(), kh.double(), g.double(), b.double())[0, 0, 1, 0]
    assert torch.tensor(0.999).bfloat16().item() == 1.0
    errors = {}
    for split in (False, True):
        monkeypatch.setattr(tango_kernels, "SCORE_SPLIT", split)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            errors[split] = abs(tango_kernels.fused_average(qs, kh, g, b)[0, 0, 1, 0].double() - exact).item()
    assert 0.004 < errors[False] < 0.006 and errors[True] < 1e-4


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
    """The fused path's SDPA backend list never holds MATH (which materializes the L x S scores):
    bf16/fp16 the memory-efficient kernel, then cuDNN; float32 the memory-efficient kernel."""
    for device_type in ("cuda", "cpu"):
        for dtype, want in ((torch.bfloat16, [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]),
                            (torch.float16, [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]),
                            (torch.float32, [SDPBackend.EFFICIENT_ATTENTION])):
            assert tango_kernels.sdpa_backends(device_type, dtype) == want


def test_missing_fused_kernel_is_an_error_naming_the_shapes():
    """With the library's backend list (fused kernels only) on a CPU, which has no fused kernel for
    these shapes, the full-prefix fused path raises, naming the kernels and shapes, instead of
    running the math backend."""
    with pytest.raises(RuntimeError, match=r"no fused attention kernel \(EFFICIENT_ATTENTION\) for q \("):
        tango_kernels.fused_average(*qkgb(), None)


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


def test_every_sdpa_call_runs_with_math_disabled_and_no_mask(monkeypatch):
    """Each SDPA call of the full-prefix fused path runs where the math backend is off (so no kernel
    can materialize the scores), with is_causal and no mask, never a T x T mask."""
    seen = []

    def spy(q, k, v, attn_mask=None, is_causal=False, scale=None):
        seen.append((torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                     attn_mask, is_causal, scale))
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    tango_kernels.fused_average(*qkgb(T=37), None)
    assert seen and all(not m and eff and mask is None and causal and sc == 1.0 for m, eff, mask, causal, sc in seen)
    assert torch.backends.cuda.math_sdp_enabled()  # restored afterwards


def test_windowed_path_runs_flexattention_over_the_window_tiles_only(monkeypatch):
    """The windowed fused path calls no SDPA and no dense kernel: FlexAttention, once per value
    block, with the window's BlockMask (tiles of FLEX_BLOCK, the tiles window_blocks lists) and
    scale 1, returning the log-sum-exp."""
    calls = []
    flex = tango_kernels.flex_attention

    def spy(q, k, v, block_mask=None, scale=None, return_aux=None, kernel_options=None):
        calls.append((block_mask.BLOCK_SIZE, block_mask.kv_num_blocks.sum().item(), scale, return_aux.lse))
        return flex(q, k, v, block_mask=block_mask, scale=scale, return_aux=return_aux)

    monkeypatch.setattr(tango_kernels, "flex_attention", spy)
    monkeypatch.setattr(F, "scaled_dot_product_attention", None)  # any SDPA call fails
    monkeypatch.setattr(tango_kernels, "FLEX_BLOCK", 8)
    tango_kernels.window_block_mask.cache_clear()
    tango_kernels.fused_average(*[t.detach() for t in qkgb(T=37, fh=5)], 4)
    kv_num = tango_kernels.window_blocks(37, 4, 8)[0]
    assert calls == [((8, 8), kv_num.sum().item(), 1.0, True)]


# ----------------------------------------------------------------------------- memory saved for backward

class _Made(TorchDispatchMode):
    """Records (weakly) the storage of every tensor the ops return, and which of them are the
    parameters' or copies of them (autocast's casts of the weights: weight-sized, not per token)."""

    def __init__(self, params):
        super().__init__()
        self.params = {t.untyped_storage().data_ptr() for t in params}
        self.made = {}  # storage address -> (weak reference, bytes, a parameter's or its copy)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cast = func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.params
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                s = t.untyped_storage()
                known = self.made.get(s.data_ptr())
                if known is None or known[0].expired():  # a new storage (a view keeps its storage's entry)
                    self.made[s.data_ptr()] = (StorageWeakRef(s), s.nbytes(), cast or s.data_ptr() in self.params)
        return out


def kept_bytes(fn, params):
    """(bytes, out): the storages that ops create while fn() runs and that are still alive once it
    has returned, out's own left out: all that the autograd graph keeps for backward (saved
    tensors, a checkpoint's inputs, selective checkpointing's kept outputs), whoever holds it;
    the parameters and autocast's copies of them are left out."""
    made = _Made(params)
    with made:
        out = fn()
    gc.collect()
    mine = out.untyped_storage().data_ptr()
    return sum(n for ptr, (ref, n, cast) in made.made.items() if not ref.expired() and not cast and ptr != mine), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 4])
def test_update_keeps_at_most_four_gate_tensors_for_backward(dense_window, monkeypatch, window, dtype):
    """One gated_update on the fused path (the attention kernels by stand-ins that keep what the
    CUDA kernels keep: q, k, v, output, log-sum-exp, each call in autocast's dtype) keeps for
    backward at most 4x one (B, T, F) compute-dtype tensor in all (full prefix: of T + 1 rows, the
    null key's), u, q, k and lse included: the gate pre-activation u W_g, the gates (the kernels'
    values), the kernels' outputs and the small ones; u W_v, SiLU's output, the merge and G * v are
    recomputed in backward. d, F/H and the value blocks as at the 70M tier, so the small tensors
    weigh what they weigh there. Without the checkpoint it keeps more than 5.5x; the gradients are
    the same either way."""
    def sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None):  # the efficient kernel's saved tensors
        assert attn_mask is None and is_causal and scale == 1.0
        if torch.is_autocast_enabled("cpu"):  # autocast casts SDPA's float32 inputs on each call
            q, k, v = (t.to(torch.get_autocast_dtype("cpu")) if t.dtype == torch.float32 else t for t in (q, k, v))
        return tango_kernels.window_dense(q, k, v, q.shape[2])[0]

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(tango_kernels, "choose_path", lambda device: "fused")
    H70, fh, d70 = seventy_m("tango", with_d=True)
    H = 2
    B, T, d, width = 2, 32, d70 * H // H70, H * fh  # d / F and q/k widths / F as at the tier (d = 64, F = 3560)
    qs, kh, _, b = [t.detach().float().requires_grad_() for t in qkgb(B=B, H=H, T=T)]
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(B, T, d, generator=gen).requires_grad_()
    wg, wv = ((torch.randn(width, d, generator=gen) / d ** 0.5).requires_grad_() for _ in range(2))
    wo = (torch.randn(d, width, generator=gen) / width ** 0.5).requires_grad_()
    inputs, params = [u, qs, kh, wg, wv, wo, b], [wg, wv, wo, b]
    rows = T if window else T + 1
    one = B * rows * width * dtype.itemsize  # one (B, T, F) tensor in the compute dtype
    results = []
    for checkpointed in (True, False):
        if not checkpointed:
            monkeypatch.setattr(tango_kernels, "checkpoint", lambda fn, *a, **kw: fn(*a))
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            # u * 1 etc.: made inside, as in the model, so the update's holding them counts
            nbytes, y = kept_bytes(lambda: tango_kernels.gated_update(u * 1, qs * 1, kh * 1, wg, wv, wo, b, window), params)
        results.append((nbytes, torch.autograd.grad(y.float().square().sum(), inputs)))
    (kept, grads), (plain, plain_grads) = results
    assert kept <= 4 * one and plain > 5.5 * one, (kept / one, plain / one)
    for a, c in zip(grads, plain_grads):
        assert torch.equal(a, c)


# ----------------------------------------------------------------------------- executed work and launch limits

def seventy_m(name, with_d=False):
    """(heads, gate columns per head) of the 70M tier (flops.train_config, GPT-2 vocabulary), and
    with with_d the model width d."""
    import flops  # noqa: PLC0415
    cfg = flops.train_config(name, "70M", 4, 2048, 50257, flops.train_flags("70M"))[0]
    return (cfg.n_head, cfg.width // cfg.n_head) + ((cfg.n_embd,) if with_d else ())


def test_executed_attention_work_at_the_70m_tier(monkeypatch):
    """attention_work at the 70M tier (H = 16, F/H = 1780, 32,768 tokens): Windowed TANGO at
    T = 8192, W = 256 at most 1.3x the model's window work; full prefix at T = 2048, bf16, at most
    1.7x the exact causal work on the register-resident 64x128 kernel, less by FlexAttention's
    causal band. Splitting the scores in hi/lo halves would pass 1.7x (the reason fused_plan leaves
    it off)."""
    H, fh = seventy_m("tango")
    assert (H, fh) == (16, 1780)
    win = tango_kernels.attention_work(4, H, 8192, 256, fh, torch.bfloat16)
    assert 1.0 < win["ratio"] <= 1.3 and win["kernel"] == "FlexAttention 32x32"
    full = tango_kernels.attention_work(16, H, 2048, None, fh, torch.bfloat16)
    assert 1.0 < full["ratio"] <= 1.7 and full["kernel"] == "efficient 64x128 (q/k 40)"
    assert tango_kernels.attention_work(16, H, 2048, None, fh, torch.float32)["kernel"].startswith("efficient 64x128")
    monkeypatch.setattr(tango_kernels, "FULL_PREFIX_KERNEL", "flex")  # the causal band in FlexAttention
    flex = tango_kernels.attention_work(16, H, 2048, None, fh, torch.bfloat16)
    assert 1.0 < flex["ratio"] < full["ratio"] and flex["kernel"] == "FlexAttention 32x32"
    monkeypatch.setattr(tango_kernels, "FULL_PREFIX_KERNEL", "sdpa")
    monkeypatch.setattr(tango_kernels, "SCORE_SPLIT", True)
    assert tango_kernels.attention_work(16, H, 2048, None, fh, torch.bfloat16)["ratio"] > 1.7


def test_attention_work_counts_tiles(monkeypatch):
    """The count by hand at a small size: full prefix T = 63 (64 rows and keys with the null, one
    64 x 64 tile, q/k 40, values 8), windowed T = 64, W = 32 (FlexAttention 32 x 32: query block 0
    one tile, block 1 two; 32 q/k dims + 16 value columns; the full prefix T = 64 the same way, its
    model work 64 x 65 / 2 per head)."""
    full = tango_kernels.attention_work(1, 1, 63, None, 8, torch.float32)
    assert full["executed"] == 64 * 64 * (40 + 8) and full["model"] == 63 * 64 // 2 * (32 + 8)
    monkeypatch.setattr(tango_kernels, "FULL_PREFIX_KERNEL", "flex")
    flex = tango_kernels.attention_work(1, 1, 64, None, 8, torch.float32)
    assert flex["executed"] == 3 * 32 * 32 * (32 + 16) and flex["model"] == 64 * 65 // 2 * (32 + 8)
    win = tango_kernels.attention_work(2, 3, 64, 32, 8, torch.float32)
    assert win["executed"] == 2 * 3 * 3 * 32 * 32 * (32 + 16) and win["model"] == 2 * 3 * 64 * 32 * 40


@pytest.mark.parametrize("W", [1, 2])
def test_small_windows_fit_the_launch_grid_and_run(W):
    """W = 1 and 2 at T = 8192, H = 16: FlexAttention's grid is (T / 32, batch, heads), within
    CUDA's 65,535 on y and z for any window; run at a small size (T = 40, H = 16) they equal the
    formula."""
    grid = tango_kernels.attention_work(4, 16, 8192, W, 1780, torch.bfloat16)["grid"]
    assert grid == (256, 4, 16) and max(grid[1:]) <= tango_kernels.GRID_LIMIT
    args = [t.detach() for t in qkgb(B=1, H=16, T=40, fh=3)]
    assert (tango_kernels.fused_average(*args, W) - windowed_reference(*args, W)).abs().max() < 3e-15


@pytest.mark.parametrize("window", [None, 4])
def test_batches_past_the_grid_limit_split_the_launch(math_sdpa, monkeypatch, window):
    """A batch larger than GRID_LIMIT (here 2, batch 3) runs in slices with the same result; more
    heads than the limit are refused in one line naming it."""
    args = [t.detach() for t in qkgb(B=3, H=2)]
    whole = tango_kernels.fused_average(*args, window)
    monkeypatch.setattr(tango_kernels, "GRID_LIMIT", 2)
    assert (tango_kernels.fused_average(*args, window) - whole).abs().max() < 1e-15
    monkeypatch.setattr(tango_kernels, "GRID_LIMIT", 1)
    with pytest.raises(ValueError, match=r"^TANGO fused path: 2 heads in one .* launch pass CUDA's grid limit of 1$"):
        tango_kernels.fused_average(*args, window)


# ----------------------------------------------------------------------------- the device switch and the model

def test_device_switch():
    assert tango_kernels.choose_path(torch.device("cpu")) == "grouped"
    assert tango_kernels.choose_path(torch.device("cuda", 0)) == "fused"


def small(name, **kw):
    return ModelConfig(**{"model": name, "vocab_size": 61, "block_size": 32, "n_embd": 64, "n_head": 2,
                          "depth": 3, "width": 48, "window": 5, **kw})


@pytest.mark.parametrize("name", ["tango", "tango-windowed", "tango-3set"])
def test_model_on_the_fused_path_equals_the_cpu_path_and_decodes_the_same(math_sdpa, dense_window, monkeypatch, name):
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


@pytest.mark.parametrize("name", ["tango", "tango-windowed", "tango-3set"])
def test_model_on_the_fused_path_under_bf16_autocast(math_sdpa, dense_window, monkeypatch, name):
    """Under bfloat16 autocast (the GPU's training dtype) the fused path, its checkpointed step
    after the kernels included (recomputed in backward under the same autocast, with a shared
    block whose weights autocast casts once per forward), trains like the CPU path: loss within
    1e-4 relative, every gradient within 2 % (tests/test_bf16.py's bar)."""
    torch.manual_seed(0)
    model = models.build_model(small(name))
    idx = torch.randint(0, 61, (2, 23))
    results = {}
    for path in ("grouped", "fused"):
        monkeypatch.setattr(tango_kernels, "choose_path", lambda device, path=path: path)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, idx)[1]
        loss.backward()
        results[path] = [loss.detach().float()] + [p.grad.float().clone() for p in model.parameters()]
    (lf, *gf), (lg, *gg) = results["fused"], results["grouped"]
    assert abs(lf - lg) < 1e-4 * lg
    for a, b in zip(gf, gg):
        assert (a - b).norm() <= 0.02 * b.norm()


@pytest.mark.parametrize("name", ["tango", "tango-windowed"])
def test_fused_update_is_one_graph_that_does_not_grow_with_the_context(math_sdpa, dense_window, monkeypatch, name):
    """On the fused path the compiled update is one graph (no graph break around the averages: no
    torch.compiler.disable, no Python loop over chunks) with as many nodes at T = 8 as at T = 64
    (the window by its dense stand-in: FlexAttention has no CPU backward; the next test traces
    FlexAttention itself)."""
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


@pytest.mark.parametrize("name", ["tango", "tango-windowed"])
def test_compiled_regions_are_static_full_graphs_per_grad_mode(math_sdpa, dense_window, monkeypatch, name):
    """compile_regions with fullgraph=True on the fused path (a graph break would raise): training
    at batch 2, then evaluation (no grad) at batch 4 and again at 4: one graph per region per grad
    mode (head and update, 4 in all), none with a symbolic dimension (compile_regions' dynamic=False;
    without it the batch became dynamic in the evaluation's recompile)."""
    monkeypatch.setattr(tango_kernels, "choose_path", lambda device: "fused")
    torch._dynamo.reset()
    symbolic = []

    def backend(gm, example_inputs):
        symbolic.append(any(isinstance(s, torch.SymInt) for t in example_inputs
                            for s in (t.shape if isinstance(t, torch.Tensor) else [t])))
        return gm.forward

    torch.manual_seed(0)
    model = models.build_model(small(name, block_size=16, window=4))
    compile_regions(model, backend=backend, fullgraph=True)
    idx = torch.randint(0, 61, (2, 16))
    model(idx, idx)[1].backward()
    with torch.no_grad():
        for _ in range(2):
            model(torch.randint(0, 61, (4, 16)))
    torch._dynamo.reset()
    assert symbolic == [False] * 4


def test_windowed_fused_average_traces_in_one_graph_with_flexattention():
    """The windowed fused average with FlexAttention and its block mask built inside the graph
    traces with fullgraph=True (no graph break) and computes windowed_reference (forward: no
    FlexAttention backward on CPU)."""
    args = [t.detach() for t in qkgb(T=37, fh=7)]
    cnt = CompileCounter()
    fn = torch.compile(lambda *a: tango_kernels.fused_average(*a, 5), backend=cnt, fullgraph=True)
    assert (fn(*args) - windowed_reference(*args, 5)).abs().max() < 3e-15
    assert cnt.frame_count == 1
    torch._dynamo.reset()


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: FlexAttention's kernel itself")
@pytest.mark.parametrize("window", [1, 2, 256])
def test_small_windows_run_on_cuda_at_8192(window):
    """W = 1, 2 (and 256) at T = 8192, H = 16 run on CUDA (FlexAttention's grid: T / 32 x batch x
    heads) and equal the chunked kernels (tango_kernels.windowed_fast) in float32, outputs and
    gradients within 1e-4 relative."""
    args = [t.detach().float().cuda().requires_grad_() for t in qkgb(B=1, H=16, T=8192, fh=64, tau=10.0)]
    out = tango_kernels.fused_average(*args, window)
    want = tango_kernels.windowed_fast(*args, window)
    dout = torch.randn_like(want)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    assert rel(out, want) < 1e-4
    for a, b in zip(torch.autograd.grad(out, args, dout), torch.autograd.grad(want, args, dout)):
        assert rel(a, b) < 1e-4
