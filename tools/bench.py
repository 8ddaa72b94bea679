"""Training-step speed, peak memory and MFU of every model at matched parameters.

    python -m tools.bench                                   # CPU: all models, T = 256..4096, eager
    python -m tools.bench --models tango,tango-3set,loop --block_sizes 512,2048
    python -m tools.bench --device cuda                     # 70M tier, T = 2048 and 8192, bf16, compiled and eager
    python -m tools.bench --quick --device cuda             # every model at T = 2048 compiled, four at T = 8192
    python -m tools.bench --quick --device cuda --part 1/3  # its first third (then 2/3, 3/3; main job with the last)
    python -m tools.bench kernels --device cuda             # TANGO's fused-path kernel choices (tools/bench_kernels.py)
    python -m tools.bench --quick --device cpu --size tiny  # the same plan scaled down (T = 32 / 128, eager; in the suite)

Each (model, block size T, compile) configuration runs in a fresh subprocess (`--timeout` caps
it; a timed-out or failed row says so and the model's larger T are skipped). Configurations run
block size by block size (every model at one T, then the next T), so the rows that the MFU ratio
compares are measured minutes apart, not a whole model's sweep apart (a drift of the host's speed
in between would move their ratio); the table lists them model by model. --rounds R runs each
block size's configurations R times, the order reversed every other round (A B C, C B A), and
pools their timed steps, so that a drift during one block size moves the rows compared alike.
Compiled rows use train.py's regional compilation (common.compile_regions: each body's repeated
unit and the head compile once); "first step s" is the seconds from the start of the
configuration (model build) to the end of its first training step, compile included.

On CUDA the defaults are what a GPU user would run: the 70M tier, T = 2048 and 8192, at least
32768 tokens per step, bf16 autocast, compiled and eager. --quick covers every model at T = 2048
compiled plus the registry's bench_long models (models.ModelSpec) at T = 8192, 2 warm-up and 3
timed steps each. Its time is an estimate from FLOPs, not
measured yet (no GPU was available while writing this): a 32k-token step at 70M is 1.5e13
(untied, T = 2048) to 2.3e14 (TANGO, T = 8192) model FLOPs (flops.train_flops), 0.05-1 s at
250 TFLOP/s, so the ~6 steps of every configuration take about a minute together; the rest
is interpreter and CUDA start-up (~10 s each) and the regional compile (~10-20 s each: one unit
and the head, forward and backward), about 8-12 minutes in all on one H100/H200-class GPU. On CPU, --quick runs the same plan at
T = 32 / 128 and V = 256, eager (an inductor compile takes minutes per model on CPU), in this
process (no per-configuration interpreter start, so its memory column is less isolated). The child builds the
model train.py builds for the same --model/--size/--depth/--block_size (flops.train_config: the
width solved to the tier's non-embedding parameter count, train.py's model flags, --window, --chunk
and --gau_s the tier's unless given; the report's header states them), AdamW as in train.py (its
weight-decay groups), random tokens, and times full training steps: forward + loss, backward,
gradient clipping 1.0, optimizer step. The batch is max(1, batch_tokens // T) sequences;
batch_tokens defaults to the largest block size, so every row does the same number of tokens per
step. On CPU the timed steps run with glibc's malloc
keeping freed memory for the next step (cpu_memory.keep_freed_memory; --cpu_memory return for
glibc's default, under which the page faults of each step's fresh large tensors took a fifth to
a half of a step on this project's CPU: docs/training.md, "Training on CPU").

compile s   compiled rows: the first training step's seconds minus a timed step's (the compile of the
            forward and backward graphs); 0 for eager rows in the JSON, "-" in the table.
recompiles  graphs torch.compile captured after the first training step (graphs: all it captured);
            0 when the first step's graphs serve every later step; eager rows as compile s.
main job    with --quick (--main_job FLAGS, default "--model tango --depth 8"): `python train.py FLAGS
            --device DEV` run until it prints its time to first update (data, model and compile
            included; its data prepared first if not yet), then stopped.
tokens/s    B T / median step time over --steps timed steps (fewer once they took --step_budget
            seconds, at least one; with --rounds, the steps of all rounds), after --warmup untimed
            ones (the last is the memory measurement) and, on CPU with --cpu_memory keep, more
            until the kept heap has stopped growing (cpu_memory.settle_heap: two in a row fault in
            at most 1 MiB; at most 10; settle_steps in the JSON).
MFU         model FLOPs/s / peak FLOPs/s. Model FLOPs = flops.train_flops(cfg, T, B T)
            = 6 x (forward MACs of one sequence, MATH.md "Cost") / T per token: 2 FLOPs per MAC, backward
            = 2 x forward, every score matrix counted as a full T x T product (no causal halving,
            so a causal kernel that skips the masked half can exceed 'its' share). For Parcae, RDM,
            PonderLM-2 (--jacobi_random, thought slots) and LRT with --lrt_detach_init the formula is a
            nominal cost, not the work a step runs, so their MFU is not comparable with the others:
            the row records why ("flops_nominal", flops.train_flops_nominal) and the table says it
            under the rows.
peak        FLOPs/s of the best of --peak_reps square matmuls of size --peak_n, measured at start
            in the benchmark's dtype and thread count (fp32 on CPU, bf16 on CUDA).
peak MB     CPU: the peak resident set size during the last warm-up training step above the RSS
            just before it, with parameters and AdamW states already allocated and gradients freed
            (/proc/self/clear_refs resets the high-water mark; glibc's mmap threshold is pinned
            and the heap trimmed first, so freed memory is returned and re-counted). It is the
            step's working memory: gradients, activations saved for backward, logits and
            transients. CUDA: torch.cuda.max_memory_allocated above the allocation before the step.

The benchmark's targets are computed from the rows (eager rows where present): TANGO's memory per
sequence grows as T^p with p <= 1.1 (least-squares slope of log(peak / B) on log T), Windowed
TANGO's time per token at T=4096 within 1.25x of T=512, the three-set model >= 3x TANGO's
tokens/s at T=2048, and every model's MFU >= 0.8x Loop Transformer++'s at the same T.

--reflux (on with --quick): inference ms/token of the ReFlux schedules of reflux.py (base, sync,
stream2, stream) on a random untied Transformer++ at the smallest block size, on --device under --dtype
(bench_decode.reflux_rows): the full-sequence protocol and cached decoding, with
flops.reflux_forward_macs's MACs ratio beside them.
`python -m tools.bench decode ...` (batch-1 cached decoding latency) is in bench_decode.py too.

Without a GPU (--device cpu) the report says that the GPU figures are not measured.

Outputs: a markdown table (printed, and --md, default out/bench/bench_<device>.md) and JSON
(--json, default out/bench/bench_<device>.json; out/ is git-ignored, so results/ changes only
where --json/--md name it) with the settings, definitions, load average, rows and targets.
"""
import argparse
import itertools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch

if not __package__:  # run as python tools/x.py, not python -m tools.x: find the project's modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flops
import models
from common import UsageError, compile_regions
from harness.cli import (ExitParser, check_output_files, int64_flag, make_parent, run_command, repeated, synchronizer,
                         write_text)
from harness.config import Dist, auto_dtype, resolve_device
from harness.optim import AdamW, make_optimizer
from tools.bench_report import REFERENCE, add_ratios, table, targets, targets_text
from tools.cpu_memory import loadavg, max_rss_mb, return_freed_memory, settle_heap, step_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
OUT_DIR = os.path.join("out", "bench")  # default outputs: git-ignored scratch; results/ only via --json/--md
DEFAULT_BLOCK_SIZES = "256,512,1024,2048,4096"

MEMORY_DEF_CPU = ("peak RSS during one training step (forward, backward, clip, AdamW step) minus RSS just "
                  "before it; parameters and AdamW states already allocated, gradients freed")
MEMORY_DEF_CUDA = "torch.cuda.max_memory_allocated during one training step minus memory_allocated before it"
FLOPS_DEF = ("flops.train_flops: 6 x forward MACs per token (MATH.md, Cost; 2 FLOPs/MAC, "
             "backward = 2 x forward, full T x T score matrices, tied head V d included)")


# ============================================================================= child: one configuration
def child(spec):
    """Benchmark one configuration; returns a dict (printed as JSON on the last stdout line)."""
    t_begin = time.perf_counter()
    torch.manual_seed(0)
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    dev = spec["device"]
    cfg = child_config(spec)
    T = spec["T"]
    B = max(1, spec["batch_tokens"] // T)
    model = models.build_model(cfg, device=dev)
    model.train()
    opt = make_optimizer(model, 6e-4, AdamW(weight_decay=0.1), dev)  # training's AdamW
    fwd = model
    if spec["dtype"] == "bfloat16":
        ctx = lambda: torch.autocast(device_type=dev.split(":")[0], dtype=torch.bfloat16)
    else:
        ctx = lambda: torch.autocast(device_type="cpu", enabled=False)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(cfg.vocab_size, (B, T + 1), generator=g).to(dev)
    x, y = data[:, :-1], data[:, 1:]
    sync = synchronizer(dev)

    def step():
        with ctx():
            _, loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    # Before the measured step: a tiny eager forward/backward (maps the code pages and starts the
    # autograd threads, which RSS would otherwise count) and an AdamW step with lr 0 (allocates its
    # states, leaves the weights alone), so the measured step holds what every training step needs.
    lrs = [grp["lr"] for grp in opt.param_groups]
    for grp in opt.param_groups:
        grp["lr"] = 0.0
    with ctx():
        model(x[:1, :min(T, 8)], y[:1, :min(T, 8)])[1].backward()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for grp, lr in zip(opt.param_groups, lrs):
        grp["lr"] = lr
    if spec["compile"]:  # after the tiny eager step, which must not compile a graph of its own shape
        backend = spec.get("backend", "inductor")
        compile_regions(model, backend=backend)  # as train.py --compile: each repeated unit (and the head) once

    # warm-up; the last warm-up step (after any compilation) is the memory measurement
    graphs0 = graphs_compiled()
    t0 = time.perf_counter()
    first_step_s = first_dur = graphs_first = None

    def first_done():  # after the first training step: its time (compile included) and its graphs
        nonlocal first_step_s, first_dur, graphs_first
        if first_step_s is None:
            first_step_s, first_dur, graphs_first = time.perf_counter() - t_begin, time.perf_counter() - t0, graphs_compiled()

    for _ in range(spec["warmup"] - 1):
        step()
        sync()
        first_done()
    sync()
    keep = not dev.startswith("cuda") and spec.get("cpu_memory", "keep") == "keep"
    if dev.startswith("cuda"):
        base = torch.cuda.memory_allocated(dev)  # dev named: without it, cuda:0's counters
        torch.cuda.reset_peak_memory_stats(dev)
        step()
        sync()
        mem_mb, method = (torch.cuda.max_memory_allocated(dev) - base) / 2**20, "cuda max_memory_allocated"
    else:
        mem_mb, method = step_memory(step, keep)
    first_done()
    settle_steps = settle_heap(step) if keep else 0  # untimed: until the kept heap stops growing
    warmup_s = time.perf_counter() - t0
    times, losses = [], []
    while len(times) < spec["steps"] and (not times or sum(times) < spec["step_budget"]):
        sync()
        t = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    if not all(map(math.isfinite, losses)):
        raise RuntimeError(f"non-finite loss {losses}")
    tokens = B * T
    fl = flops.train_flops(cfg, T, tokens)
    work = None
    import tango
    if dev.startswith("cuda") and isinstance(model.body, tango.Tango):  # the fused path's plan
        import tango_kernels
        dt = torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32
        work = tango_kernels.attention_work(B, cfg.n_head, T, cfg.window if model.body.windowed else None,
                                            cfg.width // cfg.n_head, dt)["ratio"]
    compile_s = max(0.0, first_dur - statistics.median(times)) if spec["compile"] else 0.0
    return {"width": cfg.width, "non_embedding_params": model.num_params(), "batch": B, "tokens_per_step": tokens,
            "warmup_s": warmup_s, "first_step_s": first_step_s, "model_flops_per_step": fl, "model_flops_per_token": fl / tokens,
            **timing(times, tokens, fl), "flops_nominal": flops.train_flops_nominal(cfg), "compile_s": compile_s,
            "graphs": graphs_compiled() - graphs0,
            "recompiles": graphs_compiled() - graphs_first,
            "peak_mem_mb": mem_mb, "memory_method": method, "peak_rss_mb": max_rss_mb(), "settle_steps": settle_steps,
            "final_loss": losses[-1], "attention_work": work}


def child_config(spec):
    """The ModelConfig a configuration times: the one train.py builds for its model, tier, depth,
    block size T, vocabulary and model flags (flops.train_config)."""
    flags = {f: spec[f] for f in flops.train_model_flags()}
    return flops.train_config(spec["model"], spec["size"], spec["depth"], spec["T"], spec["vocab_size"], flags)[0]


def config_spec(a, model, comp, T, threads):
    """The spec of one configuration (what the child process gets) from parse()'s flags."""
    return {"model": model, "T": T, "compile": comp, "device": a.device, "dtype": a.dtype,
            "size": a.size, "depth": a.depth, "vocab_size": a.vocab_size, **a.flags,
            "batch_tokens": a.batch_tokens, "steps": math.ceil(a.steps / a.rounds), "step_budget": a.step_budget / a.rounds,
            "warmup": max(a.warmup, 2) if comp else a.warmup, "threads": threads, "cpu_memory": a.cpu_memory,
            "backend": a.compile_backend}


def graphs_compiled():
    """Graphs torch.compile has captured in this process so far (dynamo's unique_graphs counter)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def timing(times, tokens, fl):
    """The speed columns from the timed steps (seconds each) of a step of `tokens` tokens and fl model FLOPs."""
    step_s = statistics.median(times)
    return {"step_s": step_s, "step_times_s": times, "tokens_per_s": tokens / step_s, "ms_per_token": 1e3 * step_s / tokens,
            "achieved_flops_per_s": fl / step_s}


# ============================================================================= parent
def matmul_peak(device, dtype, n, reps):
    """Best FLOPs/s of reps n x n x n matmuls (2 n^3 FLOPs each) in dtype on device."""
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    sync = synchronizer(device)
    for _ in range(2):
        a @ b
    sync()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def child_error(line):
    """A child's last stderr line without its own "error: " / "PROG: error: " prefix (the row adds one;
    PROG a script or dotted module name, so an exception's "RuntimeError: " is kept)."""
    return re.sub(r"^([\w/-]*\.[\w./-]+: )?error: ", "", line)


def run_config(spec, timeout):
    """Run one configuration in a fresh interpreter; returns its row (status 'ok', 'timeout' or 'error: ...')."""
    cmd = [sys.executable, "-m", "tools.bench", "--_child", json.dumps(spec)]
    load0 = loadavg()
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**spec, "status": "timeout", "wall_s": time.time() - t0, "load_before": load0, "load_after": loadavg()}
    row = {**spec, "wall_s": time.time() - t0, "load_before": load0, "load_after": loadavg()}
    lines = p.stdout.strip().splitlines()
    if p.returncode == 0 and lines:
        row.update(json.loads(lines[-1]))
        row["status"] = "ok"
    else:
        err = (p.stderr.strip().splitlines() or ["exit code %d" % p.returncode])[-1]
        row["status"] = "error: " + child_error(err)[:300]
    return row


MAIN_JOB = "--model tango --depth 8"  # the main job (README): its time to its first update, with --quick


BPE_PLACES = ("shared/data/gpt2.tiktoken", "../shared/data/gpt2.tiktoken")  # from the repository root, in order


def main_job_vocabulary():
    """(environment additions, text): where the main job's GPT-2 vocabulary comes from (for data
    that uses it): GPT2_BPE_FILE as set; else the first of BPE_PLACES that exists (set for the
    job); else tiktoken's download (harness.token_files.gpt2_encoder), which fails offline."""
    if os.environ.get("GPT2_BPE_FILE"):
        return {}, f"GPT2_BPE_FILE={os.environ['GPT2_BPE_FILE']} (from the environment)"
    for place in BPE_PLACES:
        path = os.path.normpath(os.path.join(ROOT, place))
        if os.path.isfile(path):
            return {"GPT2_BPE_FILE": path}, f"GPT2_BPE_FILE={path} (found by bench)"
    return {}, "tiktoken's download (GPT2_BPE_FILE unset and no " + " or ".join(BPE_PLACES) + ")"


def main_job_first_update(flags, device, timeout):
    """Seconds from start to the end of the first update of `python train.py FLAGS --device DEVICE`
    as it prints them ("first update after X s": data, model and compile included), the process
    stopped right after that line. Returns a dict: command, status ("ok", "timeout", "error: ...")
    and first_update_s, prepared (True if the run prepared its data, whose time is included),
    vocabulary (where a GPT-2 vocabulary comes from: main_job_vocabulary)."""
    import shlex
    import tempfile
    import threading
    env, vocabulary = main_job_vocabulary()
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "train.py", *shlex.split(flags), "--device", device, "--out_dir", out, "--quiet"]
        row = {"command": "python " + " ".join(shlex.quote(c) for c in cmd[1:-5]) + f" --device {device}",
               "prepared": False, "vocabulary": vocabulary}
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                             env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})  # its lines as they are printed
        timer = threading.Timer(timeout, p.kill)  # a run that hangs without printing is stopped too
        timer.start()
        last = ""
        try:
            for line in p.stdout:
                row["prepared"] |= line.startswith("prepared ")
                m = re.match(r"first update after ([0-9.]+) s", line)
                if m:
                    row.update(status="ok", first_update_s=float(m.group(1)))
                    break
                last = line.strip() or last
            else:
                code = p.wait()
                row["status"] = "timeout" if not timer.is_alive() else f"error: exit code {code}: {child_error(last)[:300]}"
        finally:
            timer.cancel()
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()
    return row


QUICK_LONG = tuple(m for m, spec in models.REGISTRY.items() if spec.bench_long)  # --quick: also at the long T
QUICK_T = {"cuda": (2048, 8192), "cpu": (32, 128)}  # --quick: (every model, QUICK_LONG) block sizes


def plan(a):
    """The (model, compile, T) configurations in run order (of --part i/n: part_of)."""
    if a.quick:
        short, long = QUICK_T["cuda" if a.device.startswith("cuda") else "cpu"]
        comp = a.device.startswith("cuda")
        configs = [(m, comp, short) for m in a.models] + [(m, comp, long) for m in QUICK_LONG if m in a.models]
    else:
        compiles = {"off": [False], "on": [True], "both": [False, True]}[a.compile]
        configs = [(m, c, T) for T in a.block_sizes for c in compiles for m in a.models]  # the models compared at one T together
    return part_of(configs, *a.part) if getattr(a, "part", None) else configs


REFERENCE_MODEL = "loop"  # Loop Transformer++: the MFU ratio's reference (tools.bench_report.REFERENCE)


def part_of(configs, i, n):
    """Part i of n (1-based) of a plan: every n-th configuration other than the reference model's,
    starting at the i-th, plus the reference's configurations at the block sizes and compile modes
    that part has (so each part's MFU ratios are measured within it). Order as in configs."""
    others = [c for c in configs if c[0] != REFERENCE_MODEL]
    mine = set(others[i - 1::n])
    keys = {(c, T) for _, c, T in mine}
    return [cfg for cfg in configs if cfg in mine or (cfg[0] == REFERENCE_MODEL and (cfg[1], cfg[2]) in keys)]


def schedule(configs, rounds):
    """plan()'s configurations with --rounds: each block size's configurations run `rounds` times,
    the order reversed every other round (A B C, C B A, ...), so that a drift of the host's speed
    while one block size runs moves the rows compared there alike. Yields (config, round)."""
    for _, group in itertools.groupby(configs, key=lambda c: c[2]):
        group = list(group)
        for r in range(rounds):
            for cfg in (group if r % 2 == 0 else group[::-1]):
                yield cfg, r


def merge_rounds(parts):
    """One row from a configuration's rounds (in run order): the timed steps of all rounds pooled
    (median over all), the largest peak memory, the first round's first-step time; the first
    failed round's row if any failed."""
    if len(parts) == 1 or any(p["status"] != "ok" for p in parts):
        return next((p for p in parts if p["status"] != "ok"), parts[0])
    row = {**parts[0], **timing([t for p in parts for t in p["step_times_s"]], parts[0]["tokens_per_step"],
                                parts[0]["model_flops_per_step"])}
    row.update(round_step_s=[p["step_s"] for p in parts], settle_steps=[p["settle_steps"] for p in parts],
               peak_mem_mb=max(p["peak_mem_mb"] for p in parts), peak_rss_mb=max(p["peak_rss_mb"] for p in parts),
               wall_s=sum(p["wall_s"] for p in parts), load_after=parts[-1]["load_after"], final_loss=parts[-1]["final_loss"])
    return row


def run_config_here(spec):
    """run_config in this process (--quick on CPU): no timeout, memory less isolated."""
    t0 = time.time()
    torch._dynamo.reset()
    row = {**spec, "load_before": loadavg()}
    try:
        row.update(child(spec))
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001  (a failing model is a row, as in a subprocess)
        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        return_freed_memory()
    return {**row, "wall_s": time.time() - t0, "load_after": loadavg()}


def parse(argv):
    """bench.py's flags, validated (ExitParser: a bad value is one line and exit code 2) and their
    defaults filled in; a.flags holds train.py's model flags as the models are built with them."""
    p = ExitParser(prog="bench.py", description="Training-step throughput, peak memory and MFU at matched parameters "
                   "(batch-1 decoding and ReFlux timings: python -m tools.bench decode --help).")
    p.add_argument("--models", default=",".join(models.REGISTRY), help="comma-separated registry names (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="every model at T = 2048 compiled plus TANGO, Windowed TANGO, three-set TANGO and Loop "
                        "Transformer++ at T = 8192 (CUDA); on CPU T = 32 / 128, eager, in this process")
    p.add_argument("--size", default=None, help=f"parameter tier: {', '.join(models.TIERS)} (default: 70M on CUDA, cpu)")
    p.add_argument("--depth", type=int, default=4, help="block applications K (default: 4)")
    p.add_argument("--block_sizes", default=None,
                   help=f"comma-separated sequence lengths T (default: 2048,8192 on CUDA, {DEFAULT_BLOCK_SIZES}; "
                        "--quick sets its own)")
    p.add_argument("--batch_tokens", type=int, default=None,
                   help="tokens per step (>= 1); batch = max(1, batch_tokens // T) (default: the largest block size, "
                        "at least 32768 on CUDA)")
    p.add_argument("--vocab_size", type=int, default=None,
                   help="vocabulary V (>= 1; default GPT-2's 50257; --quick on CPU: 256)")
    p.add_argument("--steps", type=int, default=None, help="timed training steps per configuration (median; >= 1; "
                   "default 2, --quick 3 on CUDA, 1 on CPU)")
    p.add_argument("--step_budget", type=float, default=20,
                   help="stop timing once the timed steps took this many seconds (at least one step; default 20)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run each configuration this many times, in reversed order every other round at each block "
                        "size; --steps and --step_budget are split evenly over the rounds, the steps pooled (default 1)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first, the last one measures memory (>= 1; default 1, --quick on CUDA 2; "
                        "compiled rows: at least 2 used)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: cpu)")
    p.add_argument("--compile", choices=("off", "on", "both"), default=None,
                   help="torch.compile the model (default: off on CPU, both on CUDA; --quick: on on CUDA, off on CPU)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="autocast dtype and matmul-peak dtype (default: float32 on CPU, bfloat16 on a "
                        "CUDA GPU that computes it natively)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--cpu_memory", choices=("keep", "return"), default="keep",
                   help="CPU timed steps: glibc keeps freed memory for the next step (keep, default; "
                        "cpu_memory.keep_freed_memory) or returns it, so large tensors fault in anew each step (return)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per configuration before it is killed (default 300)")
    p.add_argument("--peak_n", type=int, default=None,
                   help="matmul size for the peak (>= 1; default 2048 CPU, 8192 CUDA, 256 with --quick on CPU)")
    p.add_argument("--peak_reps", type=int, default=None,
                   help="matmuls timed for the peak, the best counts (>= 1; default 10, 3 with --quick on CPU)")
    p.add_argument("--json", default=None, help=f"output JSON (default {OUT_DIR}/bench_<device>.json)")
    p.add_argument("--md", default=None, help="output markdown (default: next to --json, .md)")
    p.add_argument("--note", action="append", default=[], help="free-text note stored in the outputs (repeatable)")
    p.add_argument("--main_job", default=None,
                   help=f"train.py flags of the main job whose time to first update is measured (default with "
                        f"--quick: '{MAIN_JOB}'; 'none' to skip)")
    p.add_argument("--compile_backend", default=None, help="torch.compile backend of the compiled rows (default inductor)")
    p.add_argument("--reflux", action="store_true",
                   help="also time the ReFlux schedules (reflux.py) at the smallest block size (on with --quick)")
    p.add_argument("--part", default=None,
                   help="i/n: run part i of n of the plan (every n-th configuration, plus Loop Transformer++ at the "
                        "same block sizes for the MFU ratio); the main job and ReFlux run with the last part "
                        "(e.g. --quick --device cuda --part 1/3)")
    flops.add_train_model_flags(p)  # --width, --window, --chunk, --gau_s, ...: the models as train.py builds them
    a = p.parse_args(argv)
    try:
        resolve_device(a, Dist())  # train.py's check: a device this machine has
    except UsageError as e:
        p.error(str(e))
    cuda = a.device.startswith("cuda")
    a.size = a.size or ("70M" if cuda else "cpu")
    if a.size not in models.TIERS:
        p.error(f"--size {a.size}: choose one of {', '.join(models.TIERS)}")
    a.models = [m for m in a.models.split(",") if m]
    for m in a.models:
        if m not in models.REGISTRY:
            p.error(f"--models: unknown model '{m}'; choose from {', '.join(models.REGISTRY)}")
    if not a.models:
        p.error("--models: name at least one model")
    if (twice := repeated(a.models)) is not None:
        p.error(f"--models {','.join(a.models)}: {twice} given twice")
    for flag in ("depth", "batch_tokens", "vocab_size", "steps", "warmup", "peak_n", "peak_reps", "rounds"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:  # None: unset, its default below
            p.error(f"--{flag} {getattr(a, flag)}: must be >= 1")
    if a.threads < 0:
        p.error(f"--threads {a.threads}: must be >= 0")
    for flag in ("step_budget", "timeout"):
        if not 0 < getattr(a, flag) < math.inf:
            p.error(f"--{flag} {getattr(a, flag)}: must be a finite number of seconds > 0")
    if a.quick:
        for flag in ("block_sizes", "compile"):  # --quick's plan would ignore them
            if getattr(a, flag) is not None:
                p.error(f"--{flag}: --quick runs its own plan (T = {' / '.join(map(str, QUICK_T['cuda' if cuda else 'cpu']))}, "
                        f"compiled on CUDA only); drop --{flag} or --quick")
        a.block_sizes = ",".join(map(str, QUICK_T["cuda" if cuda else "cpu"]))
    block_sizes = ("2048,8192" if cuda else DEFAULT_BLOCK_SIZES) if a.block_sizes is None else a.block_sizes
    try:
        a.block_sizes = [int64_flag(t) for t in block_sizes.split(",") if t]
    except argparse.ArgumentTypeError as e:
        p.error(f"--block_sizes {e}")
    except ValueError:
        p.error(f"--block_sizes {block_sizes}: comma-separated integers")
    if not a.block_sizes or min(a.block_sizes) < 1:
        p.error("--block_sizes: need positive integers")
    if (twice := repeated(a.block_sizes)) is not None:
        p.error(f"--block_sizes {block_sizes}: {twice} given twice")
    a.block_sizes = sorted(a.block_sizes)
    quick_cpu = a.quick and not cuda
    defaults = {"steps": 1 if quick_cpu else 3 if a.quick else 2, "warmup": 2 if a.quick and cuda else 1,
                "peak_n": 256 if quick_cpu else 8192 if cuda else 2048, "peak_reps": 3 if quick_cpu else 10,
                "vocab_size": 256 if quick_cpu else 50257, "batch_tokens": max(max(a.block_sizes), 32768 if cuda else 0)}
    for flag, value in defaults.items():
        if getattr(a, flag) is None:
            setattr(a, flag, value)
    a.reflux = a.reflux or a.quick
    if a.reflux and a.depth < 2:  # checked here, not after every model's row
        p.error(f"--depth {a.depth}: --reflux (on with --quick) needs --depth >= 2 (an edge S:D writes block S's "
                "increment into an earlier block D)")
    given = flops.given_train_flags(a)
    a.flags = flops.train_flags(a.size, given)
    try:  # every model solved as train.py would (models.count_params): a value train.py refuses is refused here
        error = flops.unread_flags_error(given, a.models)
        if error:
            raise UsageError(error)
        for m in a.models:
            flops.train_config(m, a.size, a.depth, max(a.block_sizes), a.vocab_size, a.flags)
    except UsageError as e:
        p.error(str(e))
    a.main_job = a.main_job or (MAIN_JOB if a.quick else "none")
    a.main_job = None if a.main_job == "none" else a.main_job
    if a.main_job:  # train.py's own checks of its flags, before the benchmark, not after it
        import shlex
        import train
        try:
            job = shlex.split(a.main_job) + ["--device", a.device]
            train.check_flags(train.parse_args(job), train.given_flags(job))
        except (UsageError, ValueError) as e:  # (ValueError: unbalanced quotes)
            p.error(f"--main_job {a.main_job!r}: {e}")
    if a.compile is None:
        a.compile = "both" if cuda else "off"
    if a.part is not None:
        m = re.fullmatch(r"(\d+)/(\d+)", a.part)
        if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
            p.error(f"--part {a.part}: give i/n with 1 <= i <= n (e.g. 1/3)")
        i, n = int(m.group(1)), int(m.group(2))
        a.part = None
        count = len([c for c in plan(a) if c[0] != REFERENCE_MODEL])
        if n > count:
            p.error(f"--part {i}/{n}: the plan has {count} configurations besides Loop Transformer++; use n <= {count}")
        a.part = (i, n)
        if i < n:  # the main job and ReFlux run once, with the last part
            a.reflux, a.main_job = False, None
    if a.compile_backend is not None:  # every row would record the backend's error, or none would use it
        import torch._dynamo
        if a.compile == "off":
            p.error("--compile_backend: only used with --compile on or both (no row is compiled); drop it")
        if a.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):  # (debug ones too: eager, aot_eager)
            p.error(f"--compile_backend {a.compile_backend}: not a torch.compile backend (e.g. "
                    f"{', '.join(torch._dynamo.list_backends())}, aot_eager, eager)")
    a.compile_backend = a.compile_backend or "inductor"
    if a.dtype is None:  # as train.py's --dtype auto
        a.dtype = auto_dtype(a.device)
    kind = a.device.split(":")[0] + (f"_part{a.part[0]}of{a.part[1]}" if a.part else "")
    a.json = os.path.join(OUT_DIR, f"bench_{kind}.json") if a.json is None else a.json  # (an empty one is refused)
    a.md = os.path.splitext(a.json)[0] + ".md" if a.md is None else a.md
    try:  # before the run, not after it (harness.cli.check_output_file: creates nothing)
        check_output_files([("--json", a.json), ("--md", a.md)])
    except UsageError as e:
        p.error(str(e))
    return a


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        print(json.dumps(child(json.loads(argv[1]))))
        return 0
    from tools.bench_decode import decode_main, reflux_rows, reflux_table  # the inference benchmarks
    if argv[:1] == ["decode"]:
        return decode_main(argv[1:])
    if argv[:1] == ["kernels"]:  # TANGO's fused-path kernel choices: time and float64 check
        from tools.bench_kernels import kernels_main
        return kernels_main(argv[1:])
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    t_start = time.time()
    load_start = loadavg()
    peak = matmul_peak(a.device, a.dtype, a.peak_n, a.peak_reps)
    if a.dtype == "bfloat16":  # emulated bfloat16 is slower than float32, and the model's kernels outrun its "peak"
        fp32 = matmul_peak(a.device, "float32", a.peak_n, a.peak_reps)
        if peak <= fp32:
            print(f"bench.py: error: --dtype bfloat16: its matmul peak on {a.device} ({peak / 1e9:.1f} GFLOP/s) is no "
                  f"higher than float32's ({fp32 / 1e9:.1f}): bfloat16 is emulated there, so MFU over that peak would "
                  "read above 100 %; use --dtype float32", file=sys.stderr)
            return 2
    print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s ({a.dtype}, {a.peak_n}^3, best of {a.peak_reps}, "
          f"{threads} threads); load average {load_start}", flush=True)
    parts, failed = {}, {}
    here = a.quick and not a.device.startswith("cuda")
    for (model, comp, T), rnd in schedule(plan(a), a.rounds):
        spec = config_spec(a, model, comp, T, threads)
        if (model, comp) in failed:  # a larger T (or a later round) of a configuration that failed
            row = {**spec, "status": f"skipped ({failed[model, comp]})"}
        else:
            row = run_config_here(spec) if here else run_config(spec, a.timeout)
            if row["status"] != "ok":
                failed[model, comp] = f"T={T} {row['status'].split(':')[0]}"
        parts.setdefault((model, comp, T), []).append(row)
        msg = (f"{row['tokens_per_s']:,.0f} tokens/s  MFU {100 * row['achieved_flops_per_s'] / peak:.1f}%  "
               + (f"(attention work {row['attention_work']:.2f}x the model's)  " if row.get("attention_work") else "")
               + f"{row['peak_mem_mb']:,.0f} MB  first step {row['first_step_s']:.1f} s  "
               + (f"compile {row['compile_s']:.1f} s  recompiles {row['recompiles']} " if comp else "")
               + f"({row['wall_s']:.0f} s, load {row['load_before']})"
               if row["status"] == "ok" else row["status"])
        print(f"  {model:<15} T={T:<5} compile={'on ' if comp else 'off'} "
              + (f"round {rnd + 1}/{a.rounds} " if a.rounds > 1 else "") + msg, flush=True)
    main_job = None
    if a.main_job:
        main_job = main_job_first_update(a.main_job, a.device, a.timeout)
        print(f"  main job `{main_job['command']}`: " + (f"first update after {main_job['first_update_s']:.1f} s"
              + (" (data prepared in this run, included)" if main_job["prepared"] else "")
              if main_job["status"] == "ok" else main_job["status"]) + f"; GPT-2 vocabulary: {main_job['vocabulary']}",
              flush=True)
    rows = [merge_rounds(p) for p in parts.values()]
    rows.sort(key=lambda r: (a.models.index(r["model"]), r["compile"], r["T"]))  # listed model by model
    add_ratios(rows, peak)
    tg = targets(rows)
    rf_rows = (reflux_rows(a.size, a.depth, min(a.block_sizes), a.vocab_size, device=a.device, dtype=a.dtype)
               if a.reflux else None)
    meta = {
        "command": "python -m tools.bench " + " ".join(argv), "device": a.device, "dtype": a.dtype, "threads": threads,
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "size": a.size, "tier": dict(zip(("d", "n_head", "target"), models.TIERS[a.size])),
        "depth": a.depth, "vocab_size": a.vocab_size, "model_flags": a.flags, "batch_tokens": a.batch_tokens,
        "steps": a.steps, "step_budget_s": a.step_budget, "rounds": a.rounds, "warmup": a.warmup, "compile": a.compile, "timeout_s": a.timeout,
        "quick": a.quick, "part": list(a.part) if a.part else None, "cpu_memory": None if a.device.startswith("cuda") else a.cpu_memory,
        "peak_flops_per_s": peak, "peak_matmul": {"n": a.peak_n, "reps": a.peak_reps, "dtype": a.dtype},
        "flops_convention": FLOPS_DEF, "mfu_reference": REFERENCE,
        "memory_definition": MEMORY_DEF_CUDA if a.device.startswith("cuda") else MEMORY_DEF_CPU,
        "load_average_start": load_start, "load_average_end": loadavg(),
        "load_average_max_during": max([r[k] for r in rows for k in ("load_before", "load_after") if r.get(k) is not None],
                                       default=None),
        "wall_s": time.time() - t_start, "notes": a.note,
    }
    cuda = a.device.startswith("cuda")
    meta["gpu_measured"] = cuda
    out = {"meta": meta, "rows": rows, "targets": tg, "main_job": main_job}
    if rf_rows is not None:
        out["reflux"] = rf_rows
    md = (f"`{meta['command']}`\n\n{a.device}, {a.dtype}, {threads} threads, tier {a.size} (d={meta['tier']['d']}, "
          f"~{meta['tier']['target']:,} non-embedding parameters), K={a.depth}, V={a.vocab_size}, "
          f"{flops.flags_text(a.flags, a.models)}, "
          f"batch max(1, {a.batch_tokens} // T), median of up to {a.steps} timed steps (fewer past {a.step_budget:g} s) "
          + (f"in {a.rounds} rounds (each configuration run {a.rounds} times, the order at each T reversed every other "
             f"round, the steps pooled), each " if a.rounds > 1 else "")
          + f"after {a.warmup} warm-up; "
          + ("" if a.device.startswith("cuda") else
             f"CPU memory {a.cpu_memory} ({'freed memory kept for the next step' if a.cpu_memory == 'keep' else 'glibc default: fresh mmaps above 32 MiB'}); ")
          + f"matmul peak {peak / 1e9:.1f} GFLOP/s; load average {load_start} at start, "
          f"max {meta['load_average_max_during']} during.\n\n"
          f"MFU: {FLOPS_DEF}, over the matmul peak. Peak MB: {meta['memory_definition']}.\n\n"
          + ("" if cuda else "No GPU in this run: the GPU figures (CUDA rows, bf16 MFU, compile times) are not "
             "measured here.\n\n")
          + "Compile s: the first compiled step's seconds minus a timed step's; recompiles: graphs captured after "
          "the first training step.\n\n"
          + table(rows) + "\n\nTargets:\n\n" + targets_text(tg) + "\n"
          + (f"\nMain job `{main_job['command']}`: "
             + (f"first update after {main_job['first_update_s']:.1f} s from start"
                + (" (its data prepared in this run, included)" if main_job["prepared"] else "")
                if main_job["status"] == "ok" else main_job["status"])
             + f"; GPT-2 vocabulary (for data that uses it): {main_job['vocabulary']}.\n" if main_job else "")
          + (f"\nReFlux schedules (inference, one sequence, no gradients, {a.device} {a.dtype}; "
             "bench_decode.reflux_rows):\n\n"
             + reflux_table(rf_rows) + "\n" if rf_rows is not None else "")
          + "".join(f"\nNote: {n}\n" for n in a.note))
    print("\n" + md)
    for path, text in ((a.json, json.dumps(out, indent=1)), (a.md, md)):
        write_text(make_parent(path), text + "\n")
    print(f"wrote {a.json} and {a.md} ({meta['wall_s']:.0f} s)")
    if not any(r["status"] == "ok" for r in rows):  # tables of failures only: a script must not read success
        print("bench.py: error: no configuration completed (each row's status above says why)", file=sys.stderr)
        return 1
    return 0


# the flags that set how much memory the command takes: its out-of-memory line names them
SIZE_FLAGS = ("--size", "--depth", "--width", "--batch_tokens", "--block_sizes", "--vocab_size", "--prompt",
              "--tokens")


if __name__ == "__main__":
    try:
        run_command(main, sizes=SIZE_FLAGS)
    except UsageError as e:  # one line, exit code 2 like every other bad input (sys.exit(str) exits 1)
        print(f"bench.py: error: {e}", file=sys.stderr)
        sys.exit(2)
