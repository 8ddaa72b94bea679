"""Run a grid of train.py runs and report them as markdown tables.

    python sweep.py run --root runs/readme --models tango,loop --depths 4 --seeds 1 --datasets stdlib
    python sweep.py report --root runs/readme [--out table.md]

`run` trains every (dataset, model, depth, seed) combination as its own train.py process in
`<root>/<dataset>/<model>-K<depth>-s<seed>/`, with the paper's protocol from train.py: matched
non-embedding parameters (the tier's width solving), the same data order for the same seed
(`--data_seed` = seed), dev-selected checkpoint, test on that checkpoint. A run whose
`summary.json` exists is skipped; one with only `ckpt_latest.pt` is resumed, so a sweep can be
stopped and continued across sessions. Extra flags after `--` go to every run.

`report` reads every `summary.json` under the root and prints one table per dataset: mean ± std
over seeds of test NLL (and dev NLL, exact match where present), lowest mean in bold.
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_dir(root, dataset, model, depth, seed, lr=None):
    name = f"{model}-K{depth}-s{seed}" + (f"-lr{lr}" if lr else "")
    return os.path.join(root, os.path.basename(dataset.rstrip("/")), name)


def cmd_run(args, extra):
    lrs = args.lrs.split(",") if args.lrs else [None]
    grid = [(ds, m, int(k), int(s), lr) for ds in args.datasets.split(",") for k in args.depths.split(",")
            for m in args.models.split(",") for lr in lrs for s in range(1, args.seeds + 1)]
    for i, (ds, m, k, s, lr) in enumerate(grid, 1):
        out = run_dir(args.root, ds, m, k, s, lr)
        if os.path.exists(os.path.join(out, "summary.json")):
            print(f"[{i}/{len(grid)}] {out}: done, skipped")
            continue
        cmd = [sys.executable, os.path.join(HERE, "train.py"), "--model", m, "--depth", str(k), "--dataset", ds,
               "--seed", str(s), "--data_seed", str(s), "--out_dir", out, "--quiet", *extra]
        if lr:
            cmd += ["--learning_rate", lr]
        if os.path.exists(os.path.join(out, "ckpt_latest.pt")):
            cmd.append("--resume")
        print(f"[{i}/{len(grid)}] " + " ".join(cmd[1:]), flush=True)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "stdout.txt"), "w") as f:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
        if rc != 0:
            print(f"  failed with exit code {rc}; see {out}/stdout.txt")


def mean_std(xs):
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def report(root):
    """Markdown tables (one per dataset) from every summary.json under root."""
    rows = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "*", "summary.json"))):
        with open(path) as f:
            s = json.load(f)
        key = (os.path.basename(os.path.dirname(os.path.dirname(path))), s["model"], s["depth"])
        rows.setdefault(key, []).append(s)
    out = []
    for ds in sorted({k[0] for k in rows}):
        keys = sorted((k for k in rows if k[0] == ds), key=lambda k: (k[2], k[1]))
        metrics = [("test_nll", "test NLL", True), ("dev_nll", "dev NLL", True)]
        em = [m for m in ("exact_match_interpolate", "exact_match_extrapolate") if m in rows[keys[0]][0]]
        metrics += [(m, "EM " + m.split("_")[-1][:6], False) for m in em]
        metrics += [("tok_per_s_median_last100", "tokens/s", None)]
        test_split = rows[keys[0]][0].get("test_split", "test")
        out.append(f"\n**{ds}** (test split: `{test_split}`; unigram entropy of dev "
                   f"{rows[keys[0]][0]['unigram_dev']:.3f} nats/token)\n")
        out.append("| model | K | seeds | non-emb params | " + " | ".join(m[1] for m in metrics) + " |")
        out.append("|---|---|---|---|" + "---|" * len(metrics))
        stats = {k: {m: mean_std([r[m] for r in rows[k] if r.get(m) is not None]) for m, _, _ in metrics}
                 for k in keys}
        for k in keys:
            cells = []
            for m, _, lower in metrics:
                mu, sd = stats[k][m]
                if mu is None:
                    cells.append("-")
                    continue
                same_depth = [stats[j][m][0] for j in keys if j[2] == k[2] and stats[j][m][0] is not None]
                best = lower is not None and mu == (min(same_depth) if lower else max(same_depth))
                fmt = "{:.0f}" if m.startswith("tok") else "{:.2%}" if m.startswith("exact") else "{:.3f}"
                txt = fmt.format(mu) + ("" if len(rows[k]) == 1 else " ± " + fmt.format(sd))
                cells.append(f"**{txt}**" if best else txt)
            out.append(f"| {k[1]} | {k[2]} | {len(rows[k])} | {rows[k][0]['non_embedding_params']:,} | "
                       + " | ".join(cells) + " |")
    return "\n".join(out).lstrip("\n") + "\n"


def lr_report(root):
    """Learning-rate sweep table (runs named ...-lr<LR>): final training loss (mean of the last 10
    updates), best dev NLL, the largest recurrent-state norm seen in training and, from the last
    evaluation, max Abar (Parcae) or ||W_1||_2 (RDM). A run stopped by a non-finite loss shows as
    diverged."""
    out = ["| model | K | peak lr | final train loss | best dev NLL | max state norm | max Abar | "
           "spectral norm (Parcae: diag(Delta) B, RDM: W_1) | status |", "|---|---|---|---|---|---|---|---|---|"]
    runs = sorted(glob.glob(os.path.join(root, "*", "*-lr*")), key=lambda p: (p.split("-K")[0], float(p.split("-lr")[1])))
    for d in runs:
        if not os.path.isdir(d):
            continue
        recs = []
        if os.path.exists(os.path.join(d, "log.jsonl")):
            with open(os.path.join(d, "log.jsonl")) as f:
                recs = [json.loads(line) for line in f]
        train = [r for r in recs if r["event"] == "train"]
        evals = [r for r in recs if r["event"] == "eval"]
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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", required=True)
    r.add_argument("--models", default="tango,tango-windowed,loop,untied,gau,flash")
    r.add_argument("--depths", default="4")
    r.add_argument("--seeds", type=int, default=1)
    r.add_argument("--datasets", default="stdlib")
    r.add_argument("--lrs", default="", help="comma-separated peak learning rates (a learning-rate sweep)")
    q = sub.add_parser("report")
    q.add_argument("--root", required=True)
    q.add_argument("--out", default=None)
    q.add_argument("--lr", action="store_true", help="the learning-rate sweep table instead")
    args = p.parse_args(argv)
    if args.cmd == "run":
        cmd_run(args, extra)
    else:
        text = lr_report(args.root) if args.lr else report(args.root)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        print(text, end="")


if __name__ == "__main__":
    main()
