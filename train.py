"""Train any registered model on a prepared dataset (SPEC.md section 8).

    python train.py --model tango --depth 8                      # CPU tier, stdlib, ~5 min
    python train.py --model loop --depth 4 --dataset dmmath
    python train.py --model tango --size 70M --block_size 2048   # one GPU: bf16 + torch.compile

Protocol: AdamW (fp32 states), linear warmup then cosine decay, weight decay 0.1 on matrices
only, gradient clipping 1.0, micro-batches with gradient accumulation, dev NLL on a fixed set of
dev windows at update counts fixed in advance (every --eval_interval and the last update), the
best-dev checkpoint kept and only it evaluated on test. NLL is in nats/token; throughput is the
median training tokens/s over the final 100 updates. Bad input: one-line error, exit code 2.
"""
import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import data as data_mod
from common import ModelConfig, UsageError
from models import REGISTRY, TIERS, build_model, solve_width

# Per-tier defaults for flags left unset (the CPU tier is sized so the main job runs in minutes).
TIER_DEFAULTS = {
    "cpu": dict(block_size=256, batch_size=8, gradient_accumulation_steps=1, max_iters=150,
                eval_interval=25, learning_rate=2e-3, warmup_iters=10, eval_windows=48, em_samples=100),
    "70M": dict(block_size=2048, batch_size=4, gradient_accumulation_steps=8, max_iters=5000,
                eval_interval=250, learning_rate=6e-4, warmup_iters=200, eval_windows=256, em_samples=1000),
    "160M": dict(block_size=2048, batch_size=4, gradient_accumulation_steps=8, max_iters=5000,
                 eval_interval=250, learning_rate=6e-4, warmup_iters=200, eval_windows=256, em_samples=1000),
}


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss or gradient); exit code 1."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default="tango", help=f"one of {', '.join(REGISTRY)}")
    a("--depth", type=int, default=8, help="K, number of block applications")
    a("--size", default=None, help=f"tier: {', '.join(TIERS)} (default: cpu without a GPU, 70M with one)")
    a("--window", type=int, default=256, help="Windowed TANGO window W")
    a("--dataset", default="stdlib", help="stdlib, dmmath, or a path to a text file or folder")
    a("--data_dir", default=None, help="dmmath: folder in the official layout (default ../shared/data/dmmath)")
    a("--data_root", default="data", help="where prepared token bins are cached")
    a("--block_size", type=int, default=None, help="training context length T")
    a("--batch_size", type=int, default=None, help="micro-batch size (sequences)")
    a("--gradient_accumulation_steps", type=int, default=None, help="micro-batches per update")
    a("--max_iters", type=int, default=None, help="number of optimizer updates")
    a("--eval_interval", type=int, default=None, help="updates between dev evaluations")
    a("--eval_windows", type=int, default=None, help="fixed dev/test windows evaluated")
    a("--eval_batch_size", type=int, default=8)
    a("--learning_rate", type=float, default=None, help="peak learning rate")
    a("--min_lr_ratio", type=float, default=0.1, help="final learning rate / peak")
    a("--warmup_iters", type=int, default=None)
    a("--weight_decay", type=float, default=0.1)
    a("--grad_clip", type=float, default=1.0)
    a("--em_samples", type=int, default=None, help="dmmath: problems per split scored by exact match")
    a("--sample_tokens", type=int, default=80, help="length of the decoded sample printed at the end")
    a("--out_dir", default="out")
    a("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
      help="autocast dtype; auto = bfloat16 on a GPU that supports it, float32 otherwise")
    a("--compile", action=argparse.BooleanOptionalAction, default=None,
      help="torch.compile the model (default: on for CUDA)")
    a("--seed", type=int, default=1337, help="model seed")
    a("--data_seed", type=int, default=None, help="data-order seed (default: --seed); same value = same batches")
    a("--resume", action="store_true", help="continue from <out_dir>/ckpt_latest.pt")
    a("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    return args


def resolve_args(args):
    """Fill tier defaults, pick the device, and validate every flag (UsageError on bad input)."""
    if args.model not in REGISTRY:
        raise UsageError(f"--model: unknown model '{args.model}'; choose one of {', '.join(REGISTRY)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available on this machine; use --device cpu")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise UsageError(f"--device {args.device}: use auto, cpu, cuda or cuda:N")
    if args.size is None:
        args.size = "70M" if args.device.startswith("cuda") else "cpu"
    if args.size not in TIERS:
        raise UsageError(f"--size {args.size}: choose one of {', '.join(TIERS)}")
    for k, v in TIER_DEFAULTS[args.size].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.data_seed is None:
        args.data_seed = args.seed
    if args.compile is None:
        args.compile = args.device.startswith("cuda")
    for flag in ("depth", "block_size", "batch_size", "gradient_accumulation_steps", "max_iters",
                 "eval_interval", "eval_windows", "eval_batch_size", "window", "em_samples"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    for flag in ("learning_rate", "grad_clip"):
        if not getattr(args, flag) > 0:
            raise UsageError(f"--{flag} {getattr(args, flag)}: must be > 0")
    if not 0 <= args.min_lr_ratio <= 1:
        raise UsageError(f"--min_lr_ratio {args.min_lr_ratio}: must be in [0, 1]")
    if args.weight_decay < 0 or args.warmup_iters < 0 or args.sample_tokens < 0:
        raise UsageError("--weight_decay, --warmup_iters and --sample_tokens must be >= 0")
    if args.dtype == "auto":
        bf16 = args.device.startswith("cuda") and torch.cuda.is_bf16_supported()
        args.dtype = "bfloat16" if bf16 else "float32"
    return args


def lr_at(it, args):
    """Learning rate for update it (0-based): linear warmup to the peak, cosine to min_lr_ratio * peak."""
    peak, warm, total = args.learning_rate, args.warmup_iters, args.max_iters
    if it < warm:
        return peak * (it + 1) / (warm + 1)
    if total <= warm:
        return peak
    progress = min(1.0, (it - warm) / max(1, total - 1 - warm))
    return peak * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, args):
    """AdamW, weight decay on matrices (dim >= 2) only, minus any the body lists in
    no_decay_parameters() (Parcae's A_log, dt_bias, B, C); fp32 states as parameters stay fp32."""
    params = [p for p in model.parameters() if p.requires_grad]
    exempt = {id(p) for p in getattr(model.body, "no_decay_parameters", lambda: [])()}
    decay = lambda p: p.dim() >= 2 and id(p) not in exempt
    groups = [{"params": [p for p in params if decay(p)], "weight_decay": args.weight_decay},
              {"params": [p for p in params if not decay(p)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def evaluate(model, data, split, starts, block_size, batch_size, device, ctx):
    """Mean NLL (nats/token) over the scored targets of fixed windows; the sum and count are
    accumulated separately, so the value does not depend on the batch size."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        x, y = data.window_batch(split, starts[i:i + batch_size], block_size)
        x, y = x.to(device), y.to(device)
        with ctx:
            logits, _ = model(x)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum").item()
        count += int((y != -1).sum())
    model.train()
    return total / max(count, 1)


@torch.no_grad()
def exact_match(model, data, split, n_samples, device, ctx):
    """Fraction of problems whose greedily decoded answer equals the reference exactly (dmmath).
    The n_samples problems are evenly spaced over the split (so every module is represented)."""
    probs = data.problems(split)
    tok = data.tokens(split)
    idx = np.linspace(0, len(probs) - 1, min(n_samples, len(probs))).round().astype(int)
    model.eval()
    correct = 0
    for q0, a0, a1 in probs[idx]:
        prompt = torch.from_numpy(tok[q0:a0].astype(np.int64))[None].to(device)  # question + "\n"
        with ctx:
            out = model.generate(prompt, max_new_tokens=int(a1 - a0) + 2, temperature=0, stop_token=data.eot)
        answer = data.decode(out[0, prompt.shape[1]:].tolist()).split("\n")[0]
        correct += answer == data.decode(tok[a0:a1])
    model.train()
    return correct / len(idx)


def clean_state_dict(model):
    """state_dict without torch.compile / DDP wrapper prefixes."""
    sd = model.state_dict()
    out = {}
    for k, v in sd.items():
        for prefix in ("_orig_mod.", "module."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v.detach().cpu()
    return out


def save_atomic(obj, path):
    """torch.save to a temporary file beside path, then os.replace: a crash leaves the old file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path):
    """Load a checkpoint with weights_only=True on the CPU; UsageError if missing or unreadable."""
    if not os.path.isfile(path):
        raise UsageError(f"--resume: no checkpoint at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"{path}: not a readable checkpoint ({type(e).__name__})") from None


def rng_state(rng):
    return {"python": random.getstate(), "numpy": rng.bit_generator.state, "torch": torch.get_rng_state()}


def run(args):
    t_start = time.time()
    args = resolve_args(args)
    device = args.device
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    # --- data (prepared once into memmapped bins, atomically) and model; nothing in out_dir yet
    folder = data_mod.prepare(args.dataset, args.data_dir, args.data_root)
    data = data_mod.Data(folder)
    data.check_block_size(args.block_size)
    d, H, target = TIERS[args.size]
    cfg = ModelConfig(model=args.model, vocab_size=data.vocab_size, block_size=args.block_size,
                      n_embd=d, n_head=H, depth=args.depth, window=args.window)
    cfg = solve_width(cfg, target, strict=args.size != "cpu")
    ckpt = None
    latest, best_path = os.path.join(args.out_dir, "ckpt_latest.pt"), os.path.join(args.out_dir, "ckpt_best.pt")
    if args.resume:
        ckpt = load_checkpoint(latest)
        if ckpt.get("config") != cfg.to_dict() or ckpt.get("data") != data_signature(data):
            raise UsageError(f"--resume: {latest} was trained with another model/tokenizer/flags "
                             f"({ckpt.get('config', {}).get('model')}); use a fresh --out_dir")
    model = build_model(cfg, device=device)
    n_params = model.num_params()
    err = n_params / target - 1
    print(f"model {args.model}  depth {args.depth}  tier {args.size}  d={d} heads={H} width={cfg.width}  "
          f"non-embedding params {n_params:,} (target {target:,}, {err:+.3%})"
          + ("" if abs(err) <= 0.002 else "  [outside 0.20 %: this tier is too small to match exactly]"))
    print(f"data {folder}: {data.tokenizer} vocab {data.vocab_size}, "
          + ", ".join(f"{k} {v:,}" for k, v in data.meta["splits"].items()) + " tokens")

    optimizer = make_optimizer(model, args)
    rng = np.random.default_rng(args.data_seed)
    it, best_dev = 0, float("inf")
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        it, best_dev = ckpt["iter"], ckpt["best_dev"]
        random.setstate(_tuplify(ckpt["rng"]["python"]))
        rng.bit_generator.state = ckpt["rng"]["numpy"]
        torch.set_rng_state(ckpt["rng"]["torch"])
        print(f"resumed from {latest} at update {it} (best dev {best_dev:.4f})")
    os.makedirs(args.out_dir, exist_ok=True)
    log = open(os.path.join(args.out_dir, "log.jsonl"), "a" if ckpt else "w")

    def emit(**rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()

    ptdtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    ctx = (torch.autocast(device_type=device.split(":")[0], dtype=ptdtype) if ptdtype != torch.float32
           else torch.autocast(device_type="cpu", enabled=False))
    step_model = torch.compile(model) if args.compile else model

    dev_starts = data.eval_windows("dev", args.block_size, args.eval_windows)
    test_starts = data.eval_windows(data.test_split, args.block_size, args.eval_windows)
    eval_at = set(range(args.eval_interval, args.max_iters + 1, args.eval_interval)) | {args.max_iters}
    baseline = data_mod.unigram_entropy(data, "dev")
    emit(event="start", args=vars(args), config=cfg.to_dict(), non_embedding_params=n_params,
         unigram_dev=baseline, resumed_at=it)

    tokens_per_update = args.batch_size * args.gradient_accumulation_steps * args.block_size
    rates = []
    bar = None
    if not args.quiet:
        from tqdm import tqdm
        bar = tqdm(total=args.max_iters, initial=it, desc=args.model, dynamic_ncols=True)
    model.train()
    while it < args.max_iters:
        t0 = time.time()
        lr = lr_at(it, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for _ in range(args.gradient_accumulation_steps):
            x, y = data.train_batch(rng, args.batch_size, args.block_size)
            x, y = x.to(device), y.to(device)
            with ctx:
                _, loss = step_model(x, y)
            (loss / args.gradient_accumulation_steps).backward()
            loss_sum += loss.item()
        loss_avg = loss_sum / args.gradient_accumulation_steps
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if not (math.isfinite(loss_avg) and math.isfinite(float(grad_norm))):
            raise TrainingError(f"non-finite loss ({loss_avg}) or gradient norm at update {it}; "
                                f"stopped; the last good checkpoint is {latest}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        it += 1
        dt = time.time() - t0
        rates.append(tokens_per_update / dt)
        emit(event="train", iter=it, loss=loss_avg, lr=lr, grad_norm=float(grad_norm), tok_per_s=rates[-1])
        if bar is not None:
            bar.set_postfix(loss=f"{loss_avg:.3f}", tok_s=f"{rates[-1]:.0f}")
            bar.update(1)
        if it in eval_at:
            dev = evaluate(step_model, data, "dev", dev_starts, args.block_size, args.eval_batch_size, device, ctx)
            improved = dev < best_dev
            best_dev = min(best_dev, dev)
            emit(event="eval", iter=it, dev_nll=dev, best=improved)
            msg = f"update {it}: dev NLL {dev:.4f}" + (" (best)" if improved else "")
            (bar.write if bar is not None else print)(msg)
            state = {"model": clean_state_dict(model), "config": cfg.to_dict(), "data": data_signature(data),
                     "iter": it, "best_dev": best_dev, "dev_nll": dev}
            if improved:
                save_atomic(state, best_path)
            save_atomic(dict(state, optimizer=optimizer.state_dict(), rng=rng_state(rng), args=vars(args)), latest)
    if bar is not None:
        bar.close()

    # --- final: evaluate only the best-dev checkpoint on test
    best = load_checkpoint(best_path)
    model.load_state_dict(best["model"])
    test = evaluate(model, data, data.test_split, test_starts, args.block_size, args.eval_batch_size, device, ctx)
    summary = {"model": args.model, "depth": args.depth, "size": args.size, "dataset": args.dataset,
               "width": cfg.width, "non_embedding_params": n_params, "params": model.num_params(False),
               "best_iter": best["iter"], "dev_nll": best["dev_nll"], "test_split": data.test_split,
               "test_nll": test, "unigram_dev": baseline,
               "tok_per_s_median_last100": float(np.median(rates[-100:])) if rates else None,
               "seed": args.seed, "data_seed": args.data_seed, "wall_s": time.time() - t_start}
    for split in data.meta.get("em_splits", []):
        summary[f"exact_match_{split}"] = exact_match(model, data, split, args.em_samples, device, ctx)
    emit(event="summary", **summary)
    log.close()
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    print(f"\n== {args.model} depth {args.depth} on {args.dataset} ({args.size} tier) ==")
    print(f"non-embedding params   {n_params:,}")
    print(f"unigram entropy (dev)  {baseline:.4f} nats/token   (baseline)")
    print(f"dev NLL (best, upd {best['iter']}) {best['dev_nll']:.4f} nats/token")
    print(f"test NLL ({data.test_split})    {test:.4f} nats/token")
    if summary["tok_per_s_median_last100"]:
        print(f"throughput             {summary['tok_per_s_median_last100']:.0f} tokens/s (median, last 100 updates)")
    for split in data.meta.get("em_splits", []):
        print(f"exact match {split:12s} {summary[f'exact_match_{split}']:.2%}  ({min(args.em_samples, len(data.problems(split)))} problems)")
    print(f"wall time              {summary['wall_s']:.0f} s")
    print_sample(model, data, args, device, ctx)
    return summary


def data_signature(data):
    """What a checkpoint must agree with the data on: tokenizer and vocabulary."""
    return {"tokenizer": data.tokenizer, "vocab_size": data.vocab_size}


def print_sample(model, data, args, device, ctx):
    """A short decoded sample from the best checkpoint (dmmath: one problem, answered greedily)."""
    if args.sample_tokens == 0:
        return
    torch.manual_seed(args.seed)
    if data.problems(data.test_split) is not None:
        q0, a0, a1 = data.problems(data.test_split)[0]
        tok = data.tokens(data.test_split)
        prompt = torch.from_numpy(tok[q0:a0].astype(np.int64))[None].to(device)
        with ctx:
            out = model.generate(prompt, max_new_tokens=args.sample_tokens, temperature=0, stop_token=data.eot)
        print(f"\n--- sample ({data.test_split}, greedy) ---\nQ: {data.decode(tok[q0:a0 - 1])}\n"
              f"model: {data.decode(out[0, prompt.shape[1]:].tolist()).strip()}\nreference: {data.decode(tok[a0:a1])}")
        return
    prompt = torch.tensor([[data.eot]], device=device)
    with ctx:
        out = model.generate(prompt, max_new_tokens=args.sample_tokens, temperature=0.8, top_k=200)
    print(f"\n--- sample (temperature 0.8, top-k 200) ---\n{data.decode(out[0, 1:].tolist())}\n---")


def _tuplify(x):
    """random.setstate needs tuples; checkpoints store them as lists or tuples."""
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def main(argv=None):
    try:
        run(parse_args(argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
