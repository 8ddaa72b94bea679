"""CPU memory for bench.py: the resident set size, glibc's malloc settings, and the peak memory of
one training step.

glibc serves every block above 32 MiB with a fresh mmap and unmaps it when it is freed, so each
training step's large tensors (the (B T) x V logits and their gradient, TANGO's (B, T, F) gates and
averages) start as fresh pages that fault in on first touch; on this project's CPU (a virtual
machine) those faults took a fifth to a half of every step. bench.py times CPU steps after
keep_freed_memory() (the heap keeps freed memory for the next step, as PyTorch's caching allocator
does on CUDA) unless --cpu_memory return, after settle_heap() (untimed steps until that heap has
stopped growing); step_memory() measures one step's peak with every freed byte returned. Linux
only (/proc/self); the malloc settings are skipped where the C library is not glibc.
"""
import ctypes
import gc
import resource


def rss_kb(field):
    """A field of /proc/self/status in KiB (VmRSS: resident now, VmHWM: its high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's mallopt parameters (malloc.h)
GLIBC_MMAP_MAX = 65536  # glibc's default M_MMAP_MAX


def _libc():
    """glibc through ctypes, or None where the C library is not glibc (no mallopt / malloc_trim)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_freed_memory():
    """Have glibc's malloc keep freed memory for reuse (M_MMAP_MAX = 0: blocks come from the heap,
    not from fresh mmaps; M_TRIM_THRESHOLD -1: the heap is never trimmed), so once the heap has
    stopped growing (a few steps: settle_heap) every training step reuses the pages of the one
    before instead of faulting in new ones. RSS stays near its high-water mark and nothing goes
    back to the system until exit (docs/training.md, "Training on CPU": max RSS 4.6 GB kept
    against 3.3 GB returned, for 1.37x the tokens/s).
    Numerics are unchanged. False (nothing done) where the C library is not glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, -1)  # -1: never trim (mallopt(3))
    return True


def return_freed_memory():
    """Undo keep_freed_memory (after an in-process configuration): mmaps on, glibc's dynamic
    steady state of the thresholds (mmap 32 MiB, trim twice that), the kept memory returned."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX)
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)
        libc.malloc_trim(0)


def step_memory(step, keep):
    """Run step() once; return (MB of peak RSS above the RSS before it, method).

    glibc keeps freed memory for reuse (its mmap threshold grows to the size of freed blocks, up
    to 32 MiB; keep_freed_memory keeps all of it), so a plain RSS difference would miss memory
    that earlier steps left behind. So mmaps are on with the threshold pinned at 128 KiB and the
    heap trimmed before the step (every freed byte is returned, every allocation during the step
    is counted); afterwards keep_freed_memory() for the timed steps (keep), or glibc's dynamic
    steady state (return_freed_memory; --cpu_memory return).
    """
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX)
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 17)
        libc.malloc_trim(0)
    base = rss_kb("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        method = "VmHWM after clear_refs"
    except OSError:
        method = "ru_maxrss (clear_refs unavailable: includes everything before the step)"
    step()
    peak = rss_kb("VmHWM")
    keep_freed_memory() if keep else return_freed_memory()
    return max(0, peak - base) / 1024, method


def minor_faults():
    """Minor page faults of this process so far (ru_minflt): pages it touched for the first time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def settle_heap(step, calm=2, max_steps=10, pages=256, faults=minor_faults):
    """Untimed step() calls until `calm` consecutive ones fault in at most `pages` new pages (1 MiB
    of 4 KiB pages: the kept heap has stopped growing), at most max_steps; returns how many ran.
    Under keep_freed_memory the heap grows for several steps: a freed block that a later, larger
    tensor (the (B T) x V logits) does not fit is kept, and the tensor goes to fresh pages; on this
    project's CPU bursts of faults the size of the logits came back every other step for up to 7
    steps (counted with ru_minflt per step), so a fixed two settling steps would leave some in the timed ones."""
    quiet = 0
    for n in range(1, max_steps + 1):
        before = faults()
        step()
        quiet = quiet + 1 if faults() - before <= pages else 0
        if quiet == calm:
            return n
    return max_steps


def max_rss_mb():
    """The process's maximum RSS so far in MB (ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def loadavg():
    """The host's 1-minute load average (/proc/loadavg), None where there is none."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return None


if __name__ == "__main__":  # a part of another command: say which, instead of exiting silently
    import os
    import sys
    if not __package__:  # run as python tools/x.py, not python -m tools.x: find the project's modules
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from harness.cli import not_a_command
    not_a_command("tools/cpu_memory.py", "python -m tools.bench (python -m tools.bench --help)")
