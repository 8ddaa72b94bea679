"""sweep.py: grid runner (resume, parallel jobs), collect, the paper-style report and plots."""
import json
import os
import subprocess
import sys

import pytest

import sweep

HERE = os.path.dirname(os.path.abspath(__file__))


def fake_grid(root, nll, seeds=(1, 2, 3), depths=(4, 8, 16), em=False, curves=True):
    """Write summary.json (+ curves.json) for nll[(model, depth)] = base test NLL; seed s adds
    0.01 * (s - 2) and dev NLL = test NLL + 0.1."""
    ds = "dmmath" if em else "stdlib"
    for (m, k), v in nll.items():
        if k not in depths:
            continue
        for s in seeds:
            d = os.path.join(root, ds, f"{m}-K{k}-s{s}")
            os.makedirs(d, exist_ok=True)
            t = v + 0.01 * (s - 2)
            summ = dict(model=m, depth=k, seed=s, test_nll=t, dev_nll=t + 0.1, non_embedding_params=1000 + k,
                        unigram_dev=5.0, test_split="interpolate" if em else "test")
            if em:
                summ.update(exact_match_interpolate=0.5 - v / 10, exact_match_extrapolate=0.25 - v / 20)
            with open(os.path.join(d, "summary.json"), "w") as f:
                json.dump(summ, f)
            if curves:
                with open(os.path.join(d, "curves.json"), "w") as f:
                    json.dump({"tokens_per_update": 100, "eval": [[10, t + 0.5], [20, t + 0.1]],
                               "train": [[i, t + 1 - i / 20] for i in range(1, 21)]}, f)


PAPER = {("tango", 4): 3.0, ("tango-windowed", 4): 3.2, ("loop", 4): 3.3, ("untied", 4): 3.1,
         ("gau", 4): 3.4, ("flash", 4): 3.15, ("parcae", 4): 2.9,
         ("tango", 8): 3.25, ("tango-windowed", 8): 3.2, ("loop", 8): 3.1, ("untied", 8): 3.3,
         ("gau", 8): 3.4, ("flash", 8): 3.5, ("parcae", 8): 2.8,
         ("tango", 16): 3.2, ("tango-windowed", 16): 3.3, ("loop", 16): 3.0, ("untied", 16): 3.4,
         ("gau", 16): 3.5, ("flash", 16): 3.6, ("parcae", 16): 2.7}


def test_grid_report_tables_and_claims(tmp_path):
    fake_grid(str(tmp_path), PAPER)
    text = sweep.grid_report(str(tmp_path))
    lines = text.splitlines()
    # held-out table: K = 4 and 8 only; Parcae (an extra row) has the lowest means, so it is bold
    head = next(ln for ln in lines if ln.startswith("| model | non-emb params K=4"))
    assert "test NLL K=4 | test NLL K=8 |" in head and "K=16" not in head
    row = next(ln for ln in lines if ln.startswith("| tango | 1,004 | 3.000 ± 0.010 | 3.250 ± 0.010 |"))
    assert "**" not in row
    assert "| parcae | 1,004 | **2.900 ± 0.010** | **2.800 ± 0.010** |" in lines
    assert any(ln.startswith("| model | dev NLL K=4 | dev NLL K=8 | dev NLL K=16 |") for ln in lines)
    claims = {ln.split(" | ")[0]: ln.split(" | ")[-1].rstrip(" |") for ln in lines if ln.startswith("| ")}
    # K=4: TANGO lowest of the six; K=8: loop lowest -> 1 of 2
    assert claims["| TANGO has the lowest mean test NLL"] == "1 of 2"
    assert claims["| TANGO is lower than every other model with the same seed"] == "3 of 6"
    assert claims["| Windowed TANGO is lower than Loop Transformer++"] == "1 of 2"   # K=4 yes, K=8 no
    assert claims["| Windowed TANGO is lower than FLASH"] == "1 of 2"               # K=4 no, K=8 yes
    assert claims["| largest test-NLL std over seeds: TANGO vs the others"] == "0.010 vs 0.010-0.010"
    assert claims["| TANGO's dev NLL never rises over K = 4 → 8 → 16"] == "rises in 1 of 1"
    assert claims["| Loop Transformer++'s dev NLL rises over K = 4 → 8 → 16"] == "0 of 1"
    assert claims["| Untied Transformer++'s dev NLL rises over K = 4 → 8 → 16"] == "1 of 1"
    assert claims["| TANGO has the lowest dev NLL at K = 16"] == "0 of 1"


def test_grid_report_exact_match_and_missing_runs(tmp_path):
    nll = {k: v for k, v in PAPER.items() if k[1] != 16}
    fake_grid(str(tmp_path), nll, seeds=(1, 2), depths=(4, 8), em=True, curves=False)
    os.remove(os.path.join(tmp_path, "dmmath", "gau-K8-s2", "summary.json"))  # an unfinished run
    text = sweep.grid_report(str(tmp_path))
    assert "| gau | 1,004 | 3.395 ± 0.007 (n=2) | 3.390 (n=1) |" in text
    # exact match: higher is better, so the lowest NLL (Parcae) has the bold EM
    assert "| **21.0% ± 0.0% (n=2)** |" in text  # parcae K=4 interpolate: 0.5 - 2.9 / 10
    assert claims_line(text, "TANGO is lower than every other model with the same seed") == "2 of 3"  # gau K=8 s2 missing
    assert "| exact match (dmmath interpolate, K = 4): TANGO / Windowed TANGO / best other |" in text
    assert "| 20.0% / 18.0% / 19.0% (untied) |" in text  # the best of loop, untied, gau, flash
    assert "dev NLL never rises" not in text  # only two depths


def claims_line(text, claim):
    return next(ln for ln in text.splitlines() if ln.startswith(f"| {claim} |")).split(" | ")[-1].rstrip(" |")


def test_collect_and_plot(tmp_path):
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
    c = json.loads((tmp_path / "res" / "stdlib" / "tango-K4-s1" / "curves.json").read_text())
    assert c == {"tokens_per_update": 48, "eval": [[2, 4.5]], "train": [[1, 5.0], [2, 4.0]]}
    assert json.loads((tmp_path / "res" / "stdlib" / "tango-K4-s1" / "summary.json").read_text())["test_nll"] == 3.0
    pytest.importorskip("matplotlib", reason="sweep.py plot needs the optional matplotlib")
    fake_grid(str(tmp_path / "grid"), PAPER, seeds=(1, 2))
    (png,) = sweep.plot(str(tmp_path / "grid"), str(tmp_path / "plots"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10_000


def test_plot_without_matplotlib_is_a_one_line_error(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; import sweep; "
            f"sweep.main(['plot', '--root', {str(tmp_path)!r}, '--out', {str(tmp_path / 'p')!r}])")
    p = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip() == \
        "sweep.py plot needs matplotlib (an optional extra): pip install matplotlib"
    assert not os.path.exists(tmp_path / "p")


def test_run_skips_finished_and_runs_in_parallel(tmp_path, monkeypatch):
    calls = []

    def fake_call(cmd, stdout, stderr, env):
        calls.append((cmd, env.get("OMP_NUM_THREADS")))
        out = cmd[cmd.index("--out_dir") + 1]
        with open(os.path.join(out, "summary.json"), "w") as f:
            f.write("{}")
        return 0 if "loop" not in cmd else 3

    monkeypatch.setattr(sweep.subprocess, "call", fake_call)
    prepared = []
    monkeypatch.setattr(sweep, "prepare_data", lambda ds, extra: prepared.append((ds, extra)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 4)
    done = tmp_path / "stdlib" / "tango-K4-s1"
    done.mkdir(parents=True)
    (done / "summary.json").write_text("{}")
    rc = sweep.main(["run", "--root", str(tmp_path), "--models", "tango,loop", "--depths", "4,8", "--seeds", "2",
                     "--jobs", "2", "--", "--size", "tiny"])
    assert rc == 1  # the loop runs failed
    assert prepared == [(["stdlib"], ["--size", "tiny"])]
    assert len(calls) == 7 and all(env == "2" for _, env in calls)
    first = calls[0][0]
    assert first[first.index("--depth") + 1] == "4" and first[-2:] == ["--size", "tiny"]
    assert sorted((c[c.index("--model") + 1], c[c.index("--depth") + 1], c[c.index("--seed") + 1]) for c, _ in calls) \
        == [("loop", "4", "1"), ("loop", "4", "2"), ("loop", "8", "1"), ("loop", "8", "2"),
            ("tango", "4", "2"), ("tango", "8", "1"), ("tango", "8", "2")]
