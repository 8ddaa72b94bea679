"""The reports of `python -m tools.sweep report` and `python -m tools.sweep plot`: markdown tables from the
summary.json files a grid left (report; the learning-rate table, lr_report), the TANGO paper's
section 4.1 tables and claims recomputed on them (grid_report, --grid), the block of a markdown
file they are written into in place (--into: report_markers, replace_between_markers) and the
loss-curve PNGs (plot). sweep.py runs and collects the grid; these only read what it left, so they
live here and sweep.py's main imports them for its report and plot commands. Bad input raises
UsageError (one line, exit code 2).
"""
import dataclasses
import glob
import json
import math
import os
import re
import statistics
import sys

if not __package__:  # run as python tools/x.py, not python -m tools.x: find the project's modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models
from common import UsageError
from harness.cli import nll_unit, not_a_command, write_text
from harness.optim import AdamW, Schedule


def log_records(run):
    """The JSON records of <run>/log.jsonl (train.py's log), [] when there is none. A last line cut
    short (a process killed while writing it) is left out; any other bad line is a UsageError."""
    path = os.path.join(run, "log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f if line.strip()]
    recs = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break
            raise UsageError(f"{path}: line {i + 1} is not a JSON record") from None
        if not isinstance(rec, dict):
            raise UsageError(f"{path}: line {i + 1} is not a JSON record (an object)")
        recs.append(rec)
    return recs


def curves_of(run):
    """A run folder's curves: {"tokens_per_update", "eval": [[update, dev NLL], ...], "train":
    [[update, loss], ...]}, from its curves.json (collected) or else from its log.jsonl (a resumed
    run logs redone updates twice; the last record of an update wins)."""
    if os.path.exists(os.path.join(run, "curves.json")):
        return read_json(os.path.join(run, "curves.json"), ("tokens_per_update", "eval", "train"))
    recs = log_records(run)
    start = [r for r in recs if r.get("event") == "start"]
    a = start[-1]["args"] if start else {}
    pairs = lambda event, key, nd: [list(p) for p in sorted(
        {r["iter"]: round(r[key], nd) for r in recs if r.get("event") == event}.items())]
    return {"tokens_per_update": a.get("batch_size", 0) * a.get("block_size", 0)
            * a.get("gradient_accumulation_steps", 0),
            "eval": pairs("eval", "dev_nll", 5), "train": pairs("train", "loss", 4)}


def is_best(mu, column, fmt, lower):
    """Whether mean mu prints as the column's lowest (lower) or highest mean (column: the means),
    so that means printed alike are bold alike; no bold when the whole column prints alike (e.g.
    0 % everywhere). Rounding keeps order, so the best printed value is the best mean's."""
    printed = {fmt.format(x) for x in column}
    return len(printed) > 1 and fmt.format(mu) == fmt.format((min if lower else max)(column))


def mean_std(xs):
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def mean_text(fmt, mu, sd, n, of):
    """A table cell: mu (and "± sd" over n > 1 values) printed with fmt, "(n=N)" when n < of runs."""
    return fmt.format(mu) + (" ± " + fmt.format(sd) if n > 1 else "") + (f" (n={n})" if n < of else "")


# a run's settings, compared within a grid cell: these summary.json fields, the curves' tokens per
# update, and (when the run folder has its log) every train.py flag but the seeds, machine flags and
# the model flags its model does not read
SUMMARY_SETTINGS = ("dataset", "size", "width", "non_embedding_params", "params", "test_split")


def run_args(run):
    """train.py's resolved flags of a run folder: its log's start records (one per start; a resumed
    run has several; one that failed before its first update leaves none, harness.config.Log), else
    the args.json that collect wrote from them; {} when it has neither. A flag whose value changed
    between starts reads "A -> B" ("A -> B -> A" when changed back: a seed trained at one rate and
    resumed at another is no longer its cell's equal); machine flags (--out_dir, --resume, ...) are
    the last start's."""
    from harness.checkpoint import MACHINE_FLAGS
    starts = [r.get("args", {}) for r in log_records(run) if r.get("event") == "start"]
    if not starts:
        path = os.path.join(run, "args.json")
        return read_json(path) if os.path.exists(path) else {}
    out = dict(starts[-1])
    for k in set(out) - set(MACHINE_FLAGS):
        values = []  # the value at each start where it changed
        for a in starts:
            if k in a and (not values or a[k] != values[-1]):
                values.append(a[k])
        if len(values) > 1:
            out[k] = " -> ".join(map(str, values))
    return out


def unit_of(runs):
    """The NLL unit of runs (summaries with "_dir"): nats/char when every run is known to be on
    characters (summary.json's tokenizer, else the run folder's flags, run_args), else nats/token."""
    def tokenizer(s):
        if "tokenizer" in s or "_dir" not in s:
            return s.get("tokenizer")
        return run_args(s["_dir"]).get("tokenizer")
    return nll_unit("char" if runs and all(tokenizer(s) == "char" for s in runs) else None)


def run_settings(run, summary):
    """{setting: value} of a finished run folder (see SUMMARY_SETTINGS; its train.py flags as
    "--flag", from run_args: a collected run's args.json as a raw run's log)."""
    from harness.checkpoint import MACHINE_FLAGS
    from harness.config import unread_model_flags
    out = {k: summary[k] for k in SUMMARY_SETTINGS if k in summary}
    if os.path.exists(os.path.join(run, "curves.json")) or os.path.exists(os.path.join(run, "log.jsonl")):
        out["tokens_per_update"] = curves_of(run)["tokens_per_update"]
    args = run_args(run)
    skip = set(MACHINE_FLAGS) | {"seed", "data_seed"} | unread_model_flags(args.get("model"))
    out.update({f"--{k}": v for k, v in args.items() if k not in skip})
    return out


# the flags of the training recipe: every model of a report's dataset must share them (check_recipe); the
# schedule's and AdamW's are their dataclasses' fields, so a new option of either joins the recipe
RECIPE = ("size", "tokenizer", "block_size", "batch_size", "gradient_accumulation_steps",
          *(f.name for f in dataclasses.fields(Schedule)), *(f.name for f in dataclasses.fields(AdamW)), "grad_clip",
          "eval_interval", "eval_windows", "max_tokens", "dtype")


def recipe_difference(ref, mine, allowed=()):
    """The first recipe setting (RECIPE's flags, tokens per update) that two runs' settings
    (run_settings) both hold and differ in, besides those in `allowed`; None when they agree."""
    return next((k for k in [f"--{f}" for f in RECIPE] + ["tokens_per_update"]
                 if k not in allowed and k in ref and k in mine and ref[k] != mine[k]), None)


def first_settings(rows):
    """run_settings of the first run of load_runs's rows (a root's recipe, which check_recipe made one)."""
    s = next(iter(rows.values()))[0]
    return run_settings(s["_dir"], s)


def check_recipe(rows, settings):
    """UsageError when two runs of one dataset (rows: load_runs's cells; settings: {run folder:
    run_settings}) were trained with another recipe (RECIPE's flags): a table or claim compares
    models, so its models must share the schedule, the budget and the rate (a learning-rate sweep
    has report --lr)."""
    first = {}
    for key in sorted(rows, key=str):
        for r in rows[key]:
            mine = settings[r["_dir"]]
            ref_dir, ref = first.setdefault(key[0], (r["_dir"], mine))
            k = recipe_difference(ref, mine)
            if k is not None:
                raise UsageError(f"{key[0]}: {ref_dir} has {k} {ref[k]}, {r['_dir']} has {k} {mine[k]}; "
                                 "the models of a report share one recipe (another rate or budget: another "
                                 "--root; a learning-rate sweep: report --lr)")


def check_cell(key, runs, settings):
    """UsageError unless the runs of one table cell (dicts with "_dir", a summary each; settings:
    {run folder: run_settings}) differ in nothing but the seed: a mean over seeds of different
    settings is no result."""
    ref = settings[runs[0]["_dir"]]
    for r in runs[1:]:
        other = settings[r["_dir"]]
        for k in sorted(set(ref) & set(other)):
            if ref[k] != other[k]:
                raise UsageError(f"{'/'.join(map(str, key))}: {runs[0]['_dir']} has {k} {ref[k]}, {r['_dir']} has "
                                 f"{k} {other[k]}; a cell averages runs that differ only in the seed")


def report(root):
    """Markdown tables (one per dataset) of the runs of load_runs(root): mean ± spread over seeds per
    (model, K), the lowest NLL at each K in bold. UsageError when root holds only learning-rate
    sweep runs (their table is lr_report), and as load_runs."""
    rows = load_runs(root)
    if not rows:
        raise UsageError(f"--root {root}: only learning-rate sweep runs (<run>-lr<LR>/); their table is report --lr")
    out = []
    for ds in sorted({k[0] for k in rows}):
        keys = sorted((k for k in rows if k[0] == ds), key=lambda k: (k[2], k[1]))
        metrics = [("test_nll", "test NLL", True), ("dev_nll", "dev NLL", True)]
        em = [m for m in ("exact_match_interpolate", "exact_match_extrapolate") if m in rows[keys[0]][0]]
        metrics += [(m, "EM " + m.split("_")[-1][:6], False) for m in em]
        metrics += [("tok_per_s_median_last100", "tokens/s", None)]
        test_split = rows[keys[0]][0].get("test_split", "test")
        out.append(f"\n**{ds}** (test split: `{test_split}`; unigram entropy of dev "
                   f"{rows[keys[0]][0]['unigram_dev']:.3f} {unit_of([r for k in keys for r in rows[k]])})\n")
        out.append("| model | K | seeds | non-emb params | " + " | ".join(m[1] for m in metrics) + " |")
        out.append("|---|---|---|---|" + "---|" * len(metrics))
        values = {k: {m: [r[m] for r in rows[k] if r.get(m) is not None] for m, _, _ in metrics} for k in keys}
        stats = {k: {m: mean_std(v) for m, v in values[k].items()} for k in keys}
        for k in keys:
            cells = []
            for m, _, lower in metrics:
                mu, sd = stats[k][m]
                if mu is None:
                    cells.append("-")
                    continue
                fmt = "{:.0f}" if m.startswith("tok") else "{:.2%}" if m.startswith("exact") else "{:.3f}"
                same_depth = [stats[j][m][0] for j in keys if j[2] == k[2] and stats[j][m][0] is not None]
                txt = mean_text(fmt, mu, sd, len(values[k][m]), len(rows[k]))
                cells.append(f"**{txt}**" if lower is not None and is_best(mu, same_depth, fmt, lower) else txt)
            out.append(f"| {k[1]} | {k[2]} | {len(rows[k])} | {rows[k][0]['non_embedding_params']:,} | "
                       + " | ".join(cells) + " |")
    return "\n".join(out).lstrip("\n") + "\n"


def lr_report(root):
    """Learning-rate sweep table (runs named ...-lr<LR>): final training loss (mean of the last 10
    updates), best dev NLL, the largest recurrent-state norm seen in training and, from the last
    evaluation, max Abar (Parcae) or ||W_1||_2 (RDM). A run stopped by a non-finite loss shows as
    diverged. A collected run (curves.json, no log) has its losses and dev NLLs, not the diagnostics."""
    out = ["| model | K | peak lr | final train loss | best dev NLL | max state norm | max Abar | "
           "spectral norm (Parcae: diag(Delta) B, RDM: W_1) | status |", "|---|---|---|---|---|---|---|---|---|"]
    name_of = lambda p: os.path.basename(p)  # (a root's own path may hold "-lr" or "-K")
    runs = sorted(glob.glob(os.path.join(root, "*", "*-lr*")),
                  key=lambda p: (os.path.dirname(p), name_of(p).split("-K")[0], float(name_of(p).split("-lr")[1])))
    if not any(os.path.isdir(d) for d in runs):
        raise UsageError(f"--root {root}: no learning-rate sweep runs (<root>/<dataset>/<run>-lr<LR>/, sweep.py run --lrs)")
    for d in runs:
        if not os.path.isdir(d):
            continue
        recs = log_records(d)
        train = [r for r in recs if r["event"] == "train"]
        evals = [r for r in recs if r["event"] == "eval"]
        if not recs and os.path.exists(os.path.join(d, "curves.json")):  # collected: its curves only
            c = curves_of(d)
            train, evals = [{"loss": v} for _, v in c["train"]], [{"dev_nll": v} for _, v in c["eval"]]
        done = os.path.exists(os.path.join(d, "summary.json"))
        name = os.path.basename(d)
        model, depth = name.split("-K")[0], name.split("-K")[1].split("-")[0]
        norms = [r["diag"]["state_norm_max"] for r in train if "diag" in r]
        last = evals[-1].get("diag", {}) if evals else {}
        spec = last.get("bbar_spectral_norm", last.get("w1_spectral_norm"))
        fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)
        out.append(f"| {model} | {depth} | {name.split('-lr')[1]} | "
                   f"{fmt(statistics.fmean(r['loss'] for r in train[-10:]) if train else None)} | "
                   f"{fmt(min((r['dev_nll'] for r in evals), default=None))} | {fmt(max(norms, default=None), '{:.1f}')} | "
                   f"{fmt(last.get('abar_max'))} | {fmt(spec, '{:.2f}')} | "
                   f"{'finished' if done else 'diverged or incomplete'} |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- paper-style report

PAPER_MODELS = tuple(name for name, spec in models.REGISTRY.items() if spec.paper_grid)  # section 4.1's six
HELD_OUT = (4, 8)  # depths with test NLL; every other depth is compared on dev NLL only (paper)


def read_json(path, keys=()):
    """The JSON object in the file at path; UsageError naming the file when it cannot be read, is
    not a JSON object, or lacks one of keys."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise UsageError(f"{path}: not a readable JSON file ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict) or any(k not in obj for k in keys):
        raise UsageError(f"{path}: expected a JSON object with the keys {', '.join(keys)}")
    return obj


def load_runs(root, *more):
    """{(dataset, model, depth): [summary, ...] sorted by seed} for every summary.json under root
    and the roots `more` (learning-rate sweep runs, named ...-lr<LR>, are left out; each summary gets
    "_dir", its run's folder). UsageError naming the folders for two runs of a cell with the same seed, when the runs
    of a cell differ in a setting other than the seed (check_cell), when a dataset's cells differ
    in the recipe (check_recipe), and for a summary whose depth or seed is not an integer or whose
    dev or test NLL is not a finite number."""
    rows = {}
    for path in [p for r in (root, *more) for p in sorted(glob.glob(os.path.join(r, "*", "*", "summary.json")))]:
        if "-lr" in os.path.basename(os.path.dirname(path)):
            continue
        s = read_json(path, ("model", "depth", "seed", "dev_nll", "test_nll", "unigram_dev", "non_embedding_params"))
        bad = [k for k in ("depth", "seed") if not isinstance(s[k], int) or isinstance(s[k], bool)]
        bad += [k for k in ("dev_nll", "test_nll") if k in s and s[k] is not None
                and not (isinstance(s[k], (int, float)) and math.isfinite(s[k]))]
        if bad:
            raise UsageError(f"{path}: {', '.join(f'{k} {s[k]!r}' for k in bad)}: depth and seed must be integers, "
                             "dev_nll and test_nll finite numbers")
        s["_dir"] = os.path.dirname(path)
        rows.setdefault((os.path.basename(os.path.dirname(s["_dir"])), s["model"], s["depth"]), []).append(s)
    settings = {}
    for key, v in rows.items():
        v.sort(key=lambda s: s["seed"])
        for a, b in zip(v, v[1:]):
            if a["seed"] == b["seed"]:
                first, second = sorted((a["_dir"], b["_dir"]))
                raise UsageError(f"--root {', '.join((root, *more))}: {first} and {second} are both {key[1]} at "
                                 f"K = {key[2]}, seed {a['seed']}; keep one")
        settings.update((s["_dir"], run_settings(s["_dir"], s)) for s in v)  # read once, for both checks
        check_cell(key, v, settings)
    check_recipe(rows, settings)
    return rows


def _order(models):
    return sorted(models, key=lambda m: (PAPER_MODELS.index(m) if m in PAPER_MODELS else len(PAPER_MODELS), m))


def _values(rows, key, metric):
    return [r[metric] for r in rows.get(key, []) if r.get(metric) is not None]


def _stat(rows, key, metric):
    return mean_std(_values(rows, key, metric))


def _table(rows, ds, models, cols):
    """cols: [(header, depth, metric, fmt)]. Cells: mean ± sample std (n − 1) over seeds, "(n=...)" when fewer
    seeds than the grid's most; the lowest NLL or highest exact match of a column is bold (nothing
    when every mean of the column is equal, e.g. 0 % exact match everywhere)."""
    seeds = max(len(v) for v in rows.values())
    out = ["| model | " + " | ".join(c[0] for c in cols) + " |", "|---|" + "---|" * len(cols)]
    stats = {(m, i): _stat(rows, (ds, m, c[1]), c[2]) for m in models for i, c in enumerate(cols)}
    for m in models:
        cells = []
        for i, (_, k, metric, fmt) in enumerate(cols):
            mu, sd = stats[m, i]
            if mu is None:
                cells.append("-")
                continue
            if metric == "non_embedding_params":  # a size, not a result: no spread, no bold
                cells.append(fmt.format(mu))
                continue
            col = [stats[j, i][0] for j in models if stats[j, i][0] is not None]
            txt = mean_text(fmt, mu, sd, len(_values(rows, (ds, m, k), metric)), seeds)
            cells.append(f"**{txt}**" if is_best(mu, col, fmt, not metric.startswith("exact")) else txt)
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return out


def grid_report(root):
    """Markdown: per dataset, held-out test NLL (and exact match) at K in HELD_OUT, dev NLL at every
    depth, then the TANGO paper's section 4.1 claims recomputed on these runs (over PAPER_MODELS;
    extra rows such as Parcae are shown but not part of the claims), then the wall time when root
    holds the sweep's printed output (wall_time)."""
    rows = load_runs(root)
    out = []
    datasets = sorted({k[0] for k in rows})
    for ds in datasets:
        models = _order({k[1] for k in rows if k[0] == ds})
        depths = sorted({k[2] for k in rows if k[0] == ds})
        held = [k for k in HELD_OUT if k in depths] or depths  # a grid without K = 4/8: test NLL at every depth
        runs = [r for k, v in rows.items() if k[0] == ds for r in v]
        out.append(f"**{ds}**: test NLL on `{runs[0].get('test_split', 'test')}` ({unit_of(runs)}, mean ± sample std "
                   f"over seeds; unigram entropy of dev {runs[0]['unigram_dev']:.3f}); bold: the lowest NLL or highest "
                   "exact match of each column, extra rows included.\n")
        cols = [(f"non-emb params K={k}", k, "non_embedding_params", "{:,.0f}") for k in held[:1]]
        cols += [(f"test NLL K={k}", k, "test_nll", "{:.3f}") for k in held]
        if any("exact_match_interpolate" in r for r in runs):
            cols += [(f"EM {sp[:6]} K={k}", k, f"exact_match_{sp}", "{:.1%}") for k in held
                     for sp in ("interpolate", "extrapolate")]
        out += _table(rows, ds, models, cols) + [""]
        out.append(f"**{ds}**: dev NLL at every depth (the checkpoint-selection split).\n")
        out += _table(rows, ds, models, [(f"dev NLL K={k}", k, "dev_nll", "{:.3f}") for k in depths]) + [""]
    out += claims(rows, datasets)
    out += paired_differences(rows, datasets)
    out += wall_time(root, rows)
    return "\n".join(out) + "\n"


def budget_report(root):
    """Markdown: each run's learning curve judged at its budget, for choosing the number of updates:
    dev NLL at the first evaluation at or after 3/4 of the run's updates and at its last one, the
    relative improvement over that last quarter (%), and the final dev NLL as a fraction of the dev
    split's unigram entropy (%). One row per run (dataset, model, K, seed), in grid order."""
    rows = load_runs(root)
    out = ["| dataset | model | K | seed | updates | dev NLL at 3/4 | dev NLL at end | last quarter | "
           "end / unigram |", "|---|---|---|---|---|---|---|---|---|"]
    models = _order({key[1] for key in rows})
    for ds, m, k in sorted(rows, key=lambda key: (key[0], key[2], models.index(key[1]))):
        for s in rows[ds, m, k]:
            evals = curves_of(s["_dir"])["eval"]
            if not evals:  # no curves.json and no log.jsonl: say so rather than drop the run
                out.append(f"| {ds} | {m} | {k} | {s['seed']} | - | - (no curves) | - | - | - |")
                continue
            last_it, last = evals[-1]
            q_it, q = next((it, v) for it, v in evals if it >= 0.75 * last_it)
            out.append(f"| {ds} | {m} | {k} | {s['seed']} | {last_it} | {q:.3f} (upd {q_it}) | {last:.3f} | "
                       f"{100 * (q - last) / q:.1f} % | {100 * last / s['unigram_dev']:.0f} % |")
    return "\n".join(out) + "\n"


EARLY_REGIME = 0.60  # dev NLL above this share of the dev split's unigram entropy: not trained under the recipe


def zoo_report(root, *more, depth=4, other_rate=None):
    """Markdown: every model of the runs under root and the roots `more` (load_runs: one recipe) at
    K = depth, ranked by mean test NLL: seeds, non-embedding parameters, test and dev NLL (mean ±
    sample std over seeds), mean dev NLL as a share of the dev split's unigram entropy (a row at or
    above EARLY_REGIME says the model did not train under the recipe), training FLOPs per token
    (flops.train_flops of the model train.py built: 6 x forward MACs per token; the vocabulary is
    (params - non-embedding params) / d), tokens/s (median of the last 100 updates, mean over seeds,
    as each run measured it) and the run folders' root; a model without a test NLL ranks last, "-" for
    what it lacks. other_rate: a root of runs of the same recipe at another peak learning rate; each
    of its models' rows sits under the model's own, labelled with the rate and not ranked (a row
    that did not train and has none says so, given other_rate or not). UsageError for more than one dataset, no run at
    K = depth, a run whose flags do not rebuild its summary's width and parameters, and an
    other_rate root whose recipe differs in more than the rate."""
    rows = {k: v for k, v in load_runs(root, *more).items() if k[2] == depth}
    datasets = sorted({k[0] for k in rows})
    if len(datasets) != 1:
        raise UsageError(f"--root {', '.join((root, *more))}: the table compares one dataset at K = {depth}; "
                         f"found {', '.join(datasets) or 'no runs'}")
    alt, rate = _other_rate(other_rate, rows, depth) if other_rate else ({}, None)
    runs = [r for v in rows.values() for r in v]
    unit, seeds = unit_of(runs), max(len(v) for v in rows.values())
    mean = lambda v, metric: mean_std([r[metric] for r in v if r.get(metric) is not None])[0]
    order = sorted((k[1] for k in rows), key=lambda m: (mean(rows[datasets[0], m, depth], "test_nll") is None,
                                                        mean(rows[datasets[0], m, depth], "test_nll") or 0.0, m))
    out = [f"**{datasets[0]}**, K = {depth}: test NLL on `{runs[0].get('test_split', 'test')}` and dev NLL ({unit}, "
           f"mean ± sample std over seeds), ranked by mean test NLL; dev / unigram: mean dev NLL over the dev "
           f"split's unigram entropy ({runs[0]['unigram_dev']:.3f}), {EARLY_REGIME:.0%} and above: not trained "
           "under this recipe" + (f" (its row at peak {rate} beneath it, not ranked)" if rate else "") +
           "; training FLOPs per token: flops.py's 6 x forward MACs of the model train.py "
           "built; tokens/s: median of the last 100 updates, mean over seeds, as each run measured it (runs that "
           "shared the machine read low: tools.bench times models alone).\n",
           "| rank | model | seeds | non-emb params | test NLL | dev NLL | dev / unigram | training FLOPs/token "
           "| tokens/s | runs |", "|---|---|---|---|---|---|---|---|---|---|"]
    nominal = {}
    for rank, m in enumerate(order, 1):
        there = alt.get(m)
        out.append(_zoo_row(str(rank), m, rows[datasets[0], m, depth], depth, seeds, nominal,
                            "" if there else "; no run at another rate yet"))
        if there:
            out.append(_zoo_row("-", f"{m} at peak {rate}", there, depth, seeds, nominal, ""))
    if nominal:
        out += ["", "\\* FLOPs from the forward formula, but " + "; ".join(f"{m}: {why}" for m, why in nominal.items())
                + "."]
    return "\n".join(out) + "\n"


def _other_rate(other, rows, depth):
    """({model: runs at K = depth}, the rate as written) of the root `other`, whose recipe must be rows'
    but for the peak learning rate; UsageError otherwise, or without runs at K = depth."""
    alt = {k[1]: v for k, v in load_runs(other).items() if k[2] == depth}
    if not alt:
        raise UsageError(f"--other_rate {other}: no runs at K = {depth}")
    mine, theirs = first_settings(rows), first_settings(alt)
    k = recipe_difference(mine, theirs, allowed=("--learning_rate",))
    if k is not None:
        raise UsageError(f"--other_rate {other}: {k} {theirs[k]}, the table's runs have {mine[k]}; its runs "
                         "differ from the table's in the peak learning rate only")
    if theirs.get("--learning_rate") == mine.get("--learning_rate"):
        raise UsageError(f"--other_rate {other}: the same peak learning rate as the table's runs")
    return alt, f"{theirs['--learning_rate']:g}"


def _zoo_row(rank, label, v, depth, seeds, nominal, note):
    """One zoo_report row of the runs v (one model at K = depth); nominal collects the FLOPs notes."""
    import flops
    s = v[0]
    args = run_args(s["_dir"])
    if "block_size" not in args:
        raise UsageError(f"{s['_dir']}: no train.py flags recorded (log.jsonl or args.json); the FLOPs need them")
    d = models.TIERS[s["size"]][0]
    V = (s["params"] - s["non_embedding_params"]) // d
    m = s["model"]
    cfg, _ = flops.train_config(m, s["size"], depth, args["block_size"], V,
                                {f: args[f] for f in flops.train_model_flags() if f in args})
    if (cfg.width, models.count_params(cfg)) != (s["width"], s["non_embedding_params"]):
        raise UsageError(f"{s['_dir']}: its flags build width {cfg.width} and {models.count_params(cfg):,} "
                         f"non-embedding parameters, its summary says {s['width']} and "
                         f"{s['non_embedding_params']:,}")
    per_token = flops.train_flops(cfg, args["block_size"], 1.0)
    if flops.train_flops_nominal(cfg):
        nominal[m] = flops.train_flops_nominal(cfg)

    def cell(metric, fmt):
        xs = [r[metric] for r in v if r.get(metric) is not None]
        return "-" if not xs else mean_text(fmt, *mean_std(xs), len(xs), seeds)
    dev = mean_std([r["dev_nll"] for r in v if r.get("dev_nll") is not None])[0]
    share = "-" if dev is None else share_text(dev / s["unigram_dev"])
    if note and share.endswith(" (not trained)"):
        share = share[:-1] + note + ")"
    tok = mean_std([r["tok_per_s_median_last100"] for r in v if r.get("tok_per_s_median_last100") is not None])[0]
    where = sorted({root_name(os.path.dirname(os.path.dirname(r["_dir"]))) for r in v})
    return (f"| {rank} | {label} | {len(v)} | {s['non_embedding_params']:,} | {cell('test_nll', '{:.3f}')} | "
            f"{cell('dev_nll', '{:.3f}')} | {share} | {per_token / 1e6:.1f} M{' *' if m in nominal else ''} | "
            f"{'-' if tok is None else f'{tok:,.0f}'} | {', '.join(where)} |")


BUDGET_LENGTH = ("--max_iters", "--lr_decay_iters", "--warmup_iters")  # what may differ between the budgets compared


def root_name(root):
    """A runs' folder as the reports print it: relative to the working folder when inside it, normalized."""
    root = os.path.normpath(root)
    rel = os.path.relpath(os.path.abspath(root))
    return rel if not rel.startswith("..") else root


def share_text(share):
    """dev NLL / unigram entropy as the zoo table prints it: "44%", "(not trained)" added at EARLY_REGIME."""
    return f"{share:.0%}" + (" (not trained)" if share >= EARLY_REGIME else "")


def budgets_report(root, *more):
    """Markdown: dev NLL against K of each model under root at root's budget beside the same model and K
    in the roots `more` (other budgets, each with its own recipe), mean ± sample std over seeds, and
    at the other budgets also over only the seeds root has (paired); then for each model and budget
    whether its dev NLL rises at some step over the depths that budget has. The budget is the runs'
    --max_iters; the roots' recipes may differ only in their length (BUDGET_LENGTH, warmup and decay
    the same share of --max_iters). UsageError as
    load_runs, for more than one dataset, a root without runs or without recorded flags, and roots
    whose recipes differ otherwise or whose budgets are the same."""
    budgets = [(r, load_runs(r)) for r in (root, *more)]
    rows = budgets[0][1]
    datasets = sorted({k[0] for _, rs in budgets for k in rs})
    if not rows or len(datasets) != 1:
        raise UsageError(f"--root {root}: dev NLL against K compares one dataset's runs; found "
                         f"{', '.join(datasets) or 'no runs'}")
    ds = datasets[0]
    recipes = []
    for flag, (r, rs) in zip(["--root"] + ["--with"] * len(more), budgets):
        if not rs:
            raise UsageError(f"--with {r}: no runs")
        mine = first_settings(rs)
        if "--max_iters" not in mine:
            raise UsageError(f"{next(iter(rs.values()))[0]['_dir']}: no train.py flags recorded (log.jsonl or "
                             "args.json); the budget needs them")
        k = recipe_difference(recipes[0], mine, allowed=BUDGET_LENGTH) if recipes else None
        if k is not None:
            raise UsageError(f"--with {r}: {k} {mine[k]}, --root {root} has {recipes[0][k]}; the budgets "
                             f"compared differ only in their length ({', '.join(BUDGET_LENGTH)})")
        for k in BUDGET_LENGTH[1:]:  # the schedule scaled with the budget: the same share of --max_iters
            if recipes and k in mine and k in recipes[0] and \
                    mine[k] * recipes[0]["--max_iters"] != recipes[0][k] * mine["--max_iters"]:
                raise UsageError(f"--with {r}: {k} {mine[k]} of --max_iters {mine['--max_iters']:,}, --root {root} has "
                                 f"{recipes[0][k]} of {recipes[0]['--max_iters']:,}; a longer budget scales the "
                                 "schedule (the same share of --max_iters)")
        if recipes and mine["--max_iters"] in [x["--max_iters"] for x in recipes]:
            raise UsageError(f"{flag} {r}: {mine['--max_iters']:,} updates, a budget given already; give runs of "
                             "another --max_iters")
        recipes.append(mine)
    updates = [f"{root_name(r)}, {x['--max_iters']:,} updates" for (r, _), x in zip(budgets, recipes)]
    models = _order({k[1] for k in rows})
    depths = sorted({k[2] for _, rs in budgets for k in rs if k[1] in models})
    cols = [f"dev NLL ({updates[0]})"]
    for u in updates[1:]:
        cols += [f"dev NLL ({u})", f"the same, paired"]
    out = [f"**{ds}**: dev NLL ({unit_of([r for v in rows.values() for r in v])}, mean ± sample std over n seeds) "
           f"against K at each budget; \"paired\": the column before it over only the seeds that "
           f"{root_name(root)} has at that K.\n",
           "| model | K | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    means = {}
    for m in models:
        for k in depths:
            own = [r["dev_nll"] for r in rows.get((ds, m, k), [])]
            seeds = {r["seed"] for r in rows.get((ds, m, k), [])}
            cells = []
            for i, (_, rs) in enumerate(budgets):
                v = [r["dev_nll"] for r in rs.get((ds, m, k), [])]
                paired = [r["dev_nll"] for r in rs.get((ds, m, k), []) if r["seed"] in seeds]
                for j, xs in enumerate([v] if i == 0 else [v, paired]):
                    mu, sd = mean_std(xs)
                    if j == 0 and mu is not None:
                        means[m, i, k] = mu
                    cells.append("-" if mu is None else
                                 mean_text("{:.3f}", mu, sd, len(xs), len(xs)) + f" (n={len(xs)})")
            if own or any(c != "-" for c in cells):
                out.append(f"| {m} | {k} | " + " | ".join(cells) + " |")
    out.append("")
    for m in models:
        for i, u in enumerate(updates):
            ks = [k for k in depths if (m, i, k) in means]
            if len(ks) < 2:
                out.append(f"- {m}, {u}: " + (f"K = {ks[0]} only, no trend yet." if ks else "no runs."))
                continue
            path = " → ".join(f"{means[m, i, k]:.3f}" for k in ks)
            up = [f"{a} → {b}" for a, b in zip(ks, ks[1:]) if means[m, i, b] > means[m, i, a]]
            out.append(f"- {m}, {u}: dev NLL over K = {' → '.join(map(str, ks))}: {path}; "
                       + (f"rises at K = {', '.join(up)}." if up else "does not rise."))
    return "\n".join(out) + "\n"


def paired_differences(rows, datasets):
    """Per dataset: each model's test NLL minus TANGO's at the same seed (mean ± std over the seeds
    both have, n = how many; negative = lower than TANGO) at every held-out depth, and each model's
    training throughput (tokens/s, median of the last 100 updates, mean over seeds, as the runs
    measured it). [] without TANGO runs."""
    out = []
    for ds in datasets:
        models = _order({k[1] for k in rows if k[0] == ds})
        depths = [k for k in HELD_OUT if (ds, "tango", k) in rows]
        if not depths:
            continue
        out += ["", f"**{ds}**: paired-seed differences, test NLL of each model minus TANGO's at the same seed "
                    f"({unit_of([r for k, v in rows.items() if k[0] == ds for r in v])}, mean ± sample std over seeds, "
                    "n seeds; negative: lower than TANGO), and training "
                    "throughput (tokens/s, median of the last 100 updates, mean over seeds; as each run measured "
                    "it, so runs that shared the machine with other work read low: tools.bench times models alone).\n",
                "| model | " + " | ".join(f"test NLL − TANGO K={k}" for k in depths)
                + " | " + " | ".join(f"tokens/s K={k}" for k in depths) + " |",
                "|---|" + "---|" * (2 * len(depths))]
        for m in models:
            cells = []
            for k in depths:
                tango = {r["seed"]: r["test_nll"] for r in rows[ds, "tango", k] if r.get("test_nll") is not None}
                diffs = [r["test_nll"] - tango[r["seed"]] for r in rows.get((ds, m, k), [])
                         if r.get("test_nll") is not None and r["seed"] in tango]
                mu, sd = mean_std(diffs)
                cells.append("-" if m == "tango" or mu is None else
                             f"{mu:+.3f}" + (f" ± {sd:.3f}" if len(diffs) > 1 else "") + f" (n={len(diffs)})")
            for k in depths:
                mu, _ = _stat(rows, (ds, m, k), "tok_per_s_median_last100")
                cells.append("-" if mu is None else f"{mu:,.0f}")
            out.append(f"| {m} | " + " | ".join(cells) + " |")
    return out


def wall_time(root, rows):
    """Lines on the grid's cost when root has the printed output of its `sweep.py run` commands
    (sweep-output.txt, one after another): each finished command's wall time as printed on its last
    line and their sum (seconds; a command stopped before that line is counted as stopped, not
    timed), the sum of the runs' own wall_s (and how many of those count their last process only),
    or that the last command had not finished. [] without that file."""
    path = os.path.join(root, "sweep-output.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read()
    done = list(re.finditer(r"^sweep: (\d+) runs?, (\d+) failed, wall time (\d+) s$", text, re.M))
    starts = list(re.finditer(r"^\[1/\d+\] ", text, re.M))  # one per command (its first run, started or skipped)
    runs = [r for v in rows.values() for r in v]
    own = (f"the {len(runs)} run's own `wall_s` adds up to" if len(runs) == 1
           else f"the {len(runs)} runs' own `wall_s` add up to") + f" {sum(r.get('wall_s', 0.0) for r in runs):,.0f} s"
    partial = sum(bool(r.get("wall_s_this_process_only")) for r in runs)
    if partial:
        own += (f" ({partial} of them resumed without the time before the resume recorded: "
                "their `wall_s` counts the last process only)")
    if not done or (starts and starts[-1].start() > done[-1].start()):
        return ["", f"**Not finished**: the last `sweep.py run` command in `sweep-output.txt` had not printed its "
                    f"wall time when these summaries were collected; {own}."]
    times = [int(m.group(3)) for m in done]
    line = "; ".join(f"{int(m.group(3)):,} s for {m.group(1)} run{'s' * (m.group(1) != '1')} ({m.group(2)} failed)"
                     for m in done)
    stopped = len(starts) - len(done)
    return ["", f"**Wall time** as `sweep.py run` printed it (`sweep-output.txt` here): {line}"
                + (f"; {sum(times):,} s in all" if len(done) > 1 else "")
                + (f" ({stopped} start{'s' if stopped > 1 else ''} stopped before printing its wall time not "
                   "counted)" if stopped > 0 else "") + f". The {own[4:]}."]


# The paper's figures below are from the TANGO paper's section 4.1 text: all 16 comparisons
# (Table 1), 47 of the 48 paired-seed comparisons (Table 13), the largest std over seeds 0.045 vs
# 0.053-0.319 (Table 12), at depth 16 the lowest dev NLL in 7 of 8 settings and TANGO's dev NLL
# falling in 7 (rising in none), Loop's rising in 4, Untied's in 3; exact match at 160M, K = 8:
# 51.86 / 52.07 / 43.0 % (GAU) interpolation, 40.96 / 39.72 / 30.2 % extrapolation. Table 1's
# values are not in the text this project has, so a count read off it (Windowed TANGO against
# Loop or FLASH) has no paper figure here.
UNSOURCED = "- (Table 1's values: not in the text used here)"


def claims(rows, datasets):
    """The paper's section 4.1 claims, each as | claim | paper | here |, over PAPER_MODELS; a
    setting counts only when all six have runs there."""
    mean = lambda ds, m, k, metric="test_nll": _stat(rows, (ds, m, k), metric)[0]
    complete = lambda ds, k, metric="test_nll": all(mean(ds, m, k, metric) is not None for m in PAPER_MODELS)
    settings = [(ds, k) for ds in datasets for k in HELD_OUT if complete(ds, k)]
    n = len(settings)
    others = [m for m in PAPER_MODELS if m != "tango"]
    baselines = others[1:]  # Loop/Untied Transformer++, GAU, FLASH: the paper's "non-TANGO baselines"
    lowest = sum(mean(ds, "tango", k) < min(mean(ds, m, k) for m in others) for ds, k in settings)
    paired = total = 0
    for ds, k in settings:
        by_seed = {m: {r["seed"]: r["test_nll"] for r in rows[ds, m, k] if r.get("test_nll") is not None}
                   for m in PAPER_MODELS}
        for seed, v in by_seed["tango"].items():
            rivals = [by_seed[m][seed] for m in others if seed in by_seed[m]]
            if len(rivals) == len(others):
                total += 1
                paired += v < min(rivals)
    beats = lambda a, b: sum(mean(ds, a, k) < mean(ds, b, k) for ds, k in settings)

    def max_sd(m):  # the largest std over seeds of m's test NLL across the settings (None: < 2 seeds)
        sds = [statistics.stdev(v) for ds, k in settings for v in [_values(rows, (ds, m, k), "test_nll")] if len(v) > 1]
        return max(sds) if sds else None
    base_sd = [x for x in map(max_sd, baselines) if x is not None]
    spread = (f"{max_sd('tango'):.3f} vs {min(base_sd):.3f}-{max(base_sd):.3f}"
              if max_sd("tango") is not None and base_sd else "- (fewer than 2 seeds)")
    if not settings:
        return ["**The paper's claims (section 4.1)**: no dataset has test NLL for all six paper architectures "
                f"({', '.join(PAPER_MODELS)}) at K = 4 or 8, so none is checked."]
    out = ["**The paper's claims (section 4.1) at this scale**, over the six paper architectures "
           f"({n} dataset × depth settings with test NLL for all six):\n",
           "| claim | paper (70M/160M, 4 datasets) | here |", "|---|---|---|",
           f"| TANGO has the lowest mean test NLL | 16 of 16 settings | {lowest} of {n} |",
           f"| TANGO is lower than every other model with the same seed | 47 of 48 | {paired} of {total} |",
           f"| Windowed TANGO is lower than Loop Transformer++ | {UNSOURCED} | {beats('tango-windowed', 'loop')} of {n} |",
           f"| Windowed TANGO is lower than FLASH | {UNSOURCED} | {beats('tango-windowed', 'flash')} of {n} |",
           f"| largest test-NLL std over seeds: TANGO vs the lowest-highest of Loop, Untied, GAU, FLASH "
           f"| 0.045 vs 0.053-0.319 | {spread} |"]
    trio = (4, 8, 16)

    def over_depths(m):
        """(the depths of trio that m has dev NLL at in every dataset where it has two or more of
        them, those datasets, the step counts falls / rises over them): a grid may run K = 16 for
        some models only, so each model's row is over its own runs."""
        have = {ds: [k for k in trio if mean(ds, m, k, "dev_nll") is not None] for ds in datasets}
        dss = [ds for ds in datasets if len(have[ds]) >= 2]
        ks = [k for k in trio if all(k in have[ds] for ds in dss)] if dss else []
        curves = [[mean(ds, m, k, "dev_nll") for k in ks] for ds in dss]
        falls = sum(all(b < a for a, b in zip(c, c[1:])) for c in curves)
        rises = sum(any(b > a for a, b in zip(c, c[1:])) for c in curves)
        return ks, len(dss), falls, rises

    for m, name, paper in (("tango", "TANGO", None), ("loop", "Loop Transformer++", "4 of 8"),
                           ("untied", "Untied Transformer++", "3 of 8")):
        ks, n_ds, falls, rises = over_depths(m)
        if len(ks) < 2:
            continue
        path = " → ".join(map(str, ks))
        over = "" if len(ks) == len(trio) else " (over K = 4 → 8 → 16)"  # the paper's steps, when ours are fewer
        if paper is None:
            out.append(f"| TANGO's dev NLL over K = {path}: falls at each step / rises at some step | "
                       f"7 / 0 of 8 settings{over} | {falls} / {rises} of {n_ds} |")
        else:
            out.append(f"| {name}'s dev NLL rises at some step over K = {path} | {paper}{over} | {rises} of {n_ds} |")
    full = [ds for ds in datasets if complete(ds, 16, "dev_nll")]
    if full:
        won = sum(mean(ds, "tango", 16, "dev_nll") < min(mean(ds, m, 16, "dev_nll") for m in others) for ds in full)
        out.append(f"| TANGO has the lowest dev NLL at K = 16 | 7 of 8 | {won} of {len(full)} |")
    for ds, k in settings:
        for sp in ("interpolate", "extrapolate"):
            metric = f"exact_match_{sp}"
            if not all(mean(ds, m, k, metric) is not None for m in PAPER_MODELS):
                continue
            top = max(mean(ds, m, k, metric) for m in baselines)
            best = [m for m in baselines if mean(ds, m, k, metric) == top]
            best = best[0] if len(best) == 1 else f"{len(best)} tied"
            out.append(f"| exact match ({ds} {sp}, K = {k}): TANGO / Windowed TANGO / best of the other four | "
                       + ("51.9 % / 52.1 % / 43.0 % (GAU)" if sp == "interpolate" else "41.0 % / 39.7 % / 30.2 % (GAU)")
                       + " at 160M, K = 8 | "
                       + f"{mean(ds, 'tango', k, metric):.1%} / {mean(ds, 'tango-windowed', k, metric):.1%} / "
                       + f"{top:.1%} ({best}) |")
    return out + seed_counts_note(rows, datasets, settings)


def seed_counts_note(rows, datasets, settings):
    """A line under the claims when the means they compare are over unequal numbers of seeds (a
    cell with fewer runs than the others): which cells, and how many seeds each has; [] otherwise."""
    cells = {(ds, m, k) for ds, k in settings for m in PAPER_MODELS}  # the test-NLL claims
    cells |= {(ds, m, k) for ds in datasets for m in PAPER_MODELS for k in (4, 8, 16)}  # the depth claims
    counts = {c: len(rows[c]) for c in cells if c in rows}
    if len(set(counts.values())) < 2:
        return []
    most = max(counts.values())
    groups = {}  # (dataset, K, seeds) -> the models of that setting with fewer seeds
    for ds, m, k in sorted(counts, key=lambda c: (c[0], c[2], PAPER_MODELS.index(c[1]))):
        if counts[ds, m, k] < most:
            groups.setdefault((ds, k, counts[ds, m, k]), []).append(m)
    parts = [f"{ds} K = {k}: " + ("every model" if len(ms) == sum(c[0] == ds and c[2] == k for c in counts)
                                  else ", ".join(ms)) + f" {n}" for (ds, k, n), ms in groups.items()]
    return ["", f"**Seeds**: the claims compare means over unequal numbers of seeds, {most} per cell except "
                + "; ".join(parts) + "."]


def plot(root, out, more=(), depths=None):
    """<out>/<dataset>.png: per depth, training loss (moving average over 10 updates) and dev NLL
    against tokens seen, one line per model (mean over seeds), from curves_of each run of root and
    the roots `more` (load_runs), at the depths `depths` (None: all). Models past the tenth are drawn
    dashed (ten colours). Needs matplotlib (optional extra); SystemExit(2) with a one-line message
    when it is missing or root has no runs; UsageError when none is at `depths`. Returns the paths written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("sweep.py plot needs matplotlib (an optional extra): pip install matplotlib", file=sys.stderr)
        raise SystemExit(2)
    every = load_runs(root, *more)
    if not every:
        print(f"sweep.py plot: no summary.json under {root}/<dataset>/<run>/", file=sys.stderr)
        raise SystemExit(2)
    rows = {k: v for k, v in every.items() if depths is None or k[2] in depths}
    if not rows:
        raise UsageError(f"--depths {','.join(map(str, depths))}: no runs at these depths under "
                         f"{', '.join((root, *more))} (they have K = {', '.join(map(str, sorted({k[2] for k in every})))})")
    written = []
    for ds in sorted({k[0] for k in rows}):
        depths = sorted({k[2] for k in rows if k[0] == ds})
        models = _order({k[1] for k in rows if k[0] == ds})
        many = len(models) > 10  # a legend beside the panels, in a wider figure
        fig, axes = plt.subplots(2, len(depths), figsize=(4.2 * len(depths) + 2.6 * many, 7), squeeze=False)
        for j, k in enumerate(depths):
            for i, m in enumerate(models):
                curves = [c for c in (curves_of(s["_dir"]) for s in rows.get((ds, m, k), [])) if c["train"]]
                if not curves:
                    continue
                color, style, tpu = f"C{i % 10}", "-" if i < 10 else "--", curves[0]["tokens_per_update"]
                for row, key, smooth in ((0, "train", 10), (1, "eval", 1)):
                    its = [it for it, _ in curves[0][key]]
                    ys = [statistics.fmean(dict(c[key]).get(it, float("nan")) for c in curves) for it in its]
                    if smooth > 1:
                        ys = [statistics.fmean(ys[max(0, t - smooth + 1):t + 1]) for t in range(len(ys))]
                    axes[row][j].plot([it * tpu / 1e3 for it in its], ys, color=color, linestyle=style, label=m,
                                      marker="o" if key == "eval" else None, ms=3)
            axes[0][j].set_title(f"{ds}, K = {k}")
            unit = unit_of([r for m in models for r in rows.get((ds, m, k), [])])
            axes[0][j].set_ylabel(f"training loss ({unit}, 10-update mean)")
            axes[1][j].set_ylabel(f"dev NLL ({unit})")
            for row in (0, 1):
                axes[row][j].set_xlabel("training tokens (thousands)")
                axes[row][j].grid(alpha=0.3)
            for row, span in ((0, 2.5), (1, 1.0)):  # zoom on the end of training (the first updates are ~ln V)
                lines = axes[row][j].get_lines()
                if lines:
                    lo = min(min(ln.get_ydata()) for ln in lines)
                    axes[row][j].set_ylim(lo - 0.05, lo + span)
        if many:
            axes[0][-1].legend(*axes[1][-1].get_legend_handles_labels(), fontsize=8, loc="upper left",
                               bbox_to_anchor=(1.02, 1.0))
        else:
            axes[1][0].legend(fontsize=8)
        fig.suptitle(f"{ds}: mean over seeds ({root})" if not more else
                     f"{ds}: mean over seeds\n({' + '.join((root, *more))})")
        fig.tight_layout()
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"{ds}.png")
        fig.savefig(path, dpi=80, metadata={"Software": None})  # no version stamp: the same bytes every time
        plt.close(fig)
        written.append(path)
    print("wrote " + ", ".join(written))
    return written


def throughput_report(root):
    """Markdown: the training throughput that tools.bench measured at the grid's shapes, one column
    per depth of each: tokens/s, the step's peak memory (MB) and MFU over Loop Transformer++'s,
    from <root>/bench_K<k>.json (tools.bench --json). A row whose status is not ok shows its status
    (timeout, error), a missing figure (no Loop Transformer++ row: no MFU ratio) a dash. UsageError
    when there is no such file, or one is unreadable or its rows are not K = k, one per model."""
    paths = sorted(p for p in glob.glob(os.path.join(root, "bench_K*.json"))
                   if re.fullmatch(r"bench_K[1-9][0-9]*\.json", os.path.basename(p)))
    if not paths:
        raise UsageError(f"--root {root}: no bench_K<k>.json (python -m tools.bench --json ...)")
    by_depth = {}
    for path in paths:
        k = int(os.path.basename(path)[len("bench_K"):-len(".json")])
        rows = read_json(path, ("rows",))["rows"]
        if not isinstance(rows, list) or not rows or not all(
                isinstance(r, dict) and isinstance(r.get("model"), str) and "depth" in r for r in rows):
            raise UsageError(f"{path}: 'rows' must be a non-empty list of tools.bench rows (model, depth, ...)")
        models = [r["model"] for r in rows]
        if {r["depth"] for r in rows} != {k} or len(set(models)) != len(models):
            raise UsageError(f"{path}: the rows must all be at depth K = {k} (its name) and one per model")
        by_depth[k] = {r["model"]: r for r in rows}
    ks = sorted(by_depth)
    models = _order(set().union(*by_depth.values()))
    cols = [("tokens/s", "tokens_per_s", ",.0f"), ("peak MB", "peak_mem_mb", ",.0f"),
            ("MFU / Loop T++", "mfu_vs_ref", ".2f")]

    def cell(row, key, fmt):
        if row is None:
            return "–"  # not benchmarked at this depth
        if row.get("status", "ok") != "ok":
            return str(row["status"]).split(":")[0]  # timeout, error: no figure
        value = row.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else "–"
    out = ["| model | " + " | ".join(f"{name} K={k}" for name, _, _ in cols for k in ks) + " |",
           "|---|" + "---:|" * (len(cols) * len(ks))]
    for m in models:
        out.append(f"| {m} | " + " | ".join(cell(by_depth[k].get(m), key, fmt) for _, key, fmt in cols for k in ks)
                   + " |")
    from tools.bench_report import nominal_notes  # (tools.bench's MFU definition)
    notes = nominal_notes([by_depth[k][m] for m in models for k in ks if m in by_depth[k]])
    return "\n".join(out + ([""] + notes if notes else [])) + "\n"


def report_markers(root, mode):
    """(begin, end): the lines around a report block of --root root in a markdown file; mode is one of
    "runs" (the per-run table), "grid", "budget", "throughput", "zoo", "budgets" (the --lr table has no markers; ValueError
    for it and for any other mode). root is written as a path relative to the working folder when it
    lies inside it: results/x/, ./results/x and its absolute path all name results/x."""
    ends = {"runs": "sweep", "grid": "grid", "budget": "budget", "throughput": "throughput", "zoo": "zoo",
            "budgets": "budgets"}
    if mode not in ends:
        raise ValueError(f"report_markers: mode {mode!r} has no markers; one of {', '.join(ends)}")
    root = root_name(root)
    flag = "" if mode == "runs" else f"--{mode} "
    return f"<!-- sweep report {flag}--root {root} -->\n", f"<!-- end of {ends[mode]} report -->"


def replace_between_markers(path, markers, text):
    """Write text between markers (begin, end) in the file at path, in place (the first begin and the
    first end after it). UsageError naming the file and the missing marker; nothing is written then."""
    begin, end = markers
    if not os.path.isfile(path):
        raise UsageError(f"--into {path}: no such file")
    with open(path) as f:
        doc = f.read()
    i = doc.find(begin)
    j = doc.find(end, i + len(begin)) if i >= 0 else -1
    if i < 0 or j < 0:
        missing = begin.strip() if i < 0 else f"{end} after {begin.strip()}"
        raise UsageError(f"--into {path}: no line {missing}; put the two marker lines where the report goes")
    write_text(path, doc[:i + len(begin)] + text + doc[j:])


if __name__ == "__main__":  # a part of another command: say which, instead of exiting silently
    not_a_command("tools/sweep_report.py", "python -m tools.sweep report or python -m tools.sweep plot (python -m tools.sweep report --help)")
