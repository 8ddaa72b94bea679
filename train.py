"""Train any registered model on a prepared dataset (SPEC.md section 8).

    python train.py --model tango --depth 8                      # CPU tier, stdlib, ~7 min
    python train.py --model loop --depth 4 --dataset dmmath
    python train.py --model tango --size 70M --block_size 2048   # one GPU: bf16 + torch.compile
    torchrun --standalone --nproc_per_node 8 train.py --model tango --size 70M   # 8 GPUs, DDP
    python train.py --model tango --depth 8 --resume             # continue out/ exactly

Protocol: AdamW (fp32 states), linear warmup then cosine decay, weight decay 0.1 on the weight
matrices and the embedding only (each model declares its exempt parameters: no_decay_parameters),
gradient clipping 1.0 once per update, micro-batches with gradient accumulation (the update
minimises the NLL summed over the scored targets of all its micro-batches on all processes divided
by their count; that is the logged loss), dev NLL on a fixed set of dev windows at update counts
fixed in advance (every --eval_interval and the last
update), the best-dev checkpoint kept and only it evaluated on test. NLL is in nats/token;
throughput is the median training tokens/s over the final 100 updates.

Errors: bad input (a flag, a data file, a checkpoint) prints one line "error: ..." on stderr and
exits 2 before anything is written to --out_dir; a non-finite loss, gradient or dev NLL stops the
run with "error: ..." naming the update and the last good checkpoint (or that none exists yet) and
exit code 1, leaving that checkpoint as it was.

Checkpoints (<out_dir>/ckpt_latest.pt, every evaluation; <out_dir>/ckpt_best.pt, lowest dev NLL):
written to a temporary file and renamed into place; plain types and CPU tensors only, so
``torch.load(path, weights_only=True, map_location="cpu")`` reads them on any machine; parameter
names carry no ``_orig_mod.``/``module.`` prefixes. ckpt_latest.pt also holds the optimizer, the
update count (which fixes the learning-rate schedule position), the RNG states of python, numpy
(the data sampler) and torch, the best dev NLL so far, seed and data_seed.

--resume continues <out_dir>/ckpt_latest.pt exactly: flags not given are taken from the
checkpoint; model-defining flags (IDENTITY_FLAGS) must agree with it; other flags given
explicitly (a lower --learning_rate after a blow-up, a larger --max_iters) override it and the
change is printed and logged. Running N updates equals running N/2 and resuming to N (same batches,
bit-identical losses on CPU fp32) when the schedule does not depend on the stop: stop early with
``--max_iters N/2 --lr_decay_iters N``, then ``--resume --max_iters N``. A fresh run (no --resume)
in an out_dir that holds checkpoints replaces them.

Multi-GPU (DDP; gloo on CPU, nccl on CUDA), one process per device:

    torchrun --standalone --nproc_per_node 4 train.py --model tango --size 70M

--gradient_accumulation_steps (the global micro-batch count per update) must be divisible by the
number of processes; each rank runs accum/world micro-batches, gradients are synchronised on the
last one only (no_sync). Every rank draws the windows of all accum micro-batches of an update
from the shared data RNG and takes its own contiguous share, so an update sees the same windows
whatever the world size; the random draws inside a training step (Parcae's and RDM's depths and
initial states) are seeded from (--seed, update, the micro-batch's global index) (step_seed), so
they do not depend on it either. Dev/test windows are sharded over ranks and their per-window NLL sums
(float64) gathered in window order. Only rank 0 prints and writes logs and checkpoints; rank 0
also prepares the dataset, so on several machines --data_root must be on a shared file system.

Debug hook: with env var TRAIN_DEBUG_DUMP=PREFIX every rank appends one JSON line per update to
PREFIX.rank<R>.jsonl: {"iter", "starts" (the train windows this rank used, per micro-batch),
"param_sha256" (of all parameters and buffers after the update)}. The tests use it to check DDP.
"""
import argparse
import contextlib
import hashlib
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
import torch.nn.functional as F

import data as data_mod
from common import ModelConfig, UsageError, compile_regions
from models import REGISTRY, TIERS, build_model, solve_width

# Per-tier defaults for flags left unset (the CPU tier is sized so the main job runs in minutes,
# the tiny tier so the README's 98-run reproduction grid runs in about 1.6 hours on 2 cores).
# window (Windowed TANGO W), chunk (FLASH C) and gau_s (GAU/FLASH s) scale with the context: at
# W >= T Windowed TANGO is exactly full-prefix TANGO and at C >= T FLASH is one quadratic chunk.
TIER_DEFAULTS = {
    "tiny": dict(block_size=128, batch_size=8, gradient_accumulation_steps=1, max_iters=120,
                 eval_interval=20, learning_rate=6e-3, warmup_iters=10, eval_windows=32, em_samples=100,
                 window=32, chunk=32, gau_s=32),
    "cpu": dict(block_size=256, batch_size=8, gradient_accumulation_steps=1, max_iters=150,
                eval_interval=25, learning_rate=2e-3, warmup_iters=10, eval_windows=48, em_samples=100,
                window=64, chunk=64, gau_s=128),
    "70M": dict(block_size=2048, batch_size=4, gradient_accumulation_steps=8, max_iters=5000,
                eval_interval=250, learning_rate=6e-4, warmup_iters=200, eval_windows=256, em_samples=1000,
                window=256, chunk=256, gau_s=128),
    "160M": dict(block_size=2048, batch_size=4, gradient_accumulation_steps=8, max_iters=5000,
                 eval_interval=250, learning_rate=6e-4, warmup_iters=200, eval_windows=256, em_samples=1000,
                 window=256, chunk=256, gau_s=128),
}

CKPT_FORMAT = 2  # bump when the checkpoint layout changes
LATEST, BEST = "ckpt_latest.pt", "ckpt_best.pt"
# --resume: these must agree with the checkpoint (they define the model, its data order or the
# meaning of "best dev"); MACHINE_FLAGS are never taken from it; every other flag is taken from the
# checkpoint unless given explicitly, in which case the given value wins and the change is logged.
IDENTITY_FLAGS = ("model", "depth", "size", "window", "chunk", "gau_s", "block_size", "seed", "data_seed",
                  "eval_windows", "mu_rec", "mu_bwd", "n_prelude", "n_core", "n_coda",
                  "da_stride", "da_recent", "n_thoughts", "jacobi")
# models whose one block (or unit, or recurrent core) can be applied any number of times
SHARED_BLOCK = ("tango", "tango-windowed", "tango-3set", "loop", "gau", "flash", "parcae", "rdm")
MACHINE_FLAGS = ("out_dir", "data_root", "num_proc", "resume", "quiet", "device", "dtype", "compile")
TRAINING_KEYS = ("format", "model", "config", "data", "iter", "best_dev", "optimizer", "rng", "args",
                 "seed", "data_seed")


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss, gradient or dev NLL); exit code 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line "error: ..." and exit 2, like every other bad input
        raise UsageError(f"{message} (see python train.py --help)")


def build_parser(suppress_defaults=False):
    """The flag parser; suppress_defaults=True leaves unset flags out (to see which were given)."""
    p = _Parser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def a(*names, **kw):
        if suppress_defaults:
            kw["default"] = argparse.SUPPRESS
        p.add_argument(*names, **kw)

    a("--model", default="tango", help=f"one of {', '.join(REGISTRY)}")
    a("--depth", type=int, default=8, help="K, number of block applications")
    a("--size", default=None, help=f"tier: {', '.join(TIERS)} (default: cpu without a GPU, 70M with one)")
    a("--window", type=int, default=None, help="Windowed TANGO window W (default: the tier's)")
    a("--chunk", type=int, default=None, help="FLASH chunk C (default: the tier's)")
    a("--gau_s", type=int, default=None, help="GAU/FLASH shared dimension s (default: the tier's)")
    a("--mu_rec", type=int, default=0, help="Parcae/RDM: mean training recurrence (0: --depth)")
    a("--mu_bwd", type=int, default=0, help="Parcae/RDM: recurrences backpropagated (0: ceil(mu_rec/2))")
    a("--n_prelude", type=int, default=2, help="Parcae/RDM: blocks before the recurrent core")
    a("--n_core", type=int, default=2, help="Parcae/RDM: blocks in the recurrent core")
    a("--n_coda", type=int, default=2, help="Parcae/RDM: blocks after the recurrent core")
    a("--kl_threshold", type=float, default=5e-4, help="RDM: KL early-exit threshold (rdm_generate_depths)")
    a("--da_stride", type=int, default=0, help="Depth-Attention: mix layers j mod stride == 0 (0: depth // 2, -1: none)")
    a("--da_recent", type=int, default=0, help="Depth-Attention: also mix the r layers just below")
    a("--n_thoughts", type=int, default=1, help="PonderLM-2: thought slots per token (0: untied Transformer++)")
    a("--jacobi", type=int, default=3, help="PonderLM-2: Jacobi refinements of the thoughts")
    a("--jacobi_random", action=argparse.BooleanOptionalAction, default=True,
      help="PonderLM-2: training draws the Jacobi refinements from {2, 3}")
    a("--eval_depths", default="", help="test-time depth sweep of the best checkpoint on dev, e.g. "
      "1,2,4,8,16,32 (shared-block models: the TANGO family, loop, gau, flash, parcae, rdm)")
    data_mod.add_arguments(a)  # --dataset, --tokenizer, --data_dir, --data_root, --max_tokens, --hf_* ...
    a("--block_size", type=int, default=None, help="training context length T")
    a("--batch_size", type=int, default=None, help="micro-batch size (sequences per process)")
    a("--gradient_accumulation_steps", type=int, default=None,
      help="micro-batches per update, over all processes (divisible by the number of processes)")
    a("--max_iters", type=int, default=None, help="number of optimizer updates")
    a("--lr_decay_iters", type=int, default=None,
      help="length of the learning-rate schedule (default: --max_iters); set it to stop a run early "
           "with the schedule of a longer one")
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
    a("--device", default="auto", help="auto, cpu, cuda, cuda:N (under torchrun: cuda:LOCAL_RANK)")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
      help="autocast dtype; auto = bfloat16 on a GPU that supports it, float32 otherwise")
    a("--compile", action=argparse.BooleanOptionalAction, default=None,
      help="torch.compile each body's repeated unit once (regional; default: on for CUDA)")
    a("--seed", type=int, default=1337, help="model seed")
    a("--data_seed", type=int, default=None, help="data-order seed (default: --seed); same value = same batches")
    a("--resume", action="store_true", help="continue from <out_dir>/ckpt_latest.pt")
    a("--quiet", action="store_true", help="no progress bar")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def given_flags(argv=None):
    """Names of the flags given on the command line (as opposed to defaults)."""
    return set(vars(build_parser(suppress_defaults=True).parse_args(argv)))


# ----------------------------------------------------------------------------- processes

@dataclass
class Dist:
    """This process's place in a torchrun job (rank 0 of 1 without torchrun)."""
    rank: int = 0
    local_rank: int = 0
    world: int = 1

    @property
    def main(self):
        return self.rank == 0

    @property
    def ddp(self):
        return self.world > 1

    @classmethod
    def from_env(cls):
        try:
            d = cls(int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
                    int(os.environ.get("WORLD_SIZE", 1)))
        except ValueError:
            raise UsageError("RANK, LOCAL_RANK and WORLD_SIZE must be integers (set by torchrun)") from None
        if d.world < 1 or not 0 <= d.rank < d.world or d.local_rank < 0:
            raise UsageError(f"RANK {d.rank} / LOCAL_RANK {d.local_rank} / WORLD_SIZE {d.world} are inconsistent")
        return d

    @classmethod
    def from_env_quiet(cls):
        """from_env, or a single process if the environment is malformed (for error printing)."""
        try:
            return cls.from_env()
        except UsageError:
            return cls()

    def all_sum(self, t):
        """Sum a tensor over ranks, in place (no-op for one process)."""
        if self.ddp:
            tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
        return t


def start_distributed(args, dist):
    """Join the process group (nccl on CUDA, gloo on CPU); pins this rank's GPU."""
    if not dist.ddp:
        return
    if args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)
    tdist.init_process_group(backend="nccl" if args.device.startswith("cuda") else "gloo")


# ----------------------------------------------------------------------------- flags

def merge_resume_args(args, given, saved):
    """Fill args from a checkpoint's args for --resume (see IDENTITY_FLAGS). Returns the explicit
    overrides as {flag: [checkpoint value, new value]}; UsageError for a conflicting identity flag."""
    changed = {}
    for k, v in saved.items():
        if k in MACHINE_FLAGS or not hasattr(args, k):
            continue
        if not isinstance(v, (type(None), bool, int, float, str)):
            raise UsageError(f"{os.path.join(args.out_dir, LATEST)}: malformed args entry {k}={v!r}")
        if k not in given:
            setattr(args, k, v)
        elif getattr(args, k) != v:
            if k in IDENTITY_FLAGS:
                raise UsageError(f"--{k} {getattr(args, k)}: the checkpoint in {args.out_dir} was trained with "
                                 f"--{k} {v}; drop the flag to resume it, or use a fresh --out_dir")
            changed[k] = [v, getattr(args, k)]
    return changed


def resolve_args(args, dist=None):
    """Fill tier defaults, pick the device, and validate every flag (UsageError on bad input)."""
    dist = dist or Dist()
    if args.model not in REGISTRY:
        raise UsageError(f"--model: unknown model '{args.model}'; choose one of {', '.join(REGISTRY)}")
    resolve_device(args, dist)
    if args.size is None:
        args.size = "70M" if args.device.startswith("cuda") else "cpu"
    if args.size not in TIERS:
        raise UsageError(f"--size {args.size}: choose one of {', '.join(TIERS)}")
    for k, v in TIER_DEFAULTS[args.size].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.data_seed is None:
        args.data_seed = args.seed
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.max_iters
    if args.compile is None:
        args.compile = args.device.startswith("cuda")
    for flag in ("depth", "block_size", "batch_size", "gradient_accumulation_steps", "max_iters",
                 "lr_decay_iters", "eval_interval", "eval_windows", "eval_batch_size", "window", "chunk", "gau_s",
                 "em_samples"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    for flag in ("learning_rate", "grad_clip"):
        if not 0 < getattr(args, flag) < math.inf:
            raise UsageError(f"--{flag} {getattr(args, flag)}: must be a finite number > 0")
    if not 0 <= args.min_lr_ratio <= 1:
        raise UsageError(f"--min_lr_ratio {args.min_lr_ratio}: must be in [0, 1]")
    if not 0 <= args.weight_decay < math.inf:
        raise UsageError(f"--weight_decay {args.weight_decay}: must be a finite number >= 0")
    for flag in ("warmup_iters", "sample_tokens"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag} {getattr(args, flag)}: must be >= 0")
    if args.gradient_accumulation_steps % dist.world:
        raise UsageError(f"--gradient_accumulation_steps {args.gradient_accumulation_steps}: must be divisible "
                         f"by the number of processes ({dist.world}); it counts micro-batches over all of them")
    try:
        args.depth_list = [int(k) for k in args.eval_depths.split(",")] if args.eval_depths else []
    except ValueError:
        raise UsageError(f"--eval_depths {args.eval_depths}: give comma-separated depths, e.g. 1,2,4,8") from None
    if args.depth_list and (args.model not in SHARED_BLOCK or min(args.depth_list) < 1):
        raise UsageError(f"--eval_depths {args.eval_depths}: needs depths >= 1 and a shared-block model "
                         f"({', '.join(SHARED_BLOCK)})")
    if not 0 < args.kl_threshold < math.inf:
        raise UsageError(f"--kl_threshold {args.kl_threshold}: must be a finite number > 0")
    if args.dtype == "auto":
        bf16 = args.device.startswith("cuda") and torch.cuda.is_bf16_supported()
        args.dtype = "bfloat16" if bf16 else "float32"
    check_paths(args)
    return args


def resolve_device(args, dist):
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise UsageError(f"--device {args.device}: use auto, cpu, cuda or cuda:N")
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available on this machine; use --device cpu")
        if dist.ddp:
            args.device = f"cuda:{dist.local_rank}"  # one GPU per process
        try:
            index = torch.device(args.device).index or 0
        except RuntimeError:
            raise UsageError(f"--device {args.device}: use auto, cpu, cuda or cuda:N") from None
        if index >= torch.cuda.device_count():
            raise UsageError(f"--device {args.device}: this machine has {torch.cuda.device_count()} GPU(s)")


def check_paths(args):
    """out_dir and data_root must be (creatable) folders."""
    for flag in ("out_dir", "data_root"):
        path = os.path.abspath(getattr(args, flag))
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"--{flag} {path}: exists and is not a folder")
        parent = path
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"--{flag} {path}: {parent} is not writable")


# ----------------------------------------------------------------------------- data

def load_data(args, dist):
    """Prepare and validate the dataset. Under DDP rank 0 prepares it and sends the folder (or its
    error) to the others, so no two processes write the same folder; the folder must then be on a
    file system all ranks see (always so with --standalone)."""
    folder = error = None
    if dist.main:
        try:
            folder = data_mod.prepare(args.dataset, args.data_dir, args.data_root, **data_mod.flag_options(args))
        except UsageError as e:
            error = str(e)
    if dist.ddp:
        box = [folder, error]
        tdist.broadcast_object_list(box, src=0)
        folder, error = box
    if error is not None:
        raise UsageError(error)
    data = data_mod.Data(folder)
    check_data(data)
    data.check_block_size(args.block_size)
    return data


def check_data(data, chunk=1 << 24):
    """UsageError unless the prepared files agree with meta.json: the splits train, dev and the test
    split exist, every token id is < vocab_size, masks are 0/1, problem offsets lie inside their
    split. Reads every token once (about 1 GB/s)."""
    meta, where = data.meta, os.path.join(data.folder, "meta.json")
    again = f"delete {data.folder} to prepare it again"
    splits = meta["splits"]
    needed = ["train", "dev", data.test_split] + list(meta.get("em_splits", []))
    missing = [s for s in needed if s not in splits]
    if missing:
        raise UsageError(f"{where}: no split {', '.join(missing)} (it has {', '.join(splits)}); {again}")
    if data.tokenizer == "char" and len(meta.get("itos", [])) != data.vocab_size:
        raise UsageError(f"{where}: itos has {len(meta.get('itos', []))} symbols, vocab_size is {data.vocab_size}")
    for s, n in splits.items():
        tok = data.tokens(s)
        top = max((int(tok[i:i + chunk].max()) for i in range(0, n, chunk)), default=-1)
        if top >= data.vocab_size:
            raise UsageError(f"{os.path.join(data.folder, s + '.bin')}: token id {top} >= vocab_size "
                             f"{data.vocab_size} of meta.json; {again}")
        mask = data.mask(s)
        if mask is not None and max((int(mask[i:i + chunk].max()) for i in range(0, n, chunk)), default=0) > 1:
            raise UsageError(f"{os.path.join(data.folder, s + '.mask.bin')}: values other than 0/1; {again}")
        check_problems(data, s, n, again)


def check_problems(data, split, n, again):
    path = os.path.join(data.folder, f"{split}.problems.npy")
    if not os.path.exists(path):
        return
    try:
        p = data.problems(split)
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise UsageError(f"{path}: unreadable ({type(e).__name__}); {again}") from None
    ok = p.ndim == 2 and p.shape[1] == 3 and np.issubdtype(p.dtype, np.integer)
    if ok and len(p):
        ok = bool((p[:, 0] >= 0).all() and (p[:, 0] <= p[:, 1]).all() and (p[:, 1] <= p[:, 2]).all()
                  and (p[:, 2] <= n).all())
    if not ok:
        raise UsageError(f"{path}: problem offsets do not fit the split's {n} tokens; {again}")


def data_signature(data):
    """What a checkpoint must agree with the data on: tokenizer, vocabulary (the symbols of a
    character vocabulary) and the token count of each split."""
    sig = {"tokenizer": data.tokenizer, "vocab_size": data.vocab_size,
           "splits": {k: int(v) for k, v in data.meta["splits"].items()}}
    if data.tokenizer == "char":
        sig["itos"] = list(data.meta["itos"])
    return sig


def sample_starts(rng, n_tokens, batch_size, block_size):
    """Start offsets of one training micro-batch: the same draw as data.Data.train_batch."""
    return rng.integers(0, n_tokens - block_size, size=batch_size)


# ----------------------------------------------------------------------------- model and optimizer

def model_config(args, data):
    d, H, target = TIERS[args.size]
    cfg = ModelConfig(model=args.model, vocab_size=data.vocab_size, block_size=args.block_size,
                      n_embd=d, n_head=H, depth=args.depth, window=args.window, chunk=args.chunk,
                      gau_s=args.gau_s, mu_rec=args.mu_rec,
                      mu_bwd=args.mu_bwd, n_prelude=args.n_prelude, n_core=args.n_core, n_coda=args.n_coda,
                      kl_threshold=args.kl_threshold, da_stride=args.da_stride, da_recent=args.da_recent,
                      n_thoughts=args.n_thoughts, jacobi=args.jacobi, jacobi_random=args.jacobi_random)
    return solve_width(cfg, target, strict=args.size not in ("tiny", "cpu")), target


def lr_at(it, args):
    """Learning rate for update it (0-based): linear warmup to the peak (positive from update 0),
    then cosine down to min_lr_ratio * peak at update lr_decay_iters - 1 (default max_iters - 1)
    and constant after. A function of it alone, so a resumed run continues the same schedule."""
    peak, warm = args.learning_rate, args.warmup_iters
    total = getattr(args, "lr_decay_iters", None) or args.max_iters
    if it < warm:
        return peak * (it + 1) / (warm + 1)
    if total <= warm:
        return peak
    progress = min(1.0, (it - warm) / max(1, total - 1 - warm))
    return peak * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def no_decay_parameters(model):
    """The parameters exempt from weight decay, by the rule each model declares: a module class
    lists the names of its own parameters that are gains, scales, offsets, temperatures, null
    scores or state-space coefficients in a class attribute ``no_decay`` (RMSNorm: weight; TANGO:
    log_tau, null; GAU/FLASH: gamma, beta; Parcae: A_log, dt_bias, B, C). Every other parameter
    (the weight matrices and the embedding) decays, whatever its rank. Returns a list without
    duplicates (a shared module counts once)."""
    out = {}
    for m in model.modules():
        for name in getattr(m, "no_decay", ()):
            p = getattr(m, name)
            if not isinstance(p, torch.nn.Parameter):
                raise TypeError(f"{type(m).__name__}.no_decay names {name!r}, which is not a parameter")
            out[id(p)] = p
    return list(out.values())


def param_groups(model, weight_decay):
    """AdamW parameter groups: [decayed (weight_decay), exempt (0)] (see no_decay_parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    exempt = {id(p) for p in no_decay_parameters(model)}
    return [{"params": [p for p in params if id(p) not in exempt], "weight_decay": weight_decay},
            {"params": [p for p in params if id(p) in exempt], "weight_decay": 0.0}]


def make_optimizer(model, args):
    """AdamW (betas 0.9, 0.95) over param_groups(model, --weight_decay); fp32 states as parameters
    stay fp32."""
    return torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.learning_rate,
                             betas=(0.9, 0.95), eps=1e-8)


def autocast_ctx(args):
    if args.dtype == "bfloat16":
        return torch.autocast(device_type=args.device.split(":")[0], dtype=torch.bfloat16)
    return torch.autocast(device_type="cpu", enabled=False)


# ----------------------------------------------------------------------------- evaluation

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
    the world size, up to the float32 forward pass itself (see test_train.py)."""
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
    return float(sums.sum()) / max(float(counts.sum()), 1.0)


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
            prompt = torch.from_numpy(tok[q0:a0].astype(np.int64))[None].to(device)  # question + "\n"
            with ctx:
                out = model.generate(prompt, max_new_tokens=int(a1 - a0) + 2, temperature=0, stop_token=data.eot)
            answer = data.decode(out[0, prompt.shape[1]:].tolist()).split("\n")[0]
            correct += answer == data.decode(tok[a0:a1])
    return correct / len(idx)


# ----------------------------------------------------------------------------- checkpoints

def strip_prefixes(sd):
    """Parameter names without torch.compile (_orig_mod.) / DDP (module.) wrapper prefixes."""
    out = {}
    for k, v in sd.items():
        changed = True
        while changed:
            changed = False
            for prefix in ("_orig_mod.", "module."):
                if k.startswith(prefix):
                    k, changed = k[len(prefix):], True
        out[k] = v
    return out


def clean_state_dict(model):
    """state_dict on the CPU without wrapper prefixes."""
    return {k: v.detach().cpu() for k, v in strip_prefixes(model.state_dict()).items()}


def to_cpu(obj):
    """obj with every tensor moved to the CPU (dicts, lists and tuples walked)."""
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def save_atomic(obj, path):
    """torch.save to a temporary file beside path, flushed to disk, then os.replace: a crash or an
    error at any point leaves the previous file at path whole (and no temporary file behind)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows it
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(path, keys=("model", "config")):
    """Load a checkpoint with weights_only=True on the CPU; UsageError if it is missing,
    unreadable (truncated, corrupted, not a checkpoint) or lacks one of keys."""
    if not os.path.isfile(path):
        raise UsageError(f"--resume: no checkpoint at {path}")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever the damage, it is a bad file
        raise UsageError(f"{path}: not a readable checkpoint ({type(e).__name__}); "
                         "it may be truncated or corrupted") from None
    if not isinstance(ck, dict) or any(k not in ck for k in keys):
        have = sorted(ck) if isinstance(ck, dict) else type(ck).__name__
        raise UsageError(f"{path}: not a training checkpoint of this train.py (needs {', '.join(keys)}; has {have})")
    if "format" in keys and ck["format"] != CKPT_FORMAT:
        raise UsageError(f"{path}: checkpoint format {ck['format']}, this train.py reads {CKPT_FORMAT}")
    return ck


def check_compatible(ck, path, cfg, data):
    """UsageError unless the checkpoint holds this model config and was trained on this data."""
    if ck["config"] != cfg.to_dict():
        saved = ck["config"] if isinstance(ck["config"], dict) else {}
        diff = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in cfg.to_dict().items() if saved.get(k) != v]
        raise UsageError(f"{path}: another model: {', '.join(diff) or 'unknown config fields'}; use a fresh --out_dir")
    if ck["data"] != data_signature(data):
        saved = ck["data"] if isinstance(ck["data"], dict) else {}
        raise UsageError(f"{path}: trained on other data ({saved.get('tokenizer')} tokenizer, vocab "
                         f"{saved.get('vocab_size')}, splits {saved.get('splits')}); this dataset has "
                         f"{data.tokenizer}, vocab {data.vocab_size}, splits {data.meta['splits']}")


def rng_state(rng, device):
    """The RNG states as plain Python values and CPU tensors (weights_only-loadable)."""
    state = {"python": _listify(random.getstate()), "numpy": rng.bit_generator.state,
             "torch": torch.get_rng_state()}
    if device.startswith("cuda"):
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, rng, device):
    random.setstate(_tuplify(state["python"]))
    rng.bit_generator.state = state["numpy"]
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.startswith("cuda"):
        torch.cuda.set_rng_state(state["cuda"], device)


def restore(ck, path, model, optimizer, rng, device):
    """Load the training state of a checkpoint; UsageError if its tensors do not fit."""
    try:
        model.load_state_dict(strip_prefixes(ck["model"]))
        optimizer.load_state_dict(ck["optimizer"])  # moves the state to the parameters' device
        set_rng_state(ck["rng"], rng, device)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise UsageError(f"{path}: does not fit this model ({why})") from None


def _listify(x):
    return [_listify(v) for v in x] if isinstance(x, (list, tuple)) else x


def _tuplify(x):
    """random.setstate needs tuples; checkpoints store them as lists."""
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


# ----------------------------------------------------------------------------- logging

class Log:
    """log.jsonl and console output; silent on ranks other than 0."""

    def __init__(self, out_dir, dist, resumed_at=None, quiet=False, total=0, desc=""):
        self.main = dist.main
        self.path = os.path.join(out_dir, "log.jsonl")
        self.f = self.bar = None
        if not self.main:
            return
        if resumed_at is not None:
            trim_log(self.path, resumed_at)
        self.f = open(self.path, "a" if resumed_at is not None else "w")
        if not quiet:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=resumed_at or 0, desc=desc, dynamic_ncols=True)

    def emit(self, **rec):
        if self.f:
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()

    def progress(self, **postfix):
        if self.bar is not None:
            self.bar.set_postfix(**postfix)
            self.bar.update(1)

    def close_bar(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def say(self, msg):
        if self.main:
            (self.bar.write if self.bar is not None else print)(msg)

    def close(self):
        self.close_bar()
        if self.f:
            self.f.close()
            self.f = None


def trim_log(path, it):
    """Drop the records of updates after it (and earlier summaries) from a log being resumed:
    a run that died after its last checkpoint leaves records the resumed run will write again."""
    if not os.path.isfile(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if rec.get("event") != "summary" and rec.get("iter", 0) <= it:
                keep.append(json.dumps(rec) + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


class DebugDump:
    """TRAIN_DEBUG_DUMP=PREFIX: per-rank JSON lines of the windows used and a parameter hash."""

    def __init__(self, dist):
        prefix = os.environ.get("TRAIN_DEBUG_DUMP")
        self.path = f"{prefix}.rank{dist.rank}.jsonl" if prefix else None

    def write(self, it, starts, model):
        if self.path:
            h = hashlib.sha256()
            for k, v in model.state_dict().items():
                h.update(k.encode())
                h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            with open(self.path, "a") as f:
                f.write(json.dumps({"iter": it, "starts": [s.tolist() for s in starts],
                                    "param_sha256": h.hexdigest()}) + "\n")


# ----------------------------------------------------------------------------- the run

@dataclass
class Run:
    """What a run holds once its inputs are validated. model is the LM (checkpoints, generation),
    with its repeated units compiled under --compile (common.compile_regions); fwd is the model
    evaluation calls; train_model is fwd, DDP-wrapped under torchrun. t_start: time.time() at the
    start; first_update_s: seconds from then to the end of this process's first update."""
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
    saved_at: int = None  # update of the checkpoint in out_dir (None: none written yet)

    def checkpoint_note(self):
        """What a stopped run leaves: the last good checkpoint, or that none exists yet."""
        if self.saved_at is None:
            return f"no checkpoint exists yet (the first is written after update {self.args.eval_interval})"
        return f"the last good checkpoint is {self.latest_path} (update {self.saved_at})"

    @property
    def latest_path(self):
        return os.path.join(self.args.out_dir, LATEST)

    @property
    def best_path(self):
        return os.path.join(self.args.out_dir, BEST)


def run(args, given=frozenset()):
    """Validate, train, evaluate the best checkpoint on test; returns the summary (rank 0)."""
    t_start = time.time()
    r, ckpt, changed = setup(args, given)  # nothing written to out_dir before this returns
    r.t_start = t_start
    open_outputs(r, resumed=ckpt is not None, changed=changed)
    rates = train_loop(r)
    summary = finish(r, rates, t_start)
    r.log.close()
    return summary


def setup(args, given):
    """Validate flags, data and checkpoints, build the model and restore a checkpoint's state.
    Raises UsageError on bad input; writes nothing."""
    dist = Dist.from_env()
    latest_path = os.path.join(args.out_dir, LATEST)
    ckpt, changed = None, {}
    if args.resume:
        ckpt = load_checkpoint(latest_path, keys=TRAINING_KEYS)
        if not isinstance(ckpt["args"], dict):
            raise UsageError(f"{latest_path}: malformed args entry")
        saved = dict(ckpt["args"])
        for k in ("chunk", "gau_s"):  # not flags before these became tier defaults: the model config has them
            if k not in saved and isinstance(ckpt["config"], dict) and k in ckpt["config"]:
                saved[k] = ckpt["config"][k]
        changed = merge_resume_args(args, given, saved)
    args = resolve_args(args, dist)
    start_distributed(args, dist)
    data = load_data(args, dist)
    cfg, target = model_config(args, data)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    model = build_model(cfg, device=args.device)
    r = Run(args, dist, data, cfg, target, model, make_optimizer(model, args), np.random.default_rng(args.data_seed))
    if ckpt is not None:
        r.best_dev = check_resume(ckpt, r.latest_path, r.best_path, cfg, data, args)
        restore(ckpt, r.latest_path, model, r.optimizer, r.rng, args.device)
        r.it = r.saved_at = ckpt["iter"]
    r.ctx = autocast_ctx(args)
    if args.compile:  # regional: each body's repeated unit (and the head) compiles once, whatever the depth
        compile_regions(model)
    r.fwd = model
    r.train_model = r.fwd
    if dist.ddp:
        from torch.nn.parallel import DistributedDataParallel
        r.train_model = DistributedDataParallel(
            r.fwd, device_ids=[dist.local_rank] if args.device.startswith("cuda") else None)
    return r, ckpt, changed


def open_outputs(r, resumed, changed):
    """Create out_dir and the log (rank 0), print the run's header and log its start event."""
    args = r.args
    if r.dist.main:
        os.makedirs(args.out_dir, exist_ok=True)
        if not resumed:
            remove_stale(args.out_dir)
    r.log = log = Log(args.out_dir, r.dist, resumed_at=r.it if resumed else None, quiet=args.quiet,
                      total=args.max_iters, desc=args.model)
    n_params, err = r.model.num_params(), r.model.num_params() / r.target - 1
    log.say(f"model {args.model}  depth {args.depth}  tier {args.size}  d={r.cfg.n_embd} heads={r.cfg.n_head} "
            f"width={r.cfg.width}  non-embedding params {n_params:,} (target {r.target:,}, {err:+.3%})"
            + ("" if abs(err) <= 0.002 else "  [outside 0.20 %: this tier is too small to match exactly]"))
    log.say(f"data {r.data.folder}: {r.data.tokenizer} vocab {r.data.vocab_size}, "
            + ", ".join(f"{k} {v:,}" for k, v in r.data.meta["splits"].items()) + " tokens"
            + (f"; {r.dist.world} processes (DDP)" if r.dist.ddp else ""))
    if resumed:
        log.say(f"resumed from {r.latest_path} at update {r.it} (best dev {r.best_dev:.4f})"
                + "".join(f"; --{k} {a} -> {b}" for k, (a, b) in changed.items()))
    log.emit(event="start", args=vars(args), config=r.cfg.to_dict(), non_embedding_params=n_params,
             unigram_dev=data_mod.unigram_entropy(r.data, "dev"), resumed_at=r.it, world_size=r.dist.world,
             resume_overrides=changed)


def train_loop(r):
    """Updates r.it .. max_iters, evaluating (and checkpointing) at the fixed update counts.
    Returns the training throughput of each update (tokens/s)."""
    args = r.args
    eval_at = set(range(args.eval_interval, args.max_iters + 1, args.eval_interval)) | {args.max_iters}
    dev_starts = r.data.eval_windows("dev", args.block_size, args.eval_windows)
    tokens_per_update = args.batch_size * args.gradient_accumulation_steps * args.block_size
    n_train = len(r.data.tokens("train"))
    dump = DebugDump(r.dist)
    rates = []
    r.model.train()
    while r.it < args.max_iters:
        t0 = time.time()
        lr = lr_at(r.it, args)
        for group in r.optimizer.param_groups:
            group["lr"] = lr
        starts = [sample_starts(r.rng, n_train, args.batch_size, args.block_size)
                  for _ in range(args.gradient_accumulation_steps)]
        loss, grad_norm = train_update(r, starts)
        r.it += 1
        rates.append(tokens_per_update / (time.time() - t0))
        if r.first_update_s is None:
            r.first_update_s = time.time() - r.t_start
            r.log.say(f"first update after {r.first_update_s:.1f} s from start (data, model"
                      + (", compile" if args.compile else "") + " included)")
        dump.write(r.it, my_share(starts, r.dist), r.model)
        r.log.emit(event="train", iter=r.it, loss=loss, lr=lr, grad_norm=grad_norm, tok_per_s=rates[-1],
                   **diagnostics(r.model, spectral=False))
        r.log.progress(loss=f"{loss:.3f}", tok_s=f"{rates[-1]:.0f}")
        if r.it in eval_at:
            eval_and_checkpoint(r, dev_starts)
    r.log.close_bar()
    return rates


def my_share(starts, dist):
    """This rank's contiguous share of an update's micro-batches."""
    m = len(starts) // dist.world
    return starts[dist.rank * m:(dist.rank + 1) * m]


def train_update(r, starts):
    """One optimizer update over this rank's share of the micro-batches (gradients synchronised on
    the last one). The update minimises the summed NLL of every scored target of every
    micro-batch of every rank divided by their count (so a micro-batch with few or no scored
    targets weighs by its targets, and an update with none at all has loss 0 and zero gradients).
    Returns that loss and the gradient norm before clipping; TrainingError if either is not finite
    (parameters left untouched)."""
    args, dist = r.args, r.dist
    mine = my_share(starts, dist)
    first = my_share(list(range(len(starts))), dist)[0]  # global index of this rank's first micro-batch
    batches = [tuple(t.to(args.device) for t in r.data.window_batch("train", s, args.block_size)) for s in mine]
    n_scored = dist.all_sum(torch.tensor(float(sum(int((y != -1).sum()) for _, y in batches)),
                                         dtype=torch.float64, device=args.device))
    scale = dist.world / max(float(n_scored), 1.0)  # DDP averages gradients over ranks: undo that
    nll_sum = torch.zeros((), dtype=torch.float64, device=args.device)
    for j, (x, y) in enumerate(batches):
        seed_random_draws(r.model, args.seed, r.it, first + j)
        sync = j == len(mine) - 1
        with contextlib.nullcontext() if sync or not dist.ddp else r.train_model.no_sync():
            with r.ctx:
                logits, _ = r.train_model(x)
            nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
            (nll * scale).backward()
        nll_sum += nll.detach().double()
    loss = float(dist.all_sum(nll_sum)) / max(float(n_scored), 1.0)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(r.model.parameters(), args.grad_clip))
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise TrainingError(f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at update {r.it + 1}; "
                            f"stopped; {r.checkpoint_note()}")
    r.optimizer.step()
    r.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def step_seed(seed, update, micro_batch):
    """The seed of the random draws (Parcae/RDM recurrence depths and initial states) of one
    micro-batch: a function of the run's --seed, the update (0-based) and the micro-batch's global
    index in the update only, so any world size, resume point or accumulation split draws the same."""
    return int(np.random.SeedSequence([seed, update, micro_batch]).generate_state(1, np.uint64)[0] >> 1)


def seed_random_draws(model, seed, update, micro_batch):
    """Point every module that draws random numbers in training (an attribute rng_seed, see
    baselines.seeded_generators) at step_seed(seed, update, micro_batch)."""
    s = step_seed(seed, update, micro_batch)
    for m in model.modules():
        if hasattr(m, "rng_seed"):
            m.rng_seed = s


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
        save_checkpoints(r, dev, improved)


def diagnostics(model, spectral):
    """The looped models' training diagnostics (Parcae, RDM: recurrent state norm per step, max Abar,
    spectral norms when spectral=True), as {"diag": {...}} for the log; {} for other models."""
    fn = getattr(model.body, "diagnostics", None)
    return {"diag": fn(spectral=spectral)} if fn is not None else {}


def depth_sweep(r, model):
    """Dev NLL of the (best) model at each --eval_depths recurrence count; restores the depth."""
    args, body = r.args, model.body
    dev_starts = r.data.eval_windows("dev", args.block_size, args.eval_windows)
    trained, curve = body.depth, []
    try:
        for k in args.depth_list:
            body.depth = k
            curve.append(evaluate(model, r.data, "dev", dev_starts, args.block_size, args.eval_batch_size,
                                  args.device, r.ctx, r.dist))
    finally:
        body.depth = trained
    r.log.emit(event="depth_sweep", depths=args.depth_list, dev_nll=curve)
    return curve


def save_checkpoints(r, dev, improved):
    """The best checkpoint first, then the latest (see check_resume for why this order)."""
    args = r.args
    state = {"format": CKPT_FORMAT, "model": clean_state_dict(r.model), "config": r.cfg.to_dict(),
             "data": data_signature(r.data), "iter": r.it, "best_dev": r.best_dev, "dev_nll": dev,
             "seed": args.seed, "data_seed": args.data_seed, "args": vars(args)}
    if improved:
        save_atomic(state, r.best_path)
    save_atomic(dict(state, optimizer=to_cpu(r.optimizer.state_dict()), rng=rng_state(r.rng, args.device)),
                r.latest_path)
    r.saved_at = r.it


def check_resume(ckpt, latest_path, best_path, cfg, data, args):
    """Validate a resumed run's checkpoints; returns the best dev NLL so far, the lower of the
    latest checkpoint's record and the best checkpoint's own (a crash between writing the best and
    the latest checkpoint leaves the best one newer), so a better best is never overwritten."""
    check_compatible(ckpt, latest_path, cfg, data)
    if not isinstance(ckpt["iter"], int) or ckpt["iter"] < 0:
        raise UsageError(f"{latest_path}: bad update count {ckpt['iter']!r}")
    if not isinstance(ckpt["best_dev"], float) or not isinstance(ckpt["rng"], dict):
        raise UsageError(f"{latest_path}: malformed best_dev or rng entries")
    if ckpt["iter"] > args.max_iters:
        raise UsageError(f"--max_iters {args.max_iters}: below the checkpoint's update {ckpt['iter']}; "
                         "give a larger --max_iters")
    best = load_checkpoint(best_path, keys=("format", "model", "config", "data", "iter", "dev_nll"))
    check_compatible(best, best_path, cfg, data)
    if not isinstance(best["dev_nll"], float):
        raise UsageError(f"{best_path}: malformed dev_nll {best['dev_nll']!r}")
    return min(ckpt["best_dev"], best["dev_nll"])


def remove_stale(out_dir):
    """A fresh run replaces the checkpoints and summary of an earlier run in its out_dir."""
    stale = [f for f in (LATEST, BEST, "summary.json") if os.path.exists(os.path.join(out_dir, f))]
    for f in stale:
        os.remove(os.path.join(out_dir, f))
    if stale:
        print(f"note: fresh run in {out_dir}: removed {', '.join(stale)} of an earlier run "
              "(use --resume to continue a run)")


def finish(r, rates, t_start):
    """Evaluate the best-dev checkpoint on test (sharded over ranks); rank 0 adds exact match,
    writes the summary and prints the report. Returns the summary (None on other ranks)."""
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
    curve = depth_sweep(r, model) if args.depth_list else None
    if not r.dist.main:
        return None
    tokens_per_update = args.batch_size * args.gradient_accumulation_steps * args.block_size
    summary = {"model": args.model, "depth": args.depth, "size": args.size, "dataset": args.dataset,
               "width": r.cfg.width, "non_embedding_params": model.num_params(), "params": model.num_params(False),
               "best_iter": best["iter"], "dev_nll": best["dev_nll"], "test_split": data.test_split,
               "test_nll": test, "unigram_dev": data_mod.unigram_entropy(data, "dev"),
               "tokens": best["iter"] * tokens_per_update,
               "tok_per_s_median_last100": float(np.median(rates[-100:])) if rates else None,
               "seed": args.seed, "data_seed": args.data_seed, "world_size": r.dist.world,
               "first_update_s": r.first_update_s, "wall_s": time.time() - t_start}
    if curve is not None:
        summary["depth_sweep"] = {"depths": args.depth_list, "dev_nll": curve}
    for split in data.meta.get("em_splits", []):
        summary[f"exact_match_{split}"] = exact_match(model, data, split, args.em_samples, args.device, r.ctx)
    r.log.emit(event="summary", **summary)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print_report(summary, data, args)
    print_sample(model, data, args, args.device, r.ctx)
    return summary


def print_report(s, data, args):
    print(f"\n== {args.model} depth {args.depth} on {args.dataset} ({args.size} tier) ==")
    print(f"non-embedding params   {s['non_embedding_params']:,}")
    print(f"unigram entropy (dev)  {s['unigram_dev']:.4f} nats/token   (baseline)")
    print(f"dev NLL (best, upd {s['best_iter']}) {s['dev_nll']:.4f} nats/token")
    print(f"test NLL ({data.test_split})    {s['test_nll']:.4f} nats/token")
    if s["tok_per_s_median_last100"]:
        print(f"throughput             {s['tok_per_s_median_last100']:.0f} tokens/s (median, last 100 updates)")
    for split in data.meta.get("em_splits", []):
        n = min(args.em_samples, len(data.problems(split)))
        print(f"exact match {split:12s} {s[f'exact_match_{split}']:.2%}  ({n} problems)")
    if "depth_sweep" in s:
        print("dev NLL by test-time depth: " + ", ".join(
            f"K={k}: {v:.4f}" for k, v in zip(s["depth_sweep"]["depths"], s["depth_sweep"]["dev_nll"])))
    if s["first_update_s"] is not None:
        print(f"first update           {s['first_update_s']:.1f} s after start"
              + (" (compile included)" if args.compile else ""))
    print(f"wall time              {s['wall_s']:.0f} s")


def print_sample(model, data, args, device, ctx):
    """A short decoded sample from the best checkpoint (dmmath: one problem, answered greedily),
    in eval mode (Parcae/RDM: fixed depth and seeded initial state); the model's mode is restored."""
    if args.sample_tokens == 0:
        return
    torch.manual_seed(args.seed)
    with eval_mode(model):
        if data.problems(data.test_split) is not None:
            q0, a0, a1 = data.problems(data.test_split)[0]
            tok = data.tokens(data.test_split)
            prompt = torch.from_numpy(tok[q0:a0].astype(np.int64))[None].to(device)
            with ctx:
                out = model.generate(prompt, max_new_tokens=args.sample_tokens, temperature=0, stop_token=data.eot)
            print(f"\n--- sample ({data.test_split}, greedy) ---\nQ: {data.decode(tok[q0:a0 - 1])}\n"
                  f"model: {data.decode(out[0, prompt.shape[1]:].tolist()).strip()}\n"
                  f"reference: {data.decode(tok[a0:a1])}")
            return
        prompt = torch.tensor([[data.eot]], device=device)
        with ctx:
            out = model.generate(prompt, max_new_tokens=args.sample_tokens, temperature=0.8, top_k=200)
    print(f"\n--- sample (temperature 0.8, top-k 200) ---\n{data.decode(out[0, 1:].tolist())}\n---")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    code = 0
    try:
        run(parse_args(argv), given_flags(argv))
    except (UsageError, TrainingError) as e:
        code = 2 if isinstance(e, UsageError) else 1
        if Dist.from_env_quiet().main:
            print(f"error: {e}", file=sys.stderr)
    finally:
        if tdist.is_available() and tdist.is_initialized():
            tdist.destroy_process_group()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
