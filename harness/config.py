"""The plumbing of a train.py run: the tiers' defaults, flag validation, the device, the processes
of a torchrun job, and what the run prints and logs (log.jsonl, the TRAIN_DEBUG_DUMP hook).

train.py declares the flags; resolve_args fills the defaults that depend on the tier or on other
flags (all of them here, in one place) and rejects bad values with a one-line UsageError (exit 2).
"""
import contextlib
import hashlib
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist

import data as data_mod
from common import UsageError
from harness.cli import FolderLock, check_decayed_rate, check_output_folder, check_rate, check_seed, repeated
from harness.checkpoint import remove_stale, trim_log
from models import (REGISTRY, TIERS, block_counts, check_idle_flags, count_params, flags_config, model_config,
                    model_flags, params_lower_bound, shared_block_models, spec_of)

# Per-tier defaults for flags left unset (the CPU tier is sized so the main job, TANGO K = 8 on
# characters, takes under 5 minutes on 2 cores),
# the tiny tier so the character-level reproduction grid, results/chargrid, 126 runs, takes about
# 1.5 hours on 2 cores).
# window (Windowed TANGO W), chunk (FLASH C) and gau_s (GAU/FLASH s) scale with the context: at
# W >= T Windowed TANGO is exactly full-prefix TANGO and at C >= T FLASH is one quadratic chunk.
_GPU_TIER = dict(block_size=2048, batch_size=4, gradient_accumulation_steps=8, max_iters=5000, eval_interval=250,
                 learning_rate=6e-4, warmup_iters=200, eval_windows=256, em_samples=1000, window=256, chunk=256,
                 gau_s=128)
TIER_DEFAULTS = {
    "tiny": dict(block_size=128, batch_size=8, gradient_accumulation_steps=1, max_iters=120,
                 eval_interval=20, learning_rate=6e-3, warmup_iters=10, eval_windows=32, em_samples=100,
                 window=32, chunk=32, gau_s=32),
    "cpu": dict(block_size=128, batch_size=8, gradient_accumulation_steps=1, max_iters=250,
                eval_interval=50, learning_rate=4e-3, warmup_iters=10, eval_windows=48, em_samples=100,
                window=64, chunk=64, gau_s=128),
    "70M": _GPU_TIER,
    "160M": dict(_GPU_TIER),  # the same run settings; the tiers differ in width and parameter target
}
# The model flags each model reads are declared in its registry row (models.ModelSpec.flags); a
# model flag is refused for every model that does not read it (as --data_dir is without dmmath);
# --model, --depth, --size and --width are every model's. The checks below read the registry
# live (models.model_flags: flag -> its models).


def unread_model_flags(model):
    """The model flags (models.model_flags) that --model `model` ignores."""
    return {flag for flag, users in model_flags().items() if model not in users}


def check_model_flags(model, given):
    """UsageError for a model flag given explicitly (given: the flag names on the command line)
    that --model does not read (models.model_flags): it would be silently ignored."""
    for flag in sorted(set(given) & unread_model_flags(model)):
        users = model_flags()[flag]
        users = users[0] if len(users) == 1 else f"{', '.join(users[:-1])} or {users[-1]}"
        raise UsageError(f"--{flag}: only used with --model {users}; --model {model} ignores it (drop the flag)")


# Evaluation flags that only one dataset reads (flag -> that --dataset), refused for the others as
# model flags are (data.prepare refuses --data_dir without dmmath and --hf_* without hf: the same way).
DATASET_FLAGS = {"em_samples": "dmmath"}  # exact match scores dmmath's problems, the only dataset with them


def check_dataset_flags(args, given):
    """UsageError for a flag of DATASET_FLAGS given explicitly (given: the flag names on the
    command line) that --dataset does not read: it would be silently ignored."""
    for flag in sorted(set(given) & set(DATASET_FLAGS)):
        if args.dataset != DATASET_FLAGS[flag]:
            raise UsageError(f"--{flag}: only used with --dataset {DATASET_FLAGS[flag]}; --dataset {args.dataset} "
                             "ignores it (drop the flag)")


# --width, every model's flag besides the ModelConfig ones: train.py's and flops.py's parsers share this help
WIDTH_HELP = ("expansion width F (Transformer++ feed-forward, TANGO gated, GAU/FLASH e), for equal-block-shape "
              "comparisons; default 0: solved to the tier's parameter target")


def tier_default(flag):
    """The help text's default of a tier-dependent flag, from TIER_DEFAULTS: 'default: tiny 128 / cpu 128 / ...'."""
    return "default: " + " / ".join(f"{tier} {d[flag]:g}" for tier, d in TIER_DEFAULTS.items())


def resolve_args(args, dist=None, reads_out_dir=False):
    """Fill the defaults that depend on the tier, the device or other flags, and validate every
    flag. reads_out_dir: the command only reads --out_dir (train.py --eval_only), so it need not be
    writable. Returns args; UsageError on bad input."""
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
    if args.tokenizer == "auto" and args.size == "cpu":
        args.tokenizer = "char"  # at 1M parameters a 50k-token embedding and head would take most of the time
    if args.data_seed is None:
        args.data_seed = args.seed
    # recorded absolute, so --resume and --eval_only find the data from any folder
    args.dataset, args.hf_data_files = data_mod.absolute_paths(args.dataset, args.hf_data_files)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.max_iters
    if args.compile is None:
        args.compile = args.device.startswith("cuda")
    if args.dtype == "auto":
        args.dtype = auto_dtype(args.device)
    if args.dtype == "bfloat16" and args.device.startswith("cuda") and not cuda_bf16():
        raise UsageError(f"--dtype bfloat16: {args.device} does not support it natively (a resumed or evaluated "
                         "run keeps its checkpoint's dtype unless given); use --dtype float32")
    check_values(args, dist)
    check_paths(args, ("data_root",) if reads_out_dir else ("out_dir", "data_root"))
    if not reads_out_dir:
        data_mod.check_outside_dataset(args.dataset, "out_dir", args.out_dir)
    check_model(args, "eval" if reads_out_dir else "train")
    return args


BYTES_PER_PARAM = {"train": 16, "eval": 4}  # float32 weight (+ gradient and AdamW's two moments when training)


def device_memory(device):
    """Bytes of memory of train.py's --device: the GPU's for cuda, the host's physical memory for
    cpu; None where the platform does not say (no os.sysconf)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None


def check_model(args, use="train"):
    """Count the flags' model from meta-device builds (no memory, little time; models.count_params): a
    value the model rejects (--width off its granularity, --n_core 0, --plt_window 0, ...) or a
    model flag outside its declared range (--fold_rank above d, ...; models.check_flag_ranges) is a
    UsageError before any data is prepared. The vocabulary size is a placeholder (the non-embedding
    parameters do not depend on it). So is a model whose non-embedding parameters alone, at
    BYTES_PER_PARAM[use], exceed the device's whole memory: such a run (--model untied --depth 2000
    --size 70M on a CPU) grew until the kernel's OOM killer ended it without a message; a depth or
    block count (--n_core, ...) far beyond memory at any width is refused with the count at the
    smallest width (models.params_lower_bound) when a strict tier's width cannot be solved.
    Activations are not counted, so a deep shared-block model can still run out of memory later
    (run_command's one line)."""
    have = device_memory(args.device)
    try:
        n, at_least = count_params(model_config(args, vocab_size=256)[0]), False  # the exact count
    except UsageError:
        # the width, model and range errors come first, as in model_config; what is left is a strict tier's solve
        n, at_least = params_lower_bound(flags_config(args, vocab_size=256), args.width), True
        if have is None or BYTES_PER_PARAM[use] * n <= have:
            raise
    need = BYTES_PER_PARAM[use] * n
    if have is not None and need > have:
        what = "weights, gradients and AdamW moments" if use == "train" else "weights"
        given = " ".join(f"--{f} {getattr(args, f)}" for f in block_counts(args))
        raise UsageError(f"--size {args.size} {given}" + (f" --width {args.width}" if args.width else "")
                         + f": the model's {'at least ' if at_least else ''}{n:,} non-embedding "
                         f"parameters need {need / 1e9:,.1f} GB for its {what} alone; {args.device} has "
                         f"{have / 1e9:,.1f} GB (give a smaller --size, --depth, --width or block count)")


def check_values(args, dist):
    """UsageError for a flag value outside its range; sets args.depth_list from --eval_depths."""
    for flag in ("depth", "block_size", "batch_size", "gradient_accumulation_steps", "max_iters",
                 "lr_decay_iters", "eval_interval", "eval_windows", "eval_batch_size", "em_samples"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    for flag in ("learning_rate", "grad_clip"):
        check_rate(f"--{flag}", getattr(args, flag))
    if not 0 <= args.min_lr_ratio <= 1:
        raise UsageError(f"--min_lr_ratio {args.min_lr_ratio}: must be in [0, 1]")
    check_rate("--weight_decay", args.weight_decay, positive=False)
    check_decayed_rate("--learning_rate", args.learning_rate, args.weight_decay)
    for flag in ("warmup_iters", "sample_tokens"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag} {getattr(args, flag)}: must be >= 0")
    for flag in ("seed", "data_seed"):
        check_seed(f"--{flag}", getattr(args, flag))
    if args.gradient_accumulation_steps % dist.world:
        raise UsageError(f"--gradient_accumulation_steps {args.gradient_accumulation_steps}: must be divisible "
                         f"by the number of processes ({dist.world}); it counts micro-batches over all of them")
    try:
        args.depth_list = [int(k) for k in args.eval_depths.split(",")] if args.eval_depths else []
    except ValueError:
        raise UsageError(f"--eval_depths {args.eval_depths}: give comma-separated depths, e.g. 1,2,4,8") from None
    if (twice := repeated(args.depth_list)) is not None:
        raise UsageError(f"--eval_depths {args.eval_depths}: {twice} given twice")
    if args.depth_list and args.model not in shared_block_models():
        raise UsageError(f"--eval_depths {args.eval_depths}: needs a shared-block model "
                         f"({', '.join(shared_block_models())})")
    if args.depth_list and min(args.depth_list) < spec_of(args.model).min_depth:
        raise UsageError(f"--eval_depths {args.eval_depths}: --model {args.model} needs depths >= "
                         f"{spec_of(args.model).min_depth}")


def resolve_device(args, dist):
    """--device auto -> cuda if available, else cpu; under torchrun each rank takes cuda:LOCAL_RANK."""
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
        torch.cuda.set_device(index)  # calls that take no device (and new CUDA contexts) go there, not to cuda:0


def cuda_bf16():
    """True if the current CUDA device computes bfloat16 natively (compute capability 8.0 and up).
    torch.cuda.is_bf16_supported() alone also says True where bfloat16 is only emulated (V100, T4):
    slow matmuls and no fused attention kernel for the TANGO fused path."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def auto_dtype(device):
    """--dtype auto on a resolved device: "bfloat16" on a CUDA GPU that computes it natively, else "float32"."""
    return "bfloat16" if device.startswith("cuda") and cuda_bf16() else "float32"


def check_paths(args, flags=("out_dir", "data_root")):
    """The folders of flags (out_dir, data_root) must be folders, or creatable ones: UsageError
    otherwise (harness.cli.check_output_folder, the check of every command's output folders).
    --data_root need not be writable where its dataset is prepared already: data.prepare checks
    that before it writes."""
    for flag in flags:
        check_output_folder(f"--{flag}", getattr(args, flag), probe=flag != "data_root")


def autocast_ctx(args):
    """bfloat16 autocast under --dtype bfloat16, else a context that changes nothing."""
    if args.dtype == "bfloat16":
        return torch.autocast(device_type=args.device.split(":")[0], dtype=torch.bfloat16)
    return torch.autocast(device_type="cpu", enabled=False)


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

    def start(self, device):
        """Join the process group (nccl on CUDA, gloo on CPU) and pin this rank's GPU; no-op alone."""
        if self.ddp:
            if device.startswith("cuda"):
                torch.cuda.set_device(device)
            tdist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")

    def all_sum(self, t):
        """Sum a tensor over ranks, in place (no-op for one process)."""
        if self.ddp:
            tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
        return t

    def share(self, items):
        """This rank's contiguous share of an update's micro-batches."""
        m = len(items) // self.world
        return items[self.rank * m:(self.rank + 1) * m]


@contextlib.contextmanager
def hold_run_folder(out_dir, dist):
    """Within: --out_dir held by this training run (harness.cli.FolderLock, taken by rank 0), so a
    second training run into it, in any process count, is refused before anything is written, with
    one line naming the folder and the process holding it (UsageError on every rank). Released at
    exit, however the run ends; a folder the hold created and nothing else used is removed again."""
    lock = FolderLock(out_dir)
    refusal = [None]
    if dist.main:
        try:
            lock.acquire(lambda holder: UsageError(
                f"--out_dir {out_dir}: another training run is writing there ({holder}); wait for it to end, "
                "or give another --out_dir (reading it, --eval_only and sample.py, needs no wait)"))
        except UsageError as e:
            refusal[0] = str(e)
    if dist.ddp:
        tdist.broadcast_object_list(refusal, 0)
    if refusal[0] is not None:
        raise UsageError(refusal[0])
    try:
        yield
    finally:
        lock.release()


# ----------------------------------------------------------------------------- console, log.jsonl

class Log:
    """log.jsonl and console output; silent on ranks other than 0.

    A run keeps its records in memory until start_writing(), which train.py calls once the first
    update has run (a resumed run with no updates left: before its final evaluation): only then does a fresh run create out_dir, remove an earlier run's checkpoints,
    summary and log (remove_stale) and write its log, and a resumed run trim its log to the update
    it resumes from (trim_log), remove an earlier finish's summary.json and append. A run that fails
    before that (a batch that does not fit in memory, a non-finite first loss, Ctrl-C) leaves
    out_dir as it found it."""

    def __init__(self, out_dir, dist, resumed_at=None, quiet=False, total=0, desc=""):
        self.main = dist.main
        self.out_dir, self.path = out_dir, os.path.join(out_dir, "log.jsonl")
        self.resumed_at = resumed_at
        self.f = self.bar = None
        self.pending = [] if self.main else None  # the records (JSON lines) until start_writing
        if self.main and not quiet:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=resumed_at or 0, desc=desc, dynamic_ncols=True)

    def start_writing(self):
        """The run's first update has run: prepare out_dir (see the class) and write the records kept
        so far. A no-op on other ranks and after the first call."""
        if self.pending is None:
            return
        stale = []
        if self.resumed_at is None:
            os.makedirs(self.out_dir, exist_ok=True)
            stale = remove_stale(self.out_dir)
        else:
            trim_log(self.path, self.resumed_at)  # drop records after the checkpoint being resumed
            summary = os.path.join(self.out_dir, "summary.json")
            if os.path.exists(summary):  # an extended finished run: unfinished until finish writes its own
                os.remove(summary)
        self.f = open(self.path, "w" if self.resumed_at is None else "a")
        self.f.writelines(self.pending)
        self.f.flush()
        self.pending = None
        if stale:
            self.say(f"note: fresh run in {self.out_dir}: removed {', '.join(stale)} of an earlier run "
                     "(use --resume to continue a run)")

    def emit(self, **rec):
        line = json.dumps(rec) + "\n"  # now: the record as it is at this point of the run
        if self.pending is not None:
            self.pending.append(line)
        elif self.f:
            self.f.write(line)
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


def check_flags(args, given, dist=None, reads_out_dir=False):
    """Every check of the flags that train.py makes before it reads data or writes anything (after
    --resume or --eval_only filled in the run's own flags): a model flag or dataset flag given
    (given: the names on the command line) that the run ignores, then the tier defaults and value
    checks of resolve_args. Returns the resolved args; UsageError on bad input. tools.sweep
    checks every grid run's flags with it before any run starts."""
    check_model_flags(args.model, given)  # a flag this model ignores
    check_dataset_flags(args, given)  # a flag this dataset ignores (--em_samples without dmmath)
    args = resolve_args(args, dist, reads_out_dir)  # tier defaults, device, validation
    check_idle_flags(flags_config(args, 1), given)  # a flag this model's other flags leave idle
    return args
