"""results/zoo: the registered models the headline grid leaves out, trained with its recipe at K = 4.
Its README's tables are `sweep.py report` over the committed summaries (the zoo table together with
the headline grid's K = 4 runs) byte for byte, its plot is the committed PNG, its runs were trained
as its printed commands ask, and together with the headline grid it covers every registered model."""
import os
import re
import shlex
import shutil

import json

import pytest

from common import UsageError
from models import REGISTRY
from tools import sweep, sweep_report
from test_chargrid import require_pinned_plotting, sweep_options
from test_cpugrid import HEADLINE_ROOT, block, readme, sweep_commands

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
ROOT = "results/zoo"
OTHER_RATE = "results/zoo/lr1e-3"  # the runs at peak 1e-3 of the models that did not train at 2e-3
DEPTH4X = "results/zoo/depth4x"  # TANGO and Loop Transformer++ at four times the headline grid's budget
MARKER = "<!-- zoo commands -->"
SEEDS, UPDATES = 3, 600


def train_flags(argv):
    """{flag: value} of a `sweep.py run` argv after its `--` (the train.py flags)."""
    return dict(zip(argv[argv.index("--") + 1::2], argv[argv.index("--") + 2::2]))


def test_zoo_blocks_are_the_committed_summaries_byte_for_byte(monkeypatch):
    monkeypatch.chdir(HERE)
    doc = readme(ROOT)
    assert block(doc, sweep_report.report_markers(ROOT, "zoo")) == \
        sweep_report.zoo_report(ROOT, HEADLINE_ROOT, other_rate=OTHER_RATE)
    assert block(doc, sweep_report.report_markers(ROOT, "runs")) == sweep_report.report(ROOT)
    assert block(doc, sweep_report.report_markers(ROOT, "budget")) == sweep_report.budget_report(ROOT)


def test_zoo_plot_is_the_committed_png_byte_for_byte(tmp_path, monkeypatch):
    require_pinned_plotting()
    monkeypatch.chdir(HERE)
    written = sweep_report.plot(ROOT, str(tmp_path), more=(HEADLINE_ROOT,), depths=[4])
    assert [os.path.basename(p) for p in written] == ["stdlib.png"]
    with open(written[0], "rb") as a, open(os.path.join(ROOT, "stdlib.png"), "rb") as b:
        assert a.read() == b.read()


def test_zoo_and_the_headline_grid_are_every_model_under_one_recipe(monkeypatch):
    """The zoo's commands train the registered models the headline grid has not, with the headline
    grid's train.py flags unchanged, 3 seeds at K = 4; every committed run is one of them (its
    recorded flags: test_cpugrid's printed-commands test); a row trains under the recipe (dev NLL
    below 60 % of the unigram entropy) or says it did not and has its row at peak 1e-3 beneath it, or
    says that run is missing; the status line counts the committed runs."""
    monkeypatch.chdir(HERE)
    runs = [c for c in sweep_commands(ROOT, MARKER) if c[0] == "run" and c[c.index("--root") + 1] == "runs/zoo"]
    headline = [c for c in sweep_commands(HEADLINE_ROOT) if c[0] == "run"]
    flags = lambda c, f: c[c.index(f) + 1]
    assert runs and headline and all(train_flags(c) == train_flags(headline[0]) for c in runs + headline)
    grid = {m for c in headline for m in flags(c, "--models").split(",")}
    zoo = {m for c in runs for m in flags(c, "--models").split(",")}
    assert zoo == set(REGISTRY) - grid and not zoo & grid
    assert {flags(c, "--depths") for c in runs} == {"4"} and max(int(flags(c, "--seeds")) for c in runs) == SEEDS
    rows = sweep_report.load_runs(ROOT)
    done = [s for v in rows.values() for s in v]
    assert done and {k[1] for k in rows} <= zoo and {k[2] for k in rows} == {4}
    assert all(sweep_report.run_args(s["_dir"])["max_iters"] == UPDATES for s in done)
    both = {k: v for k, v in sweep_report.load_runs(ROOT, HEADLINE_ROOT).items() if k[2] == 4}
    table = block(readme(ROOT), sweep_report.report_markers(ROOT, "zoo")).splitlines()
    for (_, m, _), v in both.items():  # trained under the recipe, or said not to be with its other-rate row or its absence
        row = next(i for i, ln in enumerate(table) if ln.split(" | ")[1:2] == [m])
        untrained = sweep_report.mean_std([s["dev_nll"] for s in v])[0] / v[0]["unigram_dev"] >= sweep_report.EARLY_REGIME
        assert ("(not trained" in table[row]) == untrained, table[row]
        assert not untrained or "no run at another rate yet)" in table[row] or \
            table[row + 1].startswith(f"| - | {m} at peak 0.001 | "), table[row:row + 2]
    total = len(zoo) * SEEDS
    status = re.search(r"\*\*Status: (running|done)\.\*\* (\d+) of (\d+) runs", readme(ROOT)).groups()
    assert status == ("done" if len(done) == total else "running", str(len(done)), str(total))


def test_depth4x_block_is_its_summaries_beside_the_headline_grid(monkeypatch):
    """The K table at two budgets is `report --budgets` over the committed summaries, byte for byte;
    its commands train two models (TANGO and Loop Transformer++) at K = 4, 8, 16 with the headline grid's flags
    but --max_iters and --warmup_iters four times theirs; the status line counts the committed runs
    of the command's models x depths x seeds."""
    monkeypatch.chdir(HERE)
    doc = readme(ROOT)
    assert block(doc, sweep_report.report_markers(DEPTH4X, "budgets")) == \
        sweep_report.budgets_report(DEPTH4X, HEADLINE_ROOT)
    runs = [c for c in sweep_commands(ROOT, "<!-- depth4x commands -->") if c[0] == "run"]
    headline = next(c for c in sweep_commands(HEADLINE_ROOT) if c[0] == "run")
    theirs, longer = train_flags(headline), ("--max_iters", "--warmup_iters")
    planned = set()
    for run in runs:  # in the order they ran: K = 4 at seed 1, then K = 8 and 16, then seed 2
        opts, mine = sweep_options(run), train_flags(run)
        assert {k: v for k, v in mine.items() if k not in longer} == \
            {k: v for k, v in theirs.items() if k not in longer}
        assert all(int(mine[k]) == 4 * int(theirs[k]) for k in longer)
        planned |= {(m, int(k), s) for m in opts["--models"].split(",") for k in opts["--depths"].split(",")
                    for s in range(1, int(opts["--seeds"]) + 1)}
    models = {m for m, _, _ in planned}  # every command trains the same models, at K = 4, 8, 16
    assert len(models) == 2 and {(m, k) for m, k, _ in planned} == {(m, k) for m in models for k in (4, 8, 16)}
    done = sum(map(len, sweep_report.load_runs(DEPTH4X).values()))
    total = len(planned)
    i = doc.index("## The depth claim at four times the budget")
    status = re.search(r"\*\*Status: (running|done)\.\*\* (\d+) of (\d+) runs", doc[i:]).groups()
    assert status == ("done" if done == total else "running", str(done), str(total))


def test_control_run_numbers_are_its_summary_and_the_headline_grids(monkeypatch):
    """The recipe check at the zoo's commit: the README's numbers of the rerun headline-grid run are
    its collected summary's and the committed run's."""
    monkeypatch.chdir(HERE)
    text = " ".join(readme(ROOT).split())
    said = re.search(r"dev NLL ([\d.]+) and test ([\d.]+) nats/char against the committed ([\d.]+) and ([\d.]+), "
                     r"the same best update \((\d+)\) and unigram entropy \(([\d.]+)\)", text).groups()
    (again,) = [s for v in sweep_report.load_runs("results/zoo/control").values() for s in v]
    (before,) = [s for s in sweep_report.load_runs(HEADLINE_ROOT)["stdlib", "untied", 4] if s["seed"] == 1]
    assert said == (f"{again['dev_nll']:.5f}", f"{again['test_nll']:.5f}", f"{before['dev_nll']:.5f}",
                    f"{before['test_nll']:.5f}", str(again["best_iter"]), f"{again['unigram_dev']:.5f}")
    assert again["best_iter"] == before["best_iter"] and f"{before['unigram_dev']:.5f}" == said[5]


def test_readme_headline_gives_the_depth4x_runs_dev_nll(monkeypatch):
    """The README's headline gives every committed 4x-budget run of its seed: the summary's dev NLL,
    beside the same seed's headline-grid run (1x)."""
    monkeypatch.chdir(HERE)
    with open("README.md", encoding="utf-8") as f:
        head = " ".join(block(f.read(), ("<!-- headline -->\n", "<!-- end of headline -->")).split())
    seed, runs = re.search(r"At 4x the budget, seed (\d), dev NLL \(1x in brackets\): ([^;]*);", head).groups()
    said = re.findall(r"`([a-z-]+)` K = (\d+) ([\d.]+) \(([\d.]+)\)", runs)
    long, short = sweep_report.load_runs(DEPTH4X), sweep_report.load_runs(HEADLINE_ROOT)
    assert sorted((m, int(k)) for m, k, _, _ in said) == \
        sorted((m, k) for (_, m, k), v in long.items() if any(r["seed"] == int(seed) for r in v))
    for name, k, at4x, at1x in said:
        key = ("stdlib", name, int(k))
        dev = lambda rows: next(r["dev_nll"] for r in rows[key] if r["seed"] == int(seed))
        assert (at4x, at1x) == (f"{dev(long):.3f}", f"{dev(short):.3f}"), (name, k)


@pytest.mark.parametrize("mode", ["--zoo", "--budgets"])
def test_zoo_report_commands_write_into_this_readme(mode, tmp_path, monkeypatch):
    argv, = [shlex.split(line)[3:] for line in readme(ROOT).splitlines()
             if line.startswith(f"python -m tools.sweep report {mode} ")]
    for root in (ROOT, HEADLINE_ROOT):
        shutil.copytree(os.path.join(HERE, root), tmp_path / root)
    monkeypatch.chdir(tmp_path)
    sweep.main(argv)
    assert (tmp_path / ROOT / "README.md").read_text() == readme(ROOT)


def copy_runs(tmp_path, names, dataset="stdlib"):
    """Copies of committed zoo runs (summary, curves, args) under tmp_path/<dataset>/."""
    for name in names:
        shutil.copytree(os.path.join(HERE, ROOT, "stdlib", name), tmp_path / dataset / name)
    return tmp_path


def edit_summary(run, **kw):
    path = run / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **kw}))


def test_zoo_report_ranks_labels_and_refuses(tmp_path):
    """Rows ranked by mean test NLL; a dev NLL at 60 % of the unigram entropy or above says "not trained";
    FLOPs per token are 6 x flops.py's forward MACs per token of the model the run's flags build; a
    run whose flags rebuild another width, runs of two datasets, and a run without recorded flags
    are refused in one line."""
    import flops
    import models
    root = copy_runs(tmp_path / "a", ["rdm-K4-s1", "depth-attn-K4-s1"])
    s = json.loads((root / "stdlib" / "rdm-K4-s1" / "summary.json").read_text())
    edit_summary(root / "stdlib" / "rdm-K4-s1", test_nll=1.0, dev_nll=0.6 * s["unigram_dev"])
    lines = sweep_report.zoo_report(str(root)).splitlines()
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines if ln.startswith("| ") and ln[2].isdigit()]
    assert [r[:3] for r in rows] == [["1", "rdm", "1"], ["2", "depth-attn", "1"]]
    assert rows[0][6] == "60% (not trained; no run at another rate yet)" and rows[1][6].endswith("%") and \
        "not" not in rows[1][6]
    args = json.loads((root / "stdlib" / "rdm-K4-s1" / "args.json").read_text())
    cfg, _ = flops.train_config("rdm", "cpu", 4, 256, (s["params"] - s["non_embedding_params"]) // 128,
                                {f: args[f] for f in flops.train_model_flags()})
    assert models.count_params(cfg) == s["non_embedding_params"]
    assert rows[0][7] == f"{6 * flops.forward_macs(cfg, 256)['total'] / 256 / 1e6:.1f} M *"  # RDM draws its depth
    assert "\\* FLOPs from the forward formula, but rdm: " in lines[-1]
    edit_summary(root / "stdlib" / "depth-attn-K4-s1", width=999)
    with pytest.raises(UsageError, match=r"depth-attn-K4-s1: its flags build width \d+ and [\d,]+ non-embedding "
                                         r"parameters, its summary says 999 and"):
        sweep_report.zoo_report(str(root))
    two = copy_runs(copy_runs(tmp_path / "b", ["rdm-K4-s1"]), ["depth-attn-K4-s1"], "dmmath")
    with pytest.raises(UsageError, match="one dataset at K = 4; found dmmath, stdlib"):
        sweep_report.zoo_report(str(two))
    bare = copy_runs(tmp_path / "c", ["rdm-K4-s1"])
    (bare / "stdlib" / "rdm-K4-s1" / "args.json").unlink()
    with pytest.raises(UsageError, match="rdm-K4-s1: no train.py flags recorded"):
        sweep_report.zoo_report(str(bare))


def test_budgets_report_puts_each_budget_beside_the_other(tmp_path):
    """report --budgets: dev NLL per model and K at the longer budget beside the shorter one (all its
    seeds, and paired: only the seeds the longer budget has), then whether it rises over K at each."""
    short, long = tmp_path / "short", tmp_path / "long"
    for k, seeds in ((4, (1, 2, 3)), (8, (1, 2, 3))):
        for s in seeds:
            shutil.copytree(os.path.join(HERE, HEADLINE_ROOT, "stdlib", f"tango-K{k}-s{s}"),
                            short / "stdlib" / f"tango-K{k}-s{s}")
    for k, dev in ((4, 1.30), (8, 1.25)):
        run = long / "stdlib" / f"tango-K{k}-s1"
        shutil.copytree(short / "stdlib" / f"tango-K{k}-s1", run)
        edit_summary(run, dev_nll=dev)
        args = json.loads((run / "args.json").read_text())
        (run / "args.json").write_text(json.dumps({**args, "max_iters": 2400, "lr_decay_iters": 2400,
                                                   "warmup_iters": 240}))
    rows = sweep_report.load_runs(str(short))
    mean = lambda k, seeds=(1, 2, 3): sweep_report.mean_std([r["dev_nll"] for r in rows["stdlib", "tango", k]
                                                              if r["seed"] in seeds])
    text = sweep_report.budgets_report(str(long), str(short))
    lines = text.splitlines()
    assert lines[2] == (f"| model | K | dev NLL ({long}, 2,400 updates) | dev NLL ({short}, 600 updates) | "
                        "the same, paired |")
    (m4, s4), (m8, s8) = mean(4), mean(8)
    assert lines[4] == f"| tango | 4 | 1.300 (n=1) | {m4:.3f} ± {s4:.3f} (n=3) | {mean(4, (1,))[0]:.3f} (n=1) |"
    assert lines[5] == f"| tango | 8 | 1.250 (n=1) | {m8:.3f} ± {s8:.3f} (n=3) | {mean(8, (1,))[0]:.3f} (n=1) |"
    assert f"- tango, {long}, 2,400 updates: dev NLL over K = 4 → 8: 1.300 → 1.250; does not rise." in lines
    assert (f"- tango, {short}, 600 updates: dev NLL over K = 4 → 8: {m4:.3f} → {m8:.3f}; "
            + ("rises at K = 4 → 8." if m8 > m4 else "does not rise.")) in lines
    with pytest.raises(UsageError, match=r"--with .*nothing: no runs"):
        sweep_report.budgets_report(str(long), str(tmp_path / "nothing"))


@pytest.mark.parametrize("argv, message", [
    (["report", "--root", ROOT, "--with", HEADLINE_ROOT], "--with: only with report --zoo, report --budgets and plot"),
    (["report", "--zoo", "--root", ROOT, "--with", ""], '--with "": an empty path; give another runs\' folder'),
    (["report", "--zoo", "--root", ROOT, "--with", "results/cpugrid_warmupp", "--into", f"{ROOT}/README.md"],
     "--with results/cpugrid_warmupp: no finished runs (<root>/<dataset>/<run>/summary.json)"),
    (["report", "--zoo", "--root", ROOT, "--with", f"./{ROOT}/"], f"--with ./{ROOT}/: the same folder as --root {ROOT}"),
    (["report", "--zoo", "--root", ROOT, "--with", HEADLINE_ROOT, "--with", HEADLINE_ROOT],
     f"--with {HEADLINE_ROOT}: the same folder as --with {HEADLINE_ROOT}"),
    (["plot", "--root", ROOT, "--out", "x", "--with", "nothing"], "--with nothing: no finished runs"),
    (["plot", "--root", ROOT, "--out", "x", "--depths", "4,x"], "--depths 4,x: comma-separated integers >= 1"),
    (["plot", "--root", ROOT, "--out", "x", "--depths", "\u00b2"], "--depths \u00b2: comma-separated integers >= 1"),
    (["plot", "--root", ROOT, "--out", "x", "--depths", "4,4"], "--depths 4,4: 4 given twice"),
    (["plot", "--root", ROOT, "--out", "x", "--depths", "99"],
     f"--depths 99: no runs at these depths under {ROOT} (they have K = 4)"),
    (["report", "--budgets", "--root", HEADLINE_ROOT, "--with", ROOT],
     f"--with {ROOT}: 600 updates, a budget given already; give runs of another --max_iters"),
    (["report", "--budgets", "--root", HEADLINE_ROOT, "--with", "results/cpugrid_lr"],
     f"--with results/cpugrid_lr: --learning_rate 0.001, --root {HEADLINE_ROOT} has 0.002; the budgets compared "
     "differ only in their length"),
    (["report", "--budgets", "--root", HEADLINE_ROOT, "--with", "results/cpugrid_1200"],
     f"--with results/cpugrid_1200: --warmup_iters 10 of --max_iters 1,200, --root {HEADLINE_ROOT} has 60 of 600; "
     "a longer budget scales the schedule")])
def test_report_and_plot_refuse_bad_with_and_depths(argv, message, tmp_path, monkeypatch):
    """Each a one-line UsageError naming the flag, before anything is written (the README unchanged)."""
    monkeypatch.chdir(HERE)
    before = readme(ROOT)
    with pytest.raises(UsageError, match="^" + re.escape(message)):
        sweep.main([str(tmp_path / "x") if a == "x" else a for a in argv])
    assert readme(ROOT) == before and not (tmp_path / "x").exists()


def test_zoo_report_ranks_a_model_without_test_nll_last_and_prints_roots_alike(tmp_path, monkeypatch):
    """A run without a test NLL (load_runs allows null) ranks last with "-"; a root spelled ./x/ or
    absolute prints as x, so the committed block does not depend on the spelling."""
    root = copy_runs(tmp_path / "a", ["rdm-K4-s1", "depth-attn-K4-s1"])
    edit_summary(root / "stdlib" / "rdm-K4-s1", test_nll=None)
    monkeypatch.chdir(tmp_path)
    rows = [ln for ln in sweep_report.zoo_report("./a/").splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert rows[0].startswith("| 1 | depth-attn | 1 |") and rows[0].endswith("| a |")
    assert rows[1].startswith("| 2 | rdm | 1 | 1,000,576 | - | ")
    assert sweep_report.zoo_report(str(tmp_path / "a")) == sweep_report.zoo_report("a")


def test_budgets_report_refuses_runs_without_recorded_flags(tmp_path):
    root = copy_runs(tmp_path / "a", ["rdm-K4-s1"])
    (root / "stdlib" / "rdm-K4-s1" / "args.json").unlink()
    with pytest.raises(UsageError, match="rdm-K4-s1: no train.py flags recorded"):
        sweep_report.budgets_report(str(root))


def test_readme_headline_names_the_zoo_with_its_numbers(monkeypatch):
    """The README's headline gives every zoo model's mean test NLL over its committed seeds, lowest
    first, with `--model` names, and says "so far" while a model has fewer than three seeds."""
    monkeypatch.chdir(HERE)
    with open("README.md", encoding="utf-8") as f:
        head = " ".join(block(f.read(), ("<!-- headline -->\n", "<!-- end of headline -->")).split())
    i = head.index("[`results/zoo/`](results/zoo/README.md)")
    said = re.findall(r"`([a-z0-9-]+)` (\d\.\d{3})", head[i:])
    rows = sweep_report.load_runs(ROOT)
    means = {m: sweep_report.mean_std([s["test_nll"] for s in v])[0] for (_, m, _), v in rows.items()}
    assert [m for m, _ in said] == sorted(means, key=means.get)
    assert all(v == f"{means[m]:.3f}" for m, v in said)
    seeds = {len(v) for v in rows.values()}
    assert ("so far" in head[i - 80:i]) == (min(seeds) < SEEDS)
    if seeds == {1}:
        assert "seed 1 of 3 so far" in head[i - 80:i]
    for m, mu in means.items():  # a model that did not train: the headline says so with its share
        v = next(v for (_, m_, _), v in rows.items() if m_ == m)
        share = sweep_report.mean_std([s["dev_nll"] for s in v])[0] / v[0]["unigram_dev"]
        assert (f"`{m}` {mu:.3f} (not trained: dev NLL at {share:.0%}".replace("%", " %") in head[i:]) == \
            (share >= sweep_report.EARLY_REGIME), m
    for (_, m, _), v in sweep_report.load_runs(OTHER_RATE).items():  # a 1e-3 row the headline gives
        mu = sweep_report.mean_std([s["test_nll"] for s in v])[0]
        share = sweep_report.mean_std([s["dev_nll"] for s in v])[0] / v[0]["unigram_dev"]
        said_there = re.search(rf"`{m}` [\d.]+ \(not trained: [^)]*; at peak 1e-3 ([\d.]+), (\d+) %\)", head[i:])
        assert said_there is None or said_there.groups() == (f"{mu:.3f}", f"{share:.0%}"[:-1]), m
    if "(below all seven)" in head[i:]:  # the headline grid's K = 4 table
        grid = sweep_report.load_runs(HEADLINE_ROOT)
        first = said[0][0]
        assert all(means[first] < sweep_report.mean_std([s["test_nll"] for s in v])[0]
                   for (_, m, k), v in grid.items() if k == 4), first


def test_zoo_report_puts_the_other_rate_row_under_its_model(tmp_path):
    """--other_rate: each of its models' rows sits under the model's own, labelled with the rate and
    not ranked; a row that did not train and has no such row says so; a root that differs in more
    than the rate, or not in it, is refused."""
    root = copy_runs(tmp_path / "a", ["rdm-K4-s1", "depth-attn-K4-s1"])
    unigram = json.loads((root / "stdlib" / "rdm-K4-s1" / "summary.json").read_text())["unigram_dev"]
    for name in ("rdm-K4-s1", "depth-attn-K4-s1"):
        edit_summary(root / "stdlib" / name, dev_nll=0.7 * unigram)
    other = copy_runs(tmp_path / "b", ["rdm-K4-s1"])
    run = other / "stdlib" / "rdm-K4-s1"
    edit_summary(run, dev_nll=0.5 * unigram, test_nll=1.25)
    args = json.loads((run / "args.json").read_text())
    (run / "args.json").write_text(json.dumps({**args, "learning_rate": 0.001}))
    lines = sweep_report.zoo_report(str(root), other_rate=str(other)).splitlines()
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| rank")]
    assert [r.split(" | ")[:2] for r in rows] == [["| 1", "depth-attn"], ["| 2", "rdm"], ["| -", "rdm at peak 0.001"]]
    assert " | 70% (not trained; no run at another rate yet) | " in rows[0]
    assert " | 70% (not trained) | " in rows[1] and " | 1.250 | " in rows[2] and " | 50% | " in rows[2]
    assert "(its row at peak 0.001 beneath it, not ranked)" in lines[0]
    (run / "args.json").write_text(json.dumps({**args, "learning_rate": 0.001, "warmup_iters": 10}))
    with pytest.raises(UsageError, match=r"--other_rate .*: --warmup_iters 10, the table's runs have 60; its runs "
                                         r"differ from the table's in the peak learning rate only"):
        sweep_report.zoo_report(str(root), other_rate=str(other))
    (run / "args.json").write_text(json.dumps(args))
    with pytest.raises(UsageError, match=r"--other_rate .*: the same peak learning rate as the table's runs"):
        sweep_report.zoo_report(str(root), other_rate=str(other))
