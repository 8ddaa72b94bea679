"""What every command line shares: argparse parsers that name the flag in a one-line error, flag
checks (seeds, rates, list repeats, paths), process handling (SIGTERM, out of memory, a host-memory
cap, broken pipes: run_command) and atomic output files (write_atomic). No model code reads it.
"""
import argparse
import contextlib
import dataclasses
import errno
import functools
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

import torch

from common import UsageError, is_out_of_memory


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss, gradient or dev NLL); exit code 1."""


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
    130, SIGTERM the same way ("terminated", exit code 143 = 128 + SIGTERM); a write on a full disk
    (disk_full) in one line and exit code 1."""
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
    except (MemoryError, torch.OutOfMemoryError, RuntimeError, ValueError, OSError) as e:
        full = disk_full(e)  # any command's write on a full disk (train.py says more: its checkpoint)
        if full is None and not is_out_of_memory(e):
            raise
        if full is not None:
            where = f"{full.filename}: " if full.filename else ""
            print(f"error: {where}{full_disk_text(full)}; free some space and run the command again", file=sys.stderr)
            code = 1
        else:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            print(f"error: out of memory ({first})" + (f"; give smaller sizes ({', '.join(sizes)})" if sizes else ""),
                  file=sys.stderr)
            code = 2
    finally:
        if previous is not None:  # (a caller in this process, a test, keeps its own handling)
            signal.signal(signal.SIGTERM, previous)
    sys.exit(code)


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


def check_output_folder(flag, path, probe=True):
    """UsageError "FLAG PATH: ..." unless path (an output folder, e.g. --out_dir) is a folder this
    process can write into, or can be created: not a file, no file among its parents, a writable
    nearest existing folder (probe=False: that last is not checked, for a folder that is written
    only when what it holds is missing, as --data_root). flag: as typed, e.g. "--out_dir". Creates
    nothing."""
    check_not_empty(flag, path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: exists and is not a folder")
    _check_creatable(flag, path, os.path.abspath(path), probe)


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


def _check_creatable(flag, path, folder, probe=True):
    """UsageError unless folder exists and is writable, or can be created (probe=False: unless its
    nearest existing folder is a file)."""
    parent = folder
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: {parent} is a file, not a folder")
    if not probe:
        return
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


def add_flags(add, cls, tier_help=None, defaults=True):
    """Declare the flag fields of dataclass cls (common.flag: default, help, tier) through add, a
    parser's or group's add_argument: an int field takes int64_flag, a bool a --x/--no-x pair, the
    others their annotated type. A tier field's default is None (resolved from --size later) and its
    help ends with tier_help(name); defaults=False leaves every flag unset when not given (a tool that
    passes on only the flags given)."""
    from common import flag_fields
    types = {"int": int, "float": float, "str": str, "bool": bool}
    for f in flag_fields(cls):
        kind = types[f.type if isinstance(f.type, str) else f.type.__name__]
        tier = f.metadata["tier"]
        text = f.metadata["help"].replace("%", "%%")  # (argparse formats help with %: "20 %" is text)
        text += "; " + tier_help(f.name) if tier and tier_help else ""
        default = None if tier else f.default
        if not defaults:
            default = argparse.SUPPRESS
            text += "" if tier else f" (default: {f.default})"
        if kind is bool:
            add(f"--{f.name}", action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            add(f"--{f.name}", type=kind, default=default, help=text)


def values(args, cls):
    """The dataclass cls (harness.optim.Schedule, AdamW, ...) of the parsed flags args: each field
    read from the flag of its name, so below the command line a value travels, not the namespace."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


class FolderLock:
    """An exclusive hold of a folder by one writing process: <folder>/.lock, locked with flock and
    holding '<pid> on <host> since <UTC time>' for the message of a second writer. The kernel drops
    the lock when the process ends, however it ends (kill -9 too), so a lock file left behind is
    stale and taken over. acquire() creates the folder if it is missing; release() removes the lock
    file, and the folders acquire created when nothing else was written there. Readers
    take no lock. A file system without flock (some network mounts) holds no lock: acquire works."""

    NAME = ".lock"

    def __init__(self, folder):
        self.folder, self.fd, self.created = folder, None, []

    def acquire(self, refuse):
        """Take the hold; refuse(holder) -> the exception to raise when another live process holds it
        (holder: its '<pid> on <host> since ...' text)."""
        import fcntl
        missing, parent = [], os.path.abspath(self.folder)
        while not os.path.isdir(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        os.makedirs(self.folder, exist_ok=True)
        self.created = missing  # innermost first: removed again in this order when left empty
        path = os.path.join(self.folder, self.NAME)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
                os.close(fd)
                self._remove_created_folder()
                raise refuse(holder) from None
            except OSError:  # no flock on this file system: no hold
                break
            try:
                if os.fstat(fd).st_ino == os.stat(path).st_ino:  # (not a file a releasing writer just unlinked)
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}".encode())
        except OSError:  # (a full disk) the hold is not taken: nothing of it stays
            self.release()
            raise
        return self

    def release(self):
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.remove(os.path.join(self.folder, self.NAME))  # before the unlock: a waiting writer then makes its own
        os.close(self.fd)  # (closing drops the flock)
        self.fd = None
        self._remove_created_folder()

    def _remove_created_folder(self):
        for folder in self.created:
            try:
                os.rmdir(folder)
            except OSError:  # not empty: the run wrote there, it stays (and so do the folders above it)
                break
        self.created = []


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# numpy's tofile on a full device raises an OSError without an errno, with one of these messages
NUMPY_DISK_FULL = ("requested and", "Not enough free space")


def full_disk_text(err):
    """'no space left on device', with the OS's words where they say more (a quota: 'Disk quota exceeded')."""
    return "no space left on device" + ("" if err.errno == errno.ENOSPC else f" ({err.strerror})")


def disk_full(e, folder=None):
    """The OSError of a full disk (or quota) among e and the exceptions it was raised from or while
    handling (torch.save's writer raises a RuntimeError while an ENOSPC unwinds), else None. With
    folder (where the writes went), also numpy's errno-less messages (NUMPY_DISK_FULL) when that
    folder's device has under 1 MiB free."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and (e.errno in DISK_FULL or folder is not None and e.errno is None
                                       and any(m in str(e) for m in NUMPY_DISK_FULL) and _free(folder) < 1 << 20):
            return e
        e = e.__cause__ or e.__context__
    return None


def _free(path):
    """Free bytes on the device of path, or of its nearest existing parent (inf where unknown)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return float("inf")
