"""Inference benchmarks, the two `bench.py` commands beside the training-step table: `python -m tools.bench
decode ...` (batch-1 greedy cached decoding: ms/token and sequential passes per token, decode_main)
and the --reflux rows of `python -m tools.bench` (ReFlux schedules of reflux.py against the base,
reflux_rows). They time forward passes without gradients, so they share nothing with bench.py's
subprocess-per-configuration training steps but its argument parser and load average; bench.py
imports this module when one of them is asked for.
"""
import json
import os
import statistics
import sys
import time

import torch

if not __package__:  # run as python tools/x.py, not python -m tools.x: find the project's modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flops
import models
from tools.cpu_memory import loadavg
from common import UsageError
from harness.cli import (ExitParser, check_output_files, make_parent, not_a_command, past_context_note, repeated,
                         synchronizer, write_text)


# ============================================================================= batch-1 decoding (parallel loops)
# python -m tools.bench decode --models loopstack,plt,loopfold --size cpu --depth 4 [--width F]
# Greedy cached decoding at batch 1 (the latency the parallel-loop methods target): a random prompt
# is prefilled, then --tokens tokens are decoded one at a time (LM.forward with the cache, argmax);
# ms/token is the median over the decoded tokens after --warmup untimed ones. "passes" is the
# number of sequential stack passes per decoded token (body.sequential_passes: loopstack N, PLT 1,
# LoopFold S), "rows" the block rows they process per token (N for all three: PLT and LoopFold
# batch them). On a CPU a batched row costs about what a sequential one does, so ms/token follows
# the rows, not the passes; the passes are the latency on hardware where batched rows are nearly
# free (memory-bound GPU decoding).

def decode_row(model_name, size, depth, width, prompt, tokens, warmup, device="cpu", vocab_size=50257,
               block_size=None, **flags):
    """Time batch-1 greedy decoding of the model train.py builds for --model model_name --size size
    --depth depth --block_size block_size (default: the tier's) --width width (0: solved) and the
    model flags `flags` (flops.train_config; unset ones train.py's defaults, the tier's for --window,
    --chunk, --gau_s). Returns a dict (ms_per_token, passes, rows, ..., config: the model's
    ModelConfig). UsageError for a value train.py refuses."""
    from harness.config import TIER_DEFAULTS
    block_size = TIER_DEFAULTS[size]["block_size"] if block_size is None else block_size
    cfg, _ = flops.train_config(model_name, size, depth, block_size, vocab_size,
                                flops.train_flags(size, {**flags, "width": width}))
    torch.manual_seed(0)
    model = models.build_model(cfg, device=device).eval()
    idx = torch.randint(cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    sync = synchronizer(device)
    times = []
    with torch.no_grad():
        cache = {}
        logits, _ = model(idx, cache=cache)
        for i in range(warmup + tokens):
            nxt = logits[:, -1:].argmax(-1)
            sync()
            t = time.perf_counter()
            logits, _ = model(nxt, cache=cache)
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t)
    passes = getattr(model.body, "sequential_passes", None)
    rows = depth if getattr(model.body, "loop_rows", False) else None
    n_core = cfg.n_core if "n_core" in models.spec_of(model_name).flags else None  # None: a model without it
    return {"model": model_name, "width": cfg.width, "non_embedding_params": model.num_params(), "depth": depth,
            "n_core": n_core, "passes": passes, "rows": rows, "prompt": prompt, "tokens": tokens,
            "ms_per_token": 1e3 * statistics.median(times), "ms_per_token_mean": 1e3 * statistics.fmean(times),
            "config": cfg.to_dict()}


def decode_table(rows):
    """The markdown table of decode_row dicts; "-" where a model has no such number (n_core,
    passes, rows)."""
    lines = ["| model | N loops | n_core | width | passes/token | rows/token | ms/token (median) | ms/token (mean) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        n_core = "-" if r["n_core"] is None else r["n_core"]
        lines.append(f"| {r['model']} | {r['depth']} | {n_core} | {r['width']} | {r['passes'] if r['passes'] else '-'} | "
                     f"{r['rows'] if r['rows'] else '-'} | {r['ms_per_token']:.2f} | {r['ms_per_token_mean']:.2f} |")
    return "\n".join(lines)


def decode_main(argv):
    """python -m tools.bench decode ...: one row per model (see the section comment); prints a markdown
    table and writes --json (default out/bench/decode_<device>.json) and its .md."""
    from harness.config import TIER_DEFAULTS, Dist, resolve_device, tier_default
    p = ExitParser(prog="bench.py decode", description="Batch-1 cached decoding latency and sequential passes per "
                   "token of the models train.py builds (its model flags below).")
    p.add_argument("--models", default="loopstack,plt,loopfold", help="comma-separated registry names "
                   "(default: loopstack,plt,loopfold)")
    p.add_argument("--size", default="cpu", help=f"tier: {', '.join(models.TIERS)} (default: cpu)")
    p.add_argument("--depth", type=int, default=4, help="N loops (K applications for other models; default 4)")
    p.add_argument("--block_size", type=int, default=None, help="the model's context T, as train.py's --block_size "
                   "(GAU's score scale; >= 1); " + tier_default("block_size"))
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens prefilled before timing (>= 1; default 64)")
    p.add_argument("--tokens", type=int, default=32, help="timed decoded tokens (>= 1; default 32)")
    p.add_argument("--warmup", type=int, default=4, help="untimed decoded tokens first (>= 0; default 4)")
    p.add_argument("--vocab_size", type=int, default=50257, help="vocabulary V (>= 1; default 50257)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: cpu)")
    p.add_argument("--json", default=None, help="output JSON (default out/bench/decode_<device>.json)")
    flops.add_train_model_flags(p)  # --width, --n_core, --fold, --window, ...: the models as train.py builds them
    a = p.parse_args(argv)
    try:
        resolve_device(a, Dist())  # train.py's check: a device this machine has
    except UsageError as e:
        p.error(str(e))
    names = [m for m in a.models.split(",") if m]
    for m in names:
        if m not in models.REGISTRY:
            p.error(f"--models: unknown model '{m}'; choose from {', '.join(models.REGISTRY)}")
    if not names:
        p.error("--models: name at least one model")
    if (twice := repeated(names)) is not None:
        p.error(f"--models {a.models}: {twice} given twice")
    if a.size not in models.TIERS:
        p.error(f"--size {a.size}: choose one of {', '.join(models.TIERS)}")
    a.block_size = a.block_size if a.block_size is not None else TIER_DEFAULTS[a.size]["block_size"]
    for flag in ("depth", "block_size", "prompt", "tokens", "vocab_size"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} {getattr(a, flag)}: must be >= 1")
    for flag in ("warmup", "threads"):
        if getattr(a, flag) < 0:
            p.error(f"--{flag} {getattr(a, flag)}: must be >= 0")
    path = os.path.join("out", "bench", f"decode_{a.device.split(':')[0]}.json") if a.json is None else a.json  # scratch
    md_path = os.path.splitext(path)[0] + ".md"
    given = flops.given_train_flags(a)
    flags = flops.train_flags(a.size, given)
    try:  # every model solved as train.py would (count_params) before any is timed; the outputs writable
        check_output_files([("--json", path), ("--json's .md", md_path)])
        error = flops.unread_flags_error(given, names)
        if error:
            raise UsageError(error)
        for m in names:
            flops.train_config(m, a.size, a.depth, a.block_size, a.vocab_size, flags)
    except UsageError as e:
        p.error(str(e))
    if a.threads:
        torch.set_num_threads(a.threads)
    note = past_context_note(a.prompt, a.warmup + a.tokens, a.block_size, "decoded")  # as sample.py says it
    if note:
        print(note, file=sys.stderr)
    rows = []
    for m in names:
        rows.append(decode_row(m, a.size, a.depth, flags["width"], a.prompt, a.tokens, a.warmup, a.device,
                               a.vocab_size, a.block_size, **{f: v for f, v in flags.items() if f != "width"}))
        passes = rows[-1]["passes"]  # (None: a model without sequential passes to count, "-" in the table)
        print(f"  {m:<15} {rows[-1]['ms_per_token']:.2f} ms/token" + (f", {passes} passes" if passes else ""), flush=True)
    command = "python -m tools.bench decode " + " ".join(argv)
    md = (f"`{command}`\n\n{a.device}, {torch.get_num_threads()} threads, tier {a.size}, T={a.block_size}, "
          f"V={a.vocab_size}, {flops.flags_text(flags, names)}, "
          f"batch 1, prompt {a.prompt}, {a.tokens} timed tokens after {a.warmup} untimed; load average {loadavg()}.\n\n"
          + decode_table(rows) + "\n" + (f"\n{note[0].upper()}{note[1:]}.\n" if note else ""))
    print("\n" + md)
    write_text(make_parent(path), json.dumps({"command": command, "threads": torch.get_num_threads(),
                                              "load_average": loadavg(), "rows": rows}, indent=1))
    write_text(md_path, md)
    return 0


# ============================================================================= ReFlux schedules (reflux.py)
REFLUX_SCHEDULES = ("base", "sync", "stream2", "stream")


def reflux_rows(size, depth, T, vocab_size, reps=3, device="cpu", dtype="float32"):
    """Inference ms/token of each ReFlux schedule (reflux.py) on a random untied Transformer++ as
    train.py builds it at tier `size`, K = depth, block size T (flops.train_config), edge
    reflux.default_edge(K), eager, no gradients, on `device` under `dtype` autocast (the
    benchmark's; each timing synchronized on CUDA). "forward": the full-sequence protocol over one
    length-T sequence (stream: the per-token recurrence); "decode": cached steps after a T/2-token
    prompt (stream: parallel prefill), min(T/2, 16) of them. One untimed warm-up forward, then the
    best of reps timings; ratios against the base; MACs ratio from flops.reflux_forward_macs."""
    import reflux
    torch.manual_seed(0)
    cfg, _ = flops.train_config("untied", size, depth, T, vocab_size, flops.train_flags(size))
    base = models.build_model(cfg, device=device).eval()
    idx = torch.randint(vocab_size, (1, T), generator=torch.Generator().manual_seed(0)).to(device)
    edge, P, n_dec = reflux.default_edge(depth), T // 2, max(1, min(T // 2, 16))
    sync = synchronizer(device)
    ctx = lambda: torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    rows = []
    for sched in REFLUX_SCHEDULES:
        lm = base if sched == "base" else reflux.reflux_lm(base, reflux.Settings(sched, (edge,)))
        fwd, dec = [], []
        with torch.no_grad(), ctx():
            lm(idx)  # warm-up (first-call allocations), untimed
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                lm(idx)
                sync()
                fwd.append(time.perf_counter() - t0)
                cache = {}
                lm(idx[:, :P], cache=cache)
                sync()
                t0 = time.perf_counter()
                for i in range(n_dec):
                    lm(idx[:, P + i:P + i + 1], cache=cache)
                sync()
                dec.append(time.perf_counter() - t0)
        rows.append({"schedule": sched, "edge": f"{edge[0]}:{edge[1]}", "T": T, "width": cfg.width,
                     "device": device, "dtype": dtype,
                     "forward_ms_per_token": 1e3 * min(fwd) / T, "decode_ms_per_token": 1e3 * min(dec) / n_dec,
                     "decode_tokens": n_dec,
                     "macs_ratio": flops.reflux_forward_macs(cfg, T, sched, low=edge[1])["ratio"]})
    for r in rows:
        for k in ("forward", "decode"):
            r[f"{k}_vs_base"] = r[f"{k}_ms_per_token"] / rows[0][f"{k}_ms_per_token"]
    return rows


def reflux_table(rows):
    head = ("| ReFlux schedule | T | forward ms/token | x base | decode ms/token | x base | MACs x base |\n"
            "|---|---|---|---|---|---|---|\n")
    return head + "\n".join(f"| {r['schedule']} | {r['T']} | {r['forward_ms_per_token']:.3f} | {r['forward_vs_base']:.2f} | "
                             f"{r['decode_ms_per_token']:.3f} | {r['decode_vs_base']:.2f} | {r['macs_ratio']:.2f} |"
                             for r in rows)


if __name__ == "__main__":  # a part of another command: say which, instead of exiting silently
    not_a_command("tools/bench_decode.py", "python -m tools.bench decode or python -m tools.bench --reflux (python -m tools.bench decode --help)")
