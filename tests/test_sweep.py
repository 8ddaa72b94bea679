"""sweep.py and sweep_report.py: grid runner (resume, parallel jobs), collect, the paper-style report and plots."""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from tools import sweep
from tools import sweep_report
from checks import GRID_MODELS
from common import UsageError

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


MODELS = GRID_MODELS  # tango, tango-windowed, loop, untied, gau, flash, parcae
NOISE = dict(zip(MODELS, (0.01, 0.005, 0.01, 0.3, 0.02, 0.05, 0.01)))


def fake_grid(root, test, dev=None, seeds=(1, 2, 3), em=False, curves=True):
    """Write summary.json (+ curves.json) per run: test[(model, K)] is the mean test NLL, dev[(model,
    K)] the mean dev NLL (default: test + 0.1); seed s adds NOISE[model] * (s - 2) to both."""
    ds = "dmmath" if em else "stdlib"
    dev = dev or {key: v + 0.1 for key, v in test.items()}
    for (m, k), dv in dev.items():
        for s in seeds:
            d = os.path.join(root, ds, f"{m}-K{k}-s{s}")
            os.makedirs(d, exist_ok=True)
            off = NOISE[m] * (s - 2)
            t = test[m, k] + off
            summ = dict(model=m, depth=k, seed=s, test_nll=t, dev_nll=dv + off, non_embedding_params=1000 + k,
                        unigram_dev=5.0, test_split="interpolate" if em else "test")
            if em:
                summ.update(exact_match_interpolate=0.5 - t / 10, exact_match_extrapolate=0.25 - t / 20)
            with open(os.path.join(d, "summary.json"), "w") as f:
                json.dump(summ, f)
            if curves:
                with open(os.path.join(d, "curves.json"), "w") as f:
                    json.dump({"tokens_per_update": 100, "eval": [[10, t + 0.5], [20, t + 0.1]],
                               "train": [[i, t + 1 - i / 20] for i in range(1, 21)]}, f)


TEST = {**{(m, 4): v for m, v in zip(MODELS, (3.0, 3.2, 3.3, 3.1, 3.4, 3.15, 2.9))},
        **{(m, 8): v for m, v in zip(MODELS, (3.25, 3.2, 3.1, 3.3, 3.4, 3.5, 2.8))},
        **{(m, 16): v for m, v in zip(MODELS, (3.2, 3.3, 3.0, 3.4, 3.5, 3.6, 2.7))}}
# dev NLL ordered differently from test NLL, so the depth claims must read dev_nll
DEV = {**{(m, 4): v for m, v in zip(MODELS, (3.5, 3.45, 3.6, 3.7, 3.55, 3.4, 3.0))},
       **{(m, 8): v for m, v in zip(MODELS, (3.4, 3.4, 3.55, 3.8, 3.5, 3.45, 2.9))},
       **{(m, 16): v for m, v in zip(MODELS, (3.3, 3.35, 3.6, 3.9, 3.5, 3.45, 2.8))}}


def test_grid_report_tables_and_claims(tmp_path):
    fake_grid(str(tmp_path), TEST, DEV)
    text = sweep_report.grid_report(str(tmp_path))
    lines = text.splitlines()
    # held-out table: K = 4 and 8 only; Parcae (an extra row) has the lowest means, so it is bold
    head = next(ln for ln in lines if ln.startswith("| model | non-emb params K=4"))
    assert head == "| model | non-emb params K=4 | test NLL K=4 | test NLL K=8 |"
    assert "| tango | 1,004 | 3.000 ± 0.010 | 3.250 ± 0.010 |" in lines
    assert "| untied | 1,004 | 3.100 ± 0.300 | 3.300 ± 0.300 |" in lines
    assert "| parcae | 1,004 | **2.900 ± 0.010** | **2.800 ± 0.010** |" in lines
    assert "| model | dev NLL K=4 | dev NLL K=8 | dev NLL K=16 |" in lines
    assert "| tango | 3.500 ± 0.010 | 3.400 ± 0.010 | 3.300 ± 0.010 |" in lines
    assert "| parcae | **3.000 ± 0.010** | **2.900 ± 0.010** | **2.800 ± 0.010** |" in lines
    c = lambda claim: claims_line(text, claim)
    assert "(2 dataset × depth settings with test NLL for all six)" in text
    assert c("TANGO has the lowest mean test NLL") == "1 of 2"  # K=4 yes (parcae is not a rival), K=8 no
    # per seed: untied's seed 1 (3.1 - 0.3) beats TANGO at K=4; at K=8 loop is lower for every seed
    assert c("TANGO is lower than every other model with the same seed") == "2 of 6"
    assert c("Windowed TANGO is lower than Loop Transformer++") == "1 of 2"   # K=4 yes, K=8 no
    assert c("Windowed TANGO is lower than FLASH") == "1 of 2"               # K=4 no, K=8 yes
    # TANGO 0.01; Loop 0.01, Untied 0.3, GAU 0.02, FLASH 0.05 (Windowed TANGO's 0.005 is not a baseline)
    assert c("largest test-NLL std over seeds: TANGO vs the lowest-highest of Loop, Untied, GAU, FLASH") \
        == "0.010 vs 0.010-0.300"
    assert c("TANGO's dev NLL over K = 4 → 8 → 16: falls at each step / rises at some step") == "1 / 0 of 1"
    assert c("Loop Transformer++'s dev NLL rises at some step over K = 4 → 8 → 16") == "1 of 1"
    assert c("Untied Transformer++'s dev NLL rises at some step over K = 4 → 8 → 16") == "1 of 1"
    assert c("TANGO has the lowest dev NLL at K = 16") == "1 of 1"


def test_a_tie_is_not_lower(tmp_path):
    """Loop Transformer++ at K = 4 with TANGO's exact test NLL at every seed (the same mean and
    noise): TANGO is not lower there, neither in the mean nor with the same seed."""
    fake_grid(str(tmp_path), {**TEST, ("loop", 4): TEST["tango", 4]}, DEV)
    text = sweep_report.grid_report(str(tmp_path))
    assert claims_line(text, "TANGO has the lowest mean test NLL") == "0 of 2"
    assert claims_line(text, "TANGO is lower than every other model with the same seed") == "0 of 6"


def test_grid_report_exact_match_one_seed_and_missing_runs(tmp_path):
    test = {key: v for key, v in TEST.items() if key[1] != 16}
    fake_grid(str(tmp_path), test, seeds=(1, 2), em=True, curves=False)
    os.remove(os.path.join(tmp_path, "dmmath", "gau-K8-s2", "summary.json"))  # an unfinished run
    os.remove(os.path.join(tmp_path, "dmmath", "flash-K4-s1", "summary.json"))
    text = sweep_report.grid_report(str(tmp_path))
    assert ("| gau | 1,004 | 3.390 ± 0.014 | 3.380 (n=1) | 16.1% ± 0.1% | 8.1% ± 0.1% | 16.2% (n=1) | 8.1% (n=1) |"
            in text)
    # exact match: higher is better, so the lowest NLL (Parcae) has the bold EM
    assert ("| parcae | 1,004 | **2.895 ± 0.007** | **2.795 ± 0.007** | **21.1% ± 0.1%** | **10.5% ± 0.0%** | "
            "**22.1% ± 0.1%** | **11.0% ± 0.0%** |") in text
    # seeds with a run of every model: K=4 seed 2 (TANGO lowest), K=8 seed 1 (loop lower)
    assert claims_line(text, "TANGO is lower than every other model with the same seed") == "1 of 2"
    assert claims_line(text, "exact match (dmmath interpolate, K = 4): TANGO / Windowed TANGO / best of the "
                             "other four") == "20.0% / 18.0% / 20.5% (untied)"
    assert "dev NLL over K = 4 → 8 → 16" not in text  # no K = 16 runs
    for p in tmp_path.glob("dmmath/*/summary.json"):  # nobody answers an extrapolation problem
        p.write_text(json.dumps({**json.loads(p.read_text()), "exact_match_extrapolate": 0.0}))
    assert claims_line(sweep_report.grid_report(str(tmp_path)), "exact match (dmmath extrapolate, K = 8): TANGO / "
                       "Windowed TANGO / best of the other four") == "0.0% / 0.0% / 0.0% (4 tied)"
    # one seed: no std, and the spread claim says so instead of printing 0.000
    one = tmp_path / "one"
    fake_grid(str(one), test, seeds=(1,), curves=False)
    text = sweep_report.grid_report(str(one))
    assert "| tango | 1,004 | 2.990 | 3.240 |" in text
    for p in one.glob("stdlib/*/summary.json"):  # every dev NLL equal: no bold in that table
        p.write_text(json.dumps({**json.loads(p.read_text()), "dev_nll": 4.0}))
    assert "| tango | 4.000 | 4.000 |" in sweep_report.grid_report(str(one)).splitlines()
    assert claims_line(text, "largest test-NLL std over seeds: TANGO vs the lowest-highest of Loop, Untied, "
                             "GAU, FLASH") == "- (fewer than 2 seeds)"


def test_depth_claims_use_each_models_own_depths(tmp_path):
    """K = 16 run for every model but Untied Transformer++ (the cpu grid ran it for TANGO and Loop
    Transformer++ only): their rows span 4 -> 8 -> 16, Untied Transformer++'s row spans the 4 -> 8
    it has and says the paper's span, and "lowest at K = 16" needs all six there, so it is left out."""
    keep = {key: v for key, v in DEV.items() if key[1] < 16 or key[0] != "untied"}
    fake_grid(str(tmp_path), TEST, keep)
    text = sweep_report.grid_report(str(tmp_path))
    c = lambda claim: claims_line(text, claim)
    # TANGO 3.5 -> 3.4 -> 3.3 falls; Loop 3.6 -> 3.55 -> 3.6 rises at 8 -> 16; Untied 3.7 -> 3.8 rises
    assert c("TANGO's dev NLL over K = 4 → 8 → 16: falls at each step / rises at some step") == "1 / 0 of 1"
    assert c("Loop Transformer++'s dev NLL rises at some step over K = 4 → 8 → 16") == "1 of 1"
    untied = next(ln for ln in text.splitlines() if ln.startswith("| Untied Transformer++'s dev NLL"))
    assert untied == "| Untied Transformer++'s dev NLL rises at some step over K = 4 → 8 | 3 of 8 (over K = 4 → 8 → 16) | 1 of 1 |"
    assert "lowest dev NLL at K = 16" not in text
    only4 = {key: v for key, v in DEV.items() if key[1] == 4}
    fake_grid(str(tmp_path / "k4"), TEST, only4)
    assert "dev NLL over K" not in sweep_report.grid_report(str(tmp_path / "k4"))  # one depth: no step


def test_report_refuses_what_it_cannot_read_and_writes_nothing(tmp_path, monkeypatch):
    """Bad inputs of `sweep.py report` are one-line UsageErrors before anything is written: an
    unreadable or incomplete summary.json, --lr without sweep runs, --out beside --into on the
    same file, a folder or under a file; a run without curves is a row that says so, not a dropped
    one. --out in a missing folder creates it, as every command's output paths do (harness/cli.py)."""
    monkeypatch.chdir(tmp_path)
    fake_grid("g", {k: v for k, v in TEST.items() if k[1] == 4}, seeds=(1,), curves=False)
    budget = sweep_report.budget_report("g")
    assert "| stdlib | tango | 4 | 1 | - | - (no curves) | - | - | - |" in budget.splitlines()
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- sweep report --root g -->\nold\n<!-- end of sweep report -->\n")
    before = doc.read_text()
    for argv, message in [
        (["report", "--root", "g", "--into", "doc.md", "--out", "doc.md"],
         "--out doc.md: the same file as --into; --into writes the report into it already"),
        (["report", "--root", "g", "--into", "doc.md", "--out", "doc.md/x.md"],
         f"--out doc.md/x.md: {tmp_path / 'doc.md'} is a file, not a folder"),
        (["report", "--root", "g", "--out", "g"], "--out g: is a folder; give a file path"),
        (["report", "--lr", "--root", "g"], "--root g: no learning-rate sweep runs"),
    ]:
        with pytest.raises(UsageError) as e:
            sweep.main(argv)
        assert str(e.value).startswith(message), str(e.value)
    assert doc.read_text() == before and sorted(os.listdir(tmp_path)) == ["doc.md", "g"]
    sweep.main(["report", "--root", "g", "--out", "missing/x.md"])
    assert open("missing/x.md").read() == sweep_report.report("g")
    bad = tmp_path / "g" / "stdlib" / "tango-K4-s1" / "summary.json"
    for text, message in [("{", "not a readable JSON file (JSONDecodeError"),
                          ("{}", "expected a JSON object with the keys model, depth, seed"),
                          ("[1]", "expected a JSON object")]:
        bad.write_text(text)
        for argv in (["report", "--root", "g"], ["report", "--grid", "--root", "g"], ["report", "--budget", "--root", "g"]):
            with pytest.raises(UsageError, match=re.escape(f"{os.path.join('g', 'stdlib', 'tango-K4-s1', 'summary.json')}: {message}")):
                sweep.main(argv)
    bad.write_text(json.dumps(dict(model="tango", depth=4, seed=1, test_nll=3.0, dev_nll=3.1, non_embedding_params=1004,
                                   unigram_dev=5.0, test_split="test")))
    copy = tmp_path / "g" / "stdlib" / "tango-K4-s1-copy"
    shutil.copytree(bad.parent, copy)  # the same seed twice in one cell: the mean would count it twice
    for argv in (["report", "--root", "g"], ["report", "--grid", "--root", "g"], ["report", "--budget", "--root", "g"]):
        with pytest.raises(UsageError, match=re.escape(f"{bad.parent.relative_to(tmp_path)} and "
                                                       f"{copy.relative_to(tmp_path)} are both tango at K = 4, seed 1")):
            sweep.main(argv)
    shutil.rmtree(copy)
    lr_only = tmp_path / "lr" / "stdlib" / "tango-K4-lr0.001"
    shutil.copytree(bad.parent, lr_only)
    with pytest.raises(UsageError, match="--root lr: only learning-rate sweep runs"):
        sweep.main(["report", "--root", "lr"])
    # a log whose last line was cut short by a kill loses that line only; a bad line before it is an error
    run = tmp_path / "r"
    run.mkdir()
    (run / "log.jsonl").write_text('{"event": "train", "iter": 1, "loss": 5.0}\n{"event": "tra')
    assert sweep_report.log_records(str(run)) == [{"event": "train", "iter": 1, "loss": 5.0}]
    (run / "log.jsonl").write_text('{"event": "tra\n{"event": "train", "iter": 1, "loss": 5.0}\n')
    with pytest.raises(UsageError, match=re.escape(f"{run / 'log.jsonl'}: line 1 is not a JSON record")):
        sweep_report.log_records(str(run))
    # the markers name the root the same way however it is spelled
    assert sweep_report.report_markers("g/", "grid") == sweep_report.report_markers(str(tmp_path / "g"), "grid") == \
        sweep_report.report_markers("./g", "grid") == ("<!-- sweep report --grid --root g -->\n", "<!-- end of grid report -->")
    assert [sweep_report.report_markers("g", m) for m in ("runs", "budget", "throughput")] == [
        ("<!-- sweep report --root g -->\n", "<!-- end of sweep report -->"),
        ("<!-- sweep report --budget --root g -->\n", "<!-- end of budget report -->"),
        ("<!-- sweep report --throughput --root g -->\n", "<!-- end of throughput report -->")]
    with pytest.raises(ValueError, match="mode 'lr' has no markers"):
        sweep_report.report_markers("g", "lr")


def claims_line(text, claim):
    return next(ln for ln in text.splitlines() if ln.startswith(f"| {claim} |")).split(" | ")[-1].rstrip(" |")


def test_collect_and_plot(tmp_path, capsys):
    run = tmp_path / "runs" / "stdlib" / "tango-K4-s1"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(dict(model="tango", depth=4, seed=1, test_nll=3.0, dev_nll=3.1,
                                                      non_embedding_params=10, unigram_dev=5.0)))
    log = [{"event": "start", "args": {"batch_size": 2, "block_size": 8, "gradient_accumulation_steps": 3}},
           {"event": "train", "iter": 1, "loss": 5.0}, {"event": "train", "iter": 2, "loss": 4.0},
           {"event": "eval", "iter": 2, "dev_nll": 4.5, "best": True},
           {"event": "start", "args": {"batch_size": 2, "block_size": 8, "gradient_accumulation_steps": 3}},
           {"event": "train", "iter": 2, "loss": 4.0}, {"event": "summary"}]  # resumed: iteration 2 redone
    (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in log) + "\n")
    sweep.cmd_collect(str(tmp_path / "runs"), str(tmp_path / "res"))
    assert capsys.readouterr().out.endswith(f"collected 1 run from {tmp_path / 'runs'} into {tmp_path / 'res'}\n")
    c = json.loads((tmp_path / "res" / "stdlib" / "tango-K4-s1" / "curves.json").read_text())
    assert c == {"tokens_per_update": 48, "eval": [[2, 4.5]], "train": [[1, 5.0], [2, 4.0]]}
    got = (tmp_path / "res" / "stdlib" / "tango-K4-s1" / "summary.json").read_text()
    assert got == (run / "summary.json").read_text()  # no resume recorded in its log: copied as it is
    # a run resumed by a train.py that did not record resumes in summary.json: collect marks its wall_s
    log[4]["resumed_at"] = 2
    (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in log) + "\n")
    sweep.cmd_collect(str(tmp_path / "runs"), str(tmp_path / "res"))
    got = json.loads((tmp_path / "res" / "stdlib" / "tango-K4-s1" / "summary.json").read_text())
    assert got == {**json.loads((run / "summary.json").read_text()), "resumed_at": 2, "wall_s_this_process_only": True}
    assert sweep.curves_of(str(run)) == c  # the same curves straight from log.jsonl
    pytest.importorskip("matplotlib", reason="sweep.py plot needs the optional matplotlib")
    fake_grid(str(tmp_path / "grid"), TEST, seeds=(1, 2))
    (png,) = sweep_report.plot(str(tmp_path / "grid"), str(tmp_path / "plots"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10_000


def test_plot_without_matplotlib_is_a_one_line_error(tmp_path):
    fake_grid(str(tmp_path), TEST, seeds=(1,))
    code = ("import sys; sys.modules['matplotlib'] = None; from tools import sweep; "
            f"sweep.main(['plot', '--root', {str(tmp_path)!r}, '--out', {str(tmp_path / 'p')!r}])")
    p = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip() == \
        "sweep.py plot needs matplotlib (an optional extra): pip install matplotlib"
    assert not os.path.exists(tmp_path / "p")


def test_run_skips_finished_resumes_and_runs_in_parallel(tmp_path, monkeypatch):
    import threading
    calls, lock = [], threading.Lock()
    barrier = threading.Barrier(2, timeout=10)  # the first two runs must be in flight at the same time

    def fake_call(cmd, stdout, env):
        with lock:
            calls.append((cmd, env.get("OMP_NUM_THREADS")))
            first_two = len(calls) <= 2
        if first_two:
            barrier.wait()  # BrokenBarrierError (a failed test) if the runs were sequential
        out = cmd[cmd.index("--out_dir") + 1]
        with open(os.path.join(out, "summary.json"), "w") as f:
            f.write("{}")
        return 0 if "loop" not in cmd else 3

    monkeypatch.setattr(sweep, "run_process", fake_call)
    prepared = []
    monkeypatch.setattr(sweep, "prepare_data",
                        lambda resolved: prepared.append({(a.dataset, a.size) for a in resolved}))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 4)
    done = tmp_path / "stdlib" / "tango-K4-s1"
    done.mkdir(parents=True)
    (done / "summary.json").write_text("{}")
    half = tmp_path / "stdlib" / "tango-K8-s2"  # interrupted: resumed
    half.mkdir(parents=True)
    (half / "ckpt_latest.pt").write_text("")
    rc = sweep.main(["run", "--root", str(tmp_path), "--models", "tango,loop", "--depths", "4,8",
                     "--seeds", "2", "--jobs", "2", "--", "--size", "tiny"])
    assert rc == 1  # the loop runs failed
    assert prepared == [{("stdlib", "tiny")}]
    assert len(calls) == 7 and all(env == "2" for _, env in calls)
    first = calls[0][0]
    assert first[first.index("--depth") + 1] == "4" and first[-2:] == ["--size", "tiny"]
    key = lambda c: (c[c.index("--model") + 1], c[c.index("--depth") + 1], c[c.index("--seed") + 1], c[-1])
    assert sorted(key(c) for c, _ in calls) == [
        ("loop", "4", "1", "tiny"), ("loop", "4", "2", "tiny"), ("loop", "8", "1", "tiny"), ("loop", "8", "2", "tiny"),
        ("tango", "4", "2", "tiny"), ("tango", "8", "1", "tiny"), ("tango", "8", "2", "--resume")]


def test_flags_for_sends_data_dir_to_dmmath_only():
    extra = ["--size", "tiny", "--data_dir", "/d", "--data_dir=/e", "--max_iters", "3"]
    assert sweep.flags_for("dmmath", extra) == extra
    assert sweep.flags_for("stdlib", extra) == ["--size", "tiny", "--max_iters", "3"]


@pytest.mark.parametrize("argv, message", [
    (["run", "--root", "R", "--models", "tango,bogus"], "error: --models: unknown bogus; choose from "),
    (["run", "--root", "R", "--depths", "4,abc"], "error: --depths 4,abc: comma-separated integers >= 1"),
    (["run", "--root", "R", "--seeds", "0"], "error: --seeds 0: must be >= 1"),
    (["run", "--root", "R", "--jobs", "0"], "error: --jobs 0: must be >= 1"),
    (["run", "--root", "R", "--", "--size", "huge"], "error: -- --size huge: choose one of tiny, cpu, 70M, 160M"),
    (["report", "--grid", "--root", "R"], "error: --root R: no finished runs (<root>/<dataset>/<run>/summary.json)"),
    (["collect", "--root", "R", "--to", "S"], "error: --root R: no finished runs"),
])
def test_bad_flags_are_one_line_errors_before_any_run(tmp_path, monkeypatch, capsys, argv, message):
    """In process (sweep.main raises the UsageError that `python -m tools.sweep` prints as one line with
    exit code 2, tested once in a real process below)."""
    monkeypatch.chdir(tmp_path)
    argv = [str(tmp_path / a) if a in ("R", "S") else a for a in argv]
    with pytest.raises(UsageError) as e:
        sweep.main(argv)
    text = "error: " + str(e.value)
    assert len(text.splitlines()) == 1
    assert text.startswith(message.replace(" R:", f" {tmp_path / 'R'}:").replace(" R ", f" {tmp_path / 'R'} "))
    assert capsys.readouterr().out == "" and sorted(os.listdir(tmp_path)) == []  # nothing started or written


def test_bad_flag_in_a_real_process_exits_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "tools.sweep", "run", "--root", str(tmp_path / "R"), "--seeds", "0"],
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": HERE}, capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stderr, p.stdout) == (2, "error: --seeds 0: must be >= 1\n", "")
    assert os.listdir(tmp_path) == []


def test_grid_report_without_held_out_depths(tmp_path):
    fake_grid(str(tmp_path), {key: v for key, v in TEST.items()}, {key: v for key, v in DEV.items() if key[1] == 16})
    text = sweep_report.grid_report(str(tmp_path))
    assert "| model | non-emb params K=16 | test NLL K=16 |" in text
    assert "| tango | 1,016 | 3.200 ± 0.010 |" in text
    assert text.endswith("at K = 4 or 8, so none is checked.\n")


@pytest.mark.parametrize("extra, lrs, message", [
    (["--out_dir", "x"], "", "-- --out_dir: the sweep sets this itself per run"),
    (["--seed=3"], "", "-- --seed: the sweep sets this itself per run"),
    (["--bogus"], "", "-- --bogus: not a train.py flag"),
    ([], "1e-3,abc", "--lrs 1e-3,abc: comma-separated finite learning rates > 0"),
    ([], "-1", "--lrs -1: comma-separated finite learning rates > 0"),
    ([], "inf", "--lrs inf: comma-separated finite learning rates > 0"),
    ([], "1e400", "--lrs 1e400: comma-separated finite learning rates > 0"),
    ([], "1e39", "--lrs 1e39: comma-separated finite learning rates > 0, at most 3.4e38"),  # AdamW's float32
    ([], "1e-3/2", "--lrs 1e-3/2: comma-separated finite learning rates > 0"),
])
def test_run_refuses_flags_it_sets_and_bad_lrs(extra, lrs, message):
    """Flags the sweep sets per run would win after `--` (every run into one --out_dir); unknown
    train.py flags and bad --lrs would fail every run: all are refused before anything starts."""
    args = argparse.Namespace(models="tango", depths="4", seeds=1, jobs=1, lrs=lrs, datasets="stdlib")
    with pytest.raises(UsageError) as e:
        sweep.check_run_flags(args, extra)
    assert str(e.value).startswith(message)
    for ok in ("1e-3", "1E-3,2e+0,0.5,3."):  # these are fine, as train.py's --learning_rate reads them
        sweep.check_run_flags(argparse.Namespace(models="tango", depths="4", seeds=1, jobs=1, lrs=ok, datasets="stdlib"),
                              ["--size", "tiny", "--warmup_iters", "5"])


def test_run_counts_its_runs_against_the_limit():
    """A sweep holds at most MAX_RUNS runs (a repeated model or depth is refused before the count:
    test_faults' test_every_cli_refuses_a_list_entry_given_twice)."""
    ns = lambda **kw: argparse.Namespace(**{**dict(models="tango", depths="4", seeds=1, jobs=1, lrs="",
                                                   datasets="stdlib"), **kw})
    assert sweep.MAX_RUNS == 100_000
    sweep.check_run_flags(ns(models="tango", depths="4", seeds=100_000), [])
    with pytest.raises(UsageError) as e:
        sweep.check_run_flags(ns(models="tango,loop", depths="4", seeds=50_001), [])
    assert str(e.value) == ("--models (2) x --depths (1) x --seeds (50,001) x --datasets (1) x --lrs (1) = 100,002 "
                            "runs; at most 100,000 per sweep")


def test_grid_report_prints_the_wall_time_from_the_sweep_output(tmp_path):
    fake_grid(str(tmp_path), {k: v for k, v in TEST.items() if k[1] == 4}, seeds=(1, 2))
    for i, p in enumerate(sorted(tmp_path.glob("stdlib/*/summary.json"))):  # 14 runs, 10.5 s to 23.5 s
        p.write_text(json.dumps({**json.loads(p.read_text()), "wall_s": 10.5 + i}))
    assert "Wall time" not in sweep_report.grid_report(str(tmp_path))  # no sweep-output.txt: no line
    out = tmp_path / "sweep-output.txt"
    last = lambda: sweep_report.grid_report(str(tmp_path)).split("\n\n")[-1]
    running = ("**Not finished**: the last `sweep.py run` command in `sweep-output.txt` had not printed its wall "
               "time when these summaries were collected; the 14 runs' own `wall_s` add up to 238 s.\n")
    out.write_text("# a comment\n[1/20] train.py --model tango\n[2/20] train.py --model loop\n")
    assert last() == running
    out.write_text(out.read_text() + "sweep: 20 runs, 1 failed, wall time 4214 s\n[1/2] x\n[2/2] y: done, skipped\n"
                   "sweep: 2 runs, 0 failed, wall time 95 s\n")
    assert last() == ("**Wall time** as `sweep.py run` printed it (`sweep-output.txt` here): 4,214 s for 20 runs "
                      "(1 failed); 95 s for 2 runs (0 failed); 4,309 s in all. The 14 runs' own `wall_s` add up "
                      "to 238 s.\n")
    out.write_text("[1/20] a first start, stopped\n" + out.read_text())
    assert last() == ("**Wall time** as `sweep.py run` printed it (`sweep-output.txt` here): 4,214 s for 20 runs "
                      "(1 failed); 95 s for 2 runs (0 failed); 4,309 s in all (1 start stopped before printing its "
                      "wall time not counted). The 14 runs' own `wall_s` add up to 238 s.\n")
    out.write_text(out.read_text() + "[1/7] a command still running\n")
    assert last() == running
    p = sorted(tmp_path.glob("stdlib/*/summary.json"))[0]
    p.write_text(json.dumps({**json.loads(p.read_text()), "resumed_at": 100, "wall_s_this_process_only": True}))
    assert last() == running.replace("238 s.", "238 s (1 of them resumed without the time before the resume "
                                               "recorded: their `wall_s` counts the last process only).")
    out.write_text("[1/1] a\nsweep: 1 runs, 0 failed, wall time 7 s\n[1/1] b\nsweep: 1 run, 0 failed, wall time 8 s\n")
    assert last().startswith("**Wall time** as `sweep.py run` printed it (`sweep-output.txt` here): 7 s for 1 run "
                             "(0 failed); 8 s for 1 run (0 failed); 15 s in all.")  # "1 runs": older logs
    one = tmp_path / "one"
    one.mkdir()
    (one / "sweep-output.txt").write_text("[1/1] a\nsweep: 1 run, 0 failed, wall time 7 s\n")
    assert sweep_report.wall_time(str(one), {"cell": [{"wall_s": 5.0}]})[-1].endswith(
        "7 s for 1 run (0 failed). The 1 run's own `wall_s` adds up to 5 s.")


def test_report_into_rewrites_only_its_own_block(tmp_path, monkeypatch, capsys):
    fake_grid(str(tmp_path / "g"), {k: v for k, v in TEST.items() if k[1] == 4}, seeds=(1, 2), curves=False)
    monkeypatch.chdir(tmp_path)
    doc = tmp_path / "doc.md"
    other = "<!-- sweep report --grid --root elsewhere -->\nkeep me\n<!-- end of grid report -->\n"
    doc.write_text("intro\n" + other + "<!-- sweep report --grid --root g -->\nstale\n<!-- end of grid report -->\nend\n")
    sweep.main(["report", "--grid", "--root", "g", "--into", "doc.md"])
    report = sweep_report.grid_report("g")
    assert capsys.readouterr().out == report
    want = "intro\n" + other + "<!-- sweep report --grid --root g -->\n" + report + "<!-- end of grid report -->\nend\n"
    assert doc.read_text() == want
    sweep.main(["report", "--grid", "--root", "g", "--into", "doc.md"])  # again: the same file
    assert doc.read_text() == want
    for argv, message in [
        (["report", "--root", "g", "--into", "doc.md"], "--into doc.md: no line <!-- sweep report --root g -->; "
                                                        "put the two marker lines where the report goes"),
        (["report", "--grid", "--root", "g", "--into", "nope.md"], "--into nope.md: no such file"),
        (["report", "--grid", "--root", "g", "--into", ""], '--into "": an empty path'),  # not "no --into"
        (["report", "--lr", "--root", "g", "--into", "doc.md"], "--into: not with --lr"),
        (["report", "--grid", "--budget", "--root", "g"], "argument --budget: not allowed with argument --grid"),
        (["report", "--throughput", "--root", "g"], "--root g: no bench_K<k>.json"),
    ]:
        with pytest.raises(UsageError) as e:
            sweep.main(argv)
        assert str(e.value).startswith(message)
    assert doc.read_text() == want and not os.path.exists("nope.md")
    doc.write_text("<!-- sweep report --grid --root g -->\nno end marker\n")
    with pytest.raises(UsageError, match="no line <!-- end of grid report --> after <!-- sweep report --grid --root g"):
        sweep.main(["report", "--grid", "--root", "g", "--into", "doc.md"])
    assert doc.read_text() == "<!-- sweep report --grid --root g -->\nno end marker\n"


def test_paired_differences_subtract_tango_seed_by_seed():
    """Each model minus TANGO at the same seed: seeds only one model has are left out of the pair."""
    run = lambda m, seed, nll, tps: {"model": m, "seed": seed, "test_nll": nll, "tok_per_s_median_last100": tps}
    rows = {("ds", "tango", 4): [run("tango", 1, 2.0, 100.0), run("tango", 2, 3.0, 300.0)],
            ("ds", "loop", 4): [run("loop", 1, 2.5, 1000.0), run("loop", 2, 3.1, 2000.0), run("loop", 3, 9.0, 0.0)]}
    lines = sweep_report.paired_differences(rows, ["ds"])
    assert lines[-2] == "| tango | - | 200 |"
    assert lines[-1] == "| loop | +0.300 ± 0.283 (n=2) | 1,000 |"  # diffs 0.5 and 0.1; tokens/s mean of three
    assert sweep_report.paired_differences({("ds", "loop", 4): rows["ds", "loop", 4]}, ["ds"]) == []


@pytest.mark.parametrize("argv, message", [
    (["plot", "--root", "g", "--out", "afile"], "--out afile: exists and is not a folder"),
    (["collect", "--root", "g", "--to", "afile"], "--to afile: exists and is not a folder"),
    (["collect", "--root", "g", "--to", "afile/sub"], "--to afile/sub: TMP/afile is a file, not a folder"),
    (["collect", "--root", "g", "--to", "g"], "--to g: the same folder as --root; collect copies the runs into "
                                              "another folder"),
    (["collect", "--root", "g", "--to", "./g/"], "--to ./g/: the same folder as --root; collect copies the runs "
                                                 "into another folder"),
])
def test_output_paths_are_refused_before_any_work(tmp_path, monkeypatch, argv, message):
    """plot --out FILE, collect --to FILE and collect --to ROOT are one line naming the flag, with
    nothing written (harness.cli.check_output_folder), not FileExistsError / shutil.SameFileError."""
    monkeypatch.chdir(tmp_path)
    fake_grid("g", {("tango", 4): 3.0}, seeds=(1,))
    (tmp_path / "afile").write_text("x")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(UsageError) as e:
        sweep.main(argv)
    assert str(e.value) == message.replace("TMP", str(tmp_path))
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_collect_creates_a_missing_output_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_grid("g", {("tango", 4): 3.0}, seeds=(1,))
    assert sweep.main(["collect", "--root", "g", "--to", "new/c"]) == 0
    assert os.path.isfile("new/c/stdlib/tango-K4-s1/summary.json")


def test_run_prepares_each_folder_its_runs_read_once_with_their_resolved_tokenizer(tmp_path, monkeypatch):
    """run prepares the data as train.py's resolved flags of its runs ask, each folder once: at the
    cpu tier --tokenizer auto is char (train.py resolves it by tier; data.py alone would make GPT-2
    BPE bins that no run reads); at tiny it stays auto (GPT-2 BPE; dmmath: char)."""
    import data
    prepared = []
    monkeypatch.setattr(data, "prepare", lambda ds, data_dir, data_root, **kw: prepared.append(
        (ds, data_dir, kw["tokenizer"])))
    monkeypatch.setattr(sweep, "run_process", lambda cmd, stdout, env: 0)
    for size, tokenizer in (("cpu", "char"), ("tiny", "auto")):
        prepared.clear()
        assert sweep.main(["run", "--root", str(tmp_path / size), "--models", "tango,loop", "--depths", "2",
                           "--seeds", "2", "--datasets", "stdlib,dmmath", "--", "--size", size]) == 0
        assert prepared == [("stdlib", None, tokenizer), ("dmmath", None, tokenizer)]


def no_runs(monkeypatch):
    """Make preparing data or starting a run fail the test: a refused sweep must do neither."""
    def fail(*a, **kw):
        raise AssertionError("the sweep started work")
    monkeypatch.setattr(sweep, "prepare_data", fail)
    monkeypatch.setattr(sweep, "run_process", fail)


@pytest.mark.parametrize("datasets, extra, message", [
    # train.py's own checks of each grid run, before any run starts (each run failed with exit 2)
    ("stdlib", ["--size", "tiny", "--max_iters", "0"], "R/stdlib/tango-K2-s1: --max_iters 0: must be >= 1"),
    ("stdlib", ["--size", "tiny", "--width", "100"],
     "R/stdlib/loop-K2-s1: --width 100: must be a positive multiple of 8 for --model loop (0: solve it to the "
     "tier's parameter target)"),
    ("dmmath", ["--size", "tiny", "--em_samples", "0"], "R/dmmath/tango-K2-s1: --em_samples 0: must be >= 1"),
    # flags a sweep cannot use, or that no run would read
    ("stdlib", ["--eval_only"], "-- --eval_only: a sweep trains every run; evaluate a finished one with "
                                "python train.py --eval_only --out_dir RUN"),
    ("stdlib", ["--em_samples", "5"], "-- --em_samples: no dataset of --datasets stdlib reads it (used by dmmath)"),
    ("stdlib", ["--data_dir", "x"], "-- --data_dir: no dataset of --datasets stdlib reads it (used by dmmath)"),
    # a dataset that is not there: refused before the first one is prepared, and no --root left behind
    ("stdlib,../nope", [], "--dataset: unknown dataset '../nope'; use stdlib, dmmath, a path to a text file or "
                           "folder, or hf:NAME[:CONFIG]"),
    ("stdlib", ["--size", "tiny", "--device", "cuda:7"], None),
])
def test_run_checks_every_train_run_before_anything_starts(tmp_path, monkeypatch, datasets, extra, message):
    """`sweep run -- --max_iters 0` (or --eval_only, or `--datasets ../nope`) is a one-line
    UsageError naming the run (or the flag) before any preparation, with no folder left, rather
    than every run failing with exit 2 and leaving its folder behind."""
    import torch
    if message is None:  # the device check of train.py, where this machine has no such GPU
        if torch.cuda.device_count() > 7:
            pytest.skip("this machine has a cuda:7")
        message = "R/stdlib/tango-K2-s1: --device cuda:7: " + (
            "CUDA is not available on this machine; use --device cpu" if not torch.cuda.is_available()
            else f"this machine has {torch.cuda.device_count()} GPU(s)")
    monkeypatch.chdir(tmp_path)
    no_runs(monkeypatch)
    with pytest.raises(UsageError) as e:
        sweep.main(["run", "--root", "R", "--models", "tango,loop", "--depths", "2", "--datasets", datasets,
                    "--", *extra])
    assert str(e.value) == message
    assert os.listdir(tmp_path) == []


def test_run_sends_em_samples_to_dmmath_only():
    extra = ["--size", "tiny", "--em_samples", "5", "--max_iters", "3"]
    assert sweep.flags_for("dmmath", extra) == extra
    assert sweep.flags_for("stdlib", extra) == ["--size", "tiny", "--max_iters", "3"]


def test_a_refused_run_in_a_real_process_exits_2_and_leaves_nothing(tmp_path):
    p = subprocess.run([sys.executable, "-m", "tools.sweep", "run", "--root", "R", "--models", "tango", "--depths",
                        "2", "--", "--size", "tiny", "--max_iters", "0"],
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": HERE}, capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stderr, p.stdout) == (2, "error: R/stdlib/tango-K2-s1: --max_iters 0: must be >= 1\n", "")
    assert os.listdir(tmp_path) == []


def test_report_bold_and_spread_follow_the_printed_values(tmp_path):
    """report: a metric with one value in a cell of three runs prints it with (n=1), not ± 0; means
    that print alike are bold alike; a column that prints alike everywhere has no bold."""
    fake_grid(str(tmp_path), {("tango", 4): 3.0, ("loop", 4): 3.0002, ("gau", 4): 3.5}, em=True)
    for s in (1, 3):  # tokens/s recorded by one of gau's three runs only
        path = tmp_path / "dmmath" / f"gau-K4-s{s}" / "summary.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "tok_per_s_median_last100": None}))
    path = tmp_path / "dmmath" / "gau-K4-s2" / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "tok_per_s_median_last100": 100.0}))
    for p in tmp_path.glob("dmmath/*/summary.json"):  # the same exact match everywhere
        p.write_text(json.dumps({**json.loads(p.read_text()), "exact_match_extrapolate": 0.0}))
    rows = {ln.split(" | ")[0][2:]: ln.split(" | ") for ln in sweep_report.report(str(tmp_path)).splitlines()
            if ln.startswith("| ") and " | 4 | " in ln}
    assert rows["gau"][-1] == "100 (n=1) |"
    assert rows["tango"][4].startswith("**3.000 ± ") and rows["loop"][4].startswith("**3.000 ± ")  # 3.0002 prints 3.000
    assert all(r[7] == "0.00% ± 0.00%" for r in rows.values()), rows


def test_claims_say_when_their_means_are_over_unequal_seed_counts(tmp_path):
    fake_grid(str(tmp_path), {k: v for k, v in TEST.items() if k[1] != 16})
    assert "**Seeds**" not in sweep_report.grid_report(str(tmp_path))
    fake_grid(str(tmp_path), {k: v for k, v in TEST.items() if k[1] == 16}, seeds=(1,))
    import shutil
    shutil.rmtree(tmp_path / "stdlib" / "gau-K4-s3")
    assert ("\n**Seeds**: the claims compare means over unequal numbers of seeds, 3 per cell except stdlib K = 4: gau 2; "
        "stdlib K = 16: every model 1.\n") in sweep_report.grid_report(str(tmp_path))


def test_a_run_without_test_nll_counts_in_no_claim(tmp_path):
    """A summary with test_nll null (load_runs accepts it) leaves that seed out of the paired claim,
    as it leaves it out of the means and the paired differences."""
    fake_grid(str(tmp_path), {k: v for k, v in TEST.items() if k[1] != 16})
    full = sweep_report.grid_report(str(tmp_path))
    assert "with the same seed | 47 of 48 | 2 of 6 |" in full  # K = 4 seeds 2 and 3
    p = tmp_path / "stdlib" / "loop-K4-s2" / "summary.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), "test_nll": None}))
    assert "with the same seed | 47 of 48 | 1 of 5 |" in sweep_report.grid_report(str(tmp_path))  # K = 4 seed 2 out


def test_reports_give_nats_per_char_for_character_runs(tmp_path):
    """The NLL unit follows the runs' tokenizer (summary.json, else args.json or the log): nats/char
    when every run of the table is on characters, nats/token otherwise or when unknown."""
    fake_grid(str(tmp_path), {k: v for k, v in TEST.items() if k[1] == 4})
    assert "nats/token" in sweep_report.report(str(tmp_path)) and "nats/char" not in sweep_report.grid_report(str(tmp_path))
    runs = sorted(tmp_path.glob("stdlib/*/summary.json"))
    for i, p in enumerate(runs):
        if i % 2:  # half say so in summary.json, half in args.json
            p.write_text(json.dumps({**json.loads(p.read_text()), "tokenizer": "char"}))
        else:
            (p.parent / "args.json").write_text(json.dumps({"tokenizer": "char"}))
    assert "unigram entropy of dev 5.000 nats/char" in sweep_report.report(str(tmp_path))
    assert "(nats/char, mean ± sample std" in sweep_report.grid_report(str(tmp_path))
    (runs[0].parent / "args.json").unlink()  # one run whose tokenizer is unknown
    assert "nats/char" not in sweep_report.grid_report(str(tmp_path))
    (runs[0].parent / "args.json").write_text(json.dumps({"tokenizer": "gpt2"}))  # runs of a cell on two tokenizers
    with pytest.raises(UsageError, match="has --tokenizer gpt2, .* has --tokenizer char; a cell averages runs"):
        sweep_report.grid_report(str(tmp_path))


def test_collected_runs_are_checked_by_their_args_json(tmp_path):
    """A collected root has no logs: its runs' args.json is what the cell check and the recipe
    check compare (a seed at another rate, or a model at another rate, was averaged or compared
    silently); a non-finite NLL is one line naming the file."""
    fake_grid(str(tmp_path), {k: v for k, v in TEST.items() if k[1] == 4})
    args = lambda lr: json.dumps({"learning_rate": lr, "max_iters": 600})
    for p in tmp_path.glob("stdlib/*/"):
        (p / "args.json").write_text(args(0.002))
    sweep_report.grid_report(str(tmp_path))  # one recipe
    (tmp_path / "stdlib" / "tango-K4-s2" / "args.json").write_text(args(0.001))
    with pytest.raises(UsageError, match=r"^stdlib/tango/4: .*tango-K4-s1 has --learning_rate 0.002, .*tango-K4-s2 has "
                                         r"--learning_rate 0.001; a cell averages runs that differ only in the seed$"):
        sweep_report.report(str(tmp_path))
    (tmp_path / "stdlib" / "tango-K4-s2" / "args.json").write_text(args(0.002))
    for s in (1, 2, 3):
        (tmp_path / "stdlib" / f"loop-K4-s{s}" / "args.json").write_text(args(0.001))
    with pytest.raises(UsageError, match=r"^stdlib: .* has --learning_rate 0.002, .*loop-K4-s1 has --learning_rate "
                                         r"0.001; the models of a report share one recipe"):
        sweep_report.grid_report(str(tmp_path))
    for s in (1, 2, 3):
        (tmp_path / "stdlib" / f"loop-K4-s{s}" / "args.json").write_text(args(0.002))
    p = tmp_path / "stdlib" / "gau-K4-s1" / "summary.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), "test_nll": float("nan")}))
    with pytest.raises(UsageError, match=re.escape(f"{p}: test_nll nan: depth and seed must be integers, dev_nll and "
                                                   "test_nll finite numbers")):
        sweep_report.report(str(tmp_path))


def test_a_run_resumed_with_another_setting_is_not_its_cells_equal(tmp_path):
    """run_args reads every start record of a run's log, not its last: a seed trained at one rate
    and resumed at another shows both, so the cell check, collect's args.json and the sweep's
    check of an existing run see it (with the last start alone it passed as the cell's equal);
    machine flags such as --resume and --out_dir may change between starts."""
    fake_grid(str(tmp_path), {("tango", 4): 3.0}, curves=False)
    start = lambda lr, resume: json.dumps({"event": "start", "args": {
        "learning_rate": lr, "max_iters": 600, "resume": resume, "out_dir": "x" if resume else "y"}})
    for s in (1, 2, 3):
        (tmp_path / "stdlib" / f"tango-K4-s{s}" / "log.jsonl").write_text(
            start(0.002, False) + "\n" + start(0.002, True) + "\n")
    sweep_report.report(str(tmp_path))  # a resume at the same settings is the same run
    run = tmp_path / "stdlib" / "tango-K4-s2"
    (run / "log.jsonl").write_text(start(0.002, False) + "\n" + start(0.001, True) + "\n" + start(0.001, True) + "\n")
    assert sweep_report.run_args(str(run)) == {"learning_rate": "0.002 -> 0.001", "max_iters": 600, "resume": True,
                                               "out_dir": "x"}
    other = tmp_path / "other"  # changed and changed back: both changes show
    other.mkdir()
    (other / "log.jsonl").write_text(start(0.002, False) + "\n" + start(0.001, True) + "\n" + start(0.002, True) + "\n")
    assert sweep_report.run_args(str(other))["learning_rate"] == "0.002 -> 0.001 -> 0.002"
    with pytest.raises(UsageError, match=r"tango-K4-s1 has --learning_rate 0.002, .*tango-K4-s2 has --learning_rate "
                                         r"0.002 -> 0.001; a cell averages runs that differ only in the seed$"):
        sweep_report.report(str(tmp_path))
    sweep.cmd_collect(str(tmp_path), str(tmp_path / "res"))
    assert json.loads((tmp_path / "res" / "stdlib" / "tango-K4-s2" / "args.json").read_text())["learning_rate"] \
        == "0.002 -> 0.001"


def test_run_refuses_a_copied_in_run_of_other_settings(tmp_path):
    """Continuing a grid from committed results (no log, an args.json): a run trained with other
    settings is refused, not skipped as done."""
    import train
    out = tmp_path / "stdlib" / "tango-K2-s1"
    out.mkdir(parents=True)
    argv = sweep.train_argv(str(tmp_path), "stdlib", "tango", 2, 1, None, ["--size", "tiny", "--max_iters", "6"])
    resolved = vars(train.check_flags(train.parse_args(argv), train.given_flags(argv)))
    (out / "args.json").write_text(json.dumps({**resolved, "max_iters": 4}))
    with pytest.raises(UsageError, match="trained with --max_iters 4, this sweep asks for --max_iters 6"):
        sweep.check_existing_run(str(out), argv)
    (out / "args.json").write_text(json.dumps(resolved))
    sweep.check_existing_run(str(out), argv)


def test_collect_reads_everything_first_keeps_args_and_merges_the_output(tmp_path):
    root, to = tmp_path / "runs", tmp_path / "res"
    fake_grid(str(root), {("tango", 4): 3.0, ("loop", 4): 3.1}, seeds=(1,), curves=False)
    (root / "stdlib" / "tango-K4-s1" / "args.json").write_text(json.dumps({"tokenizer": "char"}))  # copied in
    (root / "sweep-output.txt").write_text("a\n")
    sweep.cmd_collect(str(root), str(to))
    assert sorted(os.listdir(to / "stdlib" / "tango-K4-s1")) == ["args.json", "summary.json"]  # no curves made up
    assert json.loads((to / "stdlib" / "tango-K4-s1" / "args.json").read_text()) == {"tokenizer": "char"}
    for text, kept in (("a\nb\n", "a\nb\n"), ("c\n", "a\nb\nc\n"), ("c\n", "a\nb\nc\n")):
        (root / "sweep-output.txt").write_text(text)  # the same root later: replaced; another clone's: appended
        sweep.cmd_collect(str(root), str(to))
        assert (to / "sweep-output.txt").read_text() == kept
    (root / "stdlib" / "loop-K4-s1" / "summary.json").write_text("")
    with pytest.raises(UsageError, match="loop-K4-s1/summary.json: not a readable JSON file"):
        sweep.cmd_collect(str(root), str(tmp_path / "res2"))
    assert not (tmp_path / "res2").exists()  # nothing copied before the bad file was found


def test_lrs_with_a_trailing_comma_and_an_lr_report_under_a_dash_lr_path(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sweep, "run_process", lambda cmd, stdout, env: calls.append(cmd) or 0)
    monkeypatch.setattr(sweep, "prepare_data", lambda resolved: None)
    root = tmp_path / "my-lr-K9"
    assert sweep.main(["run", "--root", str(root), "--models", "tango", "--depths", "2", "--lrs", "1e-3,",
                       "--", "--size", "tiny"]) == 0
    assert [c[c.index("--out_dir") + 1] for c in calls] == [str(root / "stdlib" / "tango-K2-s1-lr1e-3")]
    os.makedirs(root / "stdlib" / "loop-K2-s1-lr2e-3")
    table = sweep_report.lr_report(str(root))
    assert "| loop | 2 | 2e-3 |" in table and "| tango | 2 | 1e-3 |" in table


def test_lr_report_of_collected_runs_reads_their_curves(tmp_path):
    """A collected learning-rate run has curves.json, not its log: its final training loss (mean of
    the last 10) and best dev NLL come from the curves ("-" before), its diagnostics stay "-"."""
    root = tmp_path / "runs"
    run = root / "dmmath" / "parcae-K4-s1-lr1e-3"
    run.mkdir(parents=True)
    recs = [{"event": "start", "args": {"batch_size": 2, "block_size": 8, "gradient_accumulation_steps": 1}}]
    recs += [{"event": "train", "iter": i, "loss": 3.0 - i / 100, "diag": {"state_norm_max": 5.0}} for i in range(1, 21)]
    recs += [{"event": "eval", "iter": i, "dev_nll": v, "diag": {"abar_max": 0.5}} for i, v in ((10, 2.9), (20, 2.7))]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "summary.json").write_text(json.dumps({"model": "parcae", "depth": 4, "seed": 1}))
    raw = sweep_report.lr_report(str(root))
    assert "| parcae | 4 | 1e-3 | 2.845 | 2.700 | 5.0 | 0.500 | - | finished |" in raw  # 3 - 15.5 / 100: updates 11-20
    sweep.cmd_collect(str(root), str(tmp_path / "res"))
    assert "| parcae | 4 | 1e-3 | 2.845 | 2.700 | - | - | - | finished |" in sweep_report.lr_report(str(tmp_path / "res"))


def test_a_stopped_sweep_passes_sigterm_on_and_starts_nothing_new(tmp_path):
    """SIGTERM reaches the sweep alone (Ctrl-C the whole process group): stop_runs passes it on to
    the running train.py, waits for it to exit, and no run starts after it."""
    import threading
    from harness.cli import Terminated
    child = tmp_path / "child.py"
    child.write_text("import signal, sys, time\n"
                     "signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), sys.exit(143)))\n"
                     "print('started', flush=True)\ntime.sleep(60)\n")
    out = tmp_path / "stdout.txt"
    rcs = []
    try:
        with open(out, "w") as f:
            t = threading.Thread(target=lambda: rcs.append(sweep.run_process([sys.executable, str(child)], f, None)))
            t.start()
            while "started" not in out.read_text():
                time.sleep(0.05)
            sweep.stop_runs(Terminated(), grace=30)
            t.join(30)
            assert rcs == [143] and out.read_text() == "started\ngot SIGTERM\n"
            assert sweep.run_process([sys.executable, str(child)], f, None) is None  # nothing new starts
    finally:
        sweep._runs["stopping"] = False  # (as the next sweep in this process starts)


def test_a_stopped_sweep_ends_its_output_file_with_the_line_it_prints(tmp_path, monkeypatch):
    """What `run` prints goes to <root>/sweep-output.txt too, the line of a stopped sweep included."""
    from harness.cli import Terminated

    def stopped(cmd, stdout, env):
        raise Terminated

    monkeypatch.setattr(sweep, "run_process", stopped)
    monkeypatch.setattr(sweep, "prepare_data", lambda resolved: None)
    with pytest.raises(Terminated, match=f"^{sweep.RESUME_HINT}$"):
        sweep.main(["run", "--root", str(tmp_path), "--models", "loop", "--depths", "2", "--", "--size", "tiny"])
    lines = (tmp_path / "sweep-output.txt").read_text().splitlines()
    assert re.fullmatch(rf"{sweep.START_LINE} \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC, id [0-9a-f]{{8}}", lines[0]), lines[0]
    assert lines[1].startswith("[1/1] train.py --model loop ") and lines[2:] == [
        "terminated: run the same command again to skip finished runs and resume the rest"]


def test_collect_keeps_each_line_of_the_sweep_outputs_once():
    """Clone A collected, clone B collected part-way and again when done, A again after it ran on:
    every line once, in the order collected (report --grid sums the wall times it prints)."""
    a, b_part, b_rest, a_more = "[1/2] a\n", "[1/2] b\n", "sweep: 2 runs, 0 failed, wall time 9 s\n", "[2/2] a\n"
    kept = sweep.merge_output("", a)
    kept = sweep.merge_output(kept, b_part)
    kept = sweep.merge_output(kept, b_part + b_rest)
    assert kept == a + b_part + b_rest
    assert sweep.merge_output(kept, a) == kept
    assert sweep.merge_output(kept, a + a_more) == kept + a_more
    assert sweep.merge_output(kept + a_more, a + a_more) == kept + a_more  # collected again: nothing new


SKIPPED = "[1/2] runs/g/stdlib/loop-K4-s1: done, skipped\n[2/2] runs/g/stdlib/tango-K4-s1: done, skipped\n"


def test_collect_keeps_each_commands_lines_once_in_any_order():
    """Each run command's lines begin with its own start line: two clones whose commands print the
    same lines first (every run skipped), collected part-way, in turns and again, keep each
    command's lines once, and collecting again changes nothing."""
    def command(n, end):
        return f"{sweep.START_LINE} 2026-12-0{n} 10:00:00 UTC, id {n:08x}\n" + SKIPPED + end
    a1, b1 = command(1, "sweep: 2 runs, 0 failed, wall time 2 s\n"), command(2, "sweep: 2 runs, 0 failed, wall time 3 s\n")
    a2_part = command(3, "[1/1] train.py --model gau --depth 4\n")
    a2 = a2_part + "sweep: 1 run, 0 failed, wall time 900 s\n"
    kept = ""
    for new in (a1, b1, a1 + a2_part, b1, a1 + a2, a1 + a2, b1):
        kept = sweep.merge_output(kept, new)
    assert kept == a1 + b1 + a2


def test_collect_of_output_without_start_lines_keeps_no_line_twice():
    """A clone whose sweep.py wrote no start lines, whose first lines are another clone's (every run
    skipped), collected as it runs on: lines it holds at its beginning are taken as held (that
    clone's own cannot be told from the other's), every later line is kept once."""
    other = SKIPPED + "sweep: 2 runs, 0 failed, wall time 2 s\n"
    clone = SKIPPED + "sweep: 2 runs, 0 failed, wall time 3 s\n[1/1] train.py --model gau --depth 4\n"
    done = "sweep: 1 run, 0 failed, wall time 900 s\n"
    kept = sweep.merge_output(other, clone)
    for new in (clone + done, clone + done):
        kept = sweep.merge_output(kept, new)
    assert kept == other + clone[len(SKIPPED):] + done


def test_collect_completes_a_held_command_in_place_and_ends_a_cut_last_line():
    """A command collected part-way, then another clone's command, then the first one done: its
    rest goes in its place, before the other command's lines, not at the end. A file whose last
    line has no newline (a sweep stopped mid-line) ends that line before the next command's."""
    def command(n, body):
        return f"{sweep.START_LINE} 2026-12-0{n} 10:00:00 UTC, id {n:08x}\n" + body
    a_part = command(1, "[1/2] train.py --model loop\n")
    a = a_part + "[2/2] train.py --model tango\nsweep: 2 runs, 0 failed, wall time 5 s\n"
    b = command(2, "[1/1] train.py --model gau\nsweep: 1 run, 0 failed, wall time 3 s\n")
    kept = sweep.merge_output(sweep.merge_output(a_part, b), a)
    assert kept == a + b
    cut = command(3, "[1/1] train.py --model loop (cut")
    assert sweep.merge_output(cut, b) == cut + "\n" + b
    assert sweep.merge_output(sweep.merge_output("", cut), b).splitlines() == cut.splitlines() + b.splitlines()


def test_a_model_flag_goes_only_to_the_runs_where_it_acts(tmp_path):
    """Like a flag only some models read, a flag the run's depth leaves idle (--plt_window at
    --depth 1: one loop) is left out of that run's train.py flags and kept for the others; a flag
    idle in every run of the grid is refused in one line before anything is made."""
    extra = ["--size", "tiny", "--plt_window", "8"]
    assert sweep.flags_for("stdlib", extra, "plt", 1) == ["--size", "tiny"]
    assert sweep.flags_for("stdlib", extra, "plt", 2) == extra
    assert sweep.flags_for("stdlib", extra, "plt") == extra  # (no depth: not judged)
    root = tmp_path / "runs"
    with pytest.raises(UsageError, match=r"^-- --plt_window: does nothing in every run of this grid \(at --depths 1 "):
        sweep.main(["run", "--root", str(root), "--models", "plt", "--depths", "1", "--", *extra])
    assert not root.exists()
