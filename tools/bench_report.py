"""bench.py's report: MFU ratios to Loop Transformer++, the speed/memory targets computed from the rows,
and the markdown table. A row is one configuration's dict from bench.child (status, model, T,
compile, tokens/s, peak memory, model FLOPs, ...); see bench.py's docstring for the columns."""
import math

REFERENCE = "loop"  # the Transformer++ the MFU ratio is taken against (one block applied K times)


def add_ratios(rows, peak):
    """MFU per row and its ratio to the reference model's MFU at the same (T, compile)."""
    for r in rows:
        if r["status"] == "ok":
            r["mfu"] = r["achieved_flops_per_s"] / peak
    ref = {(r["T"], r["compile"]): r["mfu"] for r in rows if r["model"] == REFERENCE and r["status"] == "ok"}
    for r in rows:
        if r["status"] == "ok" and (r["T"], r["compile"]) in ref:
            r["mfu_vs_ref"] = r["mfu"] / ref[(r["T"], r["compile"])]


def nominal(row):
    """Why a row's MFU is nominal, not the work its steps ran (flops.train_flops_nominal of its
    config, recorded as "flops_nominal"), or None; a row written before that field: by its model."""
    if "flops_nominal" in row:
        return row["flops_nominal"]
    from flops import TRAIN_FLOPS_NOMINAL
    return TRAIN_FLOPS_NOMINAL.get(row["model"])


def nominal_notes(rows):
    """One line per model with a nominal MFU among rows: the model and why."""
    reasons = {}
    for r in rows:
        if r.get("status", "ok") == "ok" and nominal(r):
            reasons.setdefault(r["model"], nominal(r))
    return [f"{m}: MFU from the forward formula, but {why}; not comparable with the other rows."
            for m, why in reasons.items()]


def _slope(xs, ys):
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def targets(rows):
    """The targets from the rows (eager where present): linear memory, flat windowed time, three-set
    speed, MFU; each {value, threshold, status, detail}."""
    modes = {r["compile"] for r in rows if r["status"] == "ok"}
    mode = False if False in modes else (True if modes else False)
    ok = {(r["model"], r["T"]): r for r in rows if r["status"] == "ok" and r["compile"] == mode}
    out = {}

    def na(why):
        return {"status": "n/a", "detail": why}

    pts = sorted((T, r["peak_mem_mb"] / r["batch"]) for (m, T), r in ok.items() if m == "tango" and r["peak_mem_mb"] > 0)
    if len(pts) >= 2:
        p = _slope([math.log(T) for T, _ in pts], [math.log(v) for _, v in pts])
        out["tango_memory_exponent"] = {
            "value": p, "threshold": 1.1, "status": "PASS" if p <= 1.1 else "MISS",
            "detail": f"TANGO peak step memory per sequence ~ T^{p:.2f} over T={pts[0][0]}..{pts[-1][0]} "
                      f"(least squares on log-log; 1 = linear, 2 = quadratic; "
                      + ", ".join(f"T={T}: {v:.1f} MB/seq" for T, v in pts) + ")"}
    else:
        out["tango_memory_exponent"] = na("needs TANGO rows at two or more block sizes")

    a, b = ok.get(("tango-windowed", 4096)), ok.get(("tango-windowed", 512))
    if a and b:
        q = a["ms_per_token"] / b["ms_per_token"]
        out["windowed_time_per_token_4096_vs_512"] = {
            "value": q, "threshold": 1.25, "status": "PASS" if q <= 1.25 else "MISS",
            "detail": f"Windowed TANGO {a['ms_per_token']:.4f} ms/token at T=4096 vs {b['ms_per_token']:.4f} at T=512"}
    else:
        out["windowed_time_per_token_4096_vs_512"] = na("needs tango-windowed rows at T=512 and T=4096")

    a, b = ok.get(("tango-3set", 2048)), ok.get(("tango", 2048))
    if a and b:
        q = a["tokens_per_s"] / b["tokens_per_s"]
        out["three_set_vs_tango_tokens_per_s_2048"] = {
            "value": q, "threshold": 3.0, "status": "PASS" if q >= 3.0 else "MISS",
            "detail": f"three-set {a['tokens_per_s']:.0f} tokens/s vs TANGO {b['tokens_per_s']:.0f} at T=2048; "
                      f"model FLOPs per token {a['model_flops_per_token'] / 1e6:.0f}M vs {b['model_flops_per_token'] / 1e6:.0f}M "
                      f"(ratio {b['model_flops_per_token'] / a['model_flops_per_token']:.2f}x)"}
    else:
        out["three_set_vs_tango_tokens_per_s_2048"] = na("needs tango-3set and tango rows at T=2048")

    ratios = [r for r in ok.values()  # a nominal MFU is not comparable (bench.py's MFU)
              if "mfu_vs_ref" in r and r["model"] != REFERENCE and not nominal(r)]
    left = sorted({r["model"] for r in ok.values() if "mfu_vs_ref" in r and nominal(r)})
    if ratios:
        worst = min(ratios, key=lambda r: r["mfu_vs_ref"])
        per_model = {}
        for r in ratios:
            per_model.setdefault(r["model"], []).append(r)
        below = sorted(f"{m} (min {min(x['mfu_vs_ref'] for x in rs):.2f}x at T="
                       f"{min(rs, key=lambda x: x['mfu_vs_ref'])['T']})"
                       for m, rs in per_model.items() if min(x["mfu_vs_ref"] for x in rs) < 0.8)
        out["min_mfu_vs_transformer_pp"] = {
            "value": worst["mfu_vs_ref"], "threshold": 0.8, "status": "PASS" if not below else "MISS",
            "detail": f"lowest: {worst['model']} at T={worst['T']} ({worst['mfu_vs_ref']:.2f}x Loop Transformer++'s MFU); "
                      + ("below 0.8x: " + "; ".join(below) if below else "every model at or above 0.8x at every T")
                      + (f" ({', '.join(left)} left out: their MFU is nominal, not comparable)" if left else ""),
            "per_model_min": {m: min(x["mfu_vs_ref"] for x in rs) for m, rs in per_model.items()}}
    else:
        out["min_mfu_vs_transformer_pp"] = na(f"needs {REFERENCE} rows and other models at the same T")
    out["compile"] = mode
    return out


def table(rows):
    head = ("| model | T | batch | compile | tokens/s | ms/token | peak MB | MFU | MFU / Loop T++ | first step s "
            "| compile s | recompiles |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        c = "on" if r["compile"] else "off"
        if r["status"] != "ok":
            batch = max(1, r["batch_tokens"] // r["T"]) if "batch_tokens" in r else ""
            lines.append(f"| {r['model']} | {r['T']} | {batch} | {c} | "
                         f"{r['status']} | | | | | | | |")
            continue
        ratio = f"{r['mfu_vs_ref']:.2f}" if "mfu_vs_ref" in r else ""
        work = f" (work {r['attention_work']:.2f}x)" if r.get("attention_work") else ""  # TANGO's fused plan, CUDA rows
        lines.append(f"| {r['model']} | {r['T']} | {r['batch']} | {c} | {r['tokens_per_s']:,.0f} | "
                     f"{r['ms_per_token']:.4f} | {r['peak_mem_mb']:,.0f} | {100 * r['mfu']:.1f}%{work} | {ratio} | "
                     + (f"{r['first_step_s']:.1f} |" if "first_step_s" in r else " |")
                     + (" - | - |" if not r["compile"] else
                        f" {r['compile_s']:.1f} | {r['recompiles']} |" if "compile_s" in r else " | |"))
    notes = nominal_notes(rows)
    if any(r.get("attention_work") for r in rows):
        notes.append("MFU (work Nx): the attention work TANGO's fused plan executes, whole tiles, over the model's "
                     "(tango_kernels.attention_work; the forward's, the backward runs the same tiles).")
    return "\n".join(lines + ([""] + notes if notes else []))


def targets_text(tg):
    names = {"tango_memory_exponent": "TANGO memory per sequence grows no faster than linearly in T (exponent <= 1.1)",
             "windowed_time_per_token_4096_vs_512": "Windowed TANGO time/token at 4096 within 1.25x of 512",
             "three_set_vs_tango_tokens_per_s_2048": "three-set >= 3x TANGO's tokens/s at T=2048",
             "min_mfu_vs_transformer_pp": "every model's MFU >= 0.8x Loop Transformer++'s at the same T"}
    lines = []
    for k, title in names.items():
        t = tg[k]
        v = f" {t['value']:.2f}" if "value" in t else ""
        lines.append(f"- **{t['status']}**{v}: {title}. {t['detail']}")
    return "\n".join(lines)


if __name__ == "__main__":  # a part of another command: say which, instead of exiting silently
    import os
    import sys
    if not __package__:  # run as python tools/x.py, not python -m tools.x: find the project's modules
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from harness.cli import not_a_command
    not_a_command("tools/bench_report.py", "python -m tools.bench (python -m tools.bench --help)")
