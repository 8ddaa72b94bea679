"""Evaluation and the final report of train.py: dev/test NLL over fixed windows, dmmath exact
match, the printed report and a decoded sample; train.py --eval_only (eval_only), the same
evaluation of a finished run's best checkpoint without training.

NLL is in nats/token over the scored targets (``y != -1``); every function puts the model in eval
mode for its duration (Parcae/RDM: fixed depth, seeded initial state) and restores each module's
own mode after it.
"""
import contextlib
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import data as data_mod
from common import UsageError, compile_regions
from harness.checkpoint import BEST, EVAL_FLAGS, check_compatible, eval_only_args, load_weights, overrides
from harness.cli import nll_unit, past_context_note
from harness.config import Dist, autocast_ctx, check_flags
from harness.datacheck import load_data
from models import build_model, model_config


@contextlib.contextmanager
def eval_mode(model):
    """model (every submodule) in eval mode inside the block; each module's own train/eval mode
    restored after it, also on an error."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


@torch.no_grad()
def evaluate(model, data, split, starts, block_size, batch_size, device, ctx, dist=None):
    """Mean NLL (nats/token) over the scored targets of fixed windows.

    Each window's NLL sum (float64) and target count are computed separately; with dist the
    windows are sharded over ranks (window i on rank i % world) and the per-window values summed
    over ranks, then reduced in window order. So the value depends neither on the batch size nor on
    the world size, up to the float32 forward pass itself (see tests/test_train.py).
    Raises UsageError when the windows hold no scored target: a mean over nothing is no number
    (train.py refuses such settings before training, check_scored_windows)."""
    dist = dist or Dist()
    sums = torch.zeros(len(starts), dtype=torch.float64, device=device)
    counts = torch.zeros(len(starts), dtype=torch.float64, device=device)
    mine = np.arange(dist.rank, len(starts), dist.world)
    rows_per_batch = min(batch_size, len(mine))  # a short last batch is padded: one shape, no recompile
    with eval_mode(model):
        for i in range(0, len(mine), batch_size):
            idx = mine[i:i + batch_size]
            x, y = data.window_batch(split, np.asarray(starts)[idx], block_size)
            x, y = x.to(device), y.to(device)
            x = torch.cat((x, x[-1:].expand(rows_per_batch - len(idx), -1))).contiguous()
            with ctx:
                logits, _ = model(x)
            logits = logits[:len(idx)]
            nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="none")
            rows = torch.as_tensor(idx, device=device)
            sums[rows] = nll.view(y.shape).double().sum(1)
            counts[rows] = (y != -1).sum(1).double()
    dist.all_sum(sums)
    dist.all_sum(counts)
    if not counts.sum() > 0:
        raise UsageError(f"{data.folder}: the {len(starts)} {split} windows of {block_size} tokens hold no scored "
                         "target; nothing to evaluate")
    return float(sums.sum()) / float(counts.sum())


def check_scored_windows(data, block_size, n_windows):
    """UsageError, before any training, when the fixed dev or test windows (data.eval_windows, the
    ones every dev evaluation, the depth sweep and the test use) hold no scored target, as on
    dmmath, which scores answer characters only, with windows shorter than its questions."""
    if not data.masked:  # every target of every window is scored
        return
    for split in ("dev", data.test_split):
        starts = data.eval_windows(split, block_size, n_windows)
        if not (data.window_batch(split, starts, block_size)[1] != -1).any():
            raise UsageError(f"--block_size {block_size} / --eval_windows {n_windows}: the {len(starts)} fixed {split} "
                             f"windows hold no scored target ({data.folder} scores answer tokens only); "
                             "use a larger --block_size or more --eval_windows")


def greedy_answer(model, data, split, problem, max_new_tokens, ctx, device):
    """(prompt tokens, decoded greedy continuation) of one (question, answer, end) problem."""
    q0, a0, _ = problem
    tok = data.tokens(split)
    prompt = torch.from_numpy(tok[q0:a0].astype(np.int64))[None].to(device)  # question + "\n"
    with ctx:
        out = model.generate(prompt, max_new_tokens=max_new_tokens, temperature=0, stop_token=data.eot)
    return data.decode(out[0, prompt.shape[1]:].tolist())


def depth_sweep(model, depths, nll):
    """[nll() with model.body.depth = k for k in depths]: a shared-block model's NLL at other
    recurrence counts than it was trained with; the trained depth is restored after it."""
    body = model.body
    trained, curve = body.depth, []
    try:
        for k in depths:
            body.depth = k
            curve.append(nll())
    finally:
        body.depth = trained
    return curve


@torch.no_grad()
def exact_match(model, data, split, n_samples, device, ctx):
    """Fraction of problems whose greedily decoded answer equals the reference exactly (dmmath).
    The n_samples problems are evenly spaced over the split (so every module is represented)."""
    probs = data.problems(split)
    tok = data.tokens(split)
    idx = np.linspace(0, len(probs) - 1, min(n_samples, len(probs))).round().astype(int)
    correct = 0
    with eval_mode(model):
        for q0, a0, a1 in probs[idx]:
            answer = greedy_answer(model, data, split, (q0, a0, a1), int(a1 - a0) + 2, ctx, device)
            correct += answer.split("\n")[0] == data.decode(tok[a0:a1])
    return correct / len(idx)


def print_report(s, data, args):
    row = lambda label, value: print(f"{label:<25}{value}")  # one aligned column of values
    unit = nll_unit(data.tokenizer)
    print(f"\n== {args.model} depth {args.depth} on {args.dataset} ({args.size} tier) ==")
    row("non-embedding params", f"{s['non_embedding_params']:,}")
    row("unigram entropy (dev)", f"{s['unigram_dev']:.4f} {unit}   (of the whole split)")
    if s.get("unigram_dev_windows") is not None:
        row("unigram NLL (dev)", f"{s['unigram_dev_windows']:.4f} {unit}   (baseline: train's unigram, same windows)")
    row(f"dev NLL (best, upd {s['best_iter']})", f"{s['dev_nll']:.4f} {unit}")
    row(f"test NLL ({data.test_split})", f"{s['test_nll']:.4f} {unit}")
    if s["tok_per_s_median_last100"]:
        n = s.get("tok_per_s_updates", 100)  # fewer than 100 in a short run
        row("throughput", f"{s['tok_per_s_median_last100']:.0f} tokens/s (median of the last {n} updates)")
    for split in data.meta.get("em_splits", []):
        n = min(args.em_samples, len(data.problems(split)))
        row(f"exact match {split}", f"{s[f'exact_match_{split}']:.2%}  ({n} problems)")
    if "depth_sweep" in s:
        print("dev NLL by test-time depth: " + ", ".join(
            f"K={k}: {v:.4f}" for k, v in zip(s["depth_sweep"]["depths"], s["depth_sweep"]["dev_nll"])))
    if s["first_update_s"] is not None:
        row("first update", f"{s['first_update_s']:.1f} s after start" + (" (compile included)" if args.compile else ""))
    resumed = s.get("resumed_at")
    row("wall time", f"{s['wall_s']:.0f} s" + ("" if resumed is None else
        f" (resumed at update {resumed}; " + ("this process only: the checkpoint did not record the time "
                                              "before)" if s.get("wall_s_this_process_only") else "all processes)")))


def note_past_context(prompt_len, args):
    """print_sample's note on stderr (harness.cli.past_context_note) when --sample_tokens after the
    prompt pass --block_size."""
    note = past_context_note(prompt_len, args.sample_tokens, args.block_size)
    if note:
        print(note, file=sys.stderr, flush=True)


def print_sample(model, data, args, device, ctx):
    """A short decoded sample from the best checkpoint (dmmath: one problem, answered greedily),
    in eval mode (Parcae/RDM: fixed depth and seeded initial state); the model's mode is restored."""
    if args.sample_tokens == 0:
        return
    torch.manual_seed(args.seed)
    with eval_mode(model):
        if data.problems(data.test_split) is not None:
            q0, a0, a1 = problem = data.problems(data.test_split)[0]
            tok = data.tokens(data.test_split)
            note_past_context(a0 - q0, args)
            answer = greedy_answer(model, data, data.test_split, problem, args.sample_tokens, ctx, device)
            print(f"\n--- sample ({data.test_split}, greedy) ---\nQ: {data.decode(tok[q0:a0 - 1])}\n"
                  f"model: {answer.strip()}\nreference: {data.decode(tok[a0:a1])}")
            return
        prompt = torch.tensor([[data.eot]], device=device)
        note_past_context(1, args)
        with ctx:
            out = model.generate(prompt, max_new_tokens=args.sample_tokens, temperature=0.8, top_k=200)
    print(f"\n--- sample (temperature 0.8, top-k 200) ---\n{data.decode(out[0, 1:].tolist())}\n---")


def unigram_baselines(data, block_size, eval_windows):
    """The summary's unigram fields: the dev split's unigram entropy (unigram_dev) and train's
    unigram NLL on the dev windows of length block_size the dev NLL is measured on
    (unigram_dev_windows; eval_windows of them), nats/token."""
    starts = data.eval_windows("dev", block_size, eval_windows)
    return {"unigram_dev": data_mod.unigram_entropy(data, "dev"),
            "unigram_dev_windows": data_mod.unigram_nll(data, "dev", starts, block_size)}


def eval_only(args, given):
    """--eval_only: the end of training's evaluation of <out_dir>/ckpt_best.pt without training: dev
    and test NLL (nats/token) by evaluate on the same windows, exact match and --eval_depths as in
    finish, the run's flags from the checkpoints (eval_only_args; explicit ones override, as under
    --resume), so it prints the dev and test NLL the run printed. Prints the report (dev NLL
    recomputed, not read from the checkpoint); writes nothing to --out_dir. One process (not under
    torchrun). Returns the summary; UsageError on bad input."""
    t_start, dist = time.time(), Dist()
    if args.resume:
        raise UsageError("--eval_only: evaluates the run's best checkpoint without training; drop --resume")
    if Dist.from_env().ddp:  # the NLL does not depend on the world size (evaluate): one process gives it
        raise UsageError("--eval_only: runs in one process; start it with python, not torchrun")
    best, changed = eval_only_args(args, given)
    args = check_flags(args, given, dist, reads_out_dir=True)  # a read-only --out_dir is fine
    data = load_data(args, dist)
    cfg, _ = model_config(args, data.vocab_size)
    path = os.path.join(args.out_dir, BEST)
    check_compatible(best, path, cfg, data, fix="its model config and its flags disagree (a damaged checkpoint, or one "
                     "another version of train.py wrote)")
    model = build_model(cfg, device=args.device)
    load_weights(best, path, model)
    if args.compile:  # the training run's evaluations ran compiled
        compile_regions(model)
    ctx = autocast_ctx(args)
    nll = lambda split: evaluate(model, data, split, data.eval_windows(split, args.block_size, args.eval_windows),
                                 args.block_size, args.eval_batch_size, args.device, ctx, dist)
    dev, test = nll("dev"), nll(data.test_split)
    curve = depth_sweep(model, args.depth_list, lambda: nll("dev")) if args.depth_list else None
    unused = sorted(k for k in changed if k not in EVAL_FLAGS)
    print(f"evaluating {path} (update {best['iter']}; {args.device} {args.dtype}; --eval_only: no training, "
          "nothing written)"
          + overrides({k: v for k, v in changed.items() if k in EVAL_FLAGS})
          + (f"; not used without training: {', '.join('--' + k for k in unused)}" if unused else ""))
    summary = {"non_embedding_params": model.num_params(), **unigram_baselines(data, args.block_size, args.eval_windows),
               "best_iter": best["iter"], "dev_nll": dev, "test_nll": test, "tok_per_s_median_last100": None,
               "first_update_s": None}
    if curve is not None:
        summary["depth_sweep"] = {"depths": args.depth_list, "dev_nll": curve}
    for split in data.meta.get("em_splits", []):
        summary[f"exact_match_{split}"] = exact_match(model, data, split, args.em_samples, args.device, ctx)
    summary["wall_s"] = time.time() - t_start
    print_report(summary, data, args)
    return summary
