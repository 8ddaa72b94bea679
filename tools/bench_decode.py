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
import time

import torch

import flops
import models
from tools.cpu_memory import loadavg
from common import ExitParser, ModelConfig, UsageError, not_a_command


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

def decode_row(model_name, size, depth, width, prompt, tokens, warmup, device="cpu", vocab_size=50257, **cfg_kw):
    """Time batch-1 greedy decoding of one model; returns a dict (ms_per_token, passes, rows, ...)."""
    d, H, target = models.TIERS[size]
    cfg = ModelConfig(model=model_name, vocab_size=vocab_size, block_size=max(prompt + tokens + warmup, 8),
                      n_embd=d, n_head=H, depth=depth, **cfg_kw)
    cfg = replace_width(cfg, width) if width else models.solve_width(cfg, target, strict=size not in ("tiny", "cpu"))
    torch.manual_seed(0)
    model = models.build_model(cfg, device=device).eval()
    idx = torch.randint(cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
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
    rows = depth if model_name in ("loopstack", "plt", "loopfold") else None
    return {"model": model_name, "width": cfg.width, "non_embedding_params": model.num_params(), "depth": depth,
            "n_core": cfg.n_core, "passes": passes, "rows": rows, "prompt": prompt, "tokens": tokens,
            "ms_per_token": 1e3 * statistics.median(times), "ms_per_token_mean": 1e3 * statistics.fmean(times),
            "forward_macs_per_token": flops.forward_macs(cfg, 1)["total"], "config": cfg.to_dict()}


def replace_width(cfg, width):
    if width % models.width_multiple(cfg):
        raise UsageError(f"--width {width}: must be a multiple of {models.width_multiple(cfg)} for {cfg.model}")
    d = cfg.to_dict()
    d["width"] = width
    return ModelConfig(**d)


def decode_table(rows):
    lines = ["| model | N loops | n_core | width | passes/token | rows/token | ms/token (median) | ms/token (mean) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['depth']} | {r['n_core']} | {r['width']} | {r['passes'] if r['passes'] else '-'} | "
                     f"{r['rows'] if r['rows'] else '-'} | {r['ms_per_token']:.2f} | {r['ms_per_token_mean']:.2f} |")
    return "\n".join(lines)


def decode_main(argv):
    """python -m tools.bench decode ...: one row per model (see the section comment); prints a markdown
    table and writes --json (default results/bench/decode_<device>.json) and its .md."""
    p = ExitParser(prog="bench.py decode", description="Batch-1 cached decoding latency and sequential passes per token.")
    p.add_argument("--models", default="loopstack,plt,loopfold", help="comma-separated registry names")
    p.add_argument("--size", default="cpu", help=f"tier: {', '.join(models.TIERS)}")
    p.add_argument("--depth", type=int, default=4, help="N loops (K applications for other models)")
    p.add_argument("--n_core", type=int, default=2, help="blocks per loop (parallel loops)")
    p.add_argument("--fold", type=int, default=2, help="LoopFold fold width f")
    p.add_argument("--width", type=int, default=0, help="feed-forward width F (0: solved to the tier's target)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens prefilled before timing")
    p.add_argument("--tokens", type=int, default=32, help="timed decoded tokens")
    p.add_argument("--warmup", type=int, default=4, help="untimed decoded tokens first")
    p.add_argument("--vocab_size", type=int, default=50257, help="vocabulary V")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--json", default=None, help="output JSON (default results/bench/decode_<device>.json)")
    a = p.parse_args(argv)
    names = [m for m in a.models.split(",") if m]
    for m in names:
        if m not in models.REGISTRY:
            p.error(f"--models: unknown model '{m}'; choose from {', '.join(models.REGISTRY)}")
    if a.size not in models.TIERS:
        p.error(f"--size {a.size}: choose one of {', '.join(models.TIERS)}")
    for flag in ("depth", "n_core", "fold", "prompt", "tokens", "vocab_size"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} {getattr(a, flag)}: must be >= 1")
    for flag in ("width", "warmup", "threads"):
        if getattr(a, flag) < 0:
            p.error(f"--{flag} {getattr(a, flag)}: must be >= 0")
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    for m in names:
        try:
            rows.append(decode_row(m, a.size, a.depth, a.width, a.prompt, a.tokens, a.warmup, a.device, a.vocab_size,
                                   n_core=a.n_core, fold=a.fold))
        except UsageError as e:
            p.exit(2, f"bench.py decode: error: {e}\n")
        print(f"  {m:<15} {rows[-1]['ms_per_token']:.2f} ms/token, {rows[-1]['passes']} passes", flush=True)
    command = "python -m tools.bench decode " + " ".join(argv)
    md = (f"`{command}`\n\n{a.device}, {torch.get_num_threads()} threads, tier {a.size}, batch 1, prompt {a.prompt}, "
          f"{a.tokens} timed tokens after {a.warmup} untimed; load average {loadavg()}.\n\n" + decode_table(rows) + "\n")
    print("\n" + md)
    path = a.json or os.path.join("results", "bench", f"decode_{a.device.split(':')[0]}.json")
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"command": command, "threads": torch.get_num_threads(), "load_average": loadavg(), "rows": rows}, f, indent=1)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(md)
    return 0


# ============================================================================= ReFlux schedules (reflux.py)
REFLUX_SCHEDULES = ("base", "sync", "stream2", "stream")


def reflux_rows(size, depth, T, vocab_size, reps=3):
    """Inference ms/token of each ReFlux schedule (reflux.py) on a random untied Transformer++ of
    tier `size`, K = depth, edge reflux.default_edge(K), eager, no gradients. "forward": the
    full-sequence protocol over one length-T sequence (stream: the per-token recurrence);
    "decode": cached steps after a T/2-token prompt (stream: parallel prefill), min(T/2, 16) of
    them. One untimed warm-up forward, then the best of reps timings; ratios against the base; MACs ratio from flops.reflux_forward_macs."""
    import reflux
    torch.manual_seed(0)
    d, H, target = models.TIERS[size]
    cfg = models.solve_width(ModelConfig(model="untied", vocab_size=vocab_size, block_size=T, n_embd=d, n_head=H,
                                         depth=depth), target, strict=False)
    base = models.build_model(cfg).eval()
    idx = torch.randint(vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    edge, P, n_dec = reflux.default_edge(depth), T // 2, max(1, min(T // 2, 16))
    rows = []
    for sched in REFLUX_SCHEDULES:
        lm = base if sched == "base" else reflux.reflux_lm(base, reflux.Settings(sched, (edge,)))
        fwd, dec = [], []
        with torch.no_grad():
            lm(idx)  # warm-up (first-call allocations), untimed
            for _ in range(reps):
                t0 = time.perf_counter()
                lm(idx)
                fwd.append(time.perf_counter() - t0)
                cache = {}
                lm(idx[:, :P], cache=cache)
                t0 = time.perf_counter()
                for i in range(n_dec):
                    lm(idx[:, P + i:P + i + 1], cache=cache)
                dec.append(time.perf_counter() - t0)
        rows.append({"schedule": sched, "edge": f"{edge[0]}:{edge[1]}", "T": T, "width": cfg.width,
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
