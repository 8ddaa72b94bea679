"""Shared plumbing for every model: errors, RMSNorm, RoPE, the LM wrapper, width solving.

Each architecture file (tango.py, baselines.py, ...) defines only its residual *body*
(a module mapping embeddings (B, T, d) to the final residual stream (B, T, d)); the token
embedding, the tied head, the loss, cached generation and parameter counting live here
(MATH.md, "What every model shares"), so every model has the same API:

    model = build_model(cfg)                       # models.py
    logits, loss = model(idx, targets, positions)  # (B, T, V), scalar NLL in nats/token
    logits, nll = model(idx, targets, reduction="sum")  # the summed NLL (nats) training uses
    out = model.generate(idx, max_new_tokens, temperature=1.0, top_k=None)
    model.num_params()                             # non-embedding parameters
"""
import argparse
import contextlib
import functools
import inspect
import numbers
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, asdict, fields
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F


class UsageError(ValueError):
    """Bad user input (a flag, a file, a checkpoint). train.py prints str(e) on one line and exits 2."""


class DefaultsHelp(argparse.HelpFormatter):
    """--help with '(default: X)' after a flag's help, unless the flag is required, is a switch that is
    off unless given (store_true; a --x/--no-x pair does say which side), has no default to show
    (None or "": its help says what happens without it) or its help already says its default. A
    flag without help text shows nothing (argparse's rule): every flag has help text (a test)."""

    def _get_help_string(self, action):
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if (action.required or switch or "default" in (action.help or "")
                or action.default is None or action.default in ("", argparse.SUPPRESS)):
            return action.help
        return (action.help or "") + " (default: %(default)s)"


INT64_RANGE = (-2**63, 2**63 - 1)  # what torch and numpy hold in an integer


def int64_flag(text):
    """argparse's type=int for every command: an integer flag beyond int64 (--width 1e20 written out)
    would reach torch or numpy and end in an OverflowError traceback."""
    v = int(text)
    if not INT64_RANGE[0] <= v <= INT64_RANGE[1]:
        bound = "most 2**63 - 1" if v > 0 else "least -2**63"
        raise argparse.ArgumentTypeError(f"{text}: beyond a 64-bit integer (at {bound})")
    return v


class WholeFlagParser(argparse.ArgumentParser):
    """argparse that takes flags by their whole names only: argparse would read --out as --out_dir,
    past every check that looks for a flag by name (tools.sweep's, given_flags'); every command's
    --help (subcommands' too) shows each flag's default (DefaultsHelp); type=int reads an int64
    (int64_flag); a negative number in any spelling (-1e-3, -inf) is a flag's value, not a flag
    (argparse before Python 3.13 reads -1e-3 as an unknown flag: "expected one argument")."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelp)
        super().__init__(*args, **kwargs)
        self.register("type", int, int64_flag)  # argparse looks a flag's type up here before calling it
        self._negative_number_matcher = re.compile(r"^-(\.?\d|inf|nan)", re.IGNORECASE)  # (no flag starts so)


class UsageParser(WholeFlagParser):
    """argparse for the command lines: a bad flag is a UsageError (one line "error: ...", exit code
    2, printed by the command's main) instead of argparse's usage block."""

    def error(self, message):
        raise UsageError(f"{message} (see python {self.prog} --help)")


class ExitParser(WholeFlagParser):
    """argparse for the tools' command lines: a bad flag is one line "PROG: error: ..." on stderr and
    exit code 2, without argparse's usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def owner_tag():
    """'<pid>-<host>' of this process, in the names of the temporary files and folders it writes
    (checkpoints, prepared data), so remove_orphans can tell a live writer's from a dead one's."""
    return f"{os.getpid()}-{socket.gethostname()}"


def remove_orphans(folder, prefix, random_suffix=False, min_age=3600):
    """Remove the entries of folder named prefix + owner_tag() (+ "-" and mkdtemp's 8 random
    characters with random_suffix) whose process on this host has ended and that nothing has
    changed for min_age seconds: what a kill -9 or a power loss left half-written (SIGTERM and
    Ctrl-C clean up after themselves). Another host's (a shared file system), a live process's and
    a recent one's (a writer in another pid namespace of the same host name) are kept."""
    name_re = re.compile(re.escape(prefix) + r"(\d{1,9})-" + re.escape(socket.gethostname())
                         + (r"-[a-z0-9_]{8}" if random_suffix else "") + "$")
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = name_re.match(name)
        path = os.path.join(folder, name)
        if not m or _alive(int(m.group(1))) or time.time() - _last_change(path) < min_age:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)


def _last_change(path):
    """The newest modification time of path and, for a folder, of the files in it."""
    try:
        times = [os.lstat(path).st_mtime]
        if os.path.isdir(path) and not os.path.islink(path):
            times += [e.stat(follow_symlinks=False).st_mtime for e in os.scandir(path)]
        return max(times)
    except OSError:
        return time.time()  # (gone or unreadable: not removed)


def _alive(pid):
    try:
        os.kill(pid, 0)  # signal 0: nothing sent, only whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (PermissionError), or a platform without signal 0
        return True
    return True


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's stop, `timeout`, torchrun stopping its workers), raised by
    run_command's handler: it unwinds as Ctrl-C does, so temporary files and folders are removed."""


def _on_sigterm(main_pid, signum, frame):
    if os.getpid() != main_pid:  # a forked worker (data preparation's pool): end as SIGTERM would
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    raise Terminated


def host_memory_free():
    """Bytes of host memory this process may still take before Linux's out-of-memory killer acts:
    MemAvailable + SwapFree of /proc/meminfo, or less when its cgroup (v2) has a lower memory.max;
    None where these files do not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
        free = info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, ValueError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as m, open("/sys/fs/cgroup/memory.current") as c:
            top = m.read().strip()
            if top != "max":
                free = min(free, int(top) - int(c.read()))
    except (OSError, ValueError):
        pass
    return free


@contextlib.contextmanager
def host_memory_limit():
    """Within: this process's data memory (RLIMIT_DATA) capped at its size now plus host_memory_free(),
    on Linux without a GPU. Linux overcommits memory, so without a cap a CPU batch past the host's memory
    allocates until the kernel kills the process (exit 137, no message); with it the allocation fails
    and run_command prints its one line. A tighter limit already set is kept; restored on exit."""
    free = host_memory_free() if sys.platform.startswith("linux") and not torch.cuda.is_available() else None
    if free is None:
        yield
        return
    import resource
    try:
        with open("/proc/self/status") as f:
            data = int(re.search(r"^VmData:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024
    except (OSError, AttributeError):
        yield
        return
    old = resource.getrlimit(resource.RLIMIT_DATA)
    cap = min(x for x in (data + max(free, 0), old[0], old[1]) if x != resource.RLIM_INFINITY)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, old)


def run_command(main, sizes=()):
    """Run a command's main() (its return value is the exit code, None for 0). sizes: the command's
    flags that set how much memory it takes, named by its out-of-memory line. A reader that closes
    the pipe early (python sample.py | head) ends the command quietly with exit code 1 instead of a
    BrokenPipeError traceback (the way the Python docs give, see signal's "Note on SIGPIPE"); a
    character the console's encoding lacks prints as its escape (\ufffd), not a UnicodeEncodeError. Sizes
    this machine cannot hold (host or GPU memory) end in one line and exit code 2, not a traceback;
    Ctrl-C ends in one line ("interrupted", with what the command says of its state) and exit code
    130, SIGTERM the same way ("terminated", exit code 143 = 128 + SIGTERM)."""
    if hasattr(sys.stdout, "reconfigure"):  # a console that cannot show a sampled character (ascii, cp1252): \ufffd
        sys.stdout.reconfigure(errors="backslashreplace")
    main_thread = threading.current_thread() is threading.main_thread()  # (signal handlers: main thread only)
    previous = signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, os.getpid())) if main_thread else None
    try:
        with host_memory_limit():
            code = main()
        sys.stdout.flush()
    except KeyboardInterrupt as e:
        term = isinstance(e, Terminated)
        print(("terminated" if term else "interrupted") + (f": {e}" if str(e) else ""), file=sys.stderr)
        code = 143 if term else 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush would fail too
        code = 1
    except (MemoryError, torch.OutOfMemoryError, RuntimeError, ValueError) as e:
        if not is_out_of_memory(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        print(f"error: out of memory ({first})" + (f"; give smaller sizes ({', '.join(sizes)})" if sizes else ""),
              file=sys.stderr)
        code = 2
    finally:
        if previous is not None:  # (a caller in this process, a test, keeps its own handling)
            signal.signal(signal.SIGTERM, previous)
    sys.exit(code)


SIZE_ERRORS = ("can't allocate memory",  # torch's CPU allocator (RuntimeError)
               "Storage size calculation overflowed",  # torch: a tensor of more than 2**63 bytes (RuntimeError)
               "array is too big")  # numpy: the same (ValueError)


def is_out_of_memory(e):
    """True for an allocation failure: MemoryError (numpy's too), CUDA's OutOfMemoryError, or torch's
    or numpy's error for a size no memory holds (SIZE_ERRORS, e.g. --batch_size 2**62)."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or any(m in str(e) for m in SIZE_ERRORS)


def seed_flag(text):
    """argparse type of a seed flag: an int of any size, not int64_flag's range; check_seed gives a
    seed's range, [0, 2**64), which torch.manual_seed takes."""
    return int(text)


seed_flag.__name__ = "int"  # argparse's message for a non-number: "invalid int value: 'x'"


def check_seed(flag, seed):
    """UsageError unless seed lies in [0, 2**64): numpy's default_rng refuses a negative seed and
    torch.manual_seed one of 2**64 or more, each with a traceback."""
    if not 0 <= seed < 2 ** 64:
        raise UsageError(f"{flag} {seed}: must be >= 0" if seed < 0 else f"{flag} {seed}: must be < 2**64")


FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # optimizer hyperparameters become float32 on the tensors


def check_rate(flag, value, positive=True, note=""):
    """UsageError unless value is a number > 0 (>= 0 with positive=False) that a float32 holds:
    AdamW's update raises "value cannot be converted to type float without overflow" on a
    learning rate (or lr x weight decay) above 3.4e38 after the run has started. note ends the message."""
    if not (0 < value if positive else 0 <= value) or not value <= FLOAT32_MAX:
        raise UsageError(f"{flag} {value}: must be a finite number {'>' if positive else '>='} 0 "
                         f"(at most 3.4e38, a float32){note}")


def check_decayed_rate(lr_flag, lr, weight_decay):
    """UsageError if learning rate x weight decay exceeds a float32: AdamW's decoupled decay
    multiplies them, with check_rate's overflow after the run has started."""
    if lr * weight_decay > FLOAT32_MAX:
        raise UsageError(f"{lr_flag} x --weight_decay = {lr * weight_decay:.3g}: must be at most 3.4e38 (a float32)")


def not_a_command(module, use):
    """What a companion module run directly does (python text_data.py, ...): one line on stderr
    naming the command it belongs to, `use`, and exit code 2, instead of exiting silently."""
    print(f"error: {module} has no command line of its own; use {use}", file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------------------- output paths
# Every command checks the paths it will write before any work, with these two functions, and
# creates the missing folders itself when it writes (os.makedirs; make_parent for a file's), as
# train.py --out_dir and data.py --data_root always have: a path in a missing folder is no error.

def repeated(items):
    """The first entry of items (a list flag's entries, as the command reads them) that an earlier
    one equals, else None: a repeat would be run, timed or counted twice, or dropped without a word,
    so each command refuses it ("FLAG VALUE: X given twice")."""
    seen = set()
    for x in items:
        if x in seen:
            return x
        seen.add(x)
    return None


def check_not_empty(flag, path, give='a folder ("." for this one)'):
    """UsageError 'FLAG "": an empty path; give ...' for a path flag given as "": refused, not read as
    its default or as this folder."""
    if path == "":
        raise UsageError(f'{flag} "": an empty path; give {give}')


def check_output_folder(flag, path):
    """UsageError "FLAG PATH: ..." unless path (an output folder, e.g. --out_dir) is a folder this
    process can write into, or can be created: not a file, no file among its parents, a writable
    nearest existing folder. flag: as typed, e.g. "--out_dir". Creates nothing."""
    check_not_empty(flag, path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: exists and is not a folder")
    _check_creatable(flag, path, os.path.abspath(path))


def check_output_file(flag, path):
    """UsageError "FLAG PATH: ..." unless path (an output file, e.g. --json) can be written: not a
    folder, and its folder exists or can be created (make_parent creates it when the file is
    written). Creates nothing."""
    check_not_empty(flag, path, "a file path")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a folder; give a file path")
    _check_creatable(flag, path, os.path.dirname(os.path.abspath(path)))


def check_output_files(flags_paths):
    """check_output_file for each (flag, path) of one command's outputs, then UsageError when two
    of them name the same file (the second would overwrite the first). Creates nothing."""
    seen = {}
    for flag, path in flags_paths:
        check_output_file(flag, path)
        key = os.path.normcase(os.path.realpath(path))
        if key in seen:
            raise UsageError(f"{flag} {path}: the same file as {seen[key]}; give another path")
        seen[key] = flag


def _check_creatable(flag, path, folder):
    """UsageError unless folder exists and is writable, or can be created."""
    parent = folder
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: {parent} is a file, not a folder")
    try:  # a folder made and removed at once (os.access says yes to root even where nothing can be made)
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".write-check-"))
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create folders in {parent} ({e.strerror})") from None


def make_parent(path):
    """Create the missing folders above the output file path (checked by check_output_file);
    returns path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def write_atomic(path, write, binary=False):
    """Write the file at path through write(f) (a file object, binary or text) into a temporary file
    beside it, flushed to disk, then os.replace it onto path: a crash or an error at any point
    leaves the previous file at path whole, or none, never a half-written one (and no temporary
    file behind; one that a killed process left is removed by the next write, remove_orphans).
    Returns path."""
    folder = os.path.dirname(os.path.abspath(path))
    remove_orphans(folder, os.path.basename(path) + ".tmp-")
    tmp = f"{path}.tmp-{owner_tag()}"
    try:
        with open(tmp, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows it
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path


def write_text(path, text):
    """write_atomic of a text file (UTF-8) whose whole content is text. Returns path."""
    return write_atomic(path, lambda f: f.write(text))


HEAD_DIM = 32  # d_h = 32 everywhere (MATH.md glossary)
VOCAB_MULTIPLE = 64  # the embedding/head has ceil(V / 64) * 64 rows (aligned matmul); rows >= V are padding


@dataclass
class ModelConfig:
    """Every model's hyperparameters (one dataclass for all architectures, saved in checkpoints).

    model: registry name (models.py); vocab_size V; block_size: training context T;
    n_embd: residual width d; n_head: H = d / 32; depth: K block applications;
    width: expansion width F (TANGO gated width, Transformer++ feed-forward width, ...);
    window: Windowed TANGO window W (MATH.md, "TANGO").
    gau_s, chunk, tie_unit: GAU/FLASH shared dim s, FLASH chunk C, one unit shared by all K
    applications (MATH.md, "GAU and FLASH").
    """
    model: str = "tango"
    vocab_size: int = 50257
    block_size: int = 256
    n_embd: int = 128
    n_head: int = 4
    depth: int = 8
    width: int = 512
    window: int = 256
    gau_s: int = 128
    chunk: int = 256
    tie_unit: bool = True
    # Parcae / recurrent-depth model RDM (parcae.py): prelude -> core looped -> coda.
    n_prelude: int = 2          # L_P Transformer++ (RDM: sandwich) blocks before the loop
    n_core: int = 2             # L_R blocks in the recurrent core (one recurrence = L_R block applications)
    n_coda: int = 2             # L_C blocks after the loop
    mu_rec: int = 0             # mean training recurrence; 0 = depth (parcae.resolve_recurrence)
    mu_bwd: int = 0             # recurrences backpropagated through; 0 = ceil(mu_rec / 2)
    # Depth-Attention (depth_attention.py): candidate layers C(l) = {j < l: j mod da_stride == 0} U recent window
    da_stride: int = 0          # 0 = floor(depth / 2) (the paper's default); -1 = no strided candidates
    da_recent: int = 0          # r: also mix the r layers just below
    # PonderLM-2 (ponder.py)
    n_thoughts: int = 1         # thought slots per token (0 = untied Transformer++)
    jacobi: int = 3             # Jacobi refinements of the thoughts (evaluation, prefill; training without jacobi_random)
    jacobi_random: bool = True  # training draws the refinements from U{2, 3}
    # LRT / LRT with thought tokens (latent_recurrence.py); n_thoughts above is lrt-think's thought slots
    lrt_src: int = -1           # source block whose output feeds the next slot (-1: floor(2K/3))
    lrt_tgt: int = 0            # target block whose input receives W_m m
    lrt_kv: bool = False        # also a private memory key/value slot in every block's softmax
    lrt_subsets: int = 2        # k: interleaved position subsets of the parallel refinement
    lrt_detach_init: bool = False  # the init pass without gradients
    # Parallel loops (plt.py): loopstack / plt / loopfold run n_core blocks as depth = N loops
    plt_window: int = 64        # PLT: G-SWA window W (keys t-W < j <= t of the loop's own cache)
    plt_shift: bool = True      # PLT: cross-loop shift (loop l at t reads loop l-1 at t-1); False: the release's unshifted loops
    fold: int = 2               # LoopFold: fold width f (loops per stage)
    fold_rank: int = 0          # LoopFold: predictor/corrector rank r (0 = d/4)
    fold_layout: str = "first"  # LoopFold: "first" (loop 1 alone, then groups of f) or "last" (groups, then loop N alone)
    # config keys ignored on load (from_dict): nothing reads them
    DEAD_FIELDS: ClassVar[tuple] = ("kl_exit", "kl_threshold")

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k not in cls.DEAD_FIELDS}
        unknown = set(d) - names
        if unknown:
            raise UsageError(f"checkpoint config has unknown fields {sorted(unknown)}")
        return cls(**d)


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain (MATH.md, "What every model shares"). x: (..., d) -> (..., d)."""
    no_decay = ("weight",)  # a gain: no weight decay (train.no_decay_parameters)

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_cos_sin(positions, head_dim=HEAD_DIM, base=10000.0, dtype=torch.float32):
    """Rotary tables for integer positions (T,) or (B, T) -> cos, sin of shape (B|1, 1, T, head_dim/2)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    ang = positions.to(torch.float64)[..., None] * inv_freq  # (..., T, hd/2), float64 so long positions stay exact
    if ang.dim() == 2:
        ang = ang[None]
    ang = ang[:, None]  # (B|1, 1, T, hd/2)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def compute_dtype(x):
    """The dtype matmuls on x run in: the autocast dtype when autocast is on for x's device, else x.dtype."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def apply_rope(x, cos, sin):
    """Rotate pairs (x[..., :hd/2], x[..., hd/2:]) of x: (B, H, T, hd) by the angles in cos/sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def causal_attention(q, k, v, scale=None):
    """Causal softmax attention of L new queries over S >= L keys (the last L keys are the queries' own).

    q: (B, H, L, dk), k: (B, H, S, dk), v: (B, H, S, dv) -> (B, H, L, dv). Query i sees keys
    j <= i + (S - L) (lower-right alignment), which covers training (L = S), prefill and
    single-token decoding with a cache.
    """
    L, S = q.shape[-2], k.shape[-2]
    if L == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if L == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(diagonal=S - L)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# ----------------------------------------------------------------------------- regional compilation
# torch.compile of the whole model would unroll the K block applications into one graph (compile
# time grows with K) and guard on the step shapes of every call. Instead each body marks its
# repeated unit (one block application, one TANGO update, one GAU unit) with @compiled_region and
# compile_regions(model) compiles those functions once: every application reuses the same graph
# (parameters are graph inputs, so untied blocks share it too), whatever K is.

def compiled_region(fn):
    """Mark a module method as a compiled region. Before compile_regions() (and for a module that
    was not passed to it) the method runs eagerly. A call with a decoding cache (the method's
    `cache` argument not None) always runs eagerly: decoding shapes change with every token, and
    one prompt is not worth a compile."""
    names = list(inspect.signature(fn).parameters)[1:]  # without self
    pos = names.index("cache") if "cache" in names else None

    @functools.wraps(fn)
    def call(self, *args, **kw):
        compiled = self.__dict__.get("_compiled_regions", {}).get(fn.__name__)
        if compiled is None or pos is None:
            return fn(self, *args, **kw)
        cache = kw["cache"] if "cache" in kw else args[pos] if pos < len(args) else None
        return fn(self, *args, **kw) if cache is not None else compiled(self, *args, **kw)

    call.region = fn
    return call


def compile_regions(model, **compile_kw):
    """Regional compilation: torch.compile(fn, **compile_kw) for each @compiled_region method of
    model's modules, one compiled function per method shared by every module that has it.
    Returns the model (modified in place; its parameters and state_dict are unchanged).
    dynamic=False unless given: every graph has static shapes (training and the padded evaluation
    batches keep one shape each, harness.evaluation), so no region compiles a symbolic dimension.
    A module whose region traces several graphs per mode says how many (compile_variants, e.g.
    Depth-Attention: one per candidate count); Dynamo's recompile limit is raised to 4 graphs
    (train, eval, ...) per variant, past which the region would run eagerly after a warning."""
    compile_kw.setdefault("dynamic", False)  # static shapes: a new batch size gets its own graph, none symbolic
    variants = max(getattr(m, "compile_variants", 1) for m in model.modules())
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * variants)
    compiled = {}
    for m in model.modules():
        for cls in reversed(type(m).__mro__):
            for name, attr in vars(cls).items():
                fn = getattr(attr, "region", None)
                if fn is not None:
                    if fn not in compiled:
                        compiled[fn] = torch.compile(fn, **compile_kw)
                    m.__dict__.setdefault("_compiled_regions", {})[name] = compiled[fn]
    return model


CE_ROWS = 8192  # tokens per cross-entropy chunk for bf16/fp16 logits (LM.head)


def _nll_sum(logits, targets):
    """Summed NLL (nats) of logits (N, V) widened to float32 or wider, over targets != -1."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> float32; float64 stays
    return F.cross_entropy(wide, targets, ignore_index=-1, reduction="sum")


class LM(nn.Module):
    """Token embedding E (V x d) -> body -> RMSNorm -> tied head x E^T (MATH.md, "What every model shares").

    E is stored with ceil(V / 64) * 64 rows (VOCAB_MULTIPLE: the head matmul gets an aligned
    size); the padding rows are zero, never looked up, their logits are -inf in the loss (a fixed
    bias) and sliced off the returned logits, so they are never predicted, sampled, trained or
    counted in num_params.

    The body is any module with forward(x, cos, sin, cache) -> x on (B, T, d) tensors; cache is
    None (training) or a dict the body keeps its decoding state in (keys per application, ...).
    """

    def __init__(self, cfg: ModelConfig, body: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.body = body
        self.norm_f = RMSNorm(cfg.n_embd)
        if hasattr(body, "use_final_norm"):  # a body that also applies the final norm between its loops (PLT)
            body.use_final_norm(self.norm_f)
        if not self.wte.weight.is_meta:  # meta tensors (parameter counts) hold no values: drawing them is only time
            self.apply(self._init_weights)
            # residual output projections get a smaller init, as in GPT-2 (marked by the bodies)
            for m in self.modules():
                if getattr(m, "is_residual_out", False):
                    nn.init.normal_(m.weight, std=0.02 / (2 * cfg.depth) ** 0.5)
        # pad E after the init, so the padding draws no random numbers (the same initial weights as V rows)
        pad = -cfg.vocab_size % VOCAB_MULTIPLE
        self.wte.weight = nn.Parameter(F.pad(self.wte.weight.detach(), (0, 0, 0, pad)))
        self.wte.num_embeddings = cfg.vocab_size + pad
        # the head's bias: 0 on the V real columns, -inf on the padding ones (not a parameter, not saved)
        self.register_buffer("vocab_bias", F.pad(torch.zeros(cfg.vocab_size), (0, pad), value=float("-inf")),
                             persistent=False)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def num_params(self, non_embedding=True):
        """Parameter count, each shared tensor counted once; non_embedding excludes E.
        E counts V x d (its padding rows are not parameters of the model)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() already de-duplicates shared tensors
        return n - self.wte.weight.numel() if non_embedding else n - self.wte.weight[self.cfg.vocab_size:].numel()

    def forward(self, idx, targets=None, positions=None, cache=None, reduction="mean"):
        """idx: (B, T) int64 token ids; targets: (B, T) with -1 = not scored; positions: (T,) or
        (B, T) RoPE position ids (default: 0..T-1, continuing after a cache's length).

        Returns logits (B, T, V) and the NLL over the scored targets (None without targets):
        reduction "mean" in nats/token, "sum" in nats (what training sums over micro-batches and
        divides by their count of scored targets). ValueError for another reduction.
        """
        x = self.wte(idx)
        return self.forward_embeds(x, targets, positions, cache, reduction)

    def forward_embeds(self, x, targets=None, positions=None, cache=None, reduction="mean"):
        """forward() from input embeddings x: (B, T, d) (used by latent tokens; MATH.md, "Latent tokens")."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction {reduction!r}: must be 'mean' or 'sum'")
        T = x.shape[1]
        if positions is None:
            start = cache.get("len", 0) if cache is not None else 0
            positions = torch.arange(start, start + T, device=x.device)
        dtype = compute_dtype(x)
        if getattr(self.body, "rope_float32", False):  # TANGO: its scores' precision (Tango.rope_float32)
            dtype = torch.promote_types(dtype, torch.float32)
        cos, sin = rope_cos_sin(positions, dtype=dtype)  # once per forward, for every application
        x = self.body(x, cos, sin, cache)
        if cache is not None:
            cache["len"] = cache.get("len", 0) + T
        return self.head(x, targets, cache, reduction)

    def logits(self, x):
        """Tied head on final-norm outputs x: (..., d) -> logits (..., V) (the padding rows sliced off)."""
        return (x @ self.wte.weight.t())[..., :self.cfg.vocab_size]

    @compiled_region
    def head(self, x, targets=None, cache=None, reduction="mean"):
        """Final norm, head and the NLL over targets != -1: summed (nats) for reduction "sum", that
        sum over the count of scored targets for "mean" (nats/token; None without targets).
        x: (B, T, d) -> logits (B, T, V), loss. cache only marks a decoding call (run eagerly).
        bf16/fp16 logits: the NLL by chunks of CE_ROWS tokens, each widened to float32 and
        recomputed in backward, so no float32 copy of all the logits (nor its log-softmax) is kept."""
        # (B, T, Vp): the aligned matmul over the padded rows, whose logits the bias sets to -inf, so
        # the loss reads them contiguous (no copy of a V-column slice) and they get no gradient
        padded = F.linear(self.norm_f(x), self.wte.weight, self.vocab_bias)
        loss = None
        if targets is not None:
            flat, tgt = padded.view(-1, padded.size(-1)), targets.reshape(-1)
            if padded.dtype in (torch.bfloat16, torch.float16):  # float32 only per chunk, recomputed in backward
                loss = sum(torch.utils.checkpoint.checkpoint(_nll_sum, flat[r:r + CE_ROWS], tgt[r:r + CE_ROWS],
                                                             use_reentrant=False) for r in range(0, len(tgt), CE_ROWS))
            else:  # float32 / float64: one call, as before (the same sums to the bit)
                loss = _nll_sum(flat, tgt)
            if reduction == "mean":
                loss = loss / (targets != -1).sum()
        return padded[..., :self.cfg.vocab_size], loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, stop_token=None):
        """Sample max_new_tokens continuing idx (B, T) with a decoding cache; returns (B, T + n).

        max_new_tokens: int >= 0; temperature, top_k: as in sample_next (temperature 0 = greedy,
        top_k None = all tokens, top_k > V keeps all V). A row that emitted stop_token has stopped:
        its later positions repeat stop_token (the batch stays rectangular), and generation ends
        when every row has stopped. Raises ValueError naming the argument for a value outside these
        ranges.
        """
        check_sampling(temperature, top_k, max_new_tokens)
        cache = {}
        logits, _ = self(idx, cache=cache)
        out = idx
        done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        for i in range(max_new_tokens):
            nxt = sample_next(logits[:, -1, :].float(), temperature, top_k)
            if stop_token is not None:
                nxt = torch.where(done[:, None], stop_token, nxt)  # a stopped row samples no more
                done |= nxt[:, 0] == stop_token
            out = torch.cat((out, nxt), dim=1)
            if (stop_token is not None and bool(done.all())) or i == max_new_tokens - 1:
                break  # (the last token is not fed: nothing reads its logits)
            logits, _ = self(nxt, cache=cache)
        return out


def past_context_note(prompt_len, max_new_tokens, block_size, verb="sampled"):
    """The note (str) for a decode whose positions pass the trained context block_size, or None
    within it: prompt_len + max_new_tokens - 1 positions are fed (the last new token is sampled,
    never fed). RoPE still gives those positions an angle; the model never trained on them. verb:
    how the tokens are chosen ("decoded" for greedy benchmarks)."""
    if prompt_len + max_new_tokens - 1 <= block_size:
        return None
    return (f"note: {prompt_len} prompt + {max_new_tokens} new tokens exceed the trained context of {block_size} "
            f"by more than the last token: the later tokens are {verb} at positions never trained on")


def nll_unit(tokenizer):
    """The unit of an NLL on data of `tokenizer`: nats/char for characters, else nats/token."""
    return "nats/char" if tokenizer == "char" else "nats/token"


def synchronizer(device):
    """A function that waits for the work queued on `device`, for timers: torch.cuda.synchronize
    of that very GPU (with no argument it would wait for the current one, cuda:0); CPU: nothing."""
    if str(device).startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def host_values(x):
    """x with every tensor read back as a Python float (dicts and lists walked): a diagnostics
    record taken as device tensors, read when the host syncs anyway."""
    if isinstance(x, dict):
        return {k: host_values(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [host_values(v) for v in x]
    return float(x) if torch.is_tensor(x) else x


def check_sampling(temperature=1.0, top_k=None, max_new_tokens=0):
    """ValueError naming the argument unless temperature is a finite number >= 0, top_k is None
    or an int >= 1 and max_new_tokens an int >= 0 (bools are not counts)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature {temperature!r}: must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k {top_k!r}: must be None (all tokens) or an int >= 1")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens {max_new_tokens!r}: must be an int >= 0")


def sample_next(logits, temperature=1.0, top_k=None):
    """logits (B, V) -> next ids (B, 1), drawn from softmax(logits / temperature) over the top_k
    largest logits (ties at the k-th value all kept; top_k None or >= V: every token).

    temperature 0 = argmax. Any positive temperature is safe, however small: the logits are
    shifted by their row maximum and divided in float64, so 1e-30 gives the argmax (uniform over
    exact ties) instead of an overflow. Raises ValueError for a negative, infinite or NaN
    temperature or a top_k below 1 (check_sampling).
    """
    check_sampling(temperature, top_k)
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    z = logits.double()
    if top_k is not None and top_k < z.size(-1):
        v, _ = torch.topk(z, top_k)
        z = z.masked_fill(z < v[:, [-1]], float("-inf"))
    z = (z - z.amax(-1, keepdim=True)) / temperature  # <= 0, exactly 0 at the maximum: no overflow
    return torch.multinomial(F.softmax(z, dim=-1), num_samples=1)
