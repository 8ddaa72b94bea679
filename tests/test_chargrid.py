"""The character-level reproduction grid: results/chargrid/README.md's tables, claims and wall time
are `sweep.py report --grid` over the committed summaries in results/chargrid/, byte for byte, and so
are its plots (`sweep.py plot`, with the matplotlib version requirements-dev.txt pins); the GPU recipe printed in
results/chargrid/README.md is the same grid at >= 2,000 updates and runs on CPU at a reduced size."""
import json
import os
import re
import shlex
import shutil

import pytest

from tools import sweep
from tools import sweep_report
import train
from checks import GRID_MODELS

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
ROOT = "results/chargrid"  # as results/chargrid/README.md's commands and markers spell it (relative to HERE)
MDM_SIZE = (60, 20)  # the shared mini-dmmath of tests/conftest.py (mdm, data_root), small


def readme():
    with open(os.path.join(HERE, ROOT, "README.md")) as f:
        return f.read()


def fenced_commands(marker):
    """The commands of the fenced block right after the line `marker` in results/chargrid/README.md, as
    [(environment variables, argv after `python -m tools.sweep`)]; every line is one `sweep.py` command."""
    doc = readme()
    start = doc.index("```\n", doc.index(marker + "\n")) + 4
    cmds = []
    for line in doc[start:doc.index("```", start)].splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        env = {}
        while re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            k, v = words.pop(0).split("=", 1)
            env[k] = v
        assert words[:3] == ["python", "-m", "tools.sweep"], line
        cmds.append((env, words[3:]))
    return cmds


def sweep_options(argv):
    """{flag: value} of a `sweep.py run` argv before its `--` (every run flag takes a value)."""
    own = argv[1:argv.index("--")]
    return dict(zip(own[::2], own[1::2]))


# ----------------------------------------------------------------------------- the committed grid

def test_chargrid_tables_claims_and_wall_time_are_the_committed_summaries_byte_for_byte(monkeypatch):
    monkeypatch.chdir(HERE)
    doc = readme()
    begin, end = sweep_report.report_markers(ROOT, "grid")
    i = doc.index(begin) + len(begin)
    block = doc[i:doc.index(end, i)]
    assert block == sweep_report.grid_report(ROOT)
    rows = sweep_report.load_runs(ROOT)
    assert {k[0] for k in rows} <= {"stdlib", "dmmath"} and {k[1] for k in rows} <= set(GRID_MODELS)
    assert all(k[2] in (4, 8, 16) and 1 <= len(v) <= 3 for k, v in rows.items())
    if "\n**Not finished**: " not in block:  # every sweep.py run command printed its wall time
        assert len(rows) == 2 * 7 * 3 and all(len(v) == 3 for v in rows.values())  # 126 runs
        assert "K = 4, 8 and 16 with 3)" in doc  # as the heading says
        assert "\n**Wall time** as `sweep.py run` printed it" in block
    else:  # committed before the grid finished: the report says so, with the count
        n = sum(len(v) for v in rows.values())
        assert block.endswith(f"collected; the {n} runs' own `wall_s` add up to "
                              f"{sum(r['wall_s'] for v in rows.values() for r in v):,.0f} s.\n")
    for ds in {k[0] for k in rows}:
        assert f"]({ds}.png)" in doc  # the plots sit beside the README


def test_chargrid_report_command_writes_into_this_readme(tmp_path, monkeypatch):
    """The printed `report --grid ... --into FILE` names this README, and running it on a copy of the
    README beside a copy of the summaries leaves every byte as committed."""
    (_, argv), = [c for c in fenced_commands("<!-- chargrid commands -->") if c[1][0] == "report"]
    assert argv[argv.index("--into") + 1] == ROOT + "/README.md" and argv[argv.index("--root") + 1] == ROOT
    shutil.copytree(os.path.join(HERE, ROOT), tmp_path / ROOT)
    monkeypatch.chdir(tmp_path)
    sweep.main(argv)  # prints the report and writes it between the markers
    assert (tmp_path / ROOT / "README.md").read_text() == readme()


def test_a_changed_summary_number_changes_the_report(tmp_path):
    """The byte-for-byte comparison above fails when a committed number changes: here a test NLL
    by 0.01 and a run's wall time by 10 s, each changing one cell or line."""
    shutil.copytree(os.path.join(HERE, ROOT), tmp_path / "g")
    committed = sweep_report.grid_report(str(tmp_path / "g")).splitlines()
    path = sorted((tmp_path / "g").glob("*/*-K4-s1/summary.json"))[0]
    s = json.loads(path.read_text())
    for key, delta in (("test_nll", 0.01), ("wall_s", 10.0)):
        path.write_text(json.dumps({**s, key: s[key] + delta}))
        changed = sweep_report.grid_report(str(tmp_path / "g")).splitlines()
        assert len(changed) == len(committed) and sum(a != b for a, b in zip(changed, committed)) >= 1, key
    path.write_text(json.dumps(s))
    assert sweep_report.grid_report(str(tmp_path / "g")).splitlines() == committed


def pinned(package):
    """The version requirements-dev.txt pins of package (matplotlib draws the plots, pillow writes the PNG)."""
    with open(os.path.join(HERE, "requirements-dev.txt")) as f:
        return re.search(rf"\b{package}==([0-9][\w.]*)", f.read()).group(1)


def require_pinned_plotting():
    """Skip (naming the versions) unless matplotlib and pillow are the versions requirements-dev.txt
    pins: the committed PNGs were drawn with them, and other versions may write other bytes."""
    mpl = pytest.importorskip("matplotlib", reason="sweep.py plot needs the optional matplotlib")
    import PIL
    have = {"matplotlib": mpl.__version__, "pillow": PIL.__version__}
    if have != {p: pinned(p) for p in have}:
        pytest.skip(f"the committed PNGs were made with matplotlib {pinned('matplotlib')} and pillow "
                    f"{pinned('pillow')} (pinned in requirements-dev.txt); this has {have}, whose bytes may differ")


def test_chargrid_plots_are_the_committed_pngs_byte_for_byte(tmp_path, monkeypatch):
    """sweep.py plot writes no version stamp (PNG metadata Software: None), so one matplotlib and
    pillow version make the same bytes from the same curves; the PNGs were made with the versions
    requirements-dev.txt pins (elsewhere the test skips, naming them)."""
    require_pinned_plotting()
    monkeypatch.chdir(HERE)  # the plot's title names --root as given: results/chargrid
    written = sweep_report.plot(ROOT, str(tmp_path / "new"))
    committed = sorted(f for f in os.listdir(ROOT) if f.endswith(".png"))
    assert sorted(os.path.basename(p) for p in written) == committed and committed
    for p in written:
        with open(p, "rb") as a, open(os.path.join(ROOT, os.path.basename(p)), "rb") as b:
            assert a.read() == b.read(), p
    # a changed curve point changes the picture (the copy sits at the same relative path: same title)
    copy = tmp_path / "copy"
    shutil.copytree(ROOT, copy / ROOT)
    curves = sorted((copy / ROOT).glob("*/*-K4-s1/curves.json"))[0]
    c = json.loads(curves.read_text())
    c["eval"][-1][1] -= 0.05
    curves.write_text(json.dumps(c))
    monkeypatch.chdir(copy)
    png = curves.parent.parent.name + ".png"  # the dataset of the changed run
    sweep_report.plot(ROOT, str(tmp_path / "changed"))
    with open(tmp_path / "changed" / png, "rb") as a, open(os.path.join(HERE, ROOT, png), "rb") as b:
        assert a.read() != b.read()


# ----------------------------------------------------------------------------- the GPU recipe

def test_gpu_recipe_is_the_char_grid_at_2000_updates_on_cuda():
    """The recipe's run command is the CPU grid's command (results/chargrid/README.md, both parsed) with
    another --root and --jobs, and train.py flags added only for the device, the budget and the
    evaluation interval; then collect, report --grid and plot on its folders."""
    (cpu_env, cpu), = [c for c in fenced_commands("<!-- chargrid commands -->") if c[1][0] == "run"]
    (env, run), *rest = fenced_commands("<!-- gpu recipe -->")
    assert run[0] == "run" and env == {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    opts, cpu_opts = sweep_options(run), sweep_options(cpu)
    assert opts["--jobs"] == "16" and cpu_opts["--jobs"] == "2"
    same = ("--models", "--depths", "--seeds", "--datasets")
    assert {k: opts[k] for k in same} == {k: cpu_opts[k] for k in same} == {
        "--models": ",".join(GRID_MODELS), "--depths": "4,8,16", "--seeds": "3", "--datasets": "stdlib,dmmath"}
    assert set(opts) == set(cpu_opts) == {"--root", *same, "--jobs"}
    gpu_train, cpu_train = run[run.index("--") + 1:], cpu[cpu.index("--") + 1:]
    assert gpu_train[:len(cpu_train)] == cpu_train == ["--size", "tiny", "--tokenizer", "char"]
    added = train.parse_args(gpu_train)
    assert train.given_flags(gpu_train) - train.given_flags(cpu_train) == {
        "device", "compile", "max_iters", "eval_interval", "num_proc"}
    assert (added.device, added.compile, added.max_iters, added.eval_interval) == ("cuda", True, 2000, 100)
    r, res = opts["--root"], "results/chargrid-gpu"
    assert [c[1] for c in rest] == [["collect", "--root", r, "--to", res], ["report", "--grid", "--root", res],
                                    ["plot", "--root", res, "--out", res]]


def test_gpu_recipe_runs_on_cpu_at_a_reduced_size(mdm, data_root, tmp_path, monkeypatch, capsys):
    """The recipe's commands as printed, with flags appended (the last value of a repeated flag wins):
    2 runs (TANGO and Parcae, K = 4, seed 1, dmmath: the small dataset of tests/conftest.py), 3
    updates of 8 x 32 tokens, CPU, eager; then its collect and report --grid on their output."""
    (env, run), collect, report, _ = fenced_commands("<!-- gpu recipe -->")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    runs, res = str(tmp_path / "runs"), str(tmp_path / "res")
    i = run.index("--")
    smaller = ["--root", runs, "--models", "tango,parcae", "--depths", "4", "--seeds", "1", "--datasets", "dmmath"]
    on_cpu = ["--device", "cpu", "--no-compile", "--max_iters", "3", "--eval_interval", "3", "--block_size", "32",
              "--eval_windows", "2", "--em_samples", "2", "--sample_tokens", "0", "--data_dir", str(mdm),
              "--data_root", str(data_root)]
    assert sweep.main(run[:i] + smaller + run[i:] + on_cpu) == 0
    assert sorted(os.listdir(tmp_path / "runs" / "dmmath")) == ["parcae-K4-s1", "tango-K4-s1"]
    recipe = train.parse_args(run[i + 1:])
    kept = train.given_flags(run[i + 1:]) - train.given_flags(on_cpu)
    assert kept == {"size", "tokenizer", "num_proc"}  # what reached the runs unchanged
    for name in ("parcae-K4-s1", "tango-K4-s1"):
        d = tmp_path / "runs" / "dmmath" / name
        args = [r for r in sweep.log_records(str(d)) if r["event"] == "start"][-1]["args"]
        assert {k: args[k] for k in kept} == {"size": "tiny", "tokenizer": "char", "num_proc": 16}
        assert {k: getattr(recipe, k) for k in kept} == {k: args[k] for k in kept}
        assert (args["device"], args["compile"], args["max_iters"], args["block_size"]) == ("cpu", False, 3, 32)
        s = json.loads((d / "summary.json").read_text())
        assert s["tokens"] == 3 * 8 * 32 and s["size"] == "tiny" and 0 <= s["exact_match_interpolate"] <= 1
    swap = lambda argv: [{collect[1][2]: runs, collect[1][4]: res}.get(a, a) for a in argv]
    assert sweep.main(swap(collect[1])) == 0
    capsys.readouterr()
    sweep.main(swap(report[1]))
    text = capsys.readouterr().out
    assert text == sweep_report.grid_report(res)
    assert "| tango | " in text and "| parcae | " in text and "dev NLL K=4" in text
    # run appended what it printed to <root>/sweep-output.txt, collect copied it, report printed the wall time
    assert re.search(r"\n\*\*Wall time\*\* as `sweep.py run` printed it \(`sweep-output.txt` here\): \d+ s for 2 "
                     r"runs \(0 failed\)\. The 2 runs' own `wall_s` add up to \d+ s\.\n$", text), text[-300:]


def test_gpu_estimate_is_the_scripts_output_and_the_prose_quotes_it():
    """results/chargrid/gpu_estimate.txt is today's `python results/gpu_estimate.py` (ATen operators
    counted on the CPU), and the README's kernel counts and GPU seconds are its numbers."""
    import subprocess
    import sys
    # a fresh process, as on the command line: the counts depend on torch state earlier tests may set
    out = subprocess.run([sys.executable, "results/gpu_estimate.py"], cwd=HERE, capture_output=True, text=True,
                         check=True).stdout
    with open(os.path.join(HERE, ROOT, "gpu_estimate.txt"), encoding="utf-8") as f:
        assert out == f.read()
    rows = [line.strip("|").split("|") for line in out.splitlines() if re.match(r"\| [a-z]", line)]
    eager = {}
    for _, k, n, _ in rows[1:]:
        eager.setdefault(int(k), []).append(int(n.replace(",", "")))
    spread = {k: f"{min(v):,}-{max(v):,}" for k, v in eager.items()}
    totals = re.search(r"training updates (\S+), evaluations (\S+), exact-match decoding (\S+) ", out).groups()
    seconds = {(m, mode): s for m, mode, s in
               re.findall(r"assuming (\S+) µs per kernel, \S+ fewer compiled: (eager|compiled) \S+ kernels, ([\d,]+) s", out)}
    compiled = re.search(r"assuming 1.5 µs per kernel, 4x fewer compiled: compiled (\S+) kernels", out).group(1)
    prose = " ".join(readme().split())
    for said in (f"issues {spread[4]} kernels at K = 4, {spread[8]} at K = 8 and {spread[16]} at K = 16",
                 f"{totals[0]} kernels for the grid's 252,000 updates, plus {totals[1]} for the evaluations and "
                 f"{totals[2]} for the exact-match decoding",
                 f"needs {seconds['1.5', 'eager']} s of GPU time",
                 f"({seconds['2', 'eager']} s at 2 µs, {seconds['1', 'eager']} s at 1 µs)",
                 f"needs {compiled} kernels, {seconds['1.5', 'compiled']} s ({seconds['2', 'compiled']} s at 2 µs and "
                 f"3x, {seconds['1', 'compiled']} s at 1 µs and 5x)",
                 f"({seconds['1.5', 'compiled']} s above)"):
        assert said in prose, said
