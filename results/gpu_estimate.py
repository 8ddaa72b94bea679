"""The arithmetic behind the GPU recipe's wall-time estimate (results/chargrid/README.md, "The same grid on
one GPU"): counted on the CPU, not timed on a GPU.

    python results/gpu_estimate.py                       # every model of the grid at K = 4, 8, 16
    python results/gpu_estimate.py --models tango --depths 4

For each (model, K) at the `tiny` tier (T = 128, 8 sequences, V = 416: character-level stdlib) it
counts the ATen operators that launch work (views and allocations left out) of one eager training
update (forward, loss, backward) and of one cached decoding step (exact match on dmmath), with a
TorchDispatchMode. On a GPU each such operator is about one kernel. Runs this small leave the GPU
almost idle inside each kernel, so the time is set by how many kernels are issued: processes without
MPS take turns on the GPU, so the grid's kernels run one after another. The estimate multiplies the
grid's kernel count by an assumed cost per kernel and divides the kernels of the compiled training
steps by an assumed fusion factor (--assume); both are assumptions, printed as such.
"""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import train  # noqa: E402
from common import UsageError  # noqa: E402
from harness.cli import ExitParser  # noqa: E402
from harness.config import model_config, resolve_args  # noqa: E402
from models import REGISTRY, build_model  # noqa: E402

NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "slice",
             "select", "as_strided", "detach", "alias", "split", "split_with_sizes", "unbind", "chunk", "reshape",
             "narrow", "lift_fresh", "_reshape_alias", "unflatten", "flatten", "diagonal", "empty", "empty_like",
             "empty_strided", "new_empty", "new_empty_strided"}


class CountOps(TorchDispatchMode):
    """Counts the ATen operators dispatched inside it, views and allocations left out."""

    def __init__(self):
        super().__init__()
        self.n = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def kernels(self):
        return sum(v for k, v in self.n.items() if k not in NO_KERNEL)


def config(model_name, depth, vocab=416):
    """(train.py's flags, ModelConfig) of model_name at depth (the tiny tier, characters); UsageError
    for a depth the model refuses."""
    a = resolve_args(train.parse_args(["--model", model_name, "--depth", str(depth), "--size", "tiny",
                                             "--device", "cpu", "--tokenizer", "char"]))
    return a, model_config(a, vocab)[0]


def count(a, cfg, vocab=416, prompt=20, steps=10):
    """(kernels of one training update, kernels of one decoding step) of the model of config()'s
    (train.py's flags a, ModelConfig cfg)."""
    torch.manual_seed(0)
    model = build_model(cfg, device="cpu")
    x, y = torch.randint(0, vocab, (2, a.batch_size, a.block_size))
    train.seed_random_draws(model, 1, 0, 0)
    with CountOps() as c:
        logits, _ = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").backward()
    model.eval()
    with torch.no_grad(), CountOps() as d:
        model.generate(x[:1, :prompt], steps, temperature=0)
    return c.kernels(), d.kernels() / (steps + 1)


def check(p, a):
    """Every flag's value in range, before any counting: one line naming the flag (exit code 2)
    otherwise. Returns [(model, K, *config(model, K))] in the order of --models and --depths."""
    models, depths, pairs = a.models.split(","), a.depths.split(","), a.assume.split(",")
    if any(m not in REGISTRY for m in models):
        p.error(f"--models {a.models}: comma-separated train.py --model names ({', '.join(REGISTRY)})")
    if not all(k.isdigit() and int(k) >= 1 for k in depths):
        p.error(f"--depths {a.depths}: comma-separated whole numbers >= 1")
    configs = []
    for m in models:  # every (model, K) before the first row: a model may refuse a depth
        for k in map(int, depths):
            try:
                configs.append((m, k, *config(m, k)))
            except UsageError as e:
                p.error(f"--models {m} --depths {k}: {e}")
    for flag in ("updates", "eval_interval", "seeds"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} {getattr(a, flag)}: must be >= 1")
    if not 0 < a.decode_steps < float("inf"):
        p.error(f"--decode_steps {a.decode_steps}: must be a finite number > 0")
    def positive(text):
        try:
            return 0 < float(text) < float("inf")
        except ValueError:
            return False
    if not all(len(pair.split("x")) == 2 and all(map(positive, pair.split("x"))) for pair in pairs):
        p.error(f"--assume {a.assume}: comma-separated pairs AxF of finite numbers > 0 (e.g. 1.5x4)")
    return configs


def millions(n):
    """n kernels in millions: whole millions from 10M on, two significant digits below (0.16M, not 0M)."""
    return f"{n / 1e6:,.0f}M" if n >= 1e7 else f"{n / 1e6:.2g}M"


def main():
    p = ExitParser(prog="results/gpu_estimate.py", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tango,tango-windowed,loop,untied,gau,flash,parcae",
                   help="comma-separated train.py --model names (the grid's rows)")
    p.add_argument("--depths", default="4,8,16", help="comma-separated depths K")
    p.add_argument("--updates", type=int, default=2000, help="training updates per run")
    p.add_argument("--eval_interval", type=int, default=100, help="updates between dev evaluations")
    p.add_argument("--seeds", type=int, default=3, help="seeds per (model, K) and dataset")
    p.add_argument("--decode_steps", type=float, default=10.5,
                   help="forward passes per exact-match problem: the prompt + up to answer length + 2 (dmmath's "
                        "answers: 6.3 characters on average in interpolate, 8.8 in extrapolate)")
    p.add_argument("--assume", default="1.5x4,2x3,1x5",
                   help="comma-separated pairs AxF: A µs of GPU time per small kernel, F times fewer kernels "
                        "in a compiled training step than in an eager one (assumptions, not measured)")
    a = p.parse_args()
    configs = check(p, a)
    torch.set_num_threads(1)
    train_k = eval_k = em_k = 0.0
    print("| model | K | kernels per training update (eager) | kernels per decoding step |")
    print("|---|---|---|---|")
    for m, k, flags, cfg in configs:
        upd, step = count(flags, cfg)
        print(f"| {m} | {k} | {upd:,} | {step:,.0f} |", flush=True)
        runs = 2 * a.seeds  # stdlib and dmmath
        train_k += runs * a.updates * upd
        # dev NLL: (updates / interval + 1) evaluations of 32 windows in 4 forward passes (about 0.35 of an update
        # each, the forward's share), test NLL once
        eval_k += runs * (a.updates // a.eval_interval + 2) * 4 * 0.35 * upd
        em_k += a.seeds * 200 * a.decode_steps * step  # dmmath only: 100 problems of each of 2 splits
    print(f"\neager kernels: training updates {millions(train_k)}, evaluations {millions(eval_k)}, exact-match "
          f"decoding {millions(em_k)} (eager in either mode)")
    for pair in a.assume.split(","):
        us, fusion = map(float, pair.split("x"))
        for name, n in (("eager", train_k + eval_k + em_k), ("compiled", (train_k + eval_k) / fusion + em_k)):
            print(f"assuming {us:g} µs per kernel, {fusion:g}x fewer compiled: {name} {millions(n)} kernels, "
                  f"{n * us / 1e6:,.0f} s of GPU time issued one after another")


if __name__ == "__main__":
    main()
