"""Batch-1 cached greedy decoding of the section 9.4 models at the cpu tier, equal block shape (F = 480,
solved for untied K = 4), GPT-2 vocabulary, prompt 64, 32 timed tokens after 4 untimed, one thread.
python results/lrt/decode_bench.py  (bench_decode.decode_row; prints markdown rows)"""
import json, os, sys, torch
if sys.argv[1:]:  # no flags: --help prints this docstring, anything else is refused
    print(__doc__)
    sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository root
torch.set_num_threads(1)
from tools import bench
from tools import bench_decode
rows = []
for m, K, kw in [("untied", 4, {}), ("untied", 8, {}), ("ponder", 4, dict(n_thoughts=1)), ("lrt", 4, {}), ("lrt", 8, {}),
                 ("lrt-think", 4, {})]:
    r = bench_decode.decode_row(m, "cpu", K, 480, 64, 32, 4, **kw)
    rows.append(r)
    print(f"| {m} | {K} | {r['non_embedding_params']:,} | {r['passes'] or 1} | {r['ms_per_token']:.2f} | {r['ms_per_token_mean']:.2f} |", flush=True)
print("load average", bench.loadavg())
