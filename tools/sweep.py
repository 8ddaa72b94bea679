"""Run a grid of train.py runs and report them as markdown tables and loss-curve plots.

    python -m tools.sweep run --root runs/readme --models tango,loop --depths 4 --seeds 1 --datasets stdlib
    python -m tools.sweep report --root runs/readme [--out table.md]
    python -m tools.sweep collect --root runs/grid --to results/grid      # small JSON copies to commit
    python -m tools.sweep report --grid --root results/grid               # the paper-style tables
    python -m tools.sweep report --grid --root results/chargrid --into results/chargrid/README.md   # ... in place
    python -m tools.sweep plot --root results/grid --out results/grid     # PNG curves (needs matplotlib)

`run` trains every (dataset, model, depth, seed) as its own train.py process in
`<root>/<dataset>/<model>-K<depth>-s<seed>/` with the paper's protocol (matched non-embedding
parameters, data order = seed, dev-selected checkpoint, test on it). A run with `summary.json` is
skipped, one with only `ckpt_latest.pt` resumed; a run whose flags train.py would refuse
(train.check_flags) or an existing run trained with other flags stops the sweep before anything
starts (nothing prepared, no --root made). Flags after `--` go to every run (`--data_dir` to dmmath only,
a model's own flags such as `--window` or `--n_core` only to the models that read them).
`--jobs N` runs N processes at once (OMP_NUM_THREADS = cores / N unless set), depth first. What
`run` prints (not the data preparation) is also appended to `<root>/sweep-output.txt`, after a line
of its own (`sweep run started`, the time and a random id).

`report` prints one table per dataset (mean ± sample std over seeds of test/dev NLL, exact match; lowest
in bold); a cell whose runs differ in anything but the seed is an error (exit 2). `report --grid`
prints the TANGO paper's section 4.1 tables and checks its claims one by one (and the grid's wall
time, from `<root>/sweep-output.txt`: the run command's printed output, when it is there);
`report --budget` judges each run's learning curve at its budget, `report --throughput` tabulates the
tools.bench JSONs of the grid's shapes (`<root>/bench_K<k>.json`), `report --zoo` ranks every model
at K = 4 of --root and the roots `--with` names (one recipe) with its training FLOPs per token,
`report --budgets` puts dev NLL against K at --root's budget beside the `--with` roots' (the same
recipe at other lengths); `--into FILE` also writes the report into FILE between its marker lines
(sweep_report.report_markers). `collect` copies each run's summary and curves into a folder small
enough to commit; `plot` draws the curves, of other roots too (`--with`) and at some depths
(`--depths`), with no version stamp: one matplotlib and pillow version write the same PNG bytes from
the same curves. This file runs and collects the grid; report and plot, which only read it, are in
sweep_report.py.
"""
import concurrent.futures
import glob
import json
import math
import os
import re
import secrets
import subprocess
import sys
import threading
import time

if not __package__:  # run as python tools/x.py, not python -m tools.x: find the project's modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import UsageError
from harness.cli import (FLOAT32_MAX, FolderLock, Terminated, UsageParser, check_not_empty, check_output_file,
                         check_output_folder, make_parent, repeated, run_command, write_text)
from tools.sweep_report import curves_of, log_records, read_json, run_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root: train.py
_print_lock = threading.Lock()


def say(msg, log=None):
    """print from several job threads without interleaving their lines (and append to log, a path)."""
    with _print_lock:
        print(msg, flush=True)
        if log:
            with open(log, "a") as f:
                f.write(msg + "\n")


def run_dir(root, dataset, model, depth, seed, lr=None):
    name = f"{model}-K{depth}-s{seed}" + (f"-lr{lr}" if lr else "")
    return os.path.join(root, os.path.basename(dataset.rstrip("/")), name)


def cmd_run(args, extra):
    lrs = list(filter(None, args.lrs.split(","))) or [None]  # (as check_run_flags reads --lrs)
    # one folder per run: check_run_flags refused a repeated entry and two datasets of one folder name
    grid = [(ds, m, int(k), int(s), lr) for k in args.depths.split(",") for ds in args.datasets.split(",")
            for m in args.models.split(",") for lr in lrs for s in range(1, args.seeds + 1)]
    env = dict(os.environ)
    if args.jobs > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.jobs))
    t0 = time.time()

    import data
    import train
    check_output_folder("--root", args.root)
    datasets = args.datasets.split(",")
    for ds in datasets:  # before any preparation: a later dataset's typo would stop the sweep
        data.check_dataset(ds)
    for flag, reader in dataset_flags().items():  # flags_for drops it for the other datasets: one must read it
        if flag in train.given_flags(extra) and reader not in datasets:
            raise UsageError(f"-- --{flag}: no dataset of --datasets {args.datasets} reads it (used by {reader})")
    resolved = [check_existing_run(run_dir(args.root, *g), train_argv(args.root, *g, extra))
                for g in grid]  # before anything starts: train.py's own checks, an existing run trained as asked

    def one(i, ds, m, k, s, lr):
        out = run_dir(args.root, ds, m, k, s, lr)
        if os.path.exists(os.path.join(out, "summary.json")):
            say(f"[{i}/{len(grid)}] {out}: done, skipped", log)
            return 0
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), *train_argv(args.root, ds, m, k, s, lr, extra)]
        if os.path.exists(os.path.join(out, "ckpt_latest.pt")):
            cmd.append("--resume")
        say(f"[{i}/{len(grid)}] " + " ".join(["train.py", *cmd[2:]]), log)  # no path of this machine in the log
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "stdout.txt"), "a") as f:  # a resumed run keeps the earlier output
            rc = run_process(cmd, f, env)
        if rc is None:  # the sweep is stopping: not started
            return rc
        if rc != 0:
            say(f"  {out} failed with exit code {rc}; see {out}/stdout.txt", log)
        return rc

    prepare_data(resolved)  # once, here: parallel runs never prepare the same folder
    # only now (a sweep refused above leaves no folder), and one sweep at a time in a root (each run holds its folder)
    held = FolderLock(args.root).acquire(lambda holder: UsageError(
        f"--root {args.root}: another sweep is running there ({holder}); wait for it to end (it runs this grid's "
        "runs too), or give another --root"))
    try:
        log = os.path.join(args.root, "sweep-output.txt")  # what this prints, appended (report --grid reads it)
        with open(log, "a") as f:  # (merge_output keys this command's lines by it)
            f.write(f"{START_LINE} {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, id {secrets.token_hex(4)}\n")
        _runs["stopping"] = False
        try:
            if args.jobs > 1:
                pool = concurrent.futures.ThreadPoolExecutor(args.jobs)
                try:
                    rcs = [f.result() for f in [pool.submit(one, i, *g) for i, g in enumerate(grid, 1)]]
                finally:
                    pool.shutdown(wait=False, cancel_futures=True)  # (stopped: the queued runs never start)
            else:
                rcs = [one(i, *g) for i, g in enumerate(grid, 1)]
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the running train.py processes end as they would alone
            stop_runs(e)
            with open(log, "a") as f:  # (harness.cli.run_command prints the same line on stderr)
                f.write(f"{'terminated' if isinstance(e, Terminated) else 'interrupted'}: {RESUME_HINT}\n")
            raise
        failed = sum(rc != 0 for rc in rcs)
        say(f"sweep: {len(grid)} run{'s' * (len(grid) != 1)}, {failed} failed, wall time {time.time() - t0:.0f} s", log)
        return 1 if failed else 0
    finally:
        held.release()


START_LINE = "sweep run started"  # a run command's first line in sweep-output.txt (a time and a random id follow)
RESUME_HINT = "run the same command again to skip finished runs and resume the rest"  # a stopped sweep's line
MAX_RUNS = 100_000  # runs per sweep: each a train.py process of minutes to hours, all checked before the first

# train.py flags every grid run sets itself (train_argv); given after `--` they would win and, for
# --out_dir, make every run write into one folder
SWEEP_SET_FLAGS = ("--model", "--depth", "--dataset", "--seed", "--data_seed", "--out_dir", "--resume")
# train.py flags a sweep cannot use: every grid run trains (the flag -> what to do instead)
SWEEP_REFUSED_FLAGS = {"--eval_only": "a sweep trains every run; evaluate a finished one with "
                                      "python train.py --eval_only --out_dir RUN"}


_runs = {"procs": set(), "stopping": False}  # the train.py processes running now; whether the sweep stops
_runs_lock = threading.Lock()


def run_process(cmd, stdout, env):
    """Run one train.py (cmd; its output to the file stdout) to its end and return its exit code;
    None, without starting it, once the sweep is stopping (stop_runs)."""
    with _runs_lock:
        if _runs["stopping"]:
            return None
        p = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, env=env)
        _runs["procs"].add(p)
    rc = p.wait()  # the sweep's Ctrl-C or SIGTERM, raised here (one job), leaves p to stop_runs
    with _runs_lock:
        _runs["procs"].discard(p)
    return rc


def stop_runs(signal_error, grace=120):
    """The sweep was stopped (signal_error: KeyboardInterrupt, or harness.cli.Terminated for SIGTERM):
    start no new run, pass SIGTERM on to the running train.py processes (a terminal's Ctrl-C reached
    them already; a SIGTERM went to the sweep alone) and wait for each to exit, SIGKILL after grace
    seconds, so each ends as it would alone: its note in stdout.txt, resumable from its checkpoint."""
    with _runs_lock:
        _runs["stopping"] = True
        procs = list(_runs["procs"])
    for p in procs:
        if isinstance(signal_error, Terminated):
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def train_argv(root, ds, m, k, s, lr, extra):
    """The train.py flags of one grid run (without --resume)."""
    argv = ["--model", m, "--depth", str(k), "--dataset", ds, "--seed", str(s), "--data_seed", str(s),
            "--out_dir", run_dir(root, ds, m, k, s, lr), "--quiet", *flags_for(ds, extra, m, k)]
    return argv + (["--learning_rate", lr] if lr else [])


def check_existing_run(out, argv):
    """train.py's own checks of one grid run's flags argv (train.check_flags: a bad value such as
    --max_iters 0, a flag the run ignores), then a UsageError naming the flag and both values when
    the run folder out already holds a run (its log's last start event, or the args.json of a run
    copied in from collected results: run_args) whose train.py settings differ from those argv
    asks for, after train.py's own defaults are filled in (machine flags such as --out_dir or
    --device aside): skipping or resuming it would mix settings in one grid cell. Returns train.py's
    resolved flags for the run (an argparse.Namespace)."""
    import train
    from harness.checkpoint import MACHINE_FLAGS
    from harness.config import unread_model_flags
    try:
        resolved = train.check_flags(train.parse_args(argv), train.given_flags(argv))
    except UsageError as e:  # the run it would fail (a model may refuse a value the others take)
        raise UsageError(f"{out}: {e}") from None
    requested = vars(resolved)
    saved = run_args(out)
    unread = unread_model_flags(requested["model"])  # flags this model ignores are not compared
    for k in sorted(set(saved) & set(requested) - set(MACHINE_FLAGS) - unread):
        if saved[k] != requested[k]:
            raise UsageError(f"{out}: trained with --{k} {saved[k]}, this sweep asks for --{k} {requested[k]}; "
                             "use another --root (or delete that run) to change a setting")
    return resolved


def flags_for(dataset, extra, model=None, depth=None):
    """extra without the flags train.py refuses for this run: a dataset's own flag (dataset_flags():
    --data_dir X, --em_samples N) unless dataset is the one that reads it, a model's own flag
    (models.model_flags(): --window, --n_core, --plt_window, ...) unless model reads it, and, given
    the run's depth, a model flag its other flags leave idle there (its registry rule: --plt_window
    at --depth 1), so one sweep can compare models, depths and datasets with a setting only some of
    them have."""
    import train
    from harness.config import unread_model_flags
    from models import idle_flags
    actions = train.build_parser()._option_string_actions

    def without(flags, drop):
        out, i = [], 0
        while i < len(flags):
            f = flags[i]
            action = actions.get(f.split("=", 1)[0])
            n = 1 if action is None or "=" in f or action.nargs == 0 else 2  # the flag and its value
            if (action.dest if action is not None else None) not in drop:
                out += flags[i:i + n]
            i += n
        return out
    unread = unread_model_flags(model) if model is not None else set()
    unread |= {flag for flag, reader in dataset_flags().items() if dataset != reader}
    out = without(extra, unread)
    if model is not None and depth is not None:
        run = train.parse_args(["--model", model, "--depth", str(depth), *out])
        out = without(out, set(idle_flags(run)))
    return out


def dataset_flags():
    """train.py's flags that one dataset alone reads: {flag: that --dataset} (--data_dir and
    config.DATASET_FLAGS)."""
    from harness.config import DATASET_FLAGS
    return {"data_dir": "dmmath", **DATASET_FLAGS}


def prepare_data(resolved):
    """data.prepare each folder that the runs' resolved train.py flags (check_existing_run's) will
    read, once: the same dataset, tokenizer (auto resolved by the tier, as train.py does), data
    folders and options."""
    import data
    done = set()
    for a in resolved:
        key = (a.dataset, a.data_dir if a.dataset == "dmmath" else None, a.data_root,
               tuple(sorted(data.flag_options(a).items())))
        if key not in done:
            done.add(key)
            data.prepare(*key[:3], **data.flag_options(a),
                         allow_empty_splits=False)  # an empty split would fail every run of the dataset


def cmd_collect(root, to):
    """Copy <root>/<dataset>/<run>/summary.json to <to>/<dataset>/<run>/ with its curves.json
    (curves_of: a collected run's own, else from its log) and args.json (train.py's resolved
    flags: run_args), small enough to commit; a run with neither log nor curves gets no
    curves.json. <root>/sweep-output.txt (the run commands' output) is merged into <to>'s, each
    command's lines once (merge_output).
    Every run is read before anything is written, so a bad file leaves <to> as it was. A summary
    of a resumed run written before train.py recorded resumes gets the log's resumed_at and
    wall_s_this_process_only."""
    check_output_folder("--to", to)
    if os.path.isdir(to) and os.path.samefile(root, to):  # every copy would be its own source
        raise UsageError(f"--to {to}: the same folder as --root; collect copies the runs into another folder")
    runs = []
    for path in sorted(glob.glob(os.path.join(root, "*", "*", "summary.json"))):
        run = os.path.dirname(path)
        start = [r for r in log_records(run) if r.get("event") == "start"]
        summary = read_json(path, ("model", "depth", "seed"))
        rewrite = "resumed_at" not in summary and start and start[-1].get("resumed_at")
        if rewrite:  # trained by a train.py that did not record a resume: its wall_s is the last process's only
            summary.update(resumed_at=start[-1]["resumed_at"], wall_s_this_process_only=True)
        has_curves = os.path.exists(os.path.join(run, "curves.json")) or os.path.exists(os.path.join(run, "log.jsonl"))
        runs.append((path, os.path.join(to, os.path.relpath(run, root)), summary if rewrite else None,
                     curves_of(run) if has_curves else None, run_args(run)))
    output = os.path.join(root, "sweep-output.txt")
    if os.path.exists(output):
        with open(output, encoding="utf-8", errors="replace") as f:
            text = f.read()
        os.makedirs(to, exist_ok=True)
        kept = os.path.join(to, "sweep-output.txt")
        if os.path.exists(kept):
            with open(kept, encoding="utf-8", errors="replace") as f:
                text = merge_output(f.read(), text)
        write_text(kept, text)
    for path, dest, summary, curves, args in runs:
        os.makedirs(dest, exist_ok=True)
        if summary is not None:
            write_text(os.path.join(dest, "summary.json"), json.dumps(summary, indent=1))
        else:
            with open(path, encoding="utf-8") as f:  # (json.dump writes ASCII: the same bytes)
                write_text(os.path.join(dest, "summary.json"), f.read())
        if curves is not None:
            write_text(os.path.join(dest, "curves.json"), json.dumps(curves, separators=(",", ":")))
        if args:  # train.py's resolved flags, so a committed run's settings can be checked
            write_text(os.path.join(dest, "args.json"), json.dumps(args, indent=0, sort_keys=True))
    print(f"collected {len(runs)} run{'s' * (len(runs) != 1)} from {root} into {to}")
    return 0


def merge_output(old, new):
    """The sweep output kept when a root's sweep-output.txt (new) is collected where one is (old).
    Each `run` command's lines begin with its own START_LINE: a command old holds the beginning of
    is completed in place, one it does not hold is appended, so every command's lines are kept
    once, whatever the order in which clones are collected and however often. new's lines before
    its first START_LINE (written by a sweep.py without them) are matched by content: the held
    blocks at their beginning are skipped (a later collect of the same root), the rest appended."""
    kept, lines = _lines(old), _lines(new)
    first = next((i for i, line in enumerate(lines) if line.startswith(START_LINE)), len(lines))
    i = 0
    while i < first:  # the longest beginning of lines[i:first] that kept holds, then again after it
        k = next((k for k in range(first - i, 0, -1) if _held(kept, lines[i:i + k])), 0)
        if not k:
            break
        i += k
    kept += lines[i:first]
    starts = [n for n in range(first, len(lines)) if lines[n].startswith(START_LINE)] + [len(lines)]
    for a, b in zip(starts, starts[1:]):
        block = lines[a:b]
        if block[0] not in kept:
            kept += block
            continue
        at = kept.index(block[0])
        n = 1  # how much of this command old holds: its first lines, as an earlier collect copied them
        while n < len(block) and at + n < len(kept) and kept[at + n] == block[n]:
            n += 1
        kept[at:at + n] = block
    return "".join(kept)


def _lines(text):
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return lines


def _held(kept, lines):
    """Whether kept (a list of lines) holds lines one after another."""
    return any(kept[i:i + len(lines)] == lines for i in range(len(kept) - len(lines) + 1) if kept[i] == lines[0])


def check_outputs(out, into):
    """UsageError before a report writes anything: --out a folder, under a file or where nothing
    can be written (harness.cli.check_output_file; a missing folder is created), or the same file as
    --into (the report alone would replace that document)."""
    if out is None:
        return
    check_output_file("--out", out)
    if into is not None and os.path.exists(into) and os.path.exists(out) and os.path.samefile(out, into):
        raise UsageError(f"--out {out}: the same file as --into; --into writes the report into it already")


def _is_lr(text):
    """Whether text is a finite learning rate > 0 that can name a run folder (<run>-lr<LR>)."""
    try:
        return re.fullmatch(r"[0-9.eE+-]+", text) is not None and 0 < float(text) <= FLOAT32_MAX
    except ValueError:
        return False


def depths(text):
    """The depths of a --depths value ("4,8,16"); UsageError unless comma-separated integers >= 1."""
    if not all(re.fullmatch(r"[0-9]+", k) and int(k) >= 1 for k in text.split(",")):  # (not str.isdigit: "²")
        raise UsageError(f"--depths {text}: comma-separated integers >= 1")
    ks = [int(k) for k in text.split(",")]
    if (twice := repeated(ks)) is not None:
        raise UsageError(f"--depths {text}: {twice} given twice")
    return ks


def check_run_flags(args, extra):
    """UsageError (one line, exit 2) before any run starts: a typo would otherwise fail every run."""
    from models import REGISTRY, TIERS
    bad = [m for m in args.models.split(",") if m not in REGISTRY]
    if bad:
        raise UsageError(f"--models: unknown {', '.join(bad)}; choose from {', '.join(REGISTRY)}")
    depths(args.depths)
    for flag, items in (("models", args.models.split(",")), ("datasets", args.datasets.split(","))):
        if (twice := repeated(items)) is not None:
            raise UsageError(f"--{flag} {getattr(args, flag)}: {twice} given twice")
    for flag in ("seeds", "jobs"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    import train
    known, unknown = train.build_parser().parse_known_args(extra)
    if unknown:
        raise UsageError(f"-- {' '.join(unknown)}: not a train.py flag (python train.py --help lists them)")
    given = train.given_flags(extra)
    for flag, instead in SWEEP_REFUSED_FLAGS.items():
        if flag.lstrip("-") in given:
            raise UsageError(f"-- {flag}: {instead}")
    own = [f for f in SWEEP_SET_FLAGS if f.lstrip("-") in given]
    if own:
        raise UsageError(f"-- {', '.join(own)}: the sweep sets this itself per run; use --models/--depths/"
                         "--seeds/--datasets/--lrs/--root instead")
    lrs = list(filter(None, args.lrs.split(",")))
    if not all(_is_lr(lr) for lr in lrs):
        raise UsageError(f"--lrs {args.lrs}: comma-separated finite learning rates > 0, at most 3.4e38 "
                         "(1e-3, 0.002, 3E-4, ...)")
    if (twice := repeated(float(lr) for lr in lrs)) is not None:
        raise UsageError(f"--lrs {args.lrs}: {twice:g} given twice (as the same number)")
    if lrs and "learning_rate" in given:
        raise UsageError("-- --learning_rate: --lrs sets each run's learning rate; give the rates to --lrs only")
    counts = {"models": len(args.models.split(",")), "depths": len(args.depths.split(",")),
              "seeds": args.seeds, "datasets": len(args.datasets.split(",")), "lrs": max(1, len(lrs))}
    if math.prod(counts.values()) > MAX_RUNS:  # listed and checked first
        raise UsageError(" x ".join(f"--{f} ({c:,})" for f, c in counts.items())
                         + f" = {math.prod(counts.values()):,} runs; at most {MAX_RUNS:,} per sweep")
    names = {}
    for ds in args.datasets.split(","):  # (no repeats: refused above)
        name = os.path.basename(ds.rstrip("/"))
        if name in names:
            raise UsageError(f"--datasets: {names[name]} and {ds} would share the runs' folder {name}/ under "
                             f"--root; rename one of them")
        names[name] = ds
    from models import model_flags  # a model flag goes only to the models that read it (flags_for): one of them must
    users = model_flags()
    for flag in sorted(train.given_flags(extra) & set(users)):
        if not set(args.models.split(",")) & set(users[flag]):
            raise UsageError(f"-- --{flag}: no model of --models {args.models} reads it "
                             f"(used by {', '.join(users[flag])})")
        if not any(flag in train.given_flags(flags_for(ds, extra, m, k)) for ds in args.datasets.split(",")
                   for m in args.models.split(",") for k in depths(args.depths)):
            raise UsageError(f"-- --{flag}: does nothing in every run of this grid (at --depths {args.depths} and "
                             "the other flags given); drop it")
    if known.size is not None and known.size not in TIERS:
        raise UsageError(f"-- --size {known.size}: choose one of {', '.join(TIERS)}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = UsageParser(prog="-m tools.sweep", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{run,collect,plot,report}")
    r = sub.add_parser("run", help="train the grid (flags after -- go to every train.py run)",
                       usage="python -m tools.sweep run --root ROOT [options] [-- TRAIN.PY FLAGS]")
    r.add_argument("--root", required=True, help="folder of the runs: <root>/<dataset>/<model>-K<depth>-s<seed>/")
    r.add_argument("--models", default="tango,tango-windowed,loop,untied,gau,flash",
                   help="comma-separated train.py --model names")
    r.add_argument("--depths", default="4", help="comma-separated depths K")
    r.add_argument("--seeds", type=int, default=1, help="seeds 1..N per cell; data order = seed")
    r.add_argument("--datasets", default="stdlib",
                   help="comma-separated train.py --dataset values")
    r.add_argument("--lrs", default="",
                   help="comma-separated peak learning rates (a learning-rate sweep; none: the runs take train.py's)")
    r.add_argument("--jobs", type=int, default=1, help="train.py processes at once (threads split between them)")
    c = sub.add_parser("collect", help="copy each run's summary, curves and flags into a folder small enough to commit")
    c.add_argument("--root", required=True, help="the runs' folder (of sweep.py run)")
    c.add_argument("--to", required=True, help="destination folder")
    g = sub.add_parser("plot", help="loss-curve PNGs (needs matplotlib)")
    g.add_argument("--root", required=True, help="the runs' folder (run or collected)")
    g.add_argument("--out", required=True, help="folder the PNGs are written to")
    g.add_argument("--with", dest="more", action="append", default=[], metavar="ROOT",
                   help="another runs' folder drawn with --root's (repeatable; one recipe)")
    g.add_argument("--depths", default=None, help="comma-separated depths K to draw (default: all)")
    q = sub.add_parser("report", help="markdown tables of the runs (--grid: the paper's tables and claims)")
    q.add_argument("--root", required=True, help="the runs' folder (run or collected)")
    q.add_argument("--out", default=None, help="also write the report to this file")
    mode = q.add_mutually_exclusive_group()  # one report at a time; none: the per-run summary table
    mode.add_argument("--lr", dest="mode", action="store_const", const="lr",
                      help="the learning-rate sweep table instead")
    mode.add_argument("--grid", dest="mode", action="store_const", const="grid",
                      help="the paper-style tables and claims instead")
    mode.add_argument("--budget", dest="mode", action="store_const", const="budget",
                      help="each run's last-quarter improvement of dev NLL instead")
    mode.add_argument("--throughput", dest="mode", action="store_const", const="throughput",
                      help="the tools.bench throughput of <root>/bench_K<k>.json, one column per K, instead")
    mode.add_argument("--zoo", dest="mode", action="store_const", const="zoo",
                      help="every model at K = 4 in one table ranked by test NLL, with FLOPs per token, instead")
    mode.add_argument("--budgets", dest="mode", action="store_const", const="budgets",
                      help="dev NLL against K at --root's budget beside the --with roots' budgets, instead")
    q.set_defaults(mode="runs")
    q.add_argument("--with", dest="more", action="append", default=[], metavar="ROOT",
                   help="another runs' folder in the table with --root's (repeatable; report --zoo and --budgets)")
    q.add_argument("--other_rate", default=None, metavar="ROOT",
                   help="report --zoo: runs of the same recipe at another peak learning rate, each row under its "
                   "model's own (for the models that did not train at the table's rate)")
    q.add_argument("--into", default=None, help="markdown file whose report block for this --root (between "
                   "its markers, see sweep_report.report_markers) is replaced by the report")
    args = p.parse_args(argv)
    if args.cmd == "run":
        check_run_flags(args, extra)
        try:
            return cmd_run(args, extra)
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: harness.cli.run_command prints this, exit 130 / 143
            raise type(e)(RESUME_HINT) from None
    if args.cmd == "report" and args.into is not None:
        check_output_file("--into", args.into)  # (an empty path: not "no --into")
    if args.cmd == "report" and args.into and args.mode == "lr":
        raise UsageError("--into: not with --lr (the learning-rate table has no markers)")
    if args.cmd == "report" and args.more and args.mode not in ("zoo", "budgets"):
        raise UsageError("--with: only with report --zoo, report --budgets and plot")
    if args.cmd == "report" and args.other_rate is not None and args.mode != "zoo":
        raise UsageError("--other_rate: only with report --zoo")
    drawn = depths(args.depths) if args.cmd == "plot" and args.depths is not None else None
    check_not_empty("--root", args.root, "the runs' folder")
    throughput = args.cmd == "report" and args.mode == "throughput"  # reads the bench JSONs, not the runs
    roots = [("--root", args.root)] + [("--with", r) for r in getattr(args, "more", [])]
    if getattr(args, "other_rate", None) is not None:
        roots.append(("--other_rate", args.other_rate))
    seen = {}
    for flag, root in roots[throughput:]:
        check_not_empty(flag, root, "the runs' folder" if flag == "--root" else "another runs' folder")
        if not glob.glob(os.path.join(root, "*", "*", "summary.json")):
            raise UsageError(f"{flag} {root}: no finished runs (<root>/<dataset>/<run>/summary.json)")
        key = os.path.realpath(root)
        if key in seen:
            raise UsageError(f"{flag} {root}: the same folder as {seen[key]}; give each runs' folder once")
        seen[key] = f"{flag} {root}"
    if args.cmd == "collect":
        return cmd_collect(args.root, args.to)
    from tools.sweep_report import (budget_report, budgets_report, grid_report, lr_report, plot,
                                    replace_between_markers, report, report_markers, throughput_report, zoo_report)
    if args.cmd == "plot":
        check_output_folder("--out", args.out)
        plot(args.root, args.out, more=args.more, depths=drawn)
        return 0
    else:
        check_outputs(args.out, args.into)
        reports = {"runs": report, "lr": lr_report, "grid": grid_report, "budget": budget_report,
                   "throughput": throughput_report,
                   "zoo": lambda root: zoo_report(root, *args.more, other_rate=args.other_rate),
                   "budgets": lambda root: budgets_report(root, *args.more)}
        text = reports[args.mode](args.root)
        if args.into:
            replace_between_markers(args.into, report_markers(args.root, args.mode), text)
        if args.out:
            write_text(make_parent(args.out), text)
        print(text, end="")


# the flags that set how much memory the command takes: its out-of-memory line names them
SIZE_FLAGS = ("--seeds", "--models", "--depths", "--lrs", "--datasets")


if __name__ == "__main__":
    try:
        run_command(main, sizes=SIZE_FLAGS)
    except UsageError as e:  # bad flags, an empty root, no GPT-2 vocabulary while preparing data
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
