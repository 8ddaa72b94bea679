"""Smoke test of bench.py (not a timed test): a tiny run writes a table and JSON with the expected
fields; the target arithmetic on hand-made rows; the CPU allocator setting of the timed steps."""
import json
import os
import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

import flops
from tools import bench
from tools import bench_report
from tools import cpu_memory
ROW_KEYS = {"model", "T", "batch", "compile", "status", "tokens_per_s", "ms_per_token", "peak_mem_mb", "mfu",
            "mfu_vs_ref", "model_flops_per_token", "step_times_s", "width", "non_embedding_params"}
TARGETS = {"tango_memory_exponent", "windowed_time_per_token_4096_vs_512",
           "three_set_vs_tango_tokens_per_s_2048", "min_mfu_vs_transformer_pp"}


def test_tiny_run_writes_json_and_table(tmp_path):
    out = tmp_path / "b.json"
    rc = bench.main(["--models", "tango,loop", "--block_sizes", "32", "--vocab_size", "64", "--batch_tokens", "64",
                     "--steps", "2", "--rounds", "2", "--warmup", "1", "--peak_n", "128", "--peak_reps", "2", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["meta"]["peak_flops_per_s"] > 0 and res["meta"]["device"] == "cpu"
    assert "memory_definition" in res["meta"] and "flops_convention" in res["meta"]
    assert [(r["model"], r["T"]) for r in res["rows"]] == [("tango", 32), ("loop", 32)]
    for r in res["rows"]:
        assert r["status"] == "ok", r["status"]
        assert ROW_KEYS <= set(r)
        assert r["tokens_per_s"] > 0 and r["peak_mem_mb"] >= 0 and 0 < r["mfu"]
        assert r["batch"] == 2 and r["tokens_per_step"] == 64
        # two rounds of one timed step each, pooled: the row's speed is their median
        assert len(r["step_times_s"]) == 2 and r["round_step_s"] == r["step_times_s"]
        assert r["step_s"] == sum(r["step_times_s"]) / 2 and r["tokens_per_s"] == 64 / r["step_s"]
    assert [r["mfu_vs_ref"] for r in res["rows"] if r["model"] == "loop"] == [1.0]
    assert set(res["targets"]) == TARGETS | {"compile"}
    assert res["targets"]["min_mfu_vs_transformer_pp"]["status"] in ("PASS", "MISS")
    assert res["targets"]["three_set_vs_tango_tokens_per_s_2048"]["status"] == "n/a"  # needs T=2048
    md = (tmp_path / "b.md").read_text()
    assert "| tango | 32 | 2 | off |" in md and "Targets" in md
    assert res["meta"]["cpu_memory"] == "keep" and "CPU memory keep (freed memory kept for the next step)" in md


@pytest.mark.parametrize("bf16, ok", [(1.3e9, False), (9.1e10, False), (2e11, True)])
def test_bfloat16_whose_peak_is_no_higher_than_float32s_is_refused(bf16, ok, tmp_path, monkeypatch, capsys):
    """--dtype bfloat16 where its matmul peak is no higher than float32's (emulated: a CPU without
    native bfloat16 measured 1.3 GFLOP/s against 91, and its model steps then read 225 % MFU) is one
    line, exit 2, nothing written; a native one (above float32) runs."""
    peaks = {"bfloat16": bf16, "float32": 9.1e10}
    monkeypatch.setattr(bench, "matmul_peak", lambda device, dtype, n, reps: peaks[dtype])
    monkeypatch.setattr(bench, "schedule", lambda plan, rounds: [])  # no configuration: only the check runs
    out = tmp_path / "b.json"
    rc = bench.main(["--models", "loop", "--dtype", "bfloat16", "--size", "tiny", "--json", str(out)])
    got = capsys.readouterr()
    err = got.err
    if ok:  # it goes on past the check (to the benchmark, which this test stubs out)
        assert "--dtype" not in err and got.out.startswith("matmul peak: 200.0 GFLOP/s (bfloat16, ")
        return
    assert rc == 2 and not out.exists() and err == (
        f"bench.py: error: --dtype bfloat16: its matmul peak on cpu ({bf16 / 1e9:.1f} GFLOP/s) is no higher than "
        "float32's (91.0): bfloat16 is emulated there, so MFU over that peak would read above 100 %; use --dtype "
        "float32\n")


@pytest.mark.skipif(cpu_memory._libc() is None, reason="the C library is not glibc (no mallopt)")
def test_keep_freed_memory_keeps_a_freed_block_and_return_gives_it_back():
    """After keep_freed_memory a freed 64 MiB tensor stays resident (the next step reuses its pages
    instead of faulting in new ones); glibc's default and return_freed_memory give it back. In a
    fresh interpreter: the setting is per process."""
    code = textwrap.dedent("""
        import torch
        from tools import cpu_memory
        def kept_mb():  # MiB of a touched and freed 64 MiB tensor that stay resident
            x = torch.ones(16 << 20)
            with_x = cpu_memory.rss_kb("VmRSS")
            del x
            return 64 - (with_x - cpu_memory.rss_kb("VmRSS")) // 1024
        default = kept_mb()
        cpu_memory.keep_freed_memory()
        kept = kept_mb()
        cpu_memory.return_freed_memory()
        print(default, kept, kept_mb())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=bench.ROOT)
    assert out.returncode == 0, out.stderr
    default, kept, returned = map(int, out.stdout.split())
    assert kept >= 60 and default <= 4 and returned <= 4, (default, kept, returned)


@pytest.mark.parametrize("faults, ran", [([900, 0, 900, 0, 0, 0], 5),  # growth, calm, growth, then two calm steps
                                          ([0, 0, 900], 2),  # calm from the start
                                          ([900] * 12, 10)])  # never calm: stops at max_steps
def test_settle_heap_steps_until_two_in_a_row_fault_in_at_most_a_mib(faults, ran):
    """cpu_memory.settle_heap runs untimed steps until two consecutive ones fault in at most 256 new
    pages (1 MiB), at most 10, and says how many ran (a fake step and page-fault counter)."""
    count, steps = [0], []

    def step():
        count[0] += faults[len(steps)]
        steps.append(1)

    assert cpu_memory.settle_heap(step, faults=lambda: count[0]) == ran == len(steps)


def _row(model, T, tps, mem, mfu, batch=1):
    return {"model": model, "T": T, "compile": False, "status": "ok", "batch": batch, "tokens_per_s": tps,
            "ms_per_token": 1e3 / tps, "peak_mem_mb": mem, "achieved_flops_per_s": mfu, "model_flops_per_token": 1.0}


def test_rounds_reverse_the_order_at_each_block_size():
    configs = [("a", False, 32), ("b", False, 32), ("a", False, 64), ("b", False, 64)]
    assert list(bench.schedule(configs, 1)) == [(c, 0) for c in configs]
    assert [(m, T, r) for (m, _, T), r in bench.schedule(configs, 3)] == [
        ("a", 32, 0), ("b", 32, 0), ("b", 32, 1), ("a", 32, 1), ("a", 32, 2), ("b", 32, 2),
        ("a", 64, 0), ("b", 64, 0), ("b", 64, 1), ("a", 64, 1), ("a", 64, 2), ("b", 64, 2)]


def test_merge_rounds_pools_steps_and_keeps_a_failure():
    part = lambda times, mem, status="ok": {"status": status, "step_times_s": times, "step_s": sorted(times)[len(times) // 2],
                                           "tokens_per_step": 100, "model_flops_per_step": 1e9, "peak_mem_mb": mem,
                                           "peak_rss_mb": mem, "settle_steps": 2, "wall_s": 10.0, "load_after": 0.5,
                                           "final_loss": 3.0, "first_step_s": 1.0}
    row = bench.merge_rounds([part([1.0, 4.0, 5.0], 10), part([2.0, 3.0], 12)])
    assert row["step_s"] == 3.0 and row["tokens_per_s"] == 100 / 3.0 and row["achieved_flops_per_s"] == 1e9 / 3.0
    assert row["round_step_s"] == [4.0, 3.0] and row["peak_mem_mb"] == 12 and row["wall_s"] == 20.0
    failed = {"status": "timeout", "wall_s": 300.0}
    assert bench.merge_rounds([part([1.0], 10), failed]) is failed


def test_targets_arithmetic():
    rows = [_row("tango", 512, 100, 10, 1.0, batch=8), _row("tango", 2048, 100, 10, 1.0, batch=2),  # linear
            _row("tango-3set", 2048, 310, 5, 0.9),
            _row("tango-windowed", 512, 100, 5, 0.85), _row("tango-windowed", 4096, 70, 5, 0.85),  # 1/0.7 > 1.25
            _row("loop", 512, 100, 5, 1.0), _row("loop", 2048, 100, 5, 1.0), _row("loop", 4096, 100, 5, 1.0),
            {"model": "gau", "T": 512, "compile": False, "status": "timeout"}]
    bench_report.add_ratios(rows, peak=1.0)
    tg = bench_report.targets(rows)
    assert abs(tg["tango_memory_exponent"]["value"] - 1.0) < 1e-9 and tg["tango_memory_exponent"]["status"] == "PASS"
    assert tg["windowed_time_per_token_4096_vs_512"]["status"] == "MISS"
    assert abs(tg["three_set_vs_tango_tokens_per_s_2048"]["value"] - 3.1) < 1e-9
    assert tg["three_set_vs_tango_tokens_per_s_2048"]["status"] == "PASS"
    assert tg["min_mfu_vs_transformer_pp"]["status"] == "PASS"  # lowest 0.85
    assert "timeout" in bench_report.table(rows)


def test_quick_cpu_runs_every_model_and_the_long_four(tmp_path, mdm, data_root):
    """The suite runs `python -m tools.bench --quick --device cpu --size tiny` (so the GPU command cannot
    rot), with a main job on the tests' small dataset: every row has its speed, MFU, memory and compile
    columns, the main job its time to first update, and the report says the GPU figures are not measured."""
    out = tmp_path / "q.json"
    main_job = (f"--model tango --depth 2 --size tiny --block_size 32 --batch_size 2 --dataset dmmath "
                f"--data_dir {mdm} --data_root {data_root}")
    assert bench.main(["--quick", "--device", "cpu", "--size", "tiny", "--json", str(out), "--main_job", main_job]) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["quick"] and res["meta"]["vocab_size"] == 256 and res["meta"]["gpu_measured"] is False
    expected = [(m, T) for m in bench.models.REGISTRY for T in (32, 128) if T == 32 or m in bench.QUICK_LONG]
    assert [(r["model"], r["T"]) for r in res["rows"]] == expected  # run T by T, listed model by model
    for r in res["rows"]:
        assert r["status"] == "ok", r
        assert r["compile"] is False and r["tokens_per_step"] == 128
        assert r["first_step_s"] > 0 and 0 < r["mfu"] and r["peak_mem_mb"] >= 0
        assert r["compile_s"] == 0 and r["graphs"] == 0 and r["recompiles"] == 0  # eager
    mj = res["main_job"]
    assert mj["status"] == "ok" and mj["first_update_s"] > 0, mj
    assert mj["command"].startswith("python train.py --model tango --depth 2") and mj["command"].endswith("--device cpu")
    md = (tmp_path / "q.md").read_text()
    assert "train.py's model flags --window 32 --gau_s 32 --chunk 32, batch" in md
    assert "| first step s | compile s | recompiles |" in md and "the GPU figures" in md and "not measured" in md
    assert f"first update after {mj['first_update_s']:.1f} s" in md


def test_compiled_rows_count_graphs_and_recompiles(tmp_path):
    """Compiled rows (here with dynamo's eager backend: the graphs are captured as with inductor,
    without a C++ compile) report the graphs captured, no recompile after the first step, and the
    compile seconds; a main job that fails is a row that says so."""
    out = tmp_path / "c.json"
    assert bench.main(["--models", "tango,loop", "--device", "cpu", "--size", "tiny", "--block_sizes", "32",
                       "--compile", "on", "--compile_backend", "eager", "--vocab_size", "256", "--batch_tokens", "64",
                       "--steps", "2", "--peak_n", "128", "--json", str(out),
                       "--main_job", "--model tango --dataset no-such-corpus/"]) == 0
    res = json.loads(out.read_text())
    rows = {r["model"]: r for r in res["rows"]}
    assert rows["tango"]["status"] == "ok" and rows["loop"]["status"] == "ok", res["rows"]
    # TANGO on CPU: the head and the update's three graphs (tango_kernels: eager chunked kernels between)
    assert rows["tango"]["graphs"] == 4 and rows["loop"]["graphs"] >= 2
    for r in rows.values():
        assert r["recompiles"] == 0 and r["compile_s"] >= 0
    assert res["main_job"]["status"].startswith("error: exit code 2") and "no-such-corpus" in res["main_job"]["status"]
    assert "error: error:" not in res["main_job"]["status"] and ": error:" not in res["main_job"]["status"]
    assert res["main_job"]["command"] == "python train.py --model tango --dataset no-such-corpus/ --device cpu"


def test_a_run_where_no_configuration_completed_exits_1(tmp_path, monkeypatch, capsys):
    """Every row failed (here each child "exits 2"): the tables of statuses are still written, and
    the command ends with one line saying no configuration completed and exit code 1, not 0."""
    monkeypatch.setattr(bench, "run_config", lambda spec, timeout: {**spec, "status": "error: exit code 2: x",
                                                                     "wall_s": 0.1, "load_before": None, "load_after": None})
    out = tmp_path / "f.json"
    assert bench.main(["--models", "tango,loop", "--device", "cpu", "--size", "tiny", "--block_sizes", "32",
                       "--peak_n", "64", "--json", str(out), "--md", str(tmp_path / "f.md")]) == 1
    assert [r["status"] for r in json.loads(out.read_text())["rows"]] == ["error: exit code 2: x"] * 2
    assert capsys.readouterr().err == "bench.py: error: no configuration completed (each row's status above says why)\n"


def test_cuda_defaults_and_quick_plan(monkeypatch):
    """What a GPU user gets (parsed here with CUDA pretended available; nothing runs)."""
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bench.torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(bench.torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # (--quick's main job check)
    monkeypatch.setattr(bench.torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * 10**9))
    a = bench.parse(["--device", "cuda"])
    assert (a.size, a.block_sizes, a.compile, a.dtype) == ("70M", [2048, 8192], "both", "bfloat16")
    assert a.batch_tokens == 32768 and a.vocab_size == 50257 and (a.steps, a.warmup, a.peak_n, a.peak_reps) == (2, 1, 8192, 10)
    assert (a.flags["window"], a.flags["chunk"], a.flags["gau_s"]) == (256, 256, 128)  # the 70M tier's, as train.py
    assert bench.plan(a) == [(m, c, T) for T in (2048, 8192) for c in (False, True) for m in bench.models.REGISTRY]
    q = bench.parse(["--quick", "--device", "cuda"])
    assert q.batch_tokens == 32768 and q.warmup == 2 and q.steps == 3
    long = [m for m, spec in bench.models.REGISTRY.items() if spec.bench_long]
    assert long[:2] == ["tango", "tango-windowed"] and "loop" in long  # TANGO against Loop Transformer++ at T = 8192
    assert bench.plan(q) == [(m, True, 2048) for m in bench.models.REGISTRY] + [(m, True, 8192) for m in long]


def test_quick_cuda_plan_in_parts(monkeypatch):
    """--quick --device cuda --part i/3: every configuration but Loop Transformer++'s runs in exactly
    one part, each part also runs Loop Transformer++ at its block sizes (its MFU ratios), the main
    job and ReFlux run with the last part only, and each part writes its own default files."""
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bench.torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(bench.torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * 10**9))
    whole = bench.plan(bench.parse(["--quick", "--device", "cuda"]))
    parts = [bench.parse(["--quick", "--device", "cuda", "--part", f"{i}/3"]) for i in (1, 2, 3)]
    plans = [bench.plan(a) for a in parts]
    others = [c for pl in plans for c in pl if c[0] != "loop"]
    assert sorted(others) == sorted(c for c in whole if c[0] != "loop") and len(others) == len(set(others))
    for pl in plans:
        assert [c for c in whole if c in pl] == pl  # in the whole plan's order
        assert {(c, T) for m, c, T in pl if m == "loop"} == {(c, T) for m, c, T in pl if m != "loop"}
        assert 7 <= len(pl) <= 10
    assert [(a.main_job, a.reflux) for a in parts] == [(None, False), (None, False), (bench.MAIN_JOB, True)]
    assert [os.path.basename(a.json) for a in parts] == [f"bench_cuda_part{i}of3.json" for i in (1, 2, 3)]


def test_main_job_vocabulary_source(monkeypatch, tmp_path):
    """The main job's GPT-2 vocabulary: GPT2_BPE_FILE as set; else shared/data/gpt2.tiktoken under
    the repository root (as the device machine's copy holds it), set for the job; else tiktoken's
    download, said so."""
    monkeypatch.setenv("GPT2_BPE_FILE", "/x/gpt2.tiktoken")
    assert bench.main_job_vocabulary() == ({}, "GPT2_BPE_FILE=/x/gpt2.tiktoken (from the environment)")
    monkeypatch.delenv("GPT2_BPE_FILE")
    monkeypatch.setattr(bench, "ROOT", str(tmp_path / "repo"))
    assert bench.main_job_vocabulary()[1].startswith("tiktoken's download (GPT2_BPE_FILE unset")
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "shared" / "data" / "gpt2.tiktoken").write_text("")
    path = str(tmp_path / "shared" / "data" / "gpt2.tiktoken")
    assert bench.main_job_vocabulary() == ({"GPT2_BPE_FILE": path}, f"GPT2_BPE_FILE={path} (found by bench)")


def test_quick_cpu_last_part_runs_its_configurations_and_the_main_job(tmp_path, mdm, data_root):
    """`--quick --device cpu --size tiny --part 3/3` runs its share of the plan (with Loop
    Transformer++ beside it) and the main job, whose row says where the vocabulary comes from."""
    out = tmp_path / "p.json"
    main_job = (f"--model tango --depth 2 --size tiny --block_size 32 --batch_size 2 --dataset dmmath "
                f"--data_dir {mdm} --data_root {data_root}")
    assert bench.main(["--quick", "--device", "cpu", "--size", "tiny", "--part", "3/3", "--json", str(out),
                       "--main_job", main_job]) == 0
    res = json.loads(out.read_text())
    a = bench.parse(["--quick", "--device", "cpu", "--size", "tiny", "--part", "3/3"])
    assert sorted((r["model"], r["T"]) for r in res["rows"]) == sorted((m, T) for m, _, T in bench.plan(a))
    assert all(r["status"] == "ok" and r["attention_work"] is None for r in res["rows"])  # CPU: no fused plan
    assert res["meta"]["part"] == [3, 3] and res["main_job"]["status"] == "ok"
    vocabulary = bench.main_job_vocabulary()[1]
    assert res["main_job"]["vocabulary"] == vocabulary
    assert f"GPT-2 vocabulary (for data that uses it): {vocabulary}." in (tmp_path / "p.md").read_text()


def test_table_prints_the_executed_attention_work_next_to_mfu():
    """A CUDA TANGO row's executed-work ratio (tango_kernels.attention_work) is in its MFU cell,
    with a note under the table; rows without one show MFU alone."""
    rows = [dict(_row("tango", 2048, 1000.0, 10.0, 0.3), attention_work=1.4596), _row("loop", 2048, 1000.0, 10.0, 0.35)]
    bench_report.add_ratios(rows, 1.0)
    text = bench_report.table(rows)
    assert "| 30.0% (work 1.46x) |" in text and "| 35.0% |" in text and "tango_kernels.attention_work" in text


def test_kernel_check_at_a_tiny_size(tmp_path):
    """`python -m tools.bench kernels` on CPU at a tiny size (the stand-ins for the kernels): a row
    per choice and T, each timed, checked against float64 (float32 here: within 1e-5) and with the
    work ratio of tango_kernels.attention_work; the report says the GPU figures are not measured."""
    out = tmp_path / "k.json"
    assert bench.main(["kernels", "--device", "cpu", "--block_sizes", "32,64", "--tokens", "64", "--check_T", "24",
                       "--heads", "2", "--fh", "40", "--window", "8", "--reps", "1", "--json", str(out)]) == 0
    from tools import bench_kernels
    import tango_kernels
    import torch
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * (len(bench_kernels.FULL) + len(bench_kernels.FULL_FLEX) + len(bench_kernels.WINDOWED))
    for r in rows:
        assert r["status"] == "ok" and r["ms"] > 0 and r["check_error"] < 1e-5, r
    r = next(r for r in rows if r["choice"].startswith("windowed") and "32x32" in r["choice"] and r["T"] == 64)
    assert r["work_ratio"] == tango_kernels.attention_work(1, 2, 64, 8, 40, torch.float32)["ratio"]  # tiles 32 x 32
    assert "the GPU figures are not measured here" in (tmp_path / "k.md").read_text()


def test_mfu_of_known_flops_time_and_peak(monkeypatch):
    """MFU = model FLOPs per step / median step time / peak. 6e9 FLOPs in steps of 3, 2 and 10 s
    (median 3 s; the mean, 5 s, or the fastest, 2 s, would give other values) is 2e9 FLOP/s; over a
    1e10 FLOP/s peak, MFU 0.2."""
    row = {"model": "tango", "T": 64, "compile": False, "status": "ok",
           **bench.timing([3.0, 2.0, 10.0], tokens=1000, fl=6e9)}
    assert row["step_s"] == 3.0 and row["achieved_flops_per_s"] == 2e9 and row["tokens_per_s"] == 1000 / 3.0
    bench_report.add_ratios([row], peak=1e10)
    assert row["mfu"] == pytest.approx(0.2, rel=1e-12)


def test_matmul_peak_counts_2_n_cubed_flops_over_the_best_time(monkeypatch):
    """The peak: 2 n^3 FLOPs per n x n matmul (n^3 multiply-adds) over the fastest of the timed reps.
    A clock that makes the three reps take 0.5, 0.25 and 1.0 s gives 2 * 16^3 / 0.25 = 32768 FLOP/s."""
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks))
    assert bench.matmul_peak("cpu", "float32", 16, 3) == 2 * 16 ** 3 / 0.25 == 32768.0


def test_mfu_ratio_is_the_model_over_loop_transformer_pp():
    """mfu_vs_ref = a model's MFU / Loop Transformer++'s at the same T and compile: a model at half
    the reference's achieved FLOP/s has ratio 0.5 (not 2), at another T its own reference counts."""
    rows = [_row("loop", 64, 100, 1, 4e9), _row("tango", 64, 100, 1, 2e9), _row("gau", 64, 100, 1, 6e9),
            _row("loop", 128, 100, 1, 1e9), _row("tango", 128, 100, 1, 2e9)]
    bench_report.add_ratios(rows, peak=1e10)
    assert [r["mfu"] for r in rows] == pytest.approx([0.4, 0.2, 0.6, 0.1, 0.2])
    assert [r["mfu_vs_ref"] for r in rows] == pytest.approx([1.0, 0.5, 1.5, 1.0, 2.0])
    tg = bench_report.targets(rows)["min_mfu_vs_transformer_pp"]
    assert tg["value"] == pytest.approx(0.5) and tg["status"] == "MISS" and "tango" in tg["detail"]
    assert "left out" not in tg["detail"]  # no model's MFU is nominal here
    # the models whose training FLOPs are nominal (flops.TRAIN_FLOPS_NOMINAL): not held to the target
    rows = [_row("loop", 64, 100, 1, 4e9), _row("gau", 64, 100, 1, 6e9),
            *(_row(m, 64, 100, 1, 1e9) for m in sorted(flops.TRAIN_FLOPS_NOMINAL))]
    bench_report.add_ratios(rows, peak=1e10)
    tg = bench_report.targets(rows)["min_mfu_vs_transformer_pp"]
    assert tg["status"] == "PASS" and tg["value"] == pytest.approx(1.5) and set(tg["per_model_min"]) == {"gau"}
    rows = [_row("loop", 64, 100, 1, 4e9), _row("lrt", 64, 100, 1, 1e9)]  # LRT's step is 3 forwards: held to it
    bench_report.add_ratios(rows, peak=1e10)
    assert bench_report.targets(rows)["min_mfu_vs_transformer_pp"]["status"] == "MISS"
    # a row's own flags decide (its "flops_nominal"): LRT with --lrt_detach_init is nominal, PonderLM-2
    # with --no-jacobi_random is not; the table says why under the rows
    rows = [_row("loop", 64, 100, 1, 4e9), {**_row("lrt", 64, 100, 1, 1e9), "flops_nominal": flops.LRT_DETACHED},
            {**_row("ponder", 64, 100, 1, 2e9), "flops_nominal": None}]
    bench_report.add_ratios(rows, peak=1e10)
    tg = bench_report.targets(rows)["min_mfu_vs_transformer_pp"]
    assert tg["value"] == pytest.approx(0.5) and set(tg["per_model_min"]) == {"ponder"}
    assert tg["detail"].endswith("(lrt left out: their MFU is nominal, not comparable)")
    assert bench_report.table(rows).splitlines()[-2:] == [
        "", f"lrt: MFU from the forward formula, but {flops.LRT_DETACHED}; not comparable with the other rows."]


@pytest.mark.parametrize("model,flags,why", [
    ("parcae", [], flops.TRAIN_FLOPS_NOMINAL["parcae"]), ("ponder", [], flops.TRAIN_FLOPS_NOMINAL["ponder"]),
    ("ponder", ["--no-jacobi_random"], None), ("ponder", ["--n_thoughts", "0"], None), ("lrt", [], None), ("lrt", ["--lrt_detach_init"], flops.LRT_DETACHED),
    ("lrt-think", ["--lrt_detach_init"], flops.LRT_DETACHED), ("tango", [], None)])
def test_a_bench_row_records_whether_its_mfu_is_nominal(model, flags, why):
    """bench.child's row records flops.train_flops_nominal of the config it timed (its own flags)."""
    a = bench.parse(["--models", model, "--size", "tiny", "--depth", "2", "--block_sizes", "16", "--vocab_size", "64",
                     "--batch_tokens", "32", "--steps", "1", "--warmup", "1", *flags])
    row = bench.child(bench.config_spec(a, model, False, 16, 1))
    assert row["flops_nominal"] == why


# ----------------------------------------------------------------------------- the model train.py builds, flags

from checks import first_readers  # noqa: E402
from test_flops import flags_for, train_py_config  # noqa: E402  (train.py's own resolution, for comparison)


@pytest.mark.parametrize("size, flags", [("tiny", []), ("cpu", []), ("cpu", ["--chunk", "16", "--window", "8"]),
                                         ("tiny", ["--width", "256", "--gau_s", "64", "--n_core", "3"])])
@pytest.mark.parametrize("model", first_readers("window", "chunk", "gau_s", "n_core"))
def test_bench_times_the_model_train_py_builds(model, size, flags, tmp_path):
    """A configuration's model is the one `train.py --model M --size S --depth 4 --block_size T`
    builds with the same flags: the tier's W, C and s, not ModelConfig's defaults (at --size cpu,
    T = 256, those would time FLASH as one quadratic chunk where training uses C = 64)."""
    a = bench.parse(["--models", model, "--size", size, "--depth", "4", "--block_sizes", "128,256", "--vocab_size", "100",
                     *flags_for(model, flags)])
    for T in (128, 256):
        cfg = bench.child_config(bench.config_spec(a, model, False, T, 1))
        assert cfg.to_dict() == train_py_config(model, size, 4, T, 100, tmp_path, *flags_for(model, flags)).to_dict()


@pytest.mark.parametrize("size, flags", [("tiny", []), ("cpu", ["--chunk", "16"])])
def test_bench_decode_builds_the_model_train_py_builds(size, flags, tmp_path):
    """tools.bench decode times train.py's model at the tier's --block_size (128 here) with the same
    flags, not ModelConfig's W = C = 256, s = 128 at block size prompt + tokens."""
    from tools import bench_decode
    for model in first_readers("chunk", "gau_s", "n_core"):
        given = dict(zip((f[2:] for f in flags_for(model, flags)[::2]), map(int, flags_for(model, flags)[1::2])))
        row = bench_decode.decode_row(model, size, 2, 0, 2, 1, 0, vocab_size=100, **given)
        cfg = train_py_config(model, size, 2, 128, 100, tmp_path, *flags_for(model, flags))
        assert row["config"] == cfg.to_dict() and row["width"] == cfg.width, model


def test_bench_decode_shows_n_core_only_for_the_models_that_read_it():
    """n_core is a column of the decode table; a model without the flag (tango, ponder) shows "-"
    (None in the JSON row), not ModelConfig's unused default."""
    from tools import bench_decode
    reads, other = first_readers("n_core")
    rows = [bench_decode.decode_row(reads, "tiny", 2, 0, 2, 1, 0, vocab_size=50, n_core=3),
            bench_decode.decode_row(other, "tiny", 2, 0, 2, 1, 0, vocab_size=50)]
    assert [r["n_core"] for r in rows] == [3, None]
    table = bench_decode.decode_table(rows).splitlines()
    assert table[2].startswith(f"| {reads} | 2 | 3 | ") and table[3].startswith(f"| {other} | 2 | - | "), table


def test_eager_rows_show_no_compile_figures():
    """compile s and recompiles describe compiled rows; an eager row's table cells are "-" (its JSON
    keeps compile_s 0 and the graph count it measured)."""
    eager = {**_row("loop", 64, 100, 1, 4e9), "first_step_s": 1.5, "compile_s": 0.0, "recompiles": 0}
    compiled = {**eager, "compile": True, "compile_s": 12.3, "recompiles": 1}
    bench_report.add_ratios([eager, compiled], peak=1e10)
    lines = bench_report.table([eager, compiled]).splitlines()
    assert lines[2].endswith("| 1.5 | - | - |") and lines[3].endswith("| 1.5 | 12.3 | 1 |"), lines


def test_cpugrid_bench_commands_build_flash_with_the_grids_chunk():
    """The two tools.bench commands of results/cpugrid/README.md (--size cpu, T = 256) parse and
    build every model as the grid's train.py runs did: FLASH with chunk 64, not 256."""
    import shlex
    with open(os.path.join(bench.ROOT, "results", "cpugrid", "README.md")) as f:
        lines = [ln for ln in f.read().splitlines() if ln.startswith("OMP_NUM_THREADS=2 python -m tools.bench ")]
    assert len(lines) == 2
    for line in lines:
        a = bench.parse(shlex.split(line)[4:])
        cfgs = {m: bench.child_config(bench.config_spec(a, m, False, 256, 2)) for m in a.models}
        assert (cfgs["flash"].chunk, cfgs["flash"].gau_s, cfgs["tango-windowed"].window) == (64, 128, 64)
        assert a.json.startswith("results/cpugrid/") and a.md.startswith("results/cpugrid/")


BAD_BENCH = [  # (argv, the one-line error after "bench.py: error: " / "bench.py decode: error: ")
    (["--vocab_size", "0"], "--vocab_size 0: must be >= 1"), (["--steps", "0"], "--steps 0: must be >= 1"),
    (["--peak_n", "0"], "--peak_n 0: must be >= 1"), (["--batch_tokens", "0"], "--batch_tokens 0: must be >= 1"),
    (["--warmup", "0"], "--warmup 0: must be >= 1"), (["--rounds", "0"], "--rounds 0: must be >= 1"),
    (["--depth", "0"], "--depth 0: must be >= 1"), (["--peak_reps", "-1"], "--peak_reps -1: must be >= 1"),
    (["--threads", "-1"], "--threads -1: must be >= 0"),
    (["--block_sizes", f"64,{2**64}"], f"--block_sizes {2**64}: beyond a 64-bit integer (at most 2**63 - 1)"),
    (["--timeout", "-1"], "--timeout -1.0: must be a finite number of seconds > 0"),
    (["--step_budget", "inf"], "--step_budget inf: must be a finite number of seconds > 0"),
    (["--block_sizes", "0,64"], "--block_sizes: need positive integers"),
    (["--device", "foo"], "--device foo: use auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:0"], "--device cuda:0: CUDA is not available on this machine; use --device cpu"),
    (["--models", "tango-windowed", "--window", "0"], "--window 0: must be >= 1"),
    (["--models", "flash", "--chunk", "0"], "--chunk 0: must be >= 1"),
    (["--models", "gau", "--gau_s", "16"], "--gau_s 16: must be a positive multiple of 32"),
    (["--models", "loop", "--width", "-8"], "--width -8: must be a positive multiple of 8"),
    (["--models", "loop", "--chunk", "8"], "--chunk: only used with --model flash; none of the models run (loop)"),
    (["--models", "tango-3set", "--depth", "2"], "--depth 2: --model tango-3set needs depth >= 3"),
    (["--quick", "--block_sizes", "64"], "--block_sizes: --quick runs its own plan"),
    (["--quick", "--compile", "on"], "--compile: --quick runs its own plan"),
    (["decode", "--prompt", "0"], "--prompt 0: must be >= 1"), (["decode", "--tokens", "0"], "--tokens 0: must be >= 1"),
    (["decode", "--warmup", "-1"], "--warmup -1: must be >= 0"), (["decode", "--vocab_size", "0"], "--vocab_size 0: must be >= 1"),
    (["decode", "--threads", "-1"], "--threads -1: must be >= 0"), (["decode", "--depth", "0"], "--depth 0: must be >= 1"),
    (["decode", "--block_size", "0"], "--block_size 0: must be >= 1"), (["decode", "--n_core", "0"], "--n_core 0: must be >= 1"),
    (["decode", "--fold", "0"], "--fold 0: must be >= 1"), (["decode", "--width", "-8"], "--width -8: must be a positive"),
    (["decode", "--device", "foo"], "--device foo: use auto, cpu, cuda or cuda:N"),
    (["decode", "--chunk", "8"], "--chunk: only used with --model flash"),
    (["decode", "--models", "flash", "--chunk", "0"], "--chunk 0: must be >= 1"),
    (["--json", "."], "--json .: is a folder; give a file path"),
    (["decode", "--json", "."], "--json .: is a folder; give a file path"),
    (["--json", ""], '--json "": an empty path; give a file path'),  # not the default path
    (["--md", ""], '--md "": an empty path; give a file path'),
    (["decode", "--json", ""], '--json "": an empty path; give a file path'),
    (["--block_sizes", ""], "--block_sizes: need positive integers"),  # not the default sizes
    (["--compile_backend", "bogus", "--compile", "on"], "--compile_backend bogus: not a torch.compile backend (e.g. "),
    (["--compile_backend", "eager", "--compile", "off"], "--compile_backend: only used with --compile on or both"),
    (["--main_job", "--model nope"], "--main_job '--model nope': --model: unknown model 'nope'; choose one of tango,"),
    (["--main_job", "--depth 0"], "--main_job '--depth 0': --depth 0: must be >= 1"),
    (["--main_job", "--start 'x"], "--main_job \"--start 'x\": No closing quotation"),
    (["--part", "0/3"], "--part 0/3: give i/n with 1 <= i <= n (e.g. 1/3)"),
    (["kernels", "--reps", "0"], "--reps 0: must be >= 1"), (["kernels", "--block_sizes", "64", "--tokens", "32"],
                                                          "--block_sizes 64: positive integers, each at most --tokens 32"),
    (["--part", "4/3"], "--part 4/3: give i/n with 1 <= i <= n"), (["--part", "x"], "--part x: give i/n"),
    (["--models", "tango,loop", "--block_sizes", "64", "--part", "1/2"],
     "--part 1/2: the plan has 1 configurations besides Loop Transformer++; use n <= 1"),
]


@pytest.mark.parametrize("argv, message", BAD_BENCH)
def test_bad_values_are_one_line_errors_and_nothing_is_written(argv, message, tmp_path, monkeypatch, capsys):
    """--vocab_size 0 ran with 50257, --steps/--peak_n/--batch_tokens 0 with their defaults, --device
    foo ended in a RuntimeError traceback: every numeric flag of tools.bench and tools.bench decode
    out of range is one line naming it and what is allowed, exit code 2, before anything is written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    out, err = capsys.readouterr()
    prog = {"decode": "bench.py decode", "kernels": "bench.py kernels"}.get(argv[0], "bench.py")
    assert e.value.code == 2 and out == "" and err.count("\n") == 1, (e.value.code, out, err)
    assert err.startswith(f"{prog}: error: {message}"), err
    assert os.listdir(tmp_path) == []


def test_default_outputs_go_to_the_ignored_out_folder(tmp_path, monkeypatch, capsys):
    """Without --json/--md the outputs are out/bench/{bench,decode}_<device>.{json,md} (out/ is
    git-ignored), so following docs/benchmarks.md leaves results/ as it is."""
    with open(os.path.join(bench.ROOT, ".gitignore")) as f:
        assert "out/" in f.read().split()
    a = bench.parse(["--models", "loop"])
    assert (a.json, a.md) == (os.path.join("out", "bench", "bench_cpu.json"), os.path.join("out", "bench", "bench_cpu.md"))
    monkeypatch.chdir(tmp_path)
    assert bench.main(["decode", "--models", "loopstack", "--size", "tiny", "--depth", "2", "--prompt", "2",
                       "--tokens", "1", "--warmup", "0", "--vocab_size", "64"]) == 0
    assert os.listdir(tmp_path) == ["out"]
    assert sorted(os.listdir(tmp_path / "out" / "bench")) == ["decode_cpu.json", "decode_cpu.md"]
    md = (tmp_path / "out" / "bench" / "decode_cpu.md").read_text()
    assert "tier tiny, T=128, V=64, train.py's default model flags, batch 1" in md and "Note" not in md
    # past the trained context: the note sample.py gives, on stderr and under the table
    assert bench.main(["decode", "--models", "loopstack", "--size", "tiny", "--depth", "2", "--prompt", "127",
                       "--tokens", "2", "--warmup", "1", "--vocab_size", "64", "--block_size", "128"]) == 0
    md = (tmp_path / "out" / "bench" / "decode_cpu.md").read_text()
    note = ("note: 127 prompt + 3 new tokens exceed the trained context of 128 by more than the last token: the later "
            "tokens are decoded at positions never trained on")
    assert capsys.readouterr().err.splitlines() == [note] and md.endswith("\nN" + note[1:] + ".\n")


def test_child_error_drops_the_childs_own_prefix():
    """A configuration's status says "error: " once (it read "error: error: out of memory ...")."""
    from tools import bench
    assert [bench.child_error(x) for x in ("error: out of memory (4 GB)", "bench.py: error: x", "exit code 3",
                                           "RuntimeError: error: y")] == \
        ["out of memory (4 GB)", "x", "exit code 3", "RuntimeError: error: y"]
