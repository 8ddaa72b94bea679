"""Train any registered model on a prepared dataset, evaluate its best checkpoint on test.

    python train.py --model tango --depth 8                      # CPU tier, stdlib, minutes on 2 cores
    python train.py --model loop --depth 4 --dataset dmmath
    python train.py --model tango --size 70M --block_size 2048   # one GPU: bf16 + torch.compile
    torchrun --standalone --nproc_per_node 8 train.py --model tango --size 70M   # 8 GPUs, DDP
    python train.py --model tango --depth 8 --resume             # continue out/ exactly
    python train.py --eval_only --out_dir out                    # dev/test NLL of out/ckpt_best.pt, no training

The protocol (MATH.md, "Training protocol"): AdamW, linear warmup then cosine decay, weight decay
on the weight matrices and the embedding only, gradient clipping once per update, micro-batches
with gradient accumulation. The loss of an update is the NLL summed over the scored targets of all
its micro-batches (on all processes) divided by their count. Dev NLL (nats/token) on fixed dev
windows every --eval_interval updates and after the last; the checkpoint with the lowest dev NLL is
the one evaluated on test. Throughput: median training tokens/s over the final 100 updates.

Reading order: flags (build_parser) -> set-up (setup) -> the training loop (train_loop and its
update, train_update, over the summed NLL the model returns: common.LM.head) -> the final report
(finish). Out of the story: models.py (the registry; model_config: flags -> ModelConfig),
harness/config.py (tier defaults, flag validation, processes, logging), harness/optim.py (AdamW and
the learning-rate schedule, as values), harness/datacheck.py (preparing the data once;
data.check_data checks it), harness/checkpoint.py (checkpoints and --resume), harness/evaluation.py
(NLL, exact match, the report, --eval_only), harness/cli.py (parsers, signals, atomic writes).

Errors: bad input (a flag, a data file, a checkpoint) prints one line "error: ..." on stderr and
exits 2 before anything is written to --out_dir (sizes that do not fit in memory: at the first
update, still before anything is written or removed there, resumed or not); a non-finite loss,
gradient or dev NLL stops the run with "error: ..." naming the update and the last good checkpoint
and exit code 1.

Multi-GPU (DDP; gloo on CPU, nccl on CUDA), one process per device: --gradient_accumulation_steps
counts micro-batches over all processes. Every rank draws the windows of all micro-batches of an
update from the shared data RNG and takes its own contiguous share, and the random draws inside a
step (Parcae's and RDM's depths and initial states) are seeded from (--seed, update, micro-batch)
(step_seed), so an update is the same whatever the world size. Only rank 0 prints and writes.

Debug hook: with env var TRAIN_DEBUG_DUMP=PREFIX every rank appends one JSON line per update to
PREFIX.rank<R>.jsonl: {"iter", "starts" (its train windows, per micro-batch), "param_sha256"}.
"""
import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as tdist

import data as data_mod
from common import ModelConfig, UsageError, compile_regions, host_values
from harness.checkpoint import (BEST, LATEST, check_resume, check_unfinished, load_checkpoint, overrides, restore,
                                resume_args, save_checkpoints, strip_prefixes)
from harness.cli import (TrainingError, UsageParser, add_flags, disk_full, full_disk_text, run_command, seed_flag,
                         synchronizer, values, write_text)
from harness.config import WIDTH_HELP, Dist, DebugDump, Log, autocast_ctx, check_flags, hold_run_folder, tier_default
from harness.datacheck import load_data
from harness.evaluation import (check_scored_windows, depth_sweep, eval_only, evaluate, exact_match, print_report,
                                print_sample, unigram_baselines)
from harness.optim import AdamW, Schedule, make_optimizer
from models import REGISTRY, TIERS, build_model, mismatch_reason, model_config, shared_block_models


# ----------------------------------------------------------------------------- flags

def build_parser(suppress_defaults=False):
    """The flag parser; suppress_defaults=True leaves unset flags out (to see which were given)."""
    p = UsageParser(prog="train.py", description=__doc__.split("\n")[0])

    def group(title):
        g = p.add_argument_group(title)

        def add(*names, **kw):
            if suppress_defaults:
                kw["default"] = argparse.SUPPRESS
            g.add_argument(*names, **kw)
        return add

    a = group("model")
    a("--model", default="tango", help=f"one of {', '.join(REGISTRY)}")
    a("--depth", type=int, default=8, help="K: block applications (Parcae/RDM: recurrences at evaluation)")
    a("--size", default=None, help=f"tier (width and parameter target): {', '.join(TIERS)}; "
      "default: cpu without a GPU, 70M with one")
    a("--width", type=int, default=0, help=WIDTH_HELP)
    add_flags(a, ModelConfig, tier_default)  # the model flags, as common.ModelConfig declares them
    a = group("data")
    data_mod.add_arguments(a)  # --dataset, --tokenizer, --data_dir, --data_root, --max_tokens, --hf_* ...
    a("--block_size", type=int, help="training context length T; " + tier_default("block_size"))
    a("--batch_size", type=int, help="micro-batch size (sequences per process); " + tier_default("batch_size"))
    a("--data_seed", type=seed_flag, help="data-order seed, same value = same batches; default: --seed")
    a = group("optimization")
    add_flags(a, Schedule, tier_default)  # --max_iters, --learning_rate, --warmup_iters, ... (harness/optim.py)
    a("--gradient_accumulation_steps", type=int, help="micro-batches per update, over all processes "
      "(divisible by their number); " + tier_default("gradient_accumulation_steps"))
    add_flags(a, AdamW)  # --weight_decay, ...
    a("--grad_clip", type=float, default=1.0, help="gradient norm clipping threshold")
    a("--seed", type=seed_flag, default=1337, help="model seed (initialisation, Parcae/RDM draws)")
    a = group("evaluation")
    a("--eval_interval", type=int, help="updates between dev evaluations; " + tier_default("eval_interval"))
    a("--eval_windows", type=int, help="fixed dev/test windows evaluated (non-overlapping, evenly spaced; above "
      "the split's count: all of them); " + tier_default("eval_windows"))
    a("--eval_batch_size", type=int, default=8, help="windows per evaluation forward pass")
    a("--eval_depths", default="", help="test-time depth sweep of the best checkpoint on dev, e.g. "
      f"1,2,4,8,16,32 (shared-block models: {', '.join(shared_block_models())}; depths >= 1, "
      + "".join(f"{m} >= {REGISTRY[m].min_depth}, " for m in shared_block_models() if REGISTRY[m].min_depth > 1)
      + "as --depth); default: none")
    a("--em_samples", type=int, help="dmmath: problems per split scored by exact match; " + tier_default("em_samples"))
    a("--sample_tokens", type=int, default=80, help="length of the decoded sample printed at the end")
    a = group("system")
    a("--out_dir", default="out", help="folder of log.jsonl, summary.json and the checkpoints")
    a("--resume", action="store_true", help="continue from <out_dir>/ckpt_latest.pt (default: a fresh run)")
    a("--eval_only", action="store_true", help="no training: evaluate <out_dir>/ckpt_best.pt on dev and test as the "
      "end of training does (the run's flags from the checkpoints) and print the report; writes nothing to --out_dir")
    a("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N "
      "(under torchrun: cuda:LOCAL_RANK)")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
      help="autocast dtype; auto = bfloat16 on a GPU that computes it natively (sm80+), float32 otherwise")
    a("--compile", action=argparse.BooleanOptionalAction, default=None,
      help="torch.compile each body's repeated unit once (regional); default: on for CUDA, off on CPU")
    a("--quiet", action="store_true", help="no progress bar")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def given_flags(argv=None):
    """Names of the flags given on the command line (as opposed to defaults)."""
    return set(vars(build_parser(suppress_defaults=True).parse_args(argv)))


# ----------------------------------------------------------------------------- set-up

@dataclass
class Run:
    """What a run holds once its inputs are validated. model is the LM (checkpoints, generation),
    its repeated units compiled under --compile; fwd is the model evaluation calls; train_model
    is fwd, DDP-wrapped under torchrun. it: updates done; saved_at: update of the checkpoint in
    out_dir (None: none yet); best_saved_at: update of the best checkpoint this process wrote
    (None: none); first_update_s: seconds from t_start to the end of the first update;
    resumed_at: the update this process resumed from (None: a fresh run); wall_before: seconds of
    training behind the resumed checkpoint (0 for a fresh run; None when the checkpoint predates
    that record), so wall_s() counts every process that led to this run."""
    args: argparse.Namespace
    dist: Dist
    data: data_mod.Data
    cfg: ModelConfig
    target: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    rng: np.random.Generator
    it: int = 0
    best_dev: float = math.inf
    ctx: object = None
    fwd: torch.nn.Module = None
    train_model: torch.nn.Module = None
    log: "Log" = None
    t_start: float = 0.0
    first_update_s: float = None
    saved_at: int = None
    best_saved_at: int = None
    wall_before: float = 0.0
    resumed_at: int = None

    def wall_s(self):
        """Seconds of training so far: this process's plus wall_before (this process's only if None)."""
        return (self.wall_before or 0.0) + time.time() - self.t_start

    def checkpoint_note(self):
        """What a stopped run leaves: the last good checkpoint, or that none exists yet (a fresh run
        stopped before its first update leaves out_dir as it was: Log)."""
        if self.saved_at is None and self.log is not None and self.log.pending is not None:
            return f"nothing was written to {self.args.out_dir} (a run writes there after its first update)"
        if self.saved_at is None and self.best_saved_at is not None:  # the best was written, the latest failed
            return (f"no checkpoint to resume from yet; {self.best_path} (update {self.best_saved_at}) holds the best "
                    "weights (--eval_only and sample.py read it)")
        if self.saved_at is None:
            first = min(self.args.eval_interval, self.args.max_iters)  # (train_loop's first dev evaluation)
            return f"no checkpoint exists yet (the first is written after update {first})"
        return f"the last good checkpoint is {self.latest_path} (update {self.saved_at})"

    @property
    def latest_path(self):
        return os.path.join(self.args.out_dir, LATEST)

    @property
    def best_path(self):
        return os.path.join(self.args.out_dir, BEST)


def run(args, given=frozenset()):
    """Validate, train, evaluate the best checkpoint on test; returns the summary (rank 0). --out_dir
    is held for the whole run (hold_run_folder: a second training run into it is refused)."""
    t_start = time.time()
    with contextlib.ExitStack() as held:
        r, ckpt, changed = setup(args, given, held)  # nothing written to out_dir before this returns
        r.t_start = t_start
        open_outputs(r, resumed=ckpt is not None, changed=changed)
        try:
            rates = train_loop(r)
            r.log.start_writing()  # (a no-op once an update has run) a resumed run with no updates left: log from here
            summary = finish(r, rates)
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: say what is left and how to go on (run_command prints it)
            if not r.dist.main:  # rank 0 alone knows that its save of the checkpoint finished
                raise type(e)(f"rank {r.dist.rank} stopped after update {r.it}; rank 0 names the checkpoint left") from None
            raise type(e)(f"stopped after update {r.it}; {r.checkpoint_note()}" + (
                "" if r.saved_at is None else f"; --resume --out_dir {args.out_dir} continues from it")) from None
        except Exception as e:  # a full disk under a checkpoint, the log or summary.json: one line, not a traceback
            full = disk_full(e)
            if full is None:
                raise
            raise TrainingError(f"{args.out_dir}: {full_disk_text(full)}; stopped after update {r.it}; "
                                f"{r.checkpoint_note()}") from None
        r.log.close()
    return summary


def setup(args, given, held):
    """Validate flags, data and checkpoints, hold --out_dir (held: the run's ExitStack), build the
    model and optimizer, restore a checkpoint's state. Returns (Run, checkpoint or None, resume
    overrides); UsageError on bad input; writes nothing but the hold's lock file."""
    dist = Dist.from_env()
    ckpt, changed = resume_args(args, given) if args.resume else (None, {})
    args = check_flags(args, given, dist)
    dist.start(args.device)
    held.enter_context(hold_run_folder(args.out_dir, dist))  # before data preparation: a second run stops at once
    data = load_data(args, dist)
    check_scored_windows(data, args.block_size, args.eval_windows)  # an evaluation over nothing is no number
    cfg, target = model_config(args, data.vocab_size)  # --depth, --size, ... -> ModelConfig
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    model = build_model(cfg, device=args.device)
    optimizer = make_optimizer(model, args.learning_rate, values(args, AdamW), args.device)
    r = Run(args, dist, data, cfg, target, model, optimizer, np.random.default_rng(args.data_seed))
    if ckpt is not None:
        r.best_dev = check_resume(ckpt, cfg, data, args)
        restore(ckpt, r.latest_path, model, r.optimizer, r.rng, args.device)
        check_unfinished(ckpt, args)
        r.it = r.saved_at = r.resumed_at = ckpt["iter"]
        r.wall_before = ckpt.get("wall_s")  # None for a checkpoint without it
    r.ctx = autocast_ctx(args)
    if args.compile:  # regional: each body's repeated unit (and the head) compiles once, whatever the depth
        compile_regions(model)
    r.fwd = r.train_model = model
    if dist.ddp:
        from torch.nn.parallel import DistributedDataParallel
        r.train_model = DistributedDataParallel(
            r.fwd, device_ids=[dist.local_rank] if args.device.startswith("cuda") else None)
    return r, ckpt, changed


def open_outputs(r, resumed, changed):
    """Open the log (rank 0; written from the first update on, Log), print the run's header and log
    its start event."""
    args = r.args
    r.log = log = Log(args.out_dir, r.dist, resumed_at=r.it if resumed else None, quiet=args.quiet,
                      total=args.max_iters, desc=args.model)
    n_params, err = r.model.num_params(), r.model.num_params() / r.target - 1
    reason = mismatch_reason(r.cfg, n_params, r.target)  # "" within the tolerance
    log.say(f"model {args.model}  depth {args.depth}  tier {args.size}  d={r.cfg.n_embd} heads={r.cfg.n_head} "
            f"width={r.cfg.width}  non-embedding params {n_params:,} (target {r.target:,}, {err:+.3%})"
            + ("  [--width given: not matched]" if args.width else f"  [outside 0.20 %: {reason}]" if reason else ""))
    log.say(f"data {r.data.folder}: {r.data.tokenizer} vocab {r.data.vocab_size}, "
            + ", ".join(f"{k} {v:,}" for k, v in r.data.meta["splits"].items()) + " tokens"
            + (f"; {r.dist.world} processes (DDP)" if r.dist.ddp else ""))
    if resumed:
        log.say(f"resumed from {r.latest_path} at update {r.it} (best dev {r.best_dev:.4f})" + overrides(changed))
    for note in values(args, Schedule).notes(resumed):
        log.say(note)
    log.emit(event="start", args=vars(args), config=r.cfg.to_dict(), non_embedding_params=n_params,
             unigram_dev=data_mod.unigram_entropy(r.data, "dev"), resumed_at=r.it, world_size=r.dist.world,
             resume_overrides=changed)


# ----------------------------------------------------------------------------- the training loop

def train_loop(r):
    """Updates r.it .. max_iters: sample windows -> train_update (forward, loss, backward, clip,
    step) -> log; at the fixed update counts, dev NLL and checkpoints. Returns tokens/s per update."""
    args = r.args
    def eval_at(it):  # the fixed update counts of dev evaluations (a set of them would hold max_iters / interval ints)
        return it % args.eval_interval == 0 or it == args.max_iters
    dev_starts = r.data.eval_windows("dev", args.block_size, args.eval_windows)
    schedule = values(args, Schedule)
    tokens_per_update = args.batch_size * args.gradient_accumulation_steps * args.block_size
    n_train = len(r.data.tokens("train"))
    dump = DebugDump(r.dist)
    rates = []
    pending, t_read = [], time.time()  # updates whose loss and gradient norm are not read back yet
    r.model.train()
    while r.it < args.max_iters:
        t0 = time.time()
        lr = schedule.lr_at(r.it)
        for group in r.optimizer.param_groups:
            group["lr"] = lr
        starts = [sample_starts(r.rng, n_train, args.batch_size, args.block_size)
                  for _ in range(args.gradient_accumulation_steps)]
        loss, grad_norm = train_update(r, starts)
        r.it += 1
        # the diagnostics of this update's last forward, taken now (device tensors when reads are deferred)
        diag = diagnostics(r.model, spectral=False, read=not deferred_reads(r))
        pending.append((r.it, lr, loss, grad_norm, time.time() - t0, diag))
        dump.write(r.it, r.dist.share(starts), r.model)
        if not deferred_reads(r) or r.first_update_s is None or r.it % READ_EVERY == 0 or eval_at(r.it):  # the last too
            rates += read_updates(r, pending, tokens_per_update, t_read)
            pending, t_read = [], time.time()
        if eval_at(r.it):
            eval_and_checkpoint(r, dev_starts)
            t_read = time.time()  # (pending is empty: an evaluation update is read first) not training time
    r.log.close_bar()
    return rates


READ_EVERY = 10  # CUDA: updates between reads of the loss and gradient norm (each read is a host sync)


def deferred_reads(r):
    """True on CUDA: the loss and gradient norm stay on the device and are read every READ_EVERY
    updates (the first, and before every evaluation), not every update: each read waits for the GPU.
    On CPU every update is read at once (no queue to wait for)."""
    return str(r.args.device).startswith("cuda")


def read_updates(r, pending, tokens_per_update, since):
    """Log the pending updates [(it, lr, loss, grad_norm, seconds, diagnostics)] (device tensors
    when deferred: one host sync for all) and return their tokens/s; deferred, each gets the mean
    rate over the seconds from `since` (time.time() of the last read) until the device has finished
    their work. TrainingError naming the first update whose loss or gradient norm is not finite
    (with deferred reads the run stops at most READ_EVERY updates later)."""
    rates = []
    if deferred_reads(r):
        synchronizer(r.args.device)()  # queued kernels (optimizer steps too) count before the clock stops
        elapsed = time.time() - since
    for it, lr, loss, grad_norm, secs, diag in pending:
        if deferred_reads(r):
            loss, grad_norm = check_finite(r, it, float(loss), float(grad_norm))
            secs = elapsed / len(pending)
        rates.append(tokens_per_update / secs)
        if r.first_update_s is None:
            r.log.start_writing()  # the run has trained: out_dir and its log from now on (Log)
            r.first_update_s = time.time() - r.t_start
            r.log.say(f"first update after {r.first_update_s:.1f} s from start (data, model"
                      + (", compile" if r.args.compile else "") + " included)")
        r.log.emit(event="train", iter=it, loss=loss, lr=lr, grad_norm=grad_norm, tok_per_s=rates[-1],
                   **host_values(diag))
        r.log.progress(loss=f"{loss:.3f}", tok_s=f"{rates[-1]:.0f}")
    return rates


def check_finite(r, it, loss, grad_norm):
    """(loss, grad_norm) if both are finite, else TrainingError naming update `it`."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise TrainingError(f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at update {it}; "
                            f"stopped; {r.checkpoint_note()}")
    return loss, grad_norm


def train_update(r, starts):
    """One optimizer update over this rank's share of the micro-batches (starts: one array of
    window offsets per micro-batch). Loss = summed NLL of the scored targets of every micro-batch
    of every rank / their count (an update with none has loss 0 and zero gradients). Returns that
    loss and the gradient norm before clipping (floats; on CUDA 0-dim device tensors that train_loop
    reads later, see deferred_reads); TrainingError if either is not finite (on CUDA when read)."""
    args, dist = r.args, r.dist
    first = dist.share(list(range(len(starts))))[0]  # global index of this rank's first micro-batch
    every = [r.data.window_batch("train", s, args.block_size) for s in starts]  # every rank's micro-batches
    # counted on the CPU over all ranks' windows (each rank draws them all): no device round trip
    n_scored = max(float(sum(int((y != -1).sum()) for _, y in every)), 1.0)
    batches = [(x.to(args.device, non_blocking=True), y.to(args.device, non_blocking=True))
               for x, y in dist.share(every)]
    scale = dist.world / n_scored  # DDP averages gradients over ranks: undo that
    nll_sum = torch.zeros((), dtype=torch.float64, device=args.device)
    for j, (x, y) in enumerate(batches):
        seed_random_draws(r.model, args.seed, r.it, first + j)
        sync = j == len(batches) - 1  # gradients are all-reduced on the last micro-batch only
        with contextlib.nullcontext() if sync or not dist.ddp else r.train_model.no_sync():
            with r.ctx:
                _, nll = r.train_model(x, y, reduction="sum")  # summed NLL of the scored targets (common.LM.head)
            (nll * scale).backward()
        nll_sum += nll.detach().double()
    dist.all_sum(nll_sum)
    grad_norm = torch.nn.utils.clip_grad_norm_(r.model.parameters(), args.grad_clip)
    if deferred_reads(r):  # read later by train_loop (read_updates): no host sync here
        loss = nll_sum / n_scored
    else:
        loss, grad_norm = check_finite(r, r.it + 1, float(nll_sum) / n_scored, float(grad_norm))
    r.optimizer.step()
    r.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def eval_and_checkpoint(r, dev_starts):
    """Dev NLL after update r.it; rank 0 then writes the best checkpoint if it improved and the latest."""
    args = r.args
    dev = evaluate(r.fwd, r.data, "dev", dev_starts, args.block_size, args.eval_batch_size, args.device,
                   r.ctx, r.dist)
    if not math.isfinite(dev):
        raise TrainingError(f"non-finite dev NLL ({dev}) after update {r.it}; stopped; {r.checkpoint_note()}")
    improved = dev < r.best_dev
    r.best_dev = min(r.best_dev, dev)
    r.log.emit(event="eval", iter=r.it, dev_nll=dev, best=improved, **diagnostics(r.model, spectral=True))
    r.log.say(f"update {r.it}: dev NLL {dev:.4f}" + (" (best)" if improved else ""))
    if r.dist.main:
        save_checkpoints(r, dev, improved)  # checkpoint.py: ckpt_best.pt (if improved), ckpt_latest.pt


def sample_starts(rng, n_tokens, batch_size, block_size):
    """Start offsets of one training micro-batch: the same draw as data.Data.train_batch."""
    return rng.integers(0, n_tokens - block_size, size=batch_size)


def step_seed(seed, update, micro_batch):
    """The seed of the random draws of one micro-batch (Parcae's and RDM's recurrence depths and
    initial states, PonderLM-2's N): a function of the run's --seed, the update (0-based) and the
    micro-batch's global index in the update only, so any world size or resume point draws the same.
    Another split of the update (--batch_size x --gradient_accumulation_steps) makes other
    micro-batches, so other draws."""
    return int(np.random.SeedSequence([seed, update, micro_batch]).generate_state(1, np.uint64)[0] >> 1)


def seed_random_draws(model, seed, update, micro_batch):
    """Point every module that draws random numbers in training (an attribute rng_seed) at
    step_seed(seed, update, micro_batch)."""
    s = step_seed(seed, update, micro_batch)
    for m in model.modules():
        if hasattr(m, "rng_seed"):
            m.rng_seed = s


def diagnostics(model, spectral, read=True):
    """The looped models' training diagnostics of the last forward (Parcae, RDM: recurrent state
    norm per step, max Abar, spectral norms when spectral=True), as {"diag": {...}} for the log;
    {} for other models. read=False leaves them as device tensors (no host sync; host_values reads them)."""
    fn = getattr(model.body, "diagnostics", None)
    return {"diag": fn(spectral=spectral, read=read)} if fn is not None else {}


# ----------------------------------------------------------------------------- the final report

def finish(r, rates):
    """Evaluate the best-dev checkpoint on test (sharded over ranks); rank 0 adds exact match,
    writes summary.json and prints the report. Returns the summary (None on other ranks)."""
    args, data, model = r.args, r.data, r.model
    best = load_checkpoint(r.best_path) if r.dist.main else None
    if best is not None:
        model.load_state_dict(strip_prefixes(best["model"]))
    if r.dist.ddp:  # rank 0 read the file; every rank evaluates its weights
        for t in model.state_dict().values():
            tdist.broadcast(t, 0)
    test_starts = data.eval_windows(data.test_split, args.block_size, args.eval_windows)
    test = evaluate(model, data, data.test_split, test_starts, args.block_size, args.eval_batch_size,
                    args.device, r.ctx, r.dist)
    dev_starts = data.eval_windows("dev", args.block_size, args.eval_windows)
    dev_nll = lambda: evaluate(model, data, "dev", dev_starts, args.block_size, args.eval_batch_size, args.device,
                               r.ctx, r.dist)
    # a best checkpoint written before a resume with another --dtype recorded its dev NLL in that
    # dtype: recompute it in this one, so dev and test share the dtype --eval_only uses (the last run's)
    was = [best["args"].get("dtype") if best is not None and isinstance(best.get("args"), dict) else None]
    if r.dist.ddp:
        tdist.broadcast_object_list(was, 0)
    dev = best["dev_nll"] if best is not None else None
    if was[0] not in (None, args.dtype):
        dev = dev_nll()
    curve = None
    if args.depth_list:  # --eval_depths: dev NLL of the best checkpoint at other recurrence counts
        curve = depth_sweep(model, args.depth_list, dev_nll)
        r.log.emit(event="depth_sweep", depths=args.depth_list, dev_nll=curve)
    if not r.dist.main:
        return None
    tokens_per_update = args.batch_size * args.gradient_accumulation_steps * args.block_size
    summary = {"model": args.model, "depth": args.depth, "size": args.size, "dataset": args.dataset,
               "width": r.cfg.width, "non_embedding_params": model.num_params(), "params": model.num_params(False),
               "best_iter": best["iter"], "dev_nll": dev, "test_split": data.test_split,
               "tokenizer": data.tokenizer,
               "test_nll": test, **unigram_baselines(data, args.block_size, args.eval_windows),
               "tokens": best["iter"] * tokens_per_update,
               "tok_per_s_median_last100": float(np.median(rates[-100:])) if rates else None,
               "tok_per_s_updates": len(rates[-100:]),
               "seed": args.seed, "data_seed": args.data_seed, "world_size": r.dist.world,
               "first_update_s": r.first_update_s, "wall_s": r.wall_s(), "resumed_at": r.resumed_at}
    if r.wall_before is None:  # a checkpoint without wall_s: the time before the resume is unknown
        summary["wall_s_this_process_only"] = True
    if curve is not None:
        summary["depth_sweep"] = {"depths": args.depth_list, "dev_nll": curve}
    for split in data.meta.get("em_splits", []):
        summary[f"exact_match_{split}"] = exact_match(model, data, split, args.em_samples, args.device, r.ctx)
    r.log.emit(event="summary", **summary)
    # atomic: sweep.py takes a run with summary.json as finished
    write_text(os.path.join(args.out_dir, "summary.json"), json.dumps(summary, indent=1))
    print_report(summary, data, args)
    print_sample(model, data, args, args.device, r.ctx)
    return summary


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    code = 0
    try:
        args = parse_args(argv)
        (eval_only if args.eval_only else run)(args, given_flags(argv))
    except (UsageError, TrainingError) as e:
        code = 2 if isinstance(e, UsageError) else 1
        if Dist.from_env_quiet().main:
            print(f"error: {e}", file=sys.stderr)
    finally:
        if tdist.is_available() and tdist.is_initialized():
            tdist.destroy_process_group()
    if code:
        sys.exit(code)


# the flags that set how much memory the command takes: its out-of-memory line names them
SIZE_FLAGS = ("--size", "--depth", "--width", "--batch_size", "--block_size", "--eval_batch_size")


if __name__ == "__main__":
    run_command(main, sizes=SIZE_FLAGS)
