"""ReFlux experiments: load a frozen Transformer++ checkpoint, evaluate ReFlux against it, calibrate
the router, and the command line of `python -m studies.reflux_cli` (one run) and `python -m studies.reflux_cli sweep` (edges
x α x β per schedule, then the router). The model (write operator, schedules, router, ReFluxBody)
and its equations are in reflux.py; this module holds what drives it on real data, so that reflux.py
reads as the method alone. Bad input raises UsageError (cli: one line "error: ..." on stderr, exit code 2).
"""
import argparse
import contextlib
import inspect
import json
import math
import os
import sys
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

if not __package__:  # run as python studies/x.py, not python -m studies.x: find the project's modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import data as data_mod
from harness.checkpoint import load_checkpoint, load_weights, no_checkpoint
from common import UsageError
from harness.cli import (UsageParser, check_output_file, check_output_folder, check_rate, check_seed, make_parent,
                         nll_unit, repeated, run_command, seed_flag, write_text)
from harness.datacheck import data_signature, same_data
from harness.evaluation import eval_mode, evaluate
from reflux import (SCHEDULES, Router, Settings, all_edges, default_edge, is_transformer_pp, parse_edge, recirc,
                    reflux_lm)
from sample import CheckpointTokenizer
from harness.cli import TrainingError

# =============================================================================== loading, evaluation, router training

def load(path, data_root=None):
    """(frozen base LM, data.Data of its training run, checkpoint args) from a train.py checkpoint.
    The dataset is found (or prepared) from the checkpoint's data flags; data_root overrides the
    folder it was cached in. UsageError for anything unusable."""
    ck = load_checkpoint(path, keys=("model", "config", "data"), flag="--base")
    from models import build_model, checkpoint_config
    cfg = checkpoint_config(ck["config"], f"--base {path}")
    if not is_transformer_pp(cfg.model):
        raise UsageError(f"--base {path}: ReFlux needs a Transformer++ checkpoint (untied or loop), not '{cfg.model}'")
    saved = ck.get("args") if isinstance(ck.get("args"), dict) else {}
    if "dataset" not in saved:  # e.g. latent_tokens.py pretrain's base: its data would be taken for stdlib
        raise UsageError(f"--base {path}: not a train.py checkpoint (it records no --dataset, so the data it was "
                         "trained on is unknown); ReFlux evaluates a train.py run's ckpt_best.pt")
    base = build_model(cfg)
    load_weights(ck, f"--base {path}", base)
    base.eval()
    p = argparse.ArgumentParser()
    data_mod.add_arguments(p.add_argument)
    dargs = p.parse_args([])
    for k, v in saved.items():
        if hasattr(dargs, k):
            setattr(dargs, k, v)
    dargs.num_proc = 1
    if data_root is not None:
        dargs.data_root = data_root
    data = data_mod.Data(data_mod.prepare(dargs.dataset, dargs.data_dir, dargs.data_root, **data_mod.flag_options(dargs)))
    data_mod.check_data(data)
    if not same_data(ck["data"], data):
        raise UsageError(f"--base {path}: trained on other data than {data.folder} (tokenizer, vocabulary, "
                         f"split sizes or tokens differ); give --data_root where its dataset was prepared")
    data.check_block_size(cfg.block_size)
    return base, data, saved


def nll(model, data, split, n_windows, T, batch_size=16):
    """Mean NLL (nats/token) of model on train.py's fixed windows of split (evaluation.evaluate)."""
    starts = data.eval_windows(split, T, n_windows)
    return evaluate(model, data, split, starts, T, batch_size, "cpu", contextlib.nullcontext())


@torch.no_grad()
def grid_nll(base, data, split, n_windows, T, settings, alphas, betas, batch_size=16):
    """{(α, β): mean NLL (nats/token)} of one schedule and edge set over the α x β grid, as
    nll(reflux_lm(base, replace(settings, alpha=α, beta=β)), ...) computes each, but with every grid
    point's copy of a batch of windows in one forward (rows carry their own α, β): the per-token
    stream recurrence runs once per batch instead of once per grid point. Per-window NLL sums in
    float64, reduced in window order, as evaluation.evaluate."""
    combos = [(al, be) for al in alphas for be in betas]
    if any(al <= 0 for al in alphas):
        raise UsageError(f"--alphas {alphas}: a grid needs alpha > 0 (alpha <= 0 is the base itself)")
    view = reflux_lm(base, replace(settings, alpha=max(alphas)))
    starts = data.eval_windows(split, T, n_windows)
    sums = np.zeros((len(combos), len(starts)))
    counts = np.zeros(len(starts))
    with eval_mode(view):
        for i in range(0, len(starts), batch_size):
            x, y = data.window_batch(split, starts[i:i + batch_size], T)
            B, C = x.shape[0], len(combos)
            view.body.alpha = torch.tensor([al for al, _ in combos]).repeat_interleave(B)[:, None, None]
            view.body.beta = torch.tensor([be for _, be in combos]).repeat_interleave(B)[:, None, None]
            logits, _ = view(x.repeat(C, 1))
            ce = F.cross_entropy(logits.float().flatten(0, 1), y.repeat(C, 1).flatten(), ignore_index=-1,
                                 reduction="none").view(C, B, T).double().sum(-1)
            sums[:, i:i + B] = ce.numpy()
            counts[i:i + B] = (y != -1).sum(1).double().numpy()
    total = max(float(counts.sum()), 1.0)
    return {c: float(sums[j].sum()) / total for j, c in enumerate(combos)}


def train_router(base, router, data, T, max_iters=200, batch_size=8, lr=1e-3, lam=1e-3, seed=0, log=None):
    """Calibrate the router with the backbone frozen: soft gates under sync, loss = NLL + λ mean(g)
    (nats/token), AdamW (weight decay 0.1 on W_1, W_2; none on c, a), random train windows drawn
    from np.random.default_rng(seed). Returns the list of losses; TrainingError when the loss, the
    mean gate or a router parameter is not finite (the run then reports nothing)."""
    torch.manual_seed(seed)
    view = reflux_lm(base, Settings(schedule="sync"), router)
    opt = torch.optim.AdamW([{"params": [router.w1.weight, router.w2.weight], "weight_decay": 0.1},
                             {"params": [router.c, router.a], "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    rng, losses = np.random.default_rng(seed), []
    base.eval()
    router.train()
    try:
        for it in range(max_iters):
            x, y = data.train_batch(rng, batch_size, T)
            _, loss = view(x, y)
            total = loss + lam * view.body.mean_gate
            opt.zero_grad(set_to_none=True)
            total.backward()
            opt.step()
            losses.append(float(loss.detach()))
            gate = float(view.body.mean_gate.detach())
            if not (math.isfinite(losses[-1]) and math.isfinite(gate)
                    and all(bool(torch.isfinite(p).all()) for p in router.parameters())):
                raise TrainingError(f"router training: non-finite loss ({losses[-1]}), mean gate ({gate}) or router "
                                    f"parameters at update {it}; try a smaller --lr (now {lr:g})")
            if log and (it % 50 == 0 or it == max_iters - 1):
                log(f"  router update {it}: NLL {losses[-1]:.4f}, mean gate {gate:.3f}")
    finally:
        router.eval()
    return losses


# =============================================================================== command line

# the router's flags: ignored without --router (sweep: with --no_router), so refused there
ROUTER_FLAGS = ("block", "xi", "router_rank", "alpha_max", "max_iters", "router_batch", "lr", "lam", "seed")
ALPHA_INIT = inspect.signature(Router).parameters["alpha_init"].default  # the router's initial α_e (0.2)


def _common(add):
    add("--base", required=True, help="a train.py checkpoint of an untied or loop Transformer++")
    add("--data_root", default=None, help="where its dataset is prepared (default: the checkpoint's)")
    add("--split", default="dev", help="dev, or test (the dataset's test split)")
    add("--eval_windows", type=int, default=None, help="fixed windows evaluated, >= 1 (default: the checkpoint's)")
    add("--batch_size", type=int, default=16, help="windows per evaluation batch")
    add("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add("--block", type=int, default=None, help="router block length w, 1 <= w < block_size (default: block_size / 8)")
    add("--xi", type=float, default=0.6, help="router threshold ξ (open iff gate >= ξ)")
    add("--router_rank", type=int, default=64, help="router hidden width r")
    add("--alpha_max", type=float, default=0.5, help=f"router α_e = alpha_max sigmoid(a_e), in ({ALPHA_INIT}, 1]")
    add("--max_iters", type=int, default=200, help="router training updates")
    add("--router_batch", type=int, default=8, help="router training windows per update")
    add("--lr", type=float, default=1e-3, help="router learning rate (AdamW)")
    add("--lam", type=float, default=1e-3, help="λ of the gate penalty λ mean(g)")
    add("--seed", type=seed_flag, default=0, help="router init and training windows")
    add("--json", default=None, help="write the results here as JSON")


def build_parser(sweep, suppress_defaults=False):
    """The parser of one run (sweep=False) or of the sweep subcommand; suppress_defaults leaves
    unset flags out (to see which were given)."""
    p = UsageParser(prog="-m studies.reflux_cli" + (" sweep" if sweep else ""),
                    description="ReFlux on a frozen Transformer++ checkpoint: dev NLL of the base and of ReFlux.")
    if not sweep:
        p.epilog = ("subcommand: 'sweep' (edges x α x β per schedule, then the router; "
                    "python -m studies.reflux_cli sweep --help)")

    def add(*names, **kw):
        if suppress_defaults:
            kw["default"] = argparse.SUPPRESS
        p.add_argument(*names, **kw)

    _common(add)
    if sweep:
        add("--schedules", default=",".join(SCHEDULES), help="comma-separated schedules")
        add("--edges", default="all", help="all, or comma-separated S:D")
        add("--alphas", default="0.05,0.1,0.2,0.3", help="comma-separated α, each in (0, 1]")
        add("--betas", default="0.9,1.0", help="comma-separated β, each in [0, 1]")
        add("--no_router", action="store_true", help="skip the router (edges only)")
    else:
        add("--schedule", default="stream", help="sync, stream2 or stream")
        add("--edge", action="append", default=None, help="S:D (repeatable; default floor(0.6K):floor(0.3K))")
        add("--alpha", type=float, default=None, help="write strength α in (0, 1] (default 0.2; --recirc 0.15)")
        add("--beta", type=float, default=0.9, help="write β in [0, 1] (--recirc: 1 - α)")
        add("--no_preserve_norm", action="store_true", help="no norm restore after the write")
        add("--payload", default="delta", help="delta (z_s - z_d) or state (z_s)")
        add("--recirc", action="store_true", help="recirculation baseline: payload state, β = 1 - α, no restore")
        add("--router", action="store_true", help="train the router (backbone frozen) and evaluate it")
        add("--prefill", default="parallel", help="stream's prompt in --sample: parallel or strict")
        add("--sample", type=int, default=0, help="also generate this many tokens greedily")
        add("--prompt", default="def ", help="the --sample prompt")
    return p


def check_alpha(flag, v):
    """UsageError unless α is in (0, 1]: α <= 0 writes nothing (the base itself, reflux.write), and
    above 1 the written payload (at the stream's norm) outweighs the stream (recirculation's
    β = 1 - α would be negative)."""
    if not 0 < v <= 1:
        why = "α <= 0 writes nothing: the base itself" if v <= 0 else "above 1 the payload outweighs the stream"
        raise UsageError(f"{flag} {v:g}: must lie in (0, 1] ({why})")


def check_beta(flag, v):
    """UsageError unless β is in [0, 1]: the share of the stream h the write keeps (β h)."""
    if not 0 <= v <= 1:
        raise UsageError(f"{flag} {v:g}: must lie in [0, 1] (the share β of the stream the write keeps)")


def parse(argv):
    sweep = argv[:1] == ["sweep"]
    argv = argv[1:] if sweep else argv
    a = build_parser(sweep).parse_args(argv)
    given = set(vars(build_parser(sweep, suppress_defaults=True).parse_args(argv)))
    a.sweep = sweep
    for flag in ("batch_size", "router_rank", "max_iters", "router_batch"):
        if getattr(a, flag) < 1:
            raise UsageError(f"--{flag} {getattr(a, flag)}: must be >= 1")
    for flag in ("eval_windows", "block"):  # None: the checkpoint's count, block_size / 8
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            raise UsageError(f"--{flag} {getattr(a, flag)}: must be >= 1 (leave it out for the default)")
    for flag in ("threads",) + (() if sweep else ("sample",)):
        if getattr(a, flag) < 0:
            raise UsageError(f"--{flag} {getattr(a, flag)}: must be >= 0")
    check_seed("--seed", a.seed)
    if not 0 < a.xi < 1:
        raise UsageError(f"--xi {a.xi}: must lie in (0, 1)")
    check_rate("--lr", a.lr)
    if not 0 < a.alpha_max < math.inf:
        raise UsageError(f"--alpha_max {a.alpha_max}: must be a finite number > 0")
    if not ALPHA_INIT < a.alpha_max <= 1:  # the router's α_e start at 0.2 and stay below alpha_max
        raise UsageError(f"--alpha_max {a.alpha_max:g}: must lie in ({ALPHA_INIT}, 1] (the router's α_e start at "
                         f"{ALPHA_INIT} and stay below it)")
    if not 0 <= a.lam < math.inf:  # 0: no gate penalty
        raise UsageError(f"--lam {a.lam}: must be a finite number >= 0")
    if sweep:
        a.schedules = [s for s in a.schedules.split(",") if s]
        if not a.schedules:  # an empty grid would print the base alone
            raise UsageError(f'--schedules "": give one or more of {", ".join(SCHEDULES)}')
        if a.edges != "all" and not [e for e in a.edges.split(",") if e]:
            raise UsageError(f'--edges "{a.edges}": give all, or comma-separated S:D')
        for s in a.schedules:
            if s not in SCHEDULES:
                raise UsageError(f"--schedules {s}: choose from {', '.join(SCHEDULES)}")
        a.alphas, a.betas = _floats(a.alphas, "--alphas"), _floats(a.betas, "--betas")
        lists = {"schedules": a.schedules, "edges": [] if a.edges == "all" else [e for e in a.edges.split(",") if e],
                 "alphas": a.alphas, "betas": a.betas}
        for flag, items in lists.items():
            if (twice := repeated(items)) is not None:
                raise UsageError(f"--{flag}: {twice} given twice")
        for v in a.alphas:
            check_alpha("--alphas", v)
        for v in a.betas:
            check_beta("--betas", v)
        router = not a.no_router
    else:
        if a.alpha is not None:
            check_alpha("--alpha", a.alpha)
        check_beta("--beta", a.beta)
        if a.recirc and a.payload != "delta":
            raise UsageError("--recirc: sets --payload state itself; drop --payload")
        if a.edge and (twice := repeated(a.edge)) is not None:  # one write per edge: a repeat is not a second
            raise UsageError(f"--edge {twice}: given twice")
        if a.router and (a.edge or a.recirc):
            flag = "--edge" if a.edge else "--recirc"
            raise UsageError(f"{flag}: not used with --router, which gates every pair (s, d) itself; drop {flag}")
        Settings(schedule=a.schedule, payload=a.payload, prefill=a.prefill).check(1)
        router = a.router
        ignored = {"alpha": "without --router (the router learns each edge's α)" if a.router else None,
                   "beta": "without --recirc (which sets β = 1 - α)" if a.recirc else None,
                   "no_preserve_norm": "without --recirc (which never restores the norm)" if a.recirc else None,
                   "prompt": "with --sample" if not a.sample else None,
                   "prefill": "with --schedule stream and --sample" if not (a.sample and a.schedule == "stream")
                   else None}
        for flag in sorted(f for f, rule in ignored.items() if rule and f in given):
            raise UsageError(f"--{flag}: only used {ignored[flag]}; drop --{flag}")
        if a.sample and not a.prompt:  # generate needs a token to continue from
            raise UsageError('--prompt "": give at least one character for --sample to continue')
    for flag in (f for f in ROUTER_FLAGS if f in given and not router):
        need = "without --no_router" if sweep else "with --router"
        raise UsageError(f"--{flag}: only used {need} (a router flag); drop --{flag}")
    if not os.path.isfile(a.base):
        raise no_checkpoint("--base", a.base)
    if a.data_root is not None:  # load prepares the dataset there when it is not
        check_output_folder("--data_root", a.data_root, probe=False)  # data.prepare probes it before writing
    if a.json is not None:  # (an empty path given is refused, not skipped)
        check_output_file("--json", a.json)
    return a


def _floats(text, flag):
    try:
        out = [float(v) for v in text.split(",") if v]
    except ValueError:
        raise UsageError(f"{flag} {text}: comma-separated numbers") from None
    if not out or not all(math.isfinite(v) for v in out):
        raise UsageError(f"{flag} {text}: need finite numbers")
    return out


def _setup(a):
    if a.threads:
        torch.set_num_threads(a.threads)
    base, data, saved = load(a.base, a.data_root)
    if base.cfg.depth < 2:
        raise UsageError(f"--base {a.base}: a ReFlux edge joins two blocks (source S > target D); "
                         f"this base has {base.cfg.depth}")
    split = data.test_split if a.split == "test" else a.split
    if split not in ("dev", data.test_split):
        raise UsageError(f"--split {a.split}: dev or test")
    n = a.eval_windows or int(saved.get("eval_windows") or 32)
    T = base.cfg.block_size
    w = a.block or max(1, T // 8)
    if a.block is not None and w >= T:  # the router decides block b+1 from block b: a window must hold at least two blocks
        raise UsageError(f"--block {w}: must be < the base's block_size {T} (with one block per window every gate "
                         "comes from the constant part alone)")
    return base, data, split, n, T, w


def _router(a, base, data, T, w, log):
    torch.manual_seed(a.seed)
    router = Router(base.cfg.n_embd, base.cfg.depth, a.router_rank, w, a.xi, a.alpha_max)
    t0 = time.time()
    losses = train_router(base, router, data, T, a.max_iters, a.router_batch, a.lr, a.lam, a.seed, log)
    return router, {"router_params": sum(p.numel() for p in router.parameters()), "train_s": time.time() - t0,
                    "first_loss": losses[0], "last_loss": losses[-1], "block": w, "xi": a.xi, "rank": a.router_rank,
                    "max_iters": a.max_iters, "lr": a.lr, "lam": a.lam}


def run_one(a, log=print):
    base, data, split, n, T, w = _setup(a)
    K = base.cfg.depth
    edges = tuple(parse_edge(e, K) for e in a.edge) if a.edge else (default_edge(K),)
    if a.recirc:
        s = recirc(0.15 if a.alpha is None else a.alpha, schedule=a.schedule, edges=edges, prefill=a.prefill)
    else:
        s = Settings(a.schedule, edges, 0.2 if a.alpha is None else a.alpha, a.beta, not a.no_preserve_norm,
                     a.payload, a.prefill)
    s.check(K)
    # sample.py's check: a character outside the vocabulary is refused, not sampled from the unknown id
    prompt = (CheckpointTokenizer(data_signature(data), f"--base {a.base}").encode(a.prompt, "--prompt")
              if a.sample else None)
    router, info = None, {}
    if a.router:
        log(f"training the router ({a.max_iters} updates, sync, soft gates; backbone frozen)")
        router, info = _router(a, base, data, T, w, log)
    view = reflux_lm(base, s, router)
    t0 = time.time()
    base_nll = nll(base, data, split, n, T, a.batch_size)
    t1 = time.time()
    if router is not None:
        router.reset_stats()
    rf_nll = nll(view, data, split, n, T, a.batch_size)
    t2 = time.time()
    what = "router" if router is not None else ("recirc " if a.recirc else "") + " ".join(f"{x}:{y}" for x, y in edges)
    res = {"base": a.base, "split": split, "windows": n, "block_size": T, "schedule": s.schedule, "edges": what,
           "alpha": s.alpha, "beta": s.beta, "preserve_norm": s.preserve_norm, "payload": s.payload,
           "base_nll": base_nll, "reflux_nll": rf_nll, "change": rf_nll - base_nll,
           "base_eval_s": t1 - t0, "reflux_eval_s": t2 - t1, **info}
    if router is not None:
        res["kappa"] = router.kappa()
    extra = f"  (κ = {res['kappa']:.2f} open edges per block)" if router is not None else ""
    log(f"{split} NLL over {n} windows of {T} tokens ({nll_unit(data.tokenizer)}):  base {base_nll:.4f}   "
        f"ReFlux {s.schedule} [{what}{'' if router else f', α {s.alpha:g} β {s.beta:g}'}] {rf_nll:.4f}   "
        f"change {rf_nll - base_nll:+.4f}{extra}")
    if a.sample:
        prompt = torch.tensor([prompt], dtype=torch.long)
        with eval_mode(view), eval_mode(base):
            out_b = base.generate(prompt, a.sample, temperature=0)
            out_r = view.generate(prompt, a.sample, temperature=0)
        res["sample_base"], res["sample_reflux"] = data.decode(out_b[0].tolist()), data.decode(out_r[0].tolist())
        log(f"--- greedy sample, base ---\n{res['sample_base']}\n--- greedy sample, ReFlux ---\n{res['sample_reflux']}")
    return res


def run_sweep(a, log=print):
    """Edges x α x β for each schedule (dev NLL change against the base), then the router (hard
    gates, each schedule) against the best single edge of that schedule; the chosen
    configurations are also evaluated on the test split."""
    base, data, split, n, T, w = _setup(a)
    K = base.cfg.depth
    edges = all_edges(K) if a.edges == "all" else [parse_edge(e, K, "--edges") for e in a.edges.split(",") if e]
    test = data.test_split
    t_start = time.time()
    base_nll = {split: nll(base, data, split, n, T, a.batch_size), test: nll(base, data, test, n, T, a.batch_size)}
    log(f"base: {split} {base_nll[split]:.4f}, {test} {base_nll[test]:.4f} {nll_unit(data.tokenizer)} ({n} windows of {T})")
    grid = []
    for sched in a.schedules:
        t0 = time.time()
        for e in edges:
            res = grid_nll(base, data, split, n, T, Settings(sched, (e,)), a.alphas, a.betas, a.batch_size)
            for (al, be), v in res.items():
                grid.append({"schedule": sched, "edge": f"{e[0]}:{e[1]}", "alpha": al, "beta": be,
                             "nll": v, "change": v - base_nll[split]})
        best = min((r for r in grid if r["schedule"] == sched), key=lambda r: r["nll"])
        log(f"{sched}: {len(edges) * len(a.alphas) * len(a.betas)} settings in {time.time() - t0:.0f} s; best "
            f"{best['edge']} α {best['alpha']:g} β {best['beta']:g}: {best['nll']:.4f} ({best['change']:+.4f})")
    best = {}
    for sched in a.schedules:
        b = min((r for r in grid if r["schedule"] == sched), key=lambda r: r["nll"])
        e = parse_edge(b["edge"], K)
        tv = nll(reflux_lm(base, Settings(sched, (e,), b["alpha"], b["beta"])), data, test, n, T, a.batch_size)
        best[sched] = {**b, "test_nll": tv, "test_change": tv - base_nll[test]}
    recirc_rows = []
    for sched in a.schedules:
        if sched == "stream":
            continue
        for e in edges:
            v = nll(reflux_lm(base, recirc(0.15, schedule=sched, edges=(e,))), data, split, n, T, a.batch_size)
            recirc_rows.append({"schedule": sched, "edge": f"{e[0]}:{e[1]}", "alpha": 0.15, "nll": v,
                                "change": v - base_nll[split]})
    router_res = None
    if not a.no_router:
        log(f"router: training {a.max_iters} updates (sync, soft gates), w = {w}, ξ = {a.xi}")
        router, info = _router(a, base, data, T, w, log)
        router_res = {**info, "per_schedule": {}}
        for sched in a.schedules:
            view = reflux_lm(base, Settings(sched), router)
            out = {}
            for sp in (split, test):
                router.reset_stats()
                v = nll(view, data, sp, n, T, a.batch_size)
                out[sp] = {"nll": v, "change": v - base_nll[sp], "kappa": router.kappa()}
            router_res["per_schedule"][sched] = out
            log(f"router {sched}: {split} {out[split]['nll']:.4f} ({out[split]['change']:+.4f}, κ {out[split]['kappa']:.2f}); "
                f"best single edge {best[sched]['nll']:.4f} ({best[sched]['change']:+.4f})")
    return {"base": a.base,
            "split": split, "test_split": test, "windows": n, "block_size": T, "depth": K, "base_nll": base_nll,
            "grid": grid, "best_single_edge": best, "recirc": recirc_rows, "router": router_res,
            "wall_s": time.time() - t_start, "threads": torch.get_num_threads()}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse(argv)
    res = run_sweep(a) if a.sweep else run_one(a)
    res["command"] = "python -m studies.reflux_cli " + " ".join(argv)
    if a.json:
        write_text(make_parent(a.json), json.dumps(res, indent=1))
        print(f"wrote {a.json}")
    return res


def cli(argv=None):
    """main() for the command line: bad input prints one line "error: ..." on stderr and exits 2."""
    try:
        main(argv)
    except (UsageError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, UsageError) else 1)


# the flags that set how much memory the command takes: its out-of-memory line names them
SIZE_FLAGS = ("--batch_size", "--eval_windows", "--router_batch", "--sample")


if __name__ == "__main__":
    run_command(cli, sizes=SIZE_FLAGS)
