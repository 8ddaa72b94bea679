"""The synthetic-task experiments of *Enhancing Latent Computation in Transformers with Latent
Tokens* (arXiv 2505.12629, §4) at our scale: `run_one` trains latents for one task, policy and seed
and evaluates them; `pretrain` trains a tiny base on the tasks' in-distribution data (the paper
uses Llama-3.2-1B); `sweep` runs every task x method x seed and writes the results table. They are
the bodies of this module's commands:

    python -m studies.latent_experiments --base CKPT --task summation --policy Comma_2      # run
    python -m studies.latent_experiments pretrain --task all --out_dir out/latent_base      # tiny base, ~6 CPU min
    python -m studies.latent_experiments sweep --base out/latent_base/ckpt_best.pt --out_dir results/latent_tokens \\
        --n_train 1024 --epochs 3 --n_test 256 --ablate_readout

They train through latent_tokens.fit (the one training loop); pretrain writes its checkpoint
with checkpoint.save_atomic. Bad input raises UsageError (exit code 2), a non-finite loss TrainingError (1).
"""
import itertools
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

if not __package__:  # run as python studies/x.py, not python -m studies.x: find the project's modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.evaluation import eval_mode
from harness.checkpoint import clean_state_dict, save_atomic
from harness.optim import AdamW, make_optimizer
from common import ModelConfig, UsageError
from harness.cli import (FolderLock, TrainingError, UsageParser, check_decayed_rate, check_output_files,
                         check_output_folder, check_rate, check_seed, make_parent, nll_unit, repeated, run_command,
                         seed_flag, write_text)
from harness.latent_bases import load_base
from latent_tokens import (GROUPINGS, POSITION_MODES, READOUTS, LatentLM, Policy, choose, cosine_lr, evaluate, fit,
                           latent_params, parse_policy, train_latents)
from harness.tasks import TASK_ALPHABET, TASKS, CharTokenizer, encode_sample, get_task, task_tokenizer


# =============================================================================== one run

def mean_latents(augs):
    """The mean number of latent positions per augmented sample (0 for none)."""
    return float(np.mean([sum(a.is_latent) for a in augs])) if augs else 0.0


def run_one(base, tok, task, policy, groups="shared", position_mode="prepend", marker=",", seed=0,
            n_train=4096, epochs=10, batch_size=16, lr=5e-2, min_lr=5e-5, warmup=0.01,
            weight_decay=1e-4, grad_clip=1.0, n_test=1024, eval_mode="tf", levels=None, init="embedding",
            readout="latent", log=None):
    """Train latents for one (task, policy, seed) on a frozen base and evaluate every level;
    returns (record dict, LatentLM)."""
    torch.manual_seed(seed)
    rules = parse_policy(policy)
    marker_ids = tok.marker_ids(marker) if any(r.kind == "marker" for r in rules) else ()
    llm = LatentLM(base, Policy(rules, None, groups, marker_ids, readout), position_mode=position_mode, init=init)
    rng = np.random.default_rng([seed, list(TASKS).index(task.name)])
    augs = [llm.augment(*encode_sample(tok, task, task.sample(rng, "train"))) for _ in range(n_train)]
    t0 = time.time()
    losses = train_latents(llm, augs, epochs, batch_size, lr, min_lr, warmup, weight_decay, grad_clip, seed, log)
    t_train = time.time() - t0
    metrics = {lv: evaluate(llm, tok, task, lv, n_test, mode=eval_mode) for lv in levels or list(task.levels)}
    return {"task": task.name, "policy": policy, "groups": groups, "position_mode": position_mode,
            "init": init, "readout": readout, "seed": seed, "latent_vectors": int(llm.Z.shape[0] * llm.Z.shape[1]),
            "latents_per_train_sample": mean_latents(augs),
            "final_loss": float(np.mean(losses[-8:])) if losses else None,
            "train_s": round(t_train, 1), "eval_s": round(time.time() - t0 - t_train, 1),
            "metric": task.metric, "metrics": metrics}, llm


def run(args):
    """The plain command: train latents for one task and policy, print and save the result."""
    base, tok = load_base(args.base)
    task = get_task(args.task)
    t0 = time.time()
    rec, llm = run_one(base, tok, task, args.policy, args.groups, args.position_mode, args.marker, args.seed,
                       args.n_train, args.epochs, args.batch_size, args.lr, args.min_lr, args.warmup,
                       args.weight_decay, args.grad_clip, args.n_test, args.eval_mode, init=args.init,
                       readout=args.readout, log=print)
    print(f"{task.name} / {llm.policy} / {args.position_mode}: {rec['latent_vectors']} latent vectors, "
          f"{rec['latents_per_train_sample']:.1f} latents per training sample")
    for lv, v in rec["metrics"].items():
        print(f"  {'ID ' if lv in task.id_levels else 'OOD'} {lv:6s} {task.metric}: {v:.4f}")
    print(f"  ({time.time() - t0:.0f} s)")
    if args.save:
        save_atomic(latent_params(llm), make_parent(args.save))
    if args.json:
        with open(make_parent(args.json), "a") as f:
            f.write(json.dumps(rec) + "\n")


# =============================================================================== a tiny base for the tasks

def pad_rows(rows):
    """Token rows -> (x, y) (B, L) right-padded with targets -1 (the loss ignores them)."""
    L = max(len(r) for r in rows)
    x = torch.zeros(len(rows), L, dtype=torch.long)
    y = torch.full((len(rows), L), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        x[b, :len(r)] = torch.tensor(r)
        y[b, :len(r) - 1] = torch.tensor(r[1:])
    return x, y


def task_rows(cycle, n, tok, rng):
    """n encoded training samples, the tasks taking turns in the order of cycle."""
    rows = []
    for i in range(n):
        task = TASKS[cycle[i % len(cycle)]]
        rows.append(encode_sample(tok, task, task.sample(rng, "train"))[0])
    return rows


def pretrain(args):
    """Train a small base on the tasks' in-distribution data; write the task mix as text (train.txt:
    the token stream; meta.json: tokenizer kind and itos) and ckpt_best.pt with train.py's model,
    config and data entries (its "data" entry also holds itos), which --base reads (latent_bases.load_base);
    not a full train.py checkpoint (no format, args or task-tokenizer support), so sample.py and
    train.py --eval_only refuse it. Returns the checkpoint's path.

    Rows are single samples (beginning token, query, response, ending token where the task has
    one), loss on every token; harness.optim.make_optimizer (AdamW, train.py's decay groups), cosine_lr
    from --lr to 10 % after 2 % warmup, weight decay 0.1, clipping 1.0, through `fit`."""
    from models import REGISTRY, build_model
    if args.d % 32 or args.d < 32:
        raise UsageError(f"--d {args.d}: must be a multiple of 32")
    choose("vocab", args.vocab, ("task", "char"))
    if args.model not in REGISTRY:
        raise UsageError(f"--model {args.model}: choose one of {', '.join(REGISTRY)}")
    torch.manual_seed(args.seed)
    names = list(TASKS) if args.task == "all" else [get_task(t).name for t in args.task.split(",")]
    mix = args.mix or ("1,2,1" if args.task == "all" else ",".join("1" * len(names)))
    try:
        weights = [int(w) for w in mix.split(",")]
    except ValueError:
        weights = []
    if len(weights) != len(names) or min(weights) < 1:
        raise UsageError(f"--mix {args.mix}: one positive integer weight per task ({', '.join(names)})")
    # the mix, in a fixed rotation; only its first max(n_samples, n_dev) turns are ever reached, so a
    # weight beyond them (--mix 1099511627776,1) builds no more
    turns = (n for n, w in zip(names, weights) for _ in range(w))
    cycle = list(itertools.islice(turns, max(args.n_samples, args.n_dev)))
    tok = task_tokenizer() if args.vocab == "task" else CharTokenizer(TASK_ALPHABET)
    rng = np.random.default_rng(args.seed)
    rows = task_rows(cycle, args.n_samples, tok, rng)
    dev = task_rows(cycle, args.n_dev, tok, np.random.default_rng(args.seed + 1))
    block = max(len(r) for r in rows + dev)
    width = args.width or 4 * args.d
    cfg = ModelConfig(model=args.model, vocab_size=tok.vocab_size, block_size=block, n_embd=args.d,
                      n_head=args.d // 32, depth=args.depth, width=width, window=block,
                      gau_s=max(32, args.d), chunk=64)
    model = build_model(cfg)  # (bad --width / --depth raise here, before anything is written)
    unit = nll_unit(tok.kind)

    def write_data():  # with the first checkpoint: a run stopped before it leaves no folder behind
        os.makedirs(args.out_dir, exist_ok=True)
        write_text(os.path.join(args.out_dir, "train.txt"), "".join(tok.decode(r) for r in rows))
        write_text(os.path.join(args.out_dir, "meta.json"), json.dumps(
            {"tokenizer": tok.kind, "vocab_size": tok.vocab_size, "itos": tok.itos, "tasks": names,
             "mix": weights, "n_samples": args.n_samples, "seed": args.seed,
             "command": args.command}, indent=1))
    print(f"pretrain {args.model} d={args.d} depth={args.depth} width={width}: "
          f"{model.num_params():,} non-embedding params, vocab {tok.vocab_size}, rows <= {block} tokens, "
          f"{len(rows):,} samples of {', '.join(names)}")

    @torch.no_grad()
    def dev_nll():
        with eval_mode(model):
            tot, cnt = 0.0, 0
            for b in range(0, len(dev), 64):
                x, y = pad_rows(dev[b:b + 64])
                logits, _ = model(x)
                tot += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum").item()
                cnt += int((y >= 0).sum())
        return tot / cnt

    opt = make_optimizer(model, args.lr, AdamW(weight_decay=0.1))
    best, t0, path = float("inf"), time.time(), os.path.join(args.out_dir, "ckpt_best.pt")
    warm = max(1, args.steps // 50)
    batches = (pad_rows([rows[i] for i in rng.integers(len(rows), size=args.batch_size)]) for _ in range(args.steps))
    model.train()
    for it, loss in fit(lambda xy: model(*xy)[1], batches, list(model.parameters()), opt,
                        lambda s: cosine_lr(s, args.steps, args.lr, 0.1 * args.lr, warm), 1.0,
                        lambda s: f"update {s + 1}; stopped; {path if best < float('inf') else 'no checkpoint was saved'}"):
        if (it + 1) % args.eval_interval == 0 or it + 1 == args.steps:
            d, tag = dev_nll(), ""
            if not math.isfinite(d):
                raise TrainingError(f"update {it + 1}: dev NLL {d}; stopped; "
                                    + (f"the best checkpoint is {path}" if best < float("inf") else "no checkpoint was saved"))
            if d < best:
                if best == float("inf"):
                    write_data()
                best, tag = d, " (best, saved)"
                save_atomic({"model": clean_state_dict(model), "config": cfg.to_dict(),
                                   "data": {"tokenizer": tok.kind, "vocab_size": tok.vocab_size, "itos": tok.itos},
                                   "iter": it + 1, "best_dev": best, "dev_nll": d}, path)
            print(f"update {it + 1}: train loss {loss:.4f}  dev NLL {d:.4f} {unit}{tag}  ({time.time() - t0:.0f} s)",
                  flush=True)
    base, tok = load_base(path)
    llm = LatentLM(base, "none")
    for name in names:
        res = {lv: evaluate(llm, tok, TASKS[name], lv, args.n_test) for lv in TASKS[name].levels}
        print(f"frozen base on {name}: " + "  ".join(f"{lv}: {v:.3f}" for lv, v in res.items()))
    print(f"saved {path} (best dev NLL {best:.4f} {unit}); {time.time() - t0:.0f} s")
    return path


# =============================================================================== the results table

# Rows of the table per task: (policy, groups). "matched" = Start/End with as many latents as the
# paper's method inserts on average per training sample (§4.4).
PAPER_METHOD = {"generation": ("Comma_2", "shared"), "summation": ("Comma_2", "shared"),
                "repetition": ("Start_1+Comma_1", "rule")}
TABLE_HEADS = {"generation": "correct equations within a budget of N equations (N = 10 ID; 20, 40 OOD)",
               "summation": "accuracy; number of variables (5-14 ID; 15-29, 30-49 OOD)",
               "repetition": "accuracy; copies to produce s2 (1-5 ID; 6-7, 8-10 OOD)"}


def run_key(r):
    return r["policy"], r["groups"], r.get("readout", "latent")


def sweep(args, base, tok):
    """Every task x method x seed into out_dir/results_TASK.json (one file per task, so tasks can
    run as parallel processes), then the markdown table of all of them into README_table.md."""
    tasks = [get_task(t) for t in (list(TASKS) if args.tasks == "all" else args.tasks.split(","))]
    os.makedirs(args.out_dir, exist_ok=True)
    kw = dict(n_train=args.n_train, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
              min_lr=args.min_lr, warmup=args.warmup, weight_decay=args.weight_decay,
              grad_clip=args.grad_clip, n_test=args.n_test, position_mode=args.position_mode, init=args.init)
    t0 = time.time()
    for task in tasks:
        raw_path = os.path.join(args.out_dir, f"results_{task.name}.json")
        runs = read_results(raw_path) if args.resume and os.path.exists(raw_path) else []
        done = {(r["task"], *run_key(r), r["seed"]) for r in runs}
        paper, pgroups = PAPER_METHOD[task.name]
        probe = LatentLM(base, Policy(paper, None, pgroups, tok.marker_ids(",")))
        rng = np.random.default_rng([0, list(TASKS).index(task.name)])
        M = round(mean_latents([probe.augment(*encode_sample(tok, task, task.sample(rng, "train")))
                                       for _ in range(args.n_train)]))
        rows = ([("none", "shared"), ("Start_2", "shared"), ("End_2", "shared"), (paper, pgroups),
                 (f"Start_{M}", "shared"), (f"End_{M}", "shared")] + [(p, "shared") for p in args.extra])
        rows = [(p, g, args.readout) for p, g in rows]
        if args.ablate_readout:  # the paper's method with the other readout
            rows.append((paper, pgroups, "verbal" if args.readout == "latent" else "latent"))
        for policy, groups, readout in rows:
            for seed in (args.seeds if policy != "none" else args.seeds[:1]):
                if (task.name, policy, groups, readout, seed) in done:
                    continue
                rec, _ = run_one(base, tok, task, policy, groups, seed=seed, readout=readout, **kw)
                rec["row"] = ("paper" if (policy, groups) == (paper, pgroups) else
                              "matched" if policy in (f"Start_{M}", f"End_{M}") else "")
                rec["command"] = args.command
                runs.append(rec)
                print(f"[{time.time() - t0:5.0f} s] {task.name:10s} {policy:16s} {groups:6s} {readout:6s} seed {seed}: "
                      + "  ".join(f"{k} {v:.3f}" for k, v in rec["metrics"].items())
                      + f"  (train {rec['train_s']} s, eval {rec['eval_s']} s)", flush=True)
                write_text(raw_path, json.dumps(runs, indent=1))
    runs = []
    for name in TASKS:  # the table covers every task's results in out_dir
        path = os.path.join(args.out_dir, f"results_{name}.json")
        if os.path.exists(path):
            runs += read_results(path)
    table = make_table(runs)
    write_text(os.path.join(args.out_dir, "README_table.md"), table_header(args, runs) + table)
    print(table)
    return runs


def read_results(path):
    """The run records of a results_TASK.json; UsageError naming the file when it is not a list of
    records with this sweep's keys (a file cut short or written by something else)."""
    try:
        with open(path, encoding="utf-8") as f:
            runs = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a readable results file ({type(e).__name__}); delete it to run again") from None
    keys = ("task", "policy", "groups", "seed", "metrics")
    if not (isinstance(runs, list) and all(isinstance(r, dict) and all(k in r for k in keys) for r in runs)):
        raise UsageError(f"{path}: expected a list of run records ({', '.join(keys)}); delete it to run again")
    return runs


def table_header(args, runs=()):
    """The exact commands: the base's pretraining (from its meta.json, when there) and the sweeps
    that produced the runs."""
    meta_path = os.path.join(os.path.dirname(os.path.abspath(args.base)), "meta.json")
    pre = json.load(open(meta_path)).get("command") if os.path.exists(meta_path) else None
    cmds = []
    for r in runs:
        if r.get("command") and r["command"] not in cmds:
            cmds.append(r["command"])
    lines = ["Commands:", "", "```"] + ([pre] if pre else []) + (cmds or [args.command]) + ["```", ""]
    return "\n".join(lines) + "\n"


def make_table(runs):
    """Markdown: one table per task, rows = methods, columns = levels, mean ± sample std (ddof 1) over seeds."""
    lines = []
    for name, task in TASKS.items():
        rs = [r for r in runs if r["task"] == name]
        if not rs:
            continue
        levels = list(task.levels)
        lines += [f"**{name}** - {TABLE_HEADS[name]}", "",
                  "| method | latent vectors | latents / train sample | seeds | "
                  + " | ".join(f"{lv}{' (ID)' if lv in task.id_levels else ''}" for lv in levels) + " |",
                  "|---|---|---|---|" + "---|" * len(levels)]
        for k in dict.fromkeys(run_key(r) for r in rs):
            g = [r for r in rs if run_key(r) == k]
            label = k[0] if k[1] == "shared" else f"{k[0]} (groups={k[1]})"
            if k[2] != "latent":
                label += f" [readout {k[2]}]"
            if g[0].get("row") == "paper":
                label = f"**{label}** (paper's method)"
            elif g[0].get("row") == "matched":
                label += " (matched tokens)"
            if k[0] == "none":
                label = "frozen base alone"
            scale, unit = (100, "%") if task.metric == "accuracy" else (1, "")
            cells = []
            for lv in levels:
                v = np.array([r["metrics"][lv] for r in g])
                cells.append(f"{v.mean() * scale:.1f}{unit}" if len(v) == 1 else
                             f"{v.mean() * scale:.1f} ± {v.std(ddof=1) * scale:.1f}{unit}")
            lines.append(f"| {label} | {g[0]['latent_vectors']} | {g[0]['latents_per_train_sample']:.1f} | "
                         f"{len(g)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# =============================================================================== command line

def pretrain_parser():
    p = _parser("-m studies.latent_experiments pretrain", "a tiny base trained on the tasks' in-distribution data "
                                             "(writes train.txt, meta.json, ckpt_best.pt)")
    a = p.add_argument
    a("--task", default="all", help="all or a comma list of " + ", ".join(TASKS))
    a("--mix", default=None, help="integer weights per task (default 1,2,1 for all: Summation's retrieval "
                                  "needs the most updates; 1 each otherwise)")
    a("--out_dir", default="out/latent_base", help="where train.txt, meta.json and ckpt_best.pt go")
    a("--model", default="untied", help="a models.REGISTRY name")
    a("--d", type=int, default=64, help="width (multiple of 32)")
    a("--depth", type=int, default=3, help="block applications")
    a("--width", type=int, default=None, help="expansion width (default 4 d)")
    a("--steps", type=int, default=4000, help="updates")
    a("--batch_size", type=int, default=32, help="rows per update")
    a("--lr", type=float, default=6e-3, help="peak learning rate")
    a("--vocab", default="task", help="task (Llama-3-like pieces: numbers of up to 3 digits are one token) or char")
    a("--n_samples", type=int, default=30000, help="training samples written to train.txt")
    a("--n_dev", type=int, default=384, help="dev samples (best-dev checkpoint)")
    a("--n_test", type=int, default=256, help="samples per level for the final base evaluation")
    a("--eval_interval", type=int, default=500, help="updates between dev evaluations")
    a("--seed", type=seed_flag, default=0, help="torch and numpy seed")
    a("--threads", type=int, default=1, help="torch intra-op threads (1 on a shared CPU)")
    return p


def sweep_parser():
    p = _parser("-m studies.latent_experiments sweep", "the results table: every task x method x seed")
    a = p.add_argument
    _base_flags(a)
    a("--out_dir", default="out/latent_tokens", help="results_TASK.json and README_table.md go here (results/: only when named)")
    a("--tasks", default="all", help="all or a comma list of " + ", ".join(TASKS))
    a("--seeds", type=seed_flag, nargs="+", default=[0, 1, 2], help="seeds per method")
    a("--extra", nargs="*", default=[], help="more policies (shared groups) to add to every task")
    a("--resume", action="store_true", help="skip runs already in results_TASK.json")
    a("--ablate_readout", action="store_true", help="add the paper's method with the other --readout")
    _train_flags(a)
    return p


# =============================================================================== command line

def _parser(prog, description):
    return UsageParser(prog=prog, description=description)


def _base_flags(a):
    a("--base", required=True, help="a train.py-format checkpoint (ckpt_best.pt) or hf:FOLDER (a local Hugging Face model)")
    a("--threads", type=int, default=1, help="torch intra-op threads (1 on a shared CPU)")


def _train_flags(a):
    a("--n_train", type=int, default=4096, help="training samples (paper 4096)")
    a("--epochs", type=int, default=10, help="epochs (paper 10)")
    a("--batch_size", type=int, default=16, help="batch size (paper 16)")
    a("--lr", type=float, default=5e-2, help="peak learning rate (paper 5e-2)")
    a("--min_lr", type=float, default=5e-5, help="final learning rate of the cosine (paper 5e-5)")
    a("--warmup", type=float, default=0.01, help="warmup fraction (paper 1 %%)")
    a("--weight_decay", type=float, default=1e-4, help="AdamW weight decay (paper 1e-4)")
    a("--grad_clip", type=float, default=1.0, help="gradient clipping (0 = off)")
    a("--n_test", type=int, default=1024, help="test samples per level (paper 1024)")
    a("--position_mode", default="prepend", help=f"one of {', '.join(POSITION_MODES)}")
    a("--init", default="embedding", help="Z init: embedding (sampled rows of E) or normal (N(0, 0.02))")
    a("--readout", default="latent", help="latent (the last latent predicts) or verbal (paper-literal ablation)")


def parse(p, argv, cmd):
    """Parsed and checked arguments of one command; args.command is the command line as typed."""
    args = p.parse_args(argv[1:] if cmd != "run" else argv)
    args.cmd, args.command = cmd, "python -m studies.latent_experiments " + " ".join(argv)
    check_args(args)
    torch.set_num_threads(args.threads)
    return args


def run_parser():
    p = _parser("-m studies.latent_experiments", "Train latent tokens on a frozen base and evaluate them on a task")
    p.epilog = "subcommands: 'pretrain' (a tiny base for the tasks), 'sweep' (the results table); each has --help"
    a = p.add_argument
    _base_flags(a)
    a("--task", required=True, help=", ".join(TASKS))
    a("--policy", default="Comma_2", help="Start_m, End_m, Comma_m, k_m, A+B, or none (the base alone)")
    a("--groups", default="shared", help=f"{', '.join(GROUPINGS)} (function specialization)")
    a("--marker", default=",", help="Comma_m marker token")
    a("--eval_mode", default="tf", help="tf (teacher-forced greedy, exact and fast) or generate (cached decoding)")
    a("--seed", type=seed_flag, default=0, help="torch and numpy seed")
    a("--save", default=None, help="write the trained latents (Z, policy) here (default: not saved)")
    a("--json", default=None, help="append the result as one JSON line here (default: not written)")
    _train_flags(a)
    return p


def check_args(args):
    """UsageError for a value out of its range, an unknown task, policy or mode, or an output path
    that cannot be written (a missing folder is created when written), before any work. Each
    subcommand declares its own flags: a check applies where the subcommand has the flag (v)."""
    v = vars(args)
    for flag in ("n_train", "epochs", "batch_size", "n_test", "threads", "steps", "n_samples", "n_dev",
                 "eval_interval", "depth"):
        if flag in v and v[flag] < 1:
            raise UsageError(f"--{flag} {v[flag]}: must be >= 1")
    if v.get("width") is not None and args.width < 1:  # pretrain's; the default (None) is 4 d
        raise UsageError(f"--width {args.width}: must be >= 1 (leave it out for the default 4 d)")
    check_rate("--lr", args.lr)
    for flag in ("min_lr", "weight_decay", "grad_clip"):  # run and sweep (pretrain has none of them)
        if flag in v:
            check_rate(f"--{flag}", v[flag], positive=False, note=" (0 = off)" if flag == "grad_clip" else "")
    if "weight_decay" in v:
        check_decayed_rate("--lr", args.lr, args.weight_decay)
    if "warmup" in v and not 0 <= args.warmup < 1:
        raise UsageError(f"--warmup {args.warmup}: a fraction of the updates, in [0, 1)")
    if "readout" in v:
        choose("readout", args.readout, READOUTS)
    if "position_mode" in v:
        choose("position_mode", args.position_mode, POSITION_MODES)
    if args.cmd == "run":
        get_task(args.task)
        parse_policy(args.policy)
        choose("groups", args.groups, GROUPINGS)
        choose("eval_mode", args.eval_mode, ("tf", "generate"))
    if args.cmd != "run":  # pretrain's --task, sweep's --tasks: all, or a comma list (get_task names --task)
        flag = "tasks" if args.cmd == "sweep" else "task"
        value = getattr(args, flag)
        for t in ([] if value == "all" else value.split(",")):
            if t not in TASKS:
                raise UsageError(f"--{flag}: unknown task '{t}'; give all or a comma list of {', '.join(TASKS)}")
        if (twice := repeated([] if value == "all" else value.split(","))) is not None:
            raise UsageError(f"--{flag} {value}: {twice} given twice")
    for p in v.get("extra") or []:  # run's and sweep's extra policies
        parse_policy(p, flag="--extra")
    flag = "--seeds" if hasattr(args, "seeds") else "--seed"  # sweep's --seeds, run's and pretrain's --seed
    seeds = args.seeds if hasattr(args, "seeds") else [args.seed]
    for seed in seeds:
        check_seed(flag, seed)
    if len(set(seeds)) < len(seeds):  # a repeated seed would run twice and count twice in the table's mean ± std
        raise UsageError(f"{flag} {' '.join(map(str, seeds))}: each seed at most once")
    # run's output files: checked here, not after the training (an empty path given is refused, not skipped)
    check_output_files([(f"--{flag}", v[flag]) for flag in ("save", "json") if v.get(flag) is not None])
    if v.get("out_dir") is not None:  # pretrain's and sweep's output folder
        check_output_folder("--out_dir", args.out_dir)


def main(argv=None):
    """The command line: `pretrain ...`, `sweep ...` (argv[0]) or one run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in ("pretrain", "sweep"):  # each writes its --out_dir: one such command at a time there
            args = parse(pretrain_parser() if argv[0] == "pretrain" else sweep_parser(), argv, argv[0])
            held = FolderLock(args.out_dir).acquire(lambda holder: UsageError(
                f"--out_dir {args.out_dir}: another run is writing there ({holder}); wait for it to end, or give "
                "another --out_dir"))
            try:
                pretrain(args) if argv[0] == "pretrain" else sweep(args, *load_base(args.base))
            finally:
                held.release()
        else:
            run(parse(run_parser(), argv, "run"))
    except (UsageError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, UsageError) else 1)


# the flags that set how much memory the command takes: its out-of-memory line names them
SIZE_FLAGS = ("--d", "--depth", "--width", "--batch_size", "--n_train", "--n_test", "--n_samples", "--n_dev",
              "--seeds")


if __name__ == "__main__":
    run_command(main, sizes=SIZE_FLAGS)
