"""Scaling-law fits of "Parcae: Scaling Laws For Stable Looped Language Models" (arXiv 2604.12946,
§5.2 training law, §5.3 test-time depth law and unified law) to train.py runs: fit_depth_law,
fit_training_law, fit_unified_law (Huber loss on log NLL, L-BFGS from many initializations),
read_run (N, D and dev NLL of one run's log.jsonl), fit_runs, and the command line
`python -m tools.flops_fit RUN ...` (main). flops.py keeps the analytical MAC and FLOP formulas the
fits take N and D from (unrolled_params, unembedding_params). Bad input raises UsageError (the CLI: one line, exit 2).
"""
import math
import os
import sys

import torch

if not __package__:  # run as python tools/x.py, not python -m tools.x: find the project's modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models
from common import ModelConfig, UsageError
from harness.cli import ExitParser, check_output_file, make_parent, run_command, write_text
from flops import RECURRENT_MODELS, unembedding_params, unrolled_params


# ----------------------------------------------------------------------------- scaling-law fits
# All fits minimize sum_i Huber_delta(log pred_i - log L_i) (delta = 1e-3, Hoffmann et al.) with
# torch.optim.LBFGS (float64, strong Wolfe line search). Positive coefficients are fitted in log
# space and every power / exponential term is written relative to a reference point of the data
# (the geometric mean of N and of D, the mean of T): A N^-a = exp(a' - a log(N / N0)) with
# A = exp(a') N0^a, which decouples coefficient and exponent (the fit is badly conditioned
# otherwise). "Many restarts": the objective is evaluated on a grid of initializations at once,
# and L-BFGS runs from the `restarts` best grid points; the lowest final loss wins. Huber_delta(r)
# = delta^2 Huber_1(r / delta), so Huber_1(r / delta) is minimized (same minimizer, gradients of a
# sensible scale for L-BFGS's tolerances).

HUBER_DELTA = 1e-3


def _huber(r, delta):
    a = (r / delta).abs()
    return torch.where(a <= 1, 0.5 * a * a, a - 0.5)


def _grid(*axes):
    mesh = torch.meshgrid(*[torch.as_tensor(a, dtype=torch.float64) for a in axes], indexing="ij")
    return torch.stack([m.reshape(-1) for m in mesh], -1)


def _minimize(objective, grid, restarts, max_iter):
    """objective: theta (R, P) -> (R,) losses. L-BFGS from the `restarts` best grid rows; returns
    (theta (P,), loss)."""
    with torch.no_grad():
        vals = objective(grid)
    vals = torch.where(torch.isfinite(vals), vals, torch.full_like(vals, float("inf")))
    best_theta, best_val = None, float("inf")
    for i in torch.argsort(vals)[:restarts].tolist():
        theta = grid[i].clone().requires_grad_(True)
        opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=max_iter, max_eval=2 * max_iter,
                                tolerance_grad=1e-12, tolerance_change=1e-16, history_size=50,
                                line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = objective(theta[None])[0]
            loss.backward()
            return loss

        try:
            opt.step(closure)
        except RuntimeError:  # a line search that hit a non-finite value: keep the best so far
            pass
        with torch.no_grad():
            v = float(objective(theta[None])[0])
        if math.isfinite(v) and v < best_val:
            best_theta, best_val = theta.detach().clone(), v
    if best_theta is None:
        raise UsageError("scaling-law fit: no initialization converged to a finite loss")
    return best_theta, best_val


def _as64(*xs):
    return [torch.as_tensor(x, dtype=torch.float64).reshape(-1) for x in xs]


def _check_points(n_points, n_params, law):
    if n_points < n_params:
        raise UsageError(f"{law} law: {n_points} points cannot determine {n_params} parameters")


def _check_varies(law, **variables):
    """UsageError unless every variable a law fits an exponent (or a rate) for takes >= 3 distinct
    values in the given points: with fewer, the fit returns numbers the runs cannot determine."""
    for name, values in variables.items():
        n = len(set(values.tolist()))
        if n < 3:
            raise UsageError(f"{law} law: {name} takes {n} distinct value{'s' * (n != 1)} in these runs; "
                             f"fitting its exponent needs >= 3")


# Condition number of the design (a law's variables over its points: log N, log D, T / mu_rec, each
# centered and scaled to unit length): 1 when they vary independently, infinite when one is an
# affine function of the others. Above WEAK_DESIGN the exponents trade off against each other
# (Belsley's threshold for estimates that collinearity degrades); at COLLINEAR_DESIGN or beyond
# (numerically rank deficient) the points cannot tell the terms apart at all.
WEAK_DESIGN, COLLINEAR_DESIGN = 10.0, 1e6


def design_condition(**variables):
    """(condition number, (name, name, correlation) of the most correlated pair) of the design whose
    columns are the given variables (1-D tensors over the same points, each taking >= 2 values),
    centered and scaled to unit length; math.inf for a rank-deficient design."""
    names = list(variables)
    Z = torch.stack([v - v.mean() for v in variables.values()], 1)
    Z = Z / Z.norm(dim=0)
    s = torch.linalg.svdvals(Z)
    cond = float(s[0] / s[-1]) if float(s[-1]) > float(s[0]) / COLLINEAR_DESIGN else math.inf
    corr = Z.T @ Z
    i, j = max(((i, j) for i in range(len(names)) for j in range(i + 1, len(names))), key=lambda p: abs(float(corr[p])))
    return cond, (names[i], names[j], float(corr[i, j]))


def check_design(law, exponents, **variables):
    """None when the design identifies each exponent; a warning naming the variables that move
    together when it does so only weakly (condition number above WEAK_DESIGN). UsageError when it
    cannot (COLLINEAR_DESIGN or beyond: one variable an affine function of the others, as with N
    and D both power laws of the depth). exponents: what the law fits, for the message."""
    cond, (u, v, r) = design_condition(**variables)
    if cond <= WEAK_DESIGN:
        return None
    rank_deficient = cond >= COLLINEAR_DESIGN
    moves = (f"{u} and {v} move together in these runs (correlation {r:.4f}; the design in {', '.join(variables)} "
             + ("is rank deficient)" if rank_deficient else f"has condition number {cond:.3g} > {WEAK_DESIGN:g})"))
    hint = "two --max_iters per depth" if {u, v} == {"log N", "log D"} else "other --eval_depths"
    vary = f"vary {u.removeprefix('log ')} and {v.removeprefix('log ')} independently (e.g. {hint})"
    if rank_deficient:
        raise UsageError(f"{law} law: {moves}: {exponents} cannot be identified; {vary}")
    return f"{law} law: {moves}: {exponents} are weakly identified (the fit trades one for another); {vary}"


def fit_depth_law(T, L, restarts=32, max_iter=500, delta=HUBER_DELTA):
    """Test-time depth law L(T) = L_inf + Z exp(-z T) (Parcae §5.3) from recurrences T and losses L.
    Returns {"L_inf", "Z", "z", "huber"}; UsageError for fewer than 3 distinct T."""
    T, L = _as64(T, L)
    _check_points(len(T), 3, "depth")
    _check_varies("depth", T=T)
    T0, logL = T.mean(), L.log()

    def objective(th):  # th: (R, 3) = [log L_inf, log(Z exp(-z T0)), log z]
        terms = torch.stack([th[:, :1].expand(-1, len(T)),
                             th[:, 1:2] - th[:, 2:3].exp() * (T - T0)], 0)
        return _huber(torch.logsumexp(terms, 0) - logL, delta).sum(-1)

    lmin, spread = float(L.min()), float(L.max() - L.min()) + 1e-6
    grid = _grid([math.log(lmin * f) for f in (0.5, 0.7, 0.85, 0.95, 0.99)],
                 [math.log(spread * f) for f in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)],
                 [math.log(z) for z in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)])
    th, v = _minimize(objective, grid, restarts, max_iter)
    z = float(th[2].exp())
    return {"L_inf": float(th[0].exp()), "Z": float((th[1] + z * T0).exp()), "z": z, "huber": v}


def fit_training_law(N, D, L, restarts=32, max_iter=1000, delta=HUBER_DELTA):
    """Training law L = E + A N^-a + B D^-b (Parcae §5.2; N: unrolled parameters N(mu_rec), D: tokens).
    Returns {"E", "A", "a", "B", "b", "huber"}; UsageError for fewer than 3 distinct N or D, or a
    design that cannot identify a and b (check_design: log N and log D collinear)."""
    N, D, L = _as64(N, D, L)
    _check_points(len(L), 5, "training")
    _check_varies("training", N=N, D=D)
    lN, lD = N.log(), D.log()
    check_design("training", "a and b", **{"log N": lN, "log D": lD})
    cN, cD, logL = lN.mean(), lD.mean(), L.log()

    def objective(th):  # [log E, a', a, b', b]
        terms = torch.stack([th[:, :1].expand(-1, len(L)), th[:, 1:2] - th[:, 2:3] * (lN - cN),
                             th[:, 3:4] - th[:, 4:5] * (lD - cD)], 0)
        return _huber(torch.logsumexp(terms, 0) - logL, delta).sum(-1)

    lm = math.log(float(L.mean()))
    levels = [lm + s for s in (-3.0, -2.0, -1.0, -0.3)]
    grid = _grid([lm + s for s in (-2.0, -1.0, -0.5, -0.2)], levels, (0.05, 0.2, 0.4, 0.8, 1.5),
                 levels, (0.05, 0.2, 0.4, 0.8, 1.5))
    th, v = _minimize(objective, grid, restarts, max_iter)
    a, b = float(th[2]), float(th[4])
    return {"E": float(th[0].exp()), "A": float((th[1] + a * cN).exp()), "a": a,
            "B": float((th[3] + b * cD).exp()), "b": b, "huber": v}


def fit_unified_law(N, D, T, mu_rec, L, restarts=32, max_iter=1500, delta=HUBER_DELTA):
    """Unified law L = E + X N^-x + Y D^-y + Z exp(-z T / mu_rec) (Parcae §5.3): N unrolled parameters
    N(mu_rec), D tokens, T test-time recurrences, mu_rec the training mean recurrence.
    Returns {"E", "X", "x", "Y", "y", "Z", "z", "huber"}; UsageError for fewer than 3 distinct
    N, D or T / mu_rec, or a design that cannot identify x, y and z (check_design)."""
    N, D, T, M, L = _as64(N, D, T, mu_rec, L)
    _check_points(len(L), 7, "unified")
    _check_varies("unified", N=N, D=D, T_over_mu_rec=T / M)
    lN, lD, R = N.log(), D.log(), T / M
    check_design("unified", "x, y and z", **{"log N": lN, "log D": lD, "T / mu_rec": R})
    cN, cD, cR, logL = lN.mean(), lD.mean(), R.mean(), L.log()

    def objective(th):  # [log E, x', x, y', y, z', log z]
        terms = torch.stack([th[:, :1].expand(-1, len(L)), th[:, 1:2] - th[:, 2:3] * (lN - cN),
                             th[:, 3:4] - th[:, 4:5] * (lD - cD), th[:, 5:6] - th[:, 6:7].exp() * (R - cR)], 0)
        return _huber(torch.logsumexp(terms, 0) - logL, delta).sum(-1)

    lm = math.log(float(L.mean()))
    levels = [lm + s for s in (-3.0, -1.5, -0.5)]
    grid = _grid([lm + s for s in (-1.0, -0.5, -0.2)], levels, (0.1, 0.4, 1.0), levels, (0.1, 0.4, 1.0),
                 levels, [math.log(z) for z in (0.1, 0.5, 2.0, 8.0)])
    th, v = _minimize(objective, grid, restarts, max_iter)
    x, y, z = float(th[2]), float(th[4]), float(th[6].exp())
    return {"E": float(th[0].exp()), "X": float((th[1] + x * cN).exp()), "x": x,
            "Y": float((th[3] + y * cD).exp()), "y": y, "Z": float((th[5] + z * cR).exp()), "z": z,
            "huber": v}


def log_file(path):
    """A run's log: path/log.jsonl for a run directory, else path itself."""
    return os.path.join(path, "log.jsonl") if os.path.isdir(path) else path


def read_run(path):
    """One training run from train.py's JSON log (a run directory or its log.jsonl): the first
    "start" event, the last "summary" and the last "depth_sweep". Returns {"path", "model",
    "config", "mu_rec", "N" (unrolled non-embedding parameters), "D" (tokens seen at the
    evaluated checkpoint: best_iter x tokens per update), "dev_nll", "sweep_depths",
    "sweep_nll"}; UsageError if the log is missing or has no summary."""
    import parcae
    import json
    import os
    f = log_file(path)
    if not os.path.isfile(f):
        raise UsageError(f"{path}: no log.jsonl")
    start = summary = sweep = None
    with open(f) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise UsageError(f"{f}: not a JSON-lines log") from None
            if not isinstance(rec, dict):
                raise UsageError(f"{f}: not a JSON-lines log (a line is not a JSON object)")
            ev = rec.get("event")
            if ev == "start" and start is None:
                start = rec
            elif ev == "summary":
                summary = rec
            elif ev == "depth_sweep":
                sweep = rec
    if start is None or summary is None:
        raise UsageError(f"{f}: needs a 'start' and a 'summary' event (run not finished?)")
    cfg = ModelConfig.from_dict(start["config"])
    args = start.get("args", {})
    per_update = args.get("batch_size", 1) * args.get("gradient_accumulation_steps", 1) * cfg.block_size
    looped = cfg.model in RECURRENT_MODELS
    return {"path": path, "model": cfg.model, "config": cfg,
            "mu_rec": parcae.resolve_recurrence(cfg)[0] if looped else cfg.depth,
            "N": unrolled_params(cfg) if looped else models.count_params(cfg) + unembedding_params(cfg),
            "D": float(summary.get("tokens", summary["best_iter"] * per_update)),
            "dev_nll": float(summary["dev_nll"]),
            "sweep_depths": sweep["depths"] if sweep else None, "sweep_nll": sweep["dev_nll"] if sweep else None}


NO_SWEEP = "{} law: no run has a depth_sweep event (train.py --eval_depths, e.g. 1,2,4,8,16)"


def fit_runs(runs, law="all", restarts=32):
    """Fit the laws to runs (read_run dicts): depth law per run with a sweep; training and
    unified laws per model over its runs. Returns a list of {"law", "model", "label", "points",
    "params" | "error"}: every law asked for that cannot be fit has a row with the reason (the
    depth law without any sweep one row for all runs, labelled "every run"); a fit whose design
    identifies its exponents only weakly has a "warning" too (check_design)."""
    out = []
    by_model = {}
    for r in runs:
        by_model.setdefault(r["model"], []).append(r)
    if law in ("all", "depth"):
        if not any(r["sweep_depths"] for r in runs):
            out.append({"law": "depth", "model": "-", "label": "every run", "points": 0,
                        "error": NO_SWEEP.format("depth")})
        for r in runs:
            if r["sweep_depths"]:
                row = {"law": "depth", "model": r["model"], "label": str(r["path"]), "points": len(r["sweep_depths"])}
                try:
                    row["params"] = fit_depth_law(r["sweep_depths"], r["sweep_nll"], restarts)
                except UsageError as e:
                    row["error"] = str(e)
                out.append(row)
    for model, rs in by_model.items():
        if law in ("all", "training"):
            row = {"law": "training", "model": model, "label": model, "points": len(rs)}
            try:
                row["params"] = fit_training_law([r["N"] for r in rs], [r["D"] for r in rs],
                                                 [r["dev_nll"] for r in rs], restarts)
                N, D = _as64([r["N"] for r in rs], [r["D"] for r in rs])
                if warning := check_design("training", "a and b", **{"log N": N.log(), "log D": D.log()}):
                    row["warning"] = warning
            except UsageError as e:
                row["error"] = str(e)
            out.append(row)
        if law in ("all", "unified"):
            pts = [(r["N"], r["D"], t, r["mu_rec"], l) for r in rs if r["sweep_depths"]
                   for t, l in zip(r["sweep_depths"], r["sweep_nll"])]
            row = {"law": "unified", "model": model, "label": model, "points": len(pts)}
            try:
                row["params"] = fit_unified_law(*zip(*pts), restarts=restarts) if pts else None
                if row["params"] is None:
                    raise UsageError(NO_SWEEP.format("unified"))
                N, D, T, M = _as64(*list(zip(*pts))[:4])
                if warning := check_design("unified", "x, y and z",
                                           **{"log N": N.log(), "log D": D.log(), "T / mu_rec": T / M}):
                    row["warning"] = warning
            except UsageError as e:
                row.pop("params", None)
                row["error"] = str(e)
            out.append(row)
    return out


def main(argv=None):
    """python -m tools.flops_fit RUN [RUN ...] [--law all|depth|training|unified] [--restarts R] [--out F]:
    one line per fit, or "skipped: REASON" per law that cannot be fit; exit 2 with one line and no
    --out written when none can."""
    import json
    p = ExitParser(prog="tools.flops_fit", description="Fit Parcae's scaling laws to train.py run logs.")
    p.add_argument("runs", nargs="+", help="run directories (or their log.jsonl)")
    p.add_argument("--law", default="all", choices=("all", "depth", "training", "unified"),
                   help="which scaling law to fit (all: each one the runs' variables allow)")
    p.add_argument("--restarts", type=int, default=64, help="L-BFGS restarts (best grid points)")
    p.add_argument("--out", default=None, help="also write the fits as JSON here")
    a = p.parse_args(argv)
    if a.restarts < 1:
        p.error(f"--restarts {a.restarts}: must be >= 1")
    try:
        if a.out:
            check_output_file("--out", a.out)  # before the fits, not after them
        logs = {}
        for r in a.runs:  # the same run twice (DIR, DIR/, DIR/log.jsonl) would count as two data points
            f = os.path.realpath(log_file(r))
            if f in logs:
                raise UsageError(f"{r}: the same run as {logs[f]} (each run at most once)")
            logs[f] = r
        rows = fit_runs([read_run(r) for r in a.runs], a.law, a.restarts)
        if not any("params" in row for row in rows):  # nothing to print or write but the reasons
            raise UsageError("nothing could be fit (a law is fit per model): " + "; ".join(dict.fromkeys(
                ("" if row["model"] == "-" else f"{row['model']}: ") + row["error"] for row in rows)))
    except UsageError as e:
        p.exit(2, f"tools.flops_fit: error: {e}\n")
    for row in rows:
        if "params" in row:
            vals = "  ".join(f"{k}={v:.4g}" for k, v in row["params"].items())
            print(f"{row['law']:<9}{row['model']:<8}{row['points']:>4} pts  {vals}  [{row['label']}]")
            if row.get("warning"):
                print(f"{'':<9}warning: {row['warning']}")
        else:
            print(f"{row['law']:<9}{row['model']:<8}{row['points']:>4} pts  skipped: {row['error']}  [{row['label']}]")
    if a.out:
        write_text(make_parent(a.out), json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    run_command(main)
