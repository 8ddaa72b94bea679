"""The cpu-tier character grid: results/cpugrid/README.md's budget table, grid tables and claims are
`sweep.py report --budget` / `report --grid` over the committed summaries and curves and
`report --throughput` over the committed bench JSONs, byte for byte;
its plot is the committed PNG; its printed commands are the settings the runs were trained with."""
import json
import os
import re
import shlex
import shutil

import pytest

import train
from checks import GRID_MODELS
from common import UsageError
from harness.checkpoint import MACHINE_FLAGS
from harness.config import resolve_args, unread_model_flags
from tools import sweep, sweep_report
from test_chargrid import require_pinned_plotting, sweep_options

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
ROOT = "results/cpugrid"
LR_ROOT = "results/cpugrid_lr"  # the same grid at peak learning rate 1e-3
WARM_ROOT = "results/cpugrid_warmup"  # the same grid with 60 warmup updates
HEADLINE_ROOT = WARM_ROOT  # the grid the README's headline reports


def readme(root=ROOT):
    with open(os.path.join(HERE, root, "README.md")) as f:
        return f.read()


def block(doc, markers):
    begin, end = markers
    i = doc.index(begin) + len(begin)
    return doc[i:doc.index(end, i)]


def sweep_commands(root=ROOT, marker="<!-- cpugrid commands -->"):
    """The `python -m tools.sweep ...` lines of root's README's commands block (the fence after the
    line marker), as argv lists."""
    doc = readme(root)
    start = doc.index("```\n", doc.index(marker + "\n")) + 4
    cmds = []
    for line in doc[start:doc.index("```", start)].splitlines():
        words = shlex.split(line)
        if "tools.sweep" in words:
            cmds.append(words[words.index("tools.sweep") + 1:])
    return cmds


def test_cpugrid_blocks_are_the_committed_summaries_byte_for_byte(monkeypatch):
    monkeypatch.chdir(HERE)
    doc = readme()
    assert block(doc, sweep_report.report_markers(ROOT, "budget")) == sweep_report.budget_report(ROOT)
    assert block(doc, sweep_report.report_markers(ROOT, "grid")) == sweep_report.grid_report(ROOT)
    assert block(doc, sweep_report.report_markers(ROOT, "runs")) == sweep_report.report(ROOT)  # K = 16's test NLL
    rows = sweep_report.load_runs(ROOT)
    assert rows and {k[0] for k in rows} == {"stdlib"}
    assert all(s["size"] == "cpu" and s["tokens"] == 600 * 8 * 256 for v in rows.values() for s in v)


HEADLINE_NAMES = {"TANGO": "tango", "Windowed TANGO": "tango-windowed", "Untied": "untied", "Loop": "loop",
                  "Loop Transformer++": "loop", "GAU": "gau", "FLASH": "flash", "Parcae": "parcae"}


def test_readme_headline_numbers_are_the_grids(monkeypatch):
    """Every "mean ± std" cell of the README's headline table is that row's model's test NLL at its
    column's K over the headline grid's committed runs, the lowest of each column in bold, and TANGO's
    dev NLL trend over K = 4 → 8 → 16 its dev means."""
    monkeypatch.chdir(HERE)
    with open("README.md", encoding="utf-8") as f:
        head = block(f.read(), ("<!-- headline -->\n", "<!-- end of headline -->"))
    rows = sweep_report.load_runs(HEADLINE_ROOT)
    assert sum(map(len, rows.values())) == 51
    stat = lambda m, k, metric="test_nll": sweep_report._stat(rows, ("stdlib", m, k), metric)
    table = [[c.strip() for c in line.strip("|").split("|")] for line in head.splitlines() if line.startswith("|")]
    depths = [int(h.removeprefix("K = ")) for h in table[0][1:]]
    cells = [(row[0], k, cell) for row in table[2:] for k, cell in zip(depths, row[1:]) if cell]
    assert len(cells) == 17  # seven models at K = 4 and 8, three at K = 16
    for name, k, cell in cells:
        mu, sd = stat(HEADLINE_NAMES[name], k)
        lowest = min(stat(m, k)[0] for m in {HEADLINE_NAMES[n] for n, k_, _ in cells if k_ == k})
        assert cell == (f"**{mu:.3f} ± {sd:.3f}**" if mu == lowest else f"{mu:.3f} ± {sd:.3f}"), (name, k, cell)
    head = " ".join(head.split())  # the prose's line breaks as spaces
    trend = re.search(r"dev NLL rises over K = 4 → 8 → 16 \(([\d.]+), ([\d.]+), ([\d.]+)\)", head).groups()
    assert trend == tuple(f"{stat('tango', k, 'dev_nll')[0]:.3f}" for k in (4, 8, 16))


@pytest.mark.parametrize("root, run_root, n_commands, lr, updates, commands", [
    (ROOT, "runs/cpugrid", 4, 2e-3, 600, (ROOT, "<!-- cpugrid commands -->")),
    (LR_ROOT, "runs/cpugrid_lr", 5, 1e-3, 600, (LR_ROOT, "<!-- cpugrid commands -->")),
    (WARM_ROOT, "runs/cpugrid_warmup", 11, 2e-3, 600, (WARM_ROOT, "<!-- cpugrid commands -->")),
    ("results/zoo", "runs/zoo", 2, 2e-3, 600, ("results/zoo", "<!-- zoo commands -->")),
    ("results/zoo/lr1e-3", "runs/zoo_lr1e-3", 2, 1e-3, 600, ("results/zoo", "<!-- zoo commands -->")),
    ("results/zoo/control", "runs/control", 1, 2e-3, 600, ("results/zoo", "<!-- zoo commands -->")),
    ("results/zoo/depth4x", "runs/depth4x", 3, 2e-3, 2400, ("results/zoo", "<!-- depth4x commands -->"))])
def test_cpugrid_runs_were_trained_as_the_printed_commands_ask(root, run_root, n_commands, lr, updates, commands,
                                                               monkeypatch):
    """Every committed run under root was trained as the printed `sweep.py run` commands of its
    --root (run_root) ask, in the commands block (README folder, marker line) `commands`: its
    recorded train.py settings (args.json) are those the command resolves to at today's code
    (machine flags aside), so the printed commands continue it with the same settings."""
    monkeypatch.chdir(HERE)
    runs = [c for c in sweep_commands(*commands) if c[0] == "run" and c[c.index("--root") + 1] == run_root]
    assert len(runs) == n_commands
    grids = [(sweep_options(argv), argv[argv.index("--") + 1:]) for argv in runs]
    rows = sweep_report.load_runs(root)
    assert rows
    for (ds, m, k), summaries in rows.items():
        for s in summaries:
            own, extra = next((o, e) for o, e in grids if m in o["--models"].split(",") and
                              str(k) in o["--depths"].split(",") and s["seed"] <= int(o["--seeds"]))
            argv = sweep.train_argv(run_root, ds, m, k, s["seed"], None, extra)
            requested = vars(resolve_args(train.parse_args(argv + ["--device", "cpu"])))  # as they ran
            with open(os.path.join(s["_dir"], "args.json")) as f:
                saved = json.load(f)
            keys = set(saved) - set(MACHINE_FLAGS) - unread_model_flags(m)
            assert {k_: saved[k_] for k_ in keys} == {k_: requested[k_] for k_ in keys}, s["_dir"]
            assert saved["max_iters"] == updates and saved["block_size"] == 256 and saved["tokenizer"] == "char"
            assert saved["learning_rate"] == lr


def test_budget_report_arithmetic(tmp_path):
    """The last-quarter improvement is (NLL at the first evaluation at or after 3/4 of the updates
    - NLL at the end) / the former; the share is the end NLL over the unigram entropy."""
    run = tmp_path / "stdlib" / "tango-K4-s1"
    run.mkdir(parents=True)
    summary = {"model": "tango", "depth": 4, "seed": 1, "unigram_dev": 3.0, "test_nll": 1.0, "dev_nll": 1.5,
               "non_embedding_params": 10}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "curves.json").write_text(json.dumps({"tokens_per_update": 8, "train": [[1, 3.0]],
                                                 "eval": [[100, 2.5], [300, 2.0], [400, 1.6], [500, 1.2]]}))
    table = sweep_report.budget_report(str(tmp_path))
    # 3/4 of 500 = 375: the first evaluation at or after it is update 400 (1.6); (1.6 - 1.2) / 1.6 = 25 %; 1.2 / 3 = 40 %
    assert table.splitlines()[2] == "| stdlib | tango | 4 | 1 | 500 | 1.600 (upd 400) | 1.200 | 25.0 % | 40 % |"


@pytest.mark.parametrize("root", [ROOT, WARM_ROOT])
def test_cpugrid_plot_is_the_committed_png_byte_for_byte(root, tmp_path, monkeypatch):
    require_pinned_plotting()
    monkeypatch.chdir(HERE)
    written = sweep_report.plot(root, str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["stdlib.png"]
    with open(written[0], "rb") as a, open(os.path.join(root, "stdlib.png"), "rb") as b:
        assert a.read() == b.read()


@pytest.mark.parametrize("mode", ["--budget", "--throughput"])
def test_report_command_writes_into_this_readme(mode, tmp_path, monkeypatch):
    argv, = [shlex.split(line)[3:] for line in readme().splitlines()
             if line.startswith(f"python -m tools.sweep report {mode} ")]
    shutil.copytree(os.path.join(HERE, ROOT), tmp_path / ROOT)
    monkeypatch.chdir(tmp_path)
    sweep.main(argv)
    assert (tmp_path / ROOT / "README.md").read_text() == readme()


def bench_rows(root, k):
    """The rows of <root>/bench_K<k>.json (tools.bench --json), by model."""
    with open(os.path.join(root, f"bench_K{k}.json")) as f:
        rows = json.load(f)["rows"]
    by_model = {r["model"]: r for r in rows}
    assert len(by_model) == len(rows), f"bench_K{k}.json has a model twice"
    return by_model


def test_throughput_report_columns(tmp_path):
    """One column per K for each of tokens/s, peak MB and MFU over Loop Transformer++'s, the models in
    the paper's order; a model one depth lacks is a dash; a file of two depths is an error."""
    def row(m, k, tps, mb, mfu):
        return {"model": m, "depth": k, "tokens_per_s": tps, "peak_mem_mb": mb, "mfu_vs_ref": mfu}
    (tmp_path / "bench_K4.json").write_text(json.dumps({"rows": [row("loop", 4, 4365.4, 406.2, 1.0),
                                                                  row("tango", 4, 2530.0, 1487.0, 0.914)]}))
    (tmp_path / "bench_K8.json").write_text(json.dumps({"rows": [row("tango", 8, 1134.0, 917.0, 0.905)]}))
    assert sweep_report.throughput_report(str(tmp_path)).splitlines() == [
        "| model | tokens/s K=4 | tokens/s K=8 | peak MB K=4 | peak MB K=8 | MFU / Loop T++ K=4 | MFU / Loop T++ K=8 |",
        "|---|---:|---:|---:|---:|---:|---:|",
        "| tango | 2,530 | 1,134 | 1,487 | 917 | 0.91 | 0.91 |",
        "| loop | 4,365 | – | 406 | – | 1.00 | – |"]
    # what tools.bench itself can write: a timed-out row (no figures), a run without Loop (no ratio)
    (tmp_path / "bench_K8.json").write_text(json.dumps({"rows": [
        {"model": "tango", "depth": 8, "status": "timeout"},
        {"model": "loop", "depth": 8, "status": "ok", "tokens_per_s": 10.0, "peak_mem_mb": 5.0}]}))
    (tmp_path / "bench_K8.old.json").write_text("not read: not a bench_K<k>.json name")
    assert sweep_report.throughput_report(str(tmp_path)).splitlines()[2:] == [
        "| tango | 2,530 | timeout | 1,487 | timeout | 0.91 | timeout |",
        "| loop | 4,365 | 10 | 406 | 5 | 1.00 | – |"]
    for content, message in [
        ({"rows": [row("tango", 8, 1, 1, 1), row("loop", 4, 1, 1, 1)]},
         "bench_K8.json: the rows must all be at depth K = 8 (its name) and one per model"),
        ({"rows": [row("tango", 4, 1, 1, 1)]}, "bench_K8.json: the rows must all be at depth K = 8"),
        ({"rows": [row("tango", 8, 1, 1, 1), row("tango", 8, 1, 1, 1)]}, "and one per model"),
        ({"rows": []}, "bench_K8.json: 'rows' must be a non-empty list of tools.bench rows"),
        ({"rows": [{"depth": 8}]}, "'rows' must be a non-empty list"),
        ({}, "bench_K8.json: expected a JSON object with the keys rows"),
        ([1], "expected a JSON object"),
        ("{", "bench_K8.json: not a readable JSON file"),
    ]:
        (tmp_path / "bench_K8.json").write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(UsageError, match=re.escape(message)):
            sweep_report.throughput_report(str(tmp_path))
    (tmp_path / "bench_K8.json").write_bytes(b"\xff\xfe")
    with pytest.raises(UsageError, match="not a readable JSON file"):
        sweep_report.throughput_report(str(tmp_path))
    with pytest.raises(UsageError, match="no bench_K<k>.json"):
        sweep_report.throughput_report(str(tmp_path / "nothing"))


def test_throughput_report_flags_every_model_whose_mfu_is_nominal(tmp_path):
    """A row of each model in flops.TRAIN_FLOPS_NOMINAL gets one line with its reason; the others none
    (which models draw is checked by test_faults.test_the_drawing_models_are_the_nominal_ones)."""
    import flops
    import models
    nominal = sorted(flops.TRAIN_FLOPS_NOMINAL)
    assert 0 < len(nominal) < len(models.REGISTRY)
    rows = [{"model": m, "depth": 4, "tokens_per_s": 1.0, "peak_mem_mb": 1.0, "mfu_vs_ref": 1.0}
            for m in models.REGISTRY]
    (tmp_path / "bench_K4.json").write_text(json.dumps({"rows": rows}))
    notes = [ln for ln in sweep_report.throughput_report(str(tmp_path)).splitlines() if "not comparable" in ln]
    assert sorted(notes) == sorted(f"{m}: MFU from the forward formula, but {flops.TRAIN_FLOPS_NOMINAL[m]}; not "
                                   "comparable with the other rows." for m in nominal)


def test_cpugrid_throughput_block_is_the_bench_output(monkeypatch):
    """The throughput table is `report --throughput` over the two bench JSONs; they measured the grid's shapes, with the models
    at the width the grid's runs trained (same non-embedding parameters)."""
    monkeypatch.chdir(HERE)
    bench = {k: bench_rows(ROOT, k) for k in (4, 8)}
    assert block(readme(), sweep_report.report_markers(ROOT, "throughput")) == \
        sweep_report.throughput_report(ROOT)
    runs = sweep_report.load_runs(ROOT)
    for k, rows in bench.items():
        assert set(rows) == set(GRID_MODELS)
        for r in rows.values():
            assert (r["depth"], r["T"], r["batch"], r["vocab_size"], r["window"], r["threads"], r["status"]) == \
                (k, 256, 8, 416, 64, 2, "ok")
            for s in runs.get(("stdlib", r["model"], k), []):
                assert (s["width"], s["non_embedding_params"]) == (r["width"], r["non_embedding_params"])


def args_beside_grid(s, ds, m, k):
    """(a committed run's args.json, the args.json of the grid's run of the same model, K and seed)."""
    with open(os.path.join(s["_dir"], "args.json")) as f:
        saved = json.load(f)
    with open(os.path.join(ROOT, ds, f"{m}-K{k}-s{s['seed']}", "args.json")) as f:
        return saved, json.load(f)


def test_twice_the_budget_block_is_its_committed_summaries_and_the_grids_settings(monkeypatch):
    """results/cpugrid_1200: its budget table is `report --budget` over its committed runs, byte for
    byte, and each run was trained with the grid's settings but --max_iters 1200."""
    monkeypatch.chdir(HERE)
    root = "results/cpugrid_1200"
    with open(os.path.join(root, "README.md")) as f:
        doc = f.read()
    assert block(doc, sweep_report.report_markers(root, "budget")) == sweep_report.budget_report(root)
    rows = sweep_report.load_runs(root)
    assert sorted(rows) == [("stdlib", "loop", 16), ("stdlib", "parcae", 8)]
    for (ds, m, k), (s,) in rows.items():
        assert s["seed"] == 1, s["_dir"]
        saved, grid = args_beside_grid(s, ds, m, k)
        keys = set(saved) - set(MACHINE_FLAGS) - {"max_iters", "lr_decay_iters"}  # the schedule's length
        assert {x: saved[x] for x in keys} == {x: grid[x] for x in keys}, s["_dir"]
        assert (saved["max_iters"], saved["lr_decay_iters"], grid["max_iters"], grid["lr_decay_iters"]) == \
            (1200, 1200, 600, 600) and s["tokens"] == 1200 * 8 * 256


@pytest.mark.parametrize("root, flag, values, some_rows, reports", [
    (LR_ROOT, "learning_rate", (1e-3, 2e-3), {("stdlib", "loop", 16)},  # (the floor, min_lr_ratio x peak, follows)
     ("budget", "runs")),
    (WARM_ROOT, "warmup_iters", (60, 10), {("stdlib", "loop", 16), ("stdlib", "parcae", 8)},  # 60 warmup updates
     ("budget", "grid", "runs")),
])
def test_one_setting_grid_blocks_are_its_summaries_and_the_grids_settings_but_one(root, flag, values, some_rows,
                                                                                  reports, monkeypatch):
    """results/cpugrid_lr and results/cpugrid_warmup: each one's budget, grid (cpugrid_warmup) and runs
    tables are `report --budget`, `report --grid` and `report` over its committed runs, byte for
    byte, and each run was trained with the settings of the grid's run of the same model, K and seed
    but one: flag, values[0] for the grid's values[1]."""
    monkeypatch.chdir(HERE)
    doc = readme(root)
    make = {"budget": sweep_report.budget_report, "grid": sweep_report.grid_report, "runs": sweep_report.report}
    for mode in reports:
        assert block(doc, sweep_report.report_markers(root, mode)) == make[mode](root), mode
    rows = sweep_report.load_runs(root)
    assert some_rows <= set(rows)
    for (ds, m, k), summaries in rows.items():
        for s in summaries:
            saved, grid = args_beside_grid(s, ds, m, k)
            keys = set(saved) - set(MACHINE_FLAGS) - {flag}
            assert {x: saved[x] for x in keys} == {x: grid[x] for x in keys}, s["_dir"]
            assert (saved[flag], grid[flag]) == values
            assert s["tokens"] == s["best_iter"] * 8 * 256 and s["seed"] == saved["seed"] == saved["data_seed"]
