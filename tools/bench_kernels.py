"""Kernel check of TANGO's fused path: `python -m tools.bench kernels`.

    python -m tools.bench kernels --device cuda       # 70M-tier shapes, T = 2048 and 8192, bf16 (about 3 minutes)
    python -m tools.bench kernels --device cpu --block_sizes 32,64 --tokens 64 --check_T 24 --heads 2 --fh 40 --window 8

For each choice of the fused path's plan (tango_kernels.fused_plan and its constants: full prefix,
the SDPA backend, the value-block width and the score split, or FlexAttention over the causal band
(FULL_PREFIX_KERNEL "flex"); windowed, FlexAttention's tile and value-block width) it times the average's forward + backward (tango_kernels.fused_average under
autocast, gradients of q, k, g, b) at each block size T with --tokens tokens (B = tokens // T,
--heads heads, --fh gate columns per head), the median of --reps after one untimed call, and checks
the choice against the float64 formula (tango.tango_reference / windowed_reference) at T =
--check_T (B = 1): the largest relative error (norm of the difference over the norm) of the output
and the four gradients. Each row also gives tango_kernels.attention_work's ratio (whole tiles
executed over the model's attention work) and the model's attention FLOP/s: 3 x 2 x the model's
attention MACs (backward = 2 x forward) per second.

On CPU no fused kernel takes these shapes: the check runs SDPA's math backend and the window's
dense stand-in (tango_kernels.window_dense) in place of the kernels, which tests the harness, not
the kernels; the header says so. A choice that fails (no kernel for its shapes, out of memory) is
a row with its error.
"""
import contextlib
import json
import os
import statistics
import time

import torch
from torch.nn.attention import SDPBackend

import tango_kernels
from common import UsageError
from harness.cli import ExitParser, check_output_files, int64_flag, make_parent, synchronizer, write_text
from harness.config import Dist, auto_dtype, resolve_device
from tango import tango_reference, windowed_reference

FULL = [  # (backend, value block, score split): full prefix
    ("EFFICIENT_ATTENTION", 128, False), ("EFFICIENT_ATTENTION", 256, False), ("CUDNN_ATTENTION", 128, False),
    ("EFFICIENT_ATTENTION", 128, True)]
# FlexAttention compiles per choice and shape (about 10-40 s each, an estimate): few choices keep the check near 3 minutes
WINDOWED = [(32, 256), (64, 256)]  # (FlexAttention tile, value block): windowed
FULL_FLEX = [(32, 256)]  # (FlexAttention tile, value block): full prefix as the causal band


@contextlib.contextmanager
def choice(kind, params, device_type):
    """tango_kernels set to one choice (restored afterwards); on CPU the stand-ins for the kernels."""
    names = ("SDPA_VALUE_BLOCK", "SCORE_SPLIT", "FLEX_BLOCK", "FLEX_VALUE_BLOCK", "FULL_PREFIX_KERNEL", "sdpa_backends",
             "window_kernel")
    saved = {n: getattr(tango_kernels, n) for n in names}
    try:
        if kind == "full":
            backend, block, split = params
            use = [SDPBackend.MATH] if device_type == "cpu" else [getattr(SDPBackend, backend)]
            tango_kernels.sdpa_backends = lambda *a: use
            tango_kernels.SDPA_VALUE_BLOCK, tango_kernels.SCORE_SPLIT = block, split
        else:  # "windowed" or "full-flex"
            tango_kernels.FLEX_BLOCK, tango_kernels.FLEX_VALUE_BLOCK = params
            tango_kernels.FULL_PREFIX_KERNEL = "flex" if kind == "full-flex" else "sdpa"
            if device_type == "cpu":  # FlexAttention has no CPU backward
                tango_kernels.window_kernel = tango_kernels.window_dense
        torch._dynamo.reset()  # FlexAttention's kernel recompiled for this tile
        tango_kernels._compiled_flex.cache_clear()
        tango_kernels.window_block_mask.cache_clear()
        yield
    finally:
        for n, v in saved.items():
            setattr(tango_kernels, n, v)


def inputs(B, H, T, fh, device, seed=0):
    """qs, kh, g, b in float64 (tau = 10, unit keys), requiring gradients."""
    gen = torch.Generator().manual_seed(seed)
    qs = 10 * torch.nn.functional.normalize(torch.randn(B, H, T, 32, generator=gen, dtype=torch.float64), dim=-1)
    kh = torch.nn.functional.normalize(torch.randn(B, H, T, 32, generator=gen, dtype=torch.float64), dim=-1)
    g = torch.randn(B, H, T, fh, generator=gen, dtype=torch.float64)
    b = torch.randn(H, generator=gen, dtype=torch.float64)
    return [t.to(device).requires_grad_() for t in (qs, kh, g, b)]


def run_fused(args, window, dtype, device_type, dout):
    """fused_average's output and the gradients of q, k, g, b for the upstream gradient dout, inputs
    in float32 (q, k as the model gives them), under bf16 autocast when dtype is bf16."""
    qs, kh, g, b = args
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = tango_kernels.fused_average(qs, kh, g, b, window)
    return out, torch.autograd.grad(out, args, dout.to(out.dtype))


def check(window, dtype, device, T, H, fh):
    """Largest relative error of the output and gradients against the float64 formula at T."""
    args = inputs(1, H, T, fh, device, seed=1)
    want = tango_reference(*args) if window is None else windowed_reference(*args, window)
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    gwant = torch.autograd.grad(want, args, dout)
    out, grads = run_fused([t.detach().float().requires_grad_() for t in args], window, dtype, device.split(":")[0], dout)
    rel = lambda a, w: ((a.double() - w).norm() / w.norm()).item()
    return max([rel(out, want)] + [rel(a, w) for a, w in zip(grads, gwant)])


def time_choice(window, dtype, device, T, B, H, fh, reps):
    """Median seconds of forward + backward over reps calls after one untimed one."""
    args = [t.detach().float().requires_grad_() for t in inputs(B, H, T, fh, device)]
    dout = torch.ones(B, H, T, fh, device=device)
    sync = synchronizer(device)
    run_fused(args, window, dtype, device.split(":")[0], dout)
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        run_fused(args, window, dtype, device.split(":")[0], dout)
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def kernels_main(argv):
    """python -m tools.bench kernels ...: one row per (choice, T); prints a markdown table and writes
    --json (default out/bench/kernels_<device>.json) and its .md. Returns 0, or 1 if no row ran."""
    p = ExitParser(prog="bench.py kernels", description="Time and check TANGO's fused-path kernel choices.")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--block_sizes", default="2048,8192", help="comma-separated T to time (default 2048,8192)")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per timed call, B = tokens // T (default 32768)")
    p.add_argument("--check_T", type=int, default=1024, help="T of the float64 check (default 1024)")
    p.add_argument("--heads", type=int, default=16, help="heads H (default 16: the 70M tier)")
    p.add_argument("--fh", type=int, default=1780, help="gate columns per head F/H (default 1780: the 70M tier)")
    p.add_argument("--window", type=int, default=256, help="Windowed TANGO's W (default 256)")
    p.add_argument("--reps", type=int, default=3, help="timed calls per row (median; default 3)")
    p.add_argument("--json", default=None, help="output JSON (default out/bench/kernels_<device>.json)")
    a = p.parse_args(argv)
    try:
        resolve_device(a, Dist())
        Ts = [int64_flag(t) for t in a.block_sizes.split(",") if t]
    except (UsageError, ValueError) as e:
        p.error(str(e))
    for flag in ("tokens", "check_T", "heads", "fh", "window", "reps"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} {getattr(a, flag)}: must be >= 1")
    if not Ts or min(Ts) < 1 or max(Ts) > a.tokens:
        p.error(f"--block_sizes {a.block_sizes}: positive integers, each at most --tokens {a.tokens}")
    a.json = a.json or os.path.join("out", "bench", f"kernels_{a.device.split(':')[0]}.json")
    md_path = os.path.splitext(a.json)[0] + ".md"
    try:
        check_output_files([("--json", a.json)])
    except UsageError as e:
        p.error(str(e))
    dtype = torch.bfloat16 if auto_dtype(a.device) == "bfloat16" else torch.float32
    dev_type = a.device.split(":")[0]
    rows, t0 = [], time.time()
    plans = ([("full", c, None) for c in FULL] + [("full-flex", c, None) for c in FULL_FLEX]
             + [("windowed", c, a.window) for c in WINDOWED])
    for kind, params, window in plans:
        with choice(kind, params, dev_type):
            name = (f"full: {params[0].split('_')[0].lower()}, values {params[1]}" + (", split" if params[2] else "")
                    if kind == "full" else f"full: FlexAttention {params[0]}x{params[0]}, values {params[1]}"
                    if kind == "full-flex" else f"windowed W={window}: FlexAttention {params[0]}x{params[0]}, values {params[1]}")
            try:
                err = check(window, dtype, a.device, a.check_T, min(a.heads, 2), a.fh)
            except Exception as e:  # noqa: BLE001  (a choice without a kernel is a row that says why)
                err = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            for T in Ts:
                B = max(1, a.tokens // T)
                work = tango_kernels.attention_work(B, a.heads, T, window, a.fh, dtype)
                kernel = work["kernel"] if "CUDNN" not in str(params[0]) else "cuDNN (tiles counted as the efficient kernel's)"
                row = {"choice": name, "T": T, "batch": B, "check_error": err, "work_ratio": work["ratio"], "kernel": kernel}
                if isinstance(err, str):
                    rows.append({**row, "status": err})
                    continue
                try:
                    s = time_choice(window, dtype, a.device, T, B, a.heads, a.fh, a.reps)
                    rows.append({**row, "status": "ok", "ms": 1e3 * s, "model_tflops": 6 * work["model"] / s / 1e12})
                except Exception as e:  # noqa: BLE001
                    rows.append({**row, "status": f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"})
            print(f"  {name}: " + ", ".join(f"T={r['T']} " + (f"{r['ms']:.1f} ms" if r["status"] == "ok" else r["status"])
                                            for r in rows if r["choice"] == name), flush=True)
    head = (f"`python -m tools.bench kernels {' '.join(argv)}`\n\n{a.device}, {str(dtype).split('.')[-1]}, H={a.heads}, "
            f"F/H={a.fh}, {a.tokens} tokens per call, median of {a.reps}; check against float64 at T={a.check_T} "
            f"(B=1, H={min(a.heads, 2)}): largest relative error of the output and the gradients of q, k, g, b.\n\n"
            + ("CPU: SDPA's math backend and the window's dense stand-in replace the kernels (no fused kernel on CPU):"
               " this checks the harness, not the kernels; the GPU figures are not measured here.\n\n"
               if dev_type == "cpu" else "")
            + "| choice | T | batch | kernel (attention_work) | work / model | ms fwd+bwd | model attention TFLOP/s | "
            "error vs float64 |\n|---|---:|---:|---|---:|---:|---:|---:|")
    lines = [head] + [
        f"| {r['choice']} | {r['T']} | {r['batch']} | {r['kernel']} | {r['work_ratio']:.2f} | "
        + (f"{r['ms']:.2f} | {r['model_tflops']:.3g} | {r['check_error']:.1e} |" if r["status"] == "ok" else
           f"{r['status']} | | |") for r in rows]
    md = "\n".join(lines) + "\n"
    print("\n" + md)
    meta = {"command": "python -m tools.bench kernels " + " ".join(argv), "device": a.device, "dtype": str(dtype),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(a.device) if dev_type == "cuda" else None,
            "wall_s": time.time() - t0}
    write_text(make_parent(a.json), json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    write_text(make_parent(md_path), md)
    print(f"wrote {a.json} and {md_path} ({meta['wall_s']:.0f} s)")
    return 0 if any(r["status"] == "ok" for r in rows) else 1
