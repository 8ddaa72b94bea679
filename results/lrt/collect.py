"""Tables of the small experiment of the latent-recurrence seed paper (MATH.md, "LRT") from runs/lrt-exp/*/summary.json (results/lrt/run.sh:
training FLOPs matched; results/lrt/run_tokens.sh: training tokens matched). Prints markdown tables,
the fraction of doubling LRT depth recovered by one thought, (NLL_lrt4 - NLL_lrt-think4) /
(NLL_lrt4 - NLL_lrt8) on dev NLL, and writes results/lrt/summaries.json (the runs' summaries) when every run is there (exit 2 otherwise).
python results/lrt/collect.py [ROOT ...]   (a run is taken from the first ROOT that has it)"""
import json
import os
import sys

if any(a.startswith("-") for a in sys.argv[1:]):
    print(__doc__)
    sys.exit(0 if sys.argv[1] in ("-h", "--help") else 2)
ROOTS = sys.argv[1:] or ["runs/lrt-exp"]
TABLES = {
    "training FLOPs matched (run.sh)": ["untied-4", "untied-8", "loopstack-2x4", "ponder-4", "lrt-4", "lrt-8", "lrt-think-4"],
    "training tokens matched (run_tokens.sh; untied-8, loopstack-2x4, lrt-4 from run.sh)":
        ["untied-4-t120", "untied-8", "loopstack-2x4", "ponder-4-t120", "lrt-4", "lrt-8-t120", "lrt-think-4-t120"],
}
out = {}
for title, runs in TABLES.items():
    print(f"\n{title}\n")
    print("| run | model | updates | training tokens | non-emb params | dev NLL | test NLL |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in runs:
        path = next((os.path.join(root, r, "summary.json") for root in ROOTS
                     if os.path.exists(os.path.join(root, r, "summary.json"))), None)
        if path is None:
            print(f"| {r} | not run | | | | | |")
            continue
        s = out[r] = json.load(open(path))
        print(f"| {r} | {s['model']} | {s['tokens'] // 1024} | {s['tokens']:,} | {s['non_embedding_params']:,} | "
              f"{s['dev_nll']:.4f} | {s['test_nll']:.4f} |")
    lrt4, lrt8, think = runs[4], runs[5], runs[6]
    if all(k in out for k in (lrt4, lrt8, think)):
        a, b, c = (out[k]["dev_nll"] for k in (lrt4, lrt8, think))
        print(f"\nfraction of doubling LRT depth recovered by one thought (dev NLL): "
              f"({a:.4f} - {c:.4f}) / ({a:.4f} - {b:.4f}) = {(a - c) / (a - b):.3f}")
missing = sorted({r for runs in TABLES.values() for r in runs} - set(out))
if missing:  # the committed file holds every run: a partial collection does not replace it
    print(f"\nsummaries.json not written: {len(missing)} runs missing under {', '.join(ROOTS)} ({', '.join(missing)})",
          file=sys.stderr)
    sys.exit(2)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo: common
from harness.cli import write_text  # noqa: E402  (atomic: a crash leaves the committed file whole)
write_text(os.path.join(os.path.dirname(os.path.abspath(__file__)), "summaries.json"), json.dumps(out, indent=1))
