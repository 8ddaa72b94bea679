"""Tests for train.py and its helpers (checkpoint.py, config.py, datacheck.py, evaluation.py):
exact resume, safe checkpoints, clear errors, DDP on CPU. The runs use a tiny DeepMind-Mathematics-
shaped dataset (~20 characters), so an update takes milliseconds; only torchrun and one bad input
run as subprocesses, the resume runs and the catalogue of bad inputs call train.main in-process.
"""
import argparse
import contextlib
import copy
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness import checkpoint, evaluation
import data as data_mod
import train
import harness.cli
from common import ModelConfig
from harness.cli import run_command
from harness import config as harness_config
from harness.config import resolve_args
from harness.optim import Schedule
from models import build_model, model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BPE = os.environ.get("GPT2_BPE_FILE") or os.path.join(REPO, "..", "shared", "data", "gpt2.tiktoken")
TINY = ["--model", "loop", "--depth", "2", "--block_size", "32", "--batch_size", "2", "--eval_windows", "6",
        "--eval_batch_size", "4", "--sample_tokens", "5", "--em_samples", "3", "--quiet"]


# fixtures of tests/conftest.py: mdm (a mini DeepMind Mathematics dataset; every 32-token window has
# scored answer targets), data_root (mdm prepared once) and one_thread
pytestmark = pytest.mark.usefixtures("one_thread")


def flags(mdm, data_root, out_dir, *extra):
    return [*TINY, "--dataset", "dmmath", "--data_dir", str(mdm), "--data_root", str(data_root),
            "--out_dir", str(out_dir), *extra]


def run_train(argv, env_extra=None, torchrun=0, check=True, timeout=300):
    """train.py in a fresh process (torchrun > 0: that many processes under torchrun, gloo)."""
    env = {**os.environ, "GPT2_BPE_FILE": BPE, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    launcher = [sys.executable]
    if torchrun:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(torchrun)]
    p = subprocess.run([*launcher, os.path.join(REPO, "train.py"), *argv], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=timeout)
    if check:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def call_main(argv, capsys):
    """train.main in this process; returns (exit code, stderr)."""
    capsys.readouterr()
    try:
        train.main(argv)
    except SystemExit as e:
        return e.code, capsys.readouterr().err
    return 0, capsys.readouterr().err


def records(out_dir, event):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["event"] == event]


def dump(prefix, rank=0):
    with open(f"{prefix}.rank{rank}.jsonl") as f:
        return [json.loads(line) for line in f]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def snapshot(folder):
    """{relative path: sha256} of every file under folder (None if it does not exist)."""
    if not os.path.exists(folder):
        return None
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


# ----------------------------------------------------------------------------- schedule, sampling

def Sched(lr=1e-3, warm=10, total=100, decay=None, floor=0.1):
    return Schedule(learning_rate=lr, warmup_iters=warm, max_iters=total, lr_decay_iters=decay or total,
                    min_lr_ratio=floor)


def test_lr_schedule_edges():
    assert 0 < Sched(warm=0).lr_at(0) == 1e-3  # no warmup: the peak from update 0
    assert 0 < Sched(warm=10).lr_at(0) < 1e-3
    for warm in (99, 100, 150):  # warmup as long as (or longer than) the schedule: no division by zero
        lrs = [Sched(warm=warm).lr_at(i) for i in range(100)]
        assert all(0 < x <= 1e-3 for x in lrs) and lrs == sorted(lrs)
    assert Sched(warm=0, total=1).lr_at(0) == 1e-3
    s = Sched(warm=2, total=6, decay=12)  # stopping early keeps the longer schedule
    assert [s.lr_at(i) for i in range(6)] == [Sched(warm=2, total=12).lr_at(i) for i in range(6)]
    assert Sched(warm=2, total=12).lr_at(11) == pytest.approx(1e-4)
    assert Sched(warm=2, total=12).lr_at(50) == pytest.approx(1e-4)  # constant after the decay
    # a schedule no longer than its warmup (a short run resumed with a larger --max_iters): the
    # floor after the warmup, as after any decay, whether it ends at the warmup or just after it
    for decay in (5, 10):
        assert Sched(warm=10, total=20, decay=decay).lr_at(10) == pytest.approx(1e-4)
    assert [Sched(warm=10, total=20, decay=11).lr_at(i) for i in (10, 11, 15)] == pytest.approx([1e-3, 1e-4, 1e-4])
    # literal values: warmup (it + 1) / (warm + 1) of the peak, then the cosine from the peak
    assert [Sched(warm=3, total=7).lr_at(i) for i in range(8)] == pytest.approx(
        [0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 0.775e-3, 0.325e-3, 0.1e-3, 0.1e-3])  # cos 0, pi/3, 2pi/3, pi


def test_a_run_inside_its_warmup_says_so(mdm, data_root, tmp_path):
    """--warmup_iters >= --max_iters: one note with the last update's fraction of the peak (3 of 5 + 1
    warmup steps: 0.50); one update past the warmup: the run ends at the peak, no decay (it said
    nothing); none for a run with a cosine."""
    out = main_in_process(flags(mdm, data_root, tmp_path / "a", "--max_iters", "3", "--warmup_iters", "5"))
    assert "note: --warmup_iters 5 >= --max_iters 3: the run ends inside the warmup, its last update at 0.50 x " \
           "--learning_rate (no decay)" in out.splitlines()
    out = main_in_process(flags(mdm, data_root, tmp_path / "c", "--max_iters", "3", "--warmup_iters", "3"))
    assert "note: --warmup_iters 3 >= --max_iters 3: the run ends inside the warmup, its last update at 0.75 x " \
           "--learning_rate (no decay)" in out.splitlines()
    out = main_in_process(flags(mdm, data_root, tmp_path / "b", "--max_iters", "3", "--warmup_iters", "2"))
    assert [ln for ln in out.splitlines() if ln.startswith("note:")] == [
        "note: --lr_decay_iters 3 (its default, --max_iters) ends one update after the warmup (--warmup_iters 2): no "
        "cosine; the rate rises to 1.00 x --learning_rate at update 3, where the run ends (no decay)"]
    out = main_in_process(flags(mdm, data_root, tmp_path / "d", "--max_iters", "4", "--warmup_iters", "1"))
    assert "note:" not in out


def test_sample_starts_is_data_train_batch(data_root):
    d = data_mod.Data(str(next(data_root.iterdir())))
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    for _ in range(3):
        x, y = d.train_batch(a, 4, 32)
        x2, y2 = d.window_batch("train", train.sample_starts(b, len(d.tokens("train")), 4, 32), 32)
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_accumulation_averages_micro_batches_and_clips_once(data_root):
    """The update follows the gradient of the NLL summed over every scored target of the update
    divided by their count, clipped once on its total norm; that is the returned (logged) loss."""
    d = data_mod.Data(str(next(data_root.iterdir())))
    torch.manual_seed(0)
    model = build_model(ModelConfig(model="loop", depth=1, width=32, vocab_size=d.vocab_size, n_embd=64,
                                    n_head=2, block_size=32))
    starts = [np.array([0, 100]), np.array([200, 300]), np.array([400, 500])]
    ref, nll, count = copy.deepcopy(model), 0.0, 0
    for s in starts:
        x, y = d.window_batch("train", s, 32)
        loss = torch.nn.functional.cross_entropy(ref(x)[0].flatten(0, 1), y.flatten(), ignore_index=-1,
                                                 reduction="sum")
        loss.backward()
        nll, count = nll + loss.item(), count + int((y != -1).sum())
    assert len({int((d.window_batch("train", s, 32)[1] != -1).sum()) for s in starts}) > 1  # unequal counts
    mean_grad = [p.grad / count for p in ref.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in mean_grad])).item()
    for clip in (1e9, norm / 4):
        m = copy.deepcopy(model)
        r = SimpleNamespace(args=SimpleNamespace(device="cpu", block_size=32, grad_clip=clip, seed=0), dist=train.Dist(),
                            data=d, model=m, train_model=m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0),
                            ctx=contextlib.nullcontext(), it=0, latest_path="unused")
        loss, grad_norm = train.train_update(r, starts)
        assert loss == pytest.approx(nll / count, rel=1e-6) and grad_norm == pytest.approx(norm, rel=1e-5)
        scale = min(1.0, clip / (norm + 1e-6))
        for p0, p1, g in zip(model.parameters(), m.parameters(), mean_grad):
            assert torch.allclose(p0 - p1, g * scale, rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------------------- exact resume

def main_in_process(argv, dump=None):
    """train.main in this process (TRAIN_DEBUG_DUMP=dump if given); returns its stdout."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        if dump:
            mp.setenv("TRAIN_DEBUG_DUMP", dump)
        try:
            train.main([str(a) for a in argv])
        except SystemExit as e:
            raise AssertionError(f"train.py exited with {e.code}: {out.getvalue()[-2000:]}") from None
    return out.getvalue()


@pytest.fixture(scope="module")
def runs(mdm, data_root, tmp_path_factory):
    """A: 6 updates. B: 3 updates with A's schedule (--lr_decay_iters 6), then --resume to 6.
    C: A again. D: another model seed, same data seed. All with accumulation 2, evals at 3 and 6.
    In this process: setup() seeds every RNG, so runs do not depend on what ran before."""
    root = tmp_path_factory.mktemp("runs")
    common = ["--gradient_accumulation_steps", "2", "--warmup_iters", "2", "--eval_interval", "3"]
    out = {k: root / k for k in "ABCD"}
    dumps = {k: str(root / f"dump{k}") for k in "AB"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        main_in_process(flags(mdm, data_root, out["A"], *common, "--max_iters", "6"), dumps["A"])
        main_in_process(flags(mdm, data_root, out["B"], *common, "--max_iters", "3", "--lr_decay_iters", "6"),
                        dumps["B"])
        resumed = main_in_process(flags(mdm, data_root, out["B"], "--resume", "--max_iters", "6"), dumps["B"])
        main_in_process(flags(mdm, data_root, out["C"], *common, "--max_iters", "6"))
        main_in_process(flags(mdm, data_root, out["D"], *common, "--max_iters", "6", "--seed", "7",
                              "--data_seed", "1337"))
    finally:
        torch.set_num_threads(threads)
    return dict(out=out, dumps=dumps, resumed=SimpleNamespace(stdout=resumed))


def test_resume_equals_uninterrupted_run(runs):
    A, B = runs["out"]["A"], runs["out"]["B"]
    assert "resumed from" in runs["resumed"].stdout and "--max_iters 3 -> 6" in runs["resumed"].stdout
    assert "note: the learning-rate schedule ends" not in runs["resumed"].stdout  # --lr_decay_iters 6 covers it
    ta, tb = records(A, "train"), records(B, "train")
    assert [r["iter"] for r in tb] == list(range(1, 7))
    for key in ("loss", "lr", "grad_norm"):  # bit-identical (CPU fp32, no compile)
        assert [r[key] for r in ta] == [r[key] for r in tb], key
    assert records(A, "eval") == records(B, "eval")
    # the same windows in the same order, and the same final state
    assert [r["starts"] for r in dump(runs["dumps"]["A"])] == [r["starts"] for r in dump(runs["dumps"]["B"])]
    ca, cb = load(A / "ckpt_latest.pt"), load(B / "ckpt_latest.pt")
    assert all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"])
    for sa, sb in zip(ca["optimizer"]["state"].values(), cb["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert ca["rng"]["numpy"] == cb["rng"]["numpy"] and ca["iter"] == cb["iter"] == 6
    # the learning rate of the first update after the resume is the uninterrupted run's
    assert tb[3]["lr"] == Sched(lr=4e-3, warm=2, total=6).lr_at(3)  # the cpu tier's peak


def test_same_seed_same_log_other_seed_differs(runs):
    A, C, D = (runs["out"][k] for k in "ACD")
    strip = lambda recs: [{k: v for k, v in r.items() if k != "tok_per_s"} for r in recs]
    assert strip(records(A, "train")) == strip(records(C, "train"))
    assert records(A, "eval") == records(C, "eval")
    assert [r["loss"] for r in records(A, "train")] != [r["loss"] for r in records(D, "train")]
    ca, cd = load(A / "ckpt_latest.pt"), load(D / "ckpt_latest.pt")
    assert (ca["seed"], ca["data_seed"], cd["seed"], cd["data_seed"]) == (1337, 1337, 7, 1337)
    assert ca["rng"]["numpy"] == cd["rng"]["numpy"]  # paired: the same data order


def test_checkpoint_contents(runs):
    A = runs["out"]["A"]
    latest, best = load(A / "ckpt_latest.pt"), load(A / "ckpt_best.pt")  # weights_only=True
    assert set(checkpoint.TRAINING_KEYS) <= set(latest) and "optimizer" not in best
    evals = records(A, "eval")
    assert latest["best_dev"] == min(r["dev_nll"] for r in evals)
    assert best["dev_nll"] == latest["best_dev"] and best["iter"] == min(evals, key=lambda r: r["dev_nll"])["iter"]
    assert latest["data"]["tokenizer"] == "char" and len(latest["data"]["itos"]) == latest["config"]["vocab_size"]
    for ck in (latest, best):
        assert not any(k.startswith(("_orig_mod.", "module.")) for k in ck["model"])
        assert all(t.device.type == "cpu" for t in ck["model"].values())
    state = latest["rng"]
    assert isinstance(state["python"], list) and state["numpy"]["bit_generator"] == "PCG64"
    assert torch.is_tensor(state["torch"])


def test_clean_state_dict_strips_wrappers():
    model = build_model(ModelConfig(model="loop", depth=1, width=16, vocab_size=11, n_embd=64, n_head=2))

    class Wrapper(torch.nn.Module):  # the shape of DDP: the model under .module
        def __init__(self, m):
            super().__init__()
            self.module = m

    wrapped = Wrapper(torch.compile(model))  # torch.compile wraps lazily: nothing compiles here
    assert all(k.startswith("module._orig_mod.") for k in wrapped.state_dict())
    assert list(checkpoint.clean_state_dict(wrapped)) == list(model.state_dict())
    assert list(checkpoint.strip_prefixes(wrapped.state_dict())) == list(model.state_dict())


def test_a_resumed_log_keeps_only_what_the_resumed_run_does_not_write_again(tmp_path):
    """trim_log at update 4: the records of updates after 4 and the old finish's summary and depth
    sweep (of the old best checkpoint; flops_fit would pair that sweep with the new summary) go; a
    line cut short by a crash and a line that is not a record are dropped."""
    recs = ([{"event": "start", "args": {}}] + [{"event": "train", "iter": i} for i in range(1, 7)]
            + [{"event": "eval", "iter": 4}, {"event": "eval", "iter": 6}, {"event": "depth_sweep", "dev_nll": [1.0]},
               {"event": "summary", "dev_nll": 1.0}])
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + "[1, 2]\n" + '{"event": "tra')
    checkpoint.trim_log(str(path), 4)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == recs[:5] + [{"event": "eval", "iter": 4}]


def test_resumed_run_never_overwrites_a_better_best(runs, mdm, data_root, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(runs["out"]["A"], out)
    best = load(out / "ckpt_best.pt")
    best["dev_nll"] = 0.01  # a best no later evaluation can beat
    checkpoint.save_atomic(best, str(out / "ckpt_best.pt"))
    before = snapshot(out)["ckpt_best.pt"]
    code, err = call_main(flags(mdm, data_root, out, "--resume", "--max_iters", "9"), capsys)
    assert code == 0, err
    assert snapshot(out)["ckpt_best.pt"] == before
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_iter"] == best["iter"] and summary["dev_nll"] == 0.01
    assert best["iter"] < 9 and summary["tokens"] == best["iter"] * 2 * 2 * 32  # the best's tokens, not the last's
    assert [r["iter"] for r in records(out, "train")] == list(range(1, 10))
    assert load(out / "ckpt_latest.pt")["best_dev"] == 0.01


def test_a_resume_trains_with_its_own_weight_decay(runs, mdm, data_root, tmp_path):
    """--weight_decay given on --resume is the one the optimizer uses (load_state_dict would bring
    back the checkpoint's), with the checkpoint's moments; without it, the checkpoint's value."""
    out = tmp_path / "out"
    shutil.copytree(runs["out"]["A"], out)
    saved = load(out / "ckpt_latest.pt")["optimizer"]
    for extra, decay in (([], 0.1), (["--weight_decay", "0.02"], 0.02)):
        argv = flags(mdm, data_root, out, "--resume", "--max_iters", "7", *extra)
        with contextlib.ExitStack() as held:  # (the run's hold of out_dir, released after the checks)
            r, _, changed = train.setup(train.parse_args(argv), train.given_flags(argv), held)
        assert [g["weight_decay"] for g in r.optimizer.param_groups] == [decay, 0.0]
        assert changed == ({"max_iters": [6, 7]} | ({"weight_decay": [0.1, 0.02]} if extra else {}))
        moments = r.optimizer.state_dict()["state"]
        assert all(torch.equal(moments[i][k], saved["state"][i][k]) for i in saved["state"] for k in saved["state"][i])


def test_an_extended_run_is_unfinished_until_it_finishes(runs, mdm, data_root, tmp_path, monkeypatch):
    """A finished run resumed with a larger --max_iters and stopped before its end has no
    summary.json (tools.sweep counts a folder with one as done; it held the old best's numbers);
    stopped before its first update, it leaves the folder as it was (Log)."""
    out = tmp_path / "out"
    shutil.copytree(runs["out"]["A"], out)
    assert (out / "summary.json").exists()
    before = snapshot(out)

    def stop(*a):
        raise KeyboardInterrupt
    argv = flags(mdm, data_root, out, "--resume", "--max_iters", "9")
    with monkeypatch.context() as m:
        m.setattr(train, "train_loop", stop)  # before the first update
        with pytest.raises(KeyboardInterrupt, match="the last good checkpoint is .*update 6"):
            train.run(train.parse_args(argv), train.given_flags(argv))
    assert snapshot(out) == before
    monkeypatch.setattr(train, "eval_and_checkpoint", stop)  # after it
    with pytest.raises(KeyboardInterrupt):
        train.run(train.parse_args(argv), train.given_flags(argv))
    assert not (out / "summary.json").exists() and (out / "ckpt_latest.pt").exists()
    assert [r["resumed_at"] for r in records(out, "start")] == [0, 6]  # the run's start and this resume's


def test_gpu_checkpoint_resumes_on_cpu(runs, mdm, data_root, tmp_path, capsys):
    """What a CUDA run saves (a CUDA RNG state, device/dtype/compile args, here also old-style
    _orig_mod. names) resumes on a CPU-only machine: machine flags (--device, --compile) are not
    taken from the checkpoint; --dtype, the run's numerics, is (bfloat16 autocast runs on a CPU too)."""
    out = tmp_path / "out"
    shutil.copytree(runs["out"]["A"], out)
    ck = load(out / "ckpt_latest.pt")
    ck["rng"]["cuda"] = torch.zeros(16, dtype=torch.uint8)
    ck["args"].update(device="cuda:0", dtype="bfloat16", compile=True)
    ck["model"] = {"_orig_mod." + k: v for k, v in ck["model"].items()}
    torch.save(ck, out / "ckpt_latest.pt")
    code, err = call_main(flags(mdm, data_root, out, "--resume", "--max_iters", "7"), capsys)
    assert code == 0, err
    args = records(out, "start")[-1]["args"]
    assert (args["device"], args["dtype"], args["compile"]) == ("cpu", "bfloat16", False)
    assert [r["iter"] for r in records(out, "train")] == list(range(1, 8))
    assert not any(k.startswith("_orig_mod.") for k in load(out / "ckpt_latest.pt")["model"])


def test_resume_keeps_the_sequences_per_update(runs, mdm, data_root, tmp_path, capsys):
    """--resume may split an update's sequences otherwise (--batch_size 4 x accumulation 1 for the
    run's 2 x 2) but not change their number: the summary's token count is updates x tokens per
    update. Another product is one line naming both flags, exit 2, nothing written."""
    out = tmp_path / "out"
    shutil.copytree(runs["out"]["A"], out)
    before = sorted(os.listdir(out)), (out / "log.jsonl").read_bytes()
    code, err = call_main(flags(mdm, data_root, out, "--resume", "--max_iters", "8", "--batch_size", "4"), capsys)
    assert (code, err) == (2, f"error: --batch_size 4 x --gradient_accumulation_steps 2: the checkpoint in {out} "
                              "was trained with 2 x 2 = 4 sequences per update; keep that product to resume it\n")
    assert (sorted(os.listdir(out)), (out / "log.jsonl").read_bytes()) == before
    code, err = call_main(flags(mdm, data_root, out, "--resume", "--max_iters", "8", "--batch_size", "4",
                                "--gradient_accumulation_steps", "1"), capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] == summary["best_iter"] * 4 * 32
    assert records(out, "start")[-1]["resume_overrides"]["gradient_accumulation_steps"] == [2, 1]


def test_checkpoint_from_before_chunk_and_gau_s_flags_resumes(runs, mdm, data_root, tmp_path, capsys):
    """Checkpoints written before --chunk/--gau_s existed have them only in the model config (then
    fixed at 256/128); --resume takes them from there instead of the tier's new defaults."""
    out = tmp_path / "out"
    shutil.copytree(runs["out"]["A"], out)
    ck = load(out / "ckpt_latest.pt")
    del ck["args"]["chunk"], ck["args"]["gau_s"]
    ck["config"].update(chunk=256, gau_s=128)
    torch.save(ck, out / "ckpt_latest.pt")
    best = load(out / "ckpt_best.pt")
    best["config"].update(chunk=256, gau_s=128)
    torch.save(best, out / "ckpt_best.pt")
    code, err = call_main(flags(mdm, data_root, out, "--resume", "--max_iters", "7"), capsys)
    assert code == 0, err
    args = records(out, "start")[-1]["args"]
    assert (args["chunk"], args["gau_s"]) == (256, 128)
    assert load(out / "ckpt_latest.pt")["config"]["chunk"] == 256


def test_resumed_run_wall_time_counts_the_time_before_the_resume(runs, mdm, data_root, tmp_path):
    """summary.json's wall_s of a resumed run is the checkpoint's stored training time plus this
    process's; a checkpoint without it (written before it was stored) gives this process's only,
    marked as such. A fresh run's summary has resumed_at None and its checkpoint its wall time."""
    fresh = json.loads((runs["out"]["A"] / "summary.json").read_text())
    latest = load(runs["out"]["A"] / "ckpt_latest.pt")
    assert fresh["resumed_at"] is None and "wall_s_this_process_only" not in fresh
    assert 0 < latest["wall_s"] <= fresh["wall_s"]
    for stored in (1000.0, None):
        out = tmp_path / f"out{stored}"
        shutil.copytree(runs["out"]["A"], out)
        ck = load(out / "ckpt_latest.pt")
        if stored is None:
            del ck["wall_s"]
        else:
            ck["wall_s"] = stored
        torch.save(ck, out / "ckpt_latest.pt")
        t0 = time.time()
        stdout = main_in_process(flags(mdm, data_root, out, "--resume", "--max_iters", "7"))
        took = time.time() - t0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["resumed_at"] == 6
        assert ("note: the learning-rate schedule ends at update 6 (--lr_decay_iters); the updates after it, to "
                "--max_iters 7, run at its floor (0.1 x --learning_rate); give --lr_decay_iters to lengthen it") in stdout
        printed = next(ln for ln in stdout.splitlines() if ln.startswith("wall time"))
        assert printed == f"wall time                {summary['wall_s']:.0f} s (resumed at update 6; " + (
            "this process only: the checkpoint did not record the time before)" if stored is None else "all processes)")
        if stored is None:
            assert summary["wall_s_this_process_only"] is True and 0 < summary["wall_s"] <= took
        else:
            assert "wall_s_this_process_only" not in summary and stored < summary["wall_s"] <= stored + took
            assert stored < load(out / "ckpt_latest.pt")["wall_s"] <= summary["wall_s"]


def test_checkpoint_with_the_removed_kl_fields_resumes(runs, mdm, data_root, tmp_path, capsys):
    """Checkpoints from when --kl_threshold and ModelConfig.kl_exit/kl_threshold existed (they
    changed nothing) resume; the dead fields are dropped, an unknown field is still an error."""
    out = tmp_path / "out"
    shutil.copytree(runs["out"]["A"], out)
    for name in ("ckpt_latest.pt", "ckpt_best.pt"):
        ck = load(out / name)
        ck["config"].update(kl_exit=True, kl_threshold=1e-3)
        torch.save(dict(ck, args={**ck["args"], "kl_threshold": 1e-3}), out / name)
    code, err = call_main(flags(mdm, data_root, out, "--resume", "--max_iters", "7"), capsys)
    assert code == 0, err
    ck = load(out / "ckpt_latest.pt")
    assert ck["iter"] == 7 and not {"kl_exit", "kl_threshold"} & (set(ck["config"]) | set(ck["args"]))
    with pytest.raises(train.UsageError, match=r"unknown fields \['kl_other'\]"):
        ModelConfig.from_dict({**ck["config"], "kl_other": 1})


def test_a_resume_with_no_updates_left_writes_its_log(runs, mdm, data_root, tmp_path):
    """A run killed during its final evaluation (its last checkpoint at --max_iters, no summary.json)
    is finished by --resume without any update: its log gets that start's record and the summary,
    and drops the earlier finish's summary record, as a resume with updates does (Log.start_writing
    ran only after an update, so none of these were written)."""
    out = tmp_path / "out"
    shutil.copytree(runs["out"]["A"], out)
    (out / "summary.json").unlink()
    before = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    assert [r["event"] for r in before].count("summary") == 1  # the earlier finish's
    run_train(flags(mdm, data_root, out, "--resume"))
    after = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    kept = [r for r in before if r["event"] not in ("summary", "depth_sweep")]
    assert after[:len(kept)] == kept
    new = after[len(kept):]
    assert new[0]["event"] == "start" and new[0]["resumed_at"] == load(out / "ckpt_latest.pt")["iter"]
    summary = json.loads((out / "summary.json").read_text())
    assert [r for r in new if r["event"] == "summary"] == [{"event": "summary", **summary}]


@pytest.mark.parametrize("warmup", [0, 3, 10])
@pytest.mark.parametrize("decay", [4, 6, 12])
@pytest.mark.parametrize("max_iters", [5, 9, 14])
def test_schedule_notes_say_what_lr_at_runs(warmup, decay, max_iters):
    """A resumed run's note that updates run at the floor names exactly the updates lr_at runs at the
    floor (not updates still inside the warmup: --lr_decay_iters 6, --warmup_iters 10, --max_iters 9
    said "the updates after 6 run at the floor" while they ran at 0.64-0.82 x the peak); a run that
    ends inside its warmup says so, with its last update's rate."""
    args = Schedule(learning_rate=1.0, warmup_iters=warmup, lr_decay_iters=decay, max_iters=max_iters,
                    min_lr_ratio=0.1)
    rates = [args.lr_at(i) for i in range(max_iters)]  # rates[u - 1]: update u's
    notes = args.notes(resumed=True)
    said = [int(re.search(r"ends at update (\d+)", n).group(1)) for n in notes if "run at its floor" in n]
    past = [u for u in range(1, max_iters + 1) if all(r == pytest.approx(0.1) for r in rates[u - 1:])
            and (u > warmup or warmup == 0)]  # updates from which on every one runs at the floor
    if said:  # every update after the one named runs at the floor, and the named one ends the schedule
        assert said == [max(decay, warmup)] and said[0] + 1 in past
    else:  # no update runs past the schedule
        assert max(decay, warmup) >= max_iters
    ends_in_warmup = [n for n in notes if "ends inside the warmup, its last update at" in n]
    assert len(ends_in_warmup) == (warmup >= max_iters)
    if ends_in_warmup:
        assert not said and f"at {rates[-1]:.2f} x --learning_rate" in ends_in_warmup[0]
    fresh = args.notes(resumed=False)
    if warmup >= max_iters:
        assert fresh == ends_in_warmup
    elif decay <= warmup + 1:  # no cosine: the rate climbs to update `top` and drops to the floor after it
        top = next(u for u in range(1, max_iters + 1) if u == max_iters or rates[u] == pytest.approx(0.1))
        assert all(r == pytest.approx(0.1) for r in rates[top:]) and len(fresh) == 1, fresh
        assert f"no cosine; the rate rises to {rates[top - 1]:.2f} x --learning_rate at update {top}, " in fresh[0]
        assert fresh[0].endswith("(no decay)" if top == max_iters else "then runs at its floor (0.1 x)")
    else:
        assert fresh == []


def test_a_run_that_ends_at_its_peak_says_so():
    """--warmup_iters 1 --max_iters 2 (the decay's default length, 2): update 2 runs at the peak and
    the run ends there, with no decay (it said nothing)."""
    s = Schedule(learning_rate=1.0, warmup_iters=1, lr_decay_iters=None, max_iters=2, min_lr_ratio=0.1)
    assert [s.lr_at(i) for i in range(2)] == [0.5, 1.0]
    assert s.notes(resumed=False) == ["note: --lr_decay_iters 2 (its default, --max_iters) ends one update after the "
                                      "warmup (--warmup_iters 1): no cosine; the rate rises to 1.00 x --learning_rate "
                                      "at update 2, where the run ends (no decay)"]


def test_help_shows_every_tiers_value(capsys):
    """--help: help text on every flag, the value at every tier for tier-dependent ones, no
    "(default: None)", no default stated twice."""
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "default: None" not in out and "kl_threshold" not in out
    assert "training context length T; default: tiny 128 / cpu 128 / 70M 2048 / 160M 2048" in out
    assert "peak learning rate; default: tiny 0.006 / cpu 0.004 / 70M 0.0006 / 160M 0.0006" in out
    assert all(a.help and a.help.count("default") <= 1 for a in train.build_parser()._actions)


# ----------------------------------------------------------------------------- safe checkpoints, failures

def test_interrupted_save_leaves_previous_checkpoint(runs, tmp_path, monkeypatch):
    path = tmp_path / "ckpt_latest.pt"
    shutil.copy(runs["out"]["A"] / "ckpt_latest.pt", path)
    good = snapshot(tmp_path)

    def dies_mid_write(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_atomic({"model": {}}, str(path))
    monkeypatch.undo()
    assert snapshot(tmp_path) == good  # untouched, and no temporary file left behind
    assert load(path)["iter"] == 6
    (tmp_path / "cut.pt").write_bytes(path.read_bytes()[:1000])  # what a non-atomic save could leave
    with pytest.raises(train.UsageError, match="truncated or corrupted"):
        checkpoint.load_checkpoint(str(tmp_path / "cut.pt"))


def test_output_files_are_replaced_whole_or_not_at_all(tmp_path):
    """harness.cli.write_atomic (summary.json, which sweep.py takes as a finished run; collected runs;
    report --into; the benchmarks' JSON): a write that fails midway leaves the previous file whole
    and no temporary file. No project module opens an output file for writing in place, but the
    run's append-only log, files inside a temporary folder renamed whole, and /proc."""
    import harness.cli
    path = tmp_path / "summary.json"
    path.write_text('{"dev_nll": 1.5}')

    def dies_mid_write(f):
        f.write('{"dev_nll": ')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        harness.cli.write_atomic(str(path), dies_mid_write)
    assert path.read_text() == '{"dev_nll": 1.5}' and os.listdir(tmp_path) == ["summary.json"]
    assert harness.cli.write_text(str(path), "é 2.0\n") == str(path) and path.read_bytes() == "é 2.0\n".encode()
    allowed = {"harness/config.py": 'open(self.path, "w" if self.resumed_at is None else "a")',  # the log
               "tools/cpu_memory.py": 'open("/proc/self/clear_refs", "w")'}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for folder, _, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        if rel.split(os.sep)[0] in ("tests", ".git", "data", "runs", "out") or rel.startswith("."):
            continue
        for name in files:
            if name.endswith(".py") and name not in ("test_all.py", "conftest.py"):
                file = os.path.normpath(os.path.join(rel, name))
                with open(os.path.join(root, file)) as f:
                    for line in f:
                        m = re.search(r"open\([^()]*(\([^()]*\)[^()]*)*, *[\"'][wx]b?[\"']", line)
                        in_tmp = re.search(r"open\((os\.path\.join\()?tmp\b", line)  # renamed into place whole
                        if m and not in_tmp and allowed.get(file, "\0") not in line:
                            found.append(f"{file}: {line.strip()}")
    assert found == []


def test_nonfinite_loss_stops_with_the_step_and_keeps_checkpoint(runs, mdm, data_root, tmp_path, capsys):
    """A learning rate of 1e30 (allowed: finite and positive) makes AdamW move every weight by ~1e30
    in one update; the next forward pass overflows float32, so the loss or gradient is not finite."""
    out = tmp_path / "out"
    shutil.copytree(runs["out"]["A"], out)
    good = snapshot(out)
    code, err = call_main(flags(mdm, data_root, out, "--resume", "--max_iters", "12", "--learning_rate", "1e30"),
                          capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: non-finite"), err
    step = int(re.search(r"at update (\d+)", lines[0]).group(1))
    assert 7 <= step <= 12 and "ckpt_latest.pt" in lines[0]
    now = snapshot(out)
    assert {k: now[k] for k in ("ckpt_latest.pt", "ckpt_best.pt")} == \
        {k: good[k] for k in ("ckpt_latest.pt", "ckpt_best.pt")}
    assert load(out / "ckpt_latest.pt")["iter"] == 6
    # resuming again (normal learning rate) drops the failed attempt's records from the log
    code, err = call_main(flags(mdm, data_root, out, "--resume", "--max_iters", "8"), capsys)
    assert code == 0, err
    assert [r["iter"] for r in records(out, "train")] == list(range(1, 9))
    assert len(records(out, "summary")) == 1


# ----------------------------------------------------------------------------- evaluation

def test_eval_independent_of_batch_size_and_world_size(ddp_runs, data_root):
    """Per-window NLL sums are float64 and reduced in window order, so batching and sharding only
    enter through the float32 forward pass. On this CPU the values are bit-identical; the tolerance
    we guarantee is 1e-6 relative, because a BLAS may pick other kernels (another summation order
    inside a matmul) for another batch shape, which moves float32 logits by ~1e-7 relative."""
    ck = load(ddp_runs["ddp"] / "ckpt_latest.pt")  # trained and evaluated by 2 processes
    model = build_model(ModelConfig.from_dict(ck["config"]))
    model.load_state_dict(ck["model"])
    d = data_mod.Data(str(next(data_root.iterdir())))
    starts = d.eval_windows("dev", 32, 6)
    ctx = torch.autocast("cpu", enabled=False)
    values = {bs: train.evaluate(model, d, "dev", starts, 32, bs, "cpu", ctx) for bs in (1, 4, 8)}
    assert values[4] == pytest.approx(values[8], rel=1e-6, abs=0)
    assert values[1] == pytest.approx(values[8], rel=1e-6, abs=0)
    assert ck["dev_nll"] == pytest.approx(values[4], rel=1e-6, abs=0)  # world size 2 vs 1, same weights


# ----------------------------------------------------------------------------- DDP on CPU

@pytest.fixture(scope="module")
def ddp_runs(mdm, data_root, tmp_path_factory):
    """The same 2 updates (global batch: 4 micro-batches of 2 windows) in one process and under
    torchrun with 2 processes (2 micro-batches each, the first under no_sync)."""
    root = tmp_path_factory.mktemp("ddp")
    common = ["--gradient_accumulation_steps", "4", "--max_iters", "2", "--eval_interval", "1"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the torchrun processes (OMP_NUM_THREADS=1)
    try:
        single = main_in_process(flags(mdm, data_root, root / "single", *common), str(root / "s"))
    finally:
        torch.set_num_threads(threads)
    ddp = run_train(flags(mdm, data_root, root / "ddp", *common), {"TRAIN_DEBUG_DUMP": str(root / "d")},
                    torchrun=2)
    return dict(single=root / "single", ddp=root / "ddp", s=str(root / "s"), d=str(root / "d"),
                ddp_stdout=ddp.stdout, single_stdout=single)


def test_ddp_matches_single_process(ddp_runs):
    r0, r1, single = dump(ddp_runs["d"], 0), dump(ddp_runs["d"], 1), dump(ddp_runs["s"])
    for a, b, s in zip(r0, r1, single):
        assert a["param_sha256"] == b["param_sha256"]  # identical parameters on every rank after each update
        assert len(a["starts"]) == len(b["starts"]) == 2 and len(s["starts"]) == 4
        assert not set(sum(a["starts"], [])) & set(sum(b["starts"], []))  # ranks saw different windows
        assert a["starts"] + b["starts"] == s["starts"]  # together: the single process's windows
    assert len(r0) == len(r1) == len(single) == 2
    cs, cd = load(ddp_runs["single"] / "ckpt_latest.pt"), load(ddp_runs["ddp"] / "ckpt_latest.pt")
    assert list(cs["model"]) == list(cd["model"])  # no module. prefix
    assert max((cs["model"][k] - cd["model"][k]).abs().max().item() for k in cs["model"]) <= 1e-6
    ls, ld = records(ddp_runs["single"], "train"), records(ddp_runs["ddp"], "train")
    assert [r["loss"] for r in ld] == pytest.approx([r["loss"] for r in ls], rel=1e-6)
    es, ed = records(ddp_runs["single"], "eval"), records(ddp_runs["ddp"], "eval")
    assert [r["dev_nll"] for r in ed] == pytest.approx([r["dev_nll"] for r in es], rel=1e-6)


def test_ddp_only_rank0_writes_and_prints(ddp_runs):
    out = ddp_runs["ddp"]
    assert len(records(out, "start")) == 1 and records(out, "start")[0]["world_size"] == 2
    assert [r["iter"] for r in records(out, "train")] == [1, 2]
    assert sorted(os.listdir(out)) == ["ckpt_best.pt", "ckpt_latest.pt", "log.jsonl", "summary.json"]
    assert ddp_runs["ddp_stdout"].count("update 1: dev NLL") == 1
    assert ddp_runs["ddp_stdout"].count("test NLL") == 1
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and math.isfinite(s["test_nll"])


# ----------------------------------------------------------------------------- bad input catalogue

def _tamper(key, fn):
    """A setup step: load <out>/ckpt_latest.pt, change it with fn, save it back."""
    def setup(ctx):
        p = ctx["out"] / "ckpt_latest.pt"
        ck = load(p)
        fn(ck)
        torch.save(ck, p)
    setup.__name__ = key
    return setup


def _write(rel, how):
    def setup(ctx):
        p = ctx[rel.split("/")[0]] / rel.split("/", 1)[1]
        how(p)
    return setup


def _meta(fn):
    def setup(ctx):
        p = ctx["folder"] / "meta.json"
        meta = json.loads(p.read_text())
        fn(meta)
        p.write_text(json.dumps(meta))
    return setup


def _corrupt_tokens(p):
    a = np.fromfile(p, dtype="<u2")
    a[len(a) // 2] = 60000
    a.tofile(p)


def _swap_two_tokens(p):  # every id stays in the vocabulary: only the hash can tell
    a = np.fromfile(p, dtype="<u2")
    i = int(np.flatnonzero(a[:-1] != a[1:])[0])
    a[i], a[i + 1] = a[i + 1], a[i]
    a.tofile(p)


def _set_shape(ck):
    k = next(k for k, v in ck["model"].items() if v.dim() == 2)
    ck["model"][k] = ck["model"][k][:, :-1].clone()


# (id, extra flags, needle in the error line, setup steps, mode): mode "fresh" = a new out_dir that
# must not be created; "resume" = a copy of a finished run's out_dir that must stay byte-identical.
# Setup steps get ctx: out (the out_dir), folder (a private copy of the prepared dataset), tmp.
CASES = [
    ("model", ["--model", "nope"], "--model", [], "fresh"),
    ("depth0", ["--depth", "0"], "--depth", [], "fresh"),
    ("depth_text", ["--depth", "abc"], "--depth", [], "fresh"),
    ("unknown_flag", ["--bogus", "1"], "unrecognized arguments", [], "fresh"),
    ("size", ["--size", "1B"], "--size", [], "fresh"),
    ("lr_negative", ["--learning_rate", "-1"], "--learning_rate", [], "fresh"),
    ("lr_nan", ["--learning_rate", "nan"], "--learning_rate", [], "fresh"),
    ("lr_inf", ["--learning_rate", "inf"], "--learning_rate", [], "fresh"),
    ("lr_float32", ["--learning_rate", "1e39"],  # finite, but AdamW's float32 update overflowed (a traceback)
     "--learning_rate 1e+39: must be a finite number > 0 (at most 3.4e38, a float32)", [], "fresh"),
    ("lr_times_decay", ["--learning_rate", "1e38", "--weight_decay", "10"], "--learning_rate x --weight_decay", [], "fresh"),
    ("min_lr_ratio", ["--min_lr_ratio", "2"], "--min_lr_ratio", [], "fresh"),
    ("warmup", ["--warmup_iters", "-1"], "--warmup_iters", [], "fresh"),
    ("weight_decay", ["--weight_decay", "-0.1"], "--weight_decay", [], "fresh"),
    ("grad_clip", ["--grad_clip", "0"], "--grad_clip", [], "fresh"),
    ("eval_interval", ["--eval_interval", "0"], "--eval_interval", [], "fresh"),
    ("eval_batch_size", ["--eval_batch_size", "0"], "--eval_batch_size", [], "fresh"),
    ("lr_decay_iters", ["--lr_decay_iters", "0"], "--lr_decay_iters", [], "fresh"),
    ("sample_tokens", ["--sample_tokens", "-1"], "--sample_tokens", [], "fresh"),
    ("seed", ["--seed", "-1"], "--seed", [], "fresh"),
    ("seed_too_large", ["--seed", str(2 ** 64)], f"--seed {2 ** 64}: must be < 2**64", [], "fresh"),  # torch's range
    ("data_seed", ["--data_seed", "-2"], "--data_seed", [], "fresh"),
    ("num_proc", ["--num_proc", "0"], "--num_proc", [], "fresh"),
    ("device", ["--device", "tpu"], "--device", [], "fresh"),
    ("device_cuda", ["--device", "cuda"], "CUDA", [], "fresh"),  # skipped on a machine with CUDA
    ("dtype", ["--dtype", "float16"], "--dtype", [], "fresh"),
    ("accum_vs_world", ["--gradient_accumulation_steps", "3", "ENV:WORLD_SIZE=2"], "divisible", [], "fresh"),
    ("world_env", ["ENV:WORLD_SIZE=two"], "WORLD_SIZE", [], "fresh"),
    ("out_dir_file", ["--out_dir", "TMP/afile"], "--out_dir", [_write("tmp/afile", lambda p: p.write_text("x"))],
     "fresh"),
    ("out_dir_uncreatable", ["--out_dir", "/proc/tango-lab-test/out"], "--out_dir /proc/tango-lab-test/out: cannot "
     "create folders in /proc", [], "fresh"),  # (as root too: os.access would say yes)
    ("data_root_file", ["--data_root", "TMP/afile"], "--data_root",
     [_write("tmp/afile", lambda p: p.write_text("x"))], "fresh"),
    ("block_size", ["--block_size", "100000"], "--block_size", [], "fresh"),
    ("dataset_missing", ["--dataset", "TMP/nothing", "--data_dir", None], "--dataset", [], "fresh"),
    ("dataset_empty", ["--dataset", "TMP/empty", "--data_dir", None], "--dataset",
     [_write("tmp/empty", lambda p: p.mkdir())], "fresh"),
    ("no_vocab", ["--dataset", "TMP/text.txt", "--tokenizer", "gpt2", "--data_dir", None, "ENV:GPT2_BPE_FILE=/nonexistent/gpt2"],
     "GPT2_BPE_FILE", [_write("tmp/text.txt", lambda p: p.write_text("some text " * 50))], "fresh"),
    ("data_dir_not_dmmath", ["--dataset", "stdlib", "--data_dir", "TMP"], "--data_dir", [], "fresh"),
    ("dmmath_layout", ["--data_dir", "TMP/empty"], "--data_dir", [_write("tmp/empty", lambda p: p.mkdir())],
     "fresh"),
    ("bin_token_out_of_range", [], "train.bin: token id 60000 >=",
     [_write("folder/train.bin", _corrupt_tokens), _meta(lambda m: m.pop("sha256"))], "fresh"),
    ("bin_bytes_changed", [], "dev.bin: its SHA-256 is not meta.json's", [_write("folder/dev.bin", _swap_two_tokens)],
     "fresh"),
    ("meta_vocab_size", [], "vocab_size", [_meta(lambda m: m.update(vocab_size=10))], "fresh"),
    ("meta_no_dev_split", [], "no split dev", [_meta(lambda m: m["splits"].pop("dev"))], "fresh"),
    ("meta_test_split", [], "no split", [_meta(lambda m: m.update(test_split="nope"))], "fresh"),
    ("mask_values", [], "mask.bin", [_write("folder/dev.mask.bin", lambda p: p.write_bytes(b"\x07" * p.stat().st_size))],
     "fresh"),
    ("problems_unreadable", [], "problems.npy",
     [_write("folder/interpolate.problems.npy", lambda p: p.write_bytes(b"garbage"))], "fresh"),
    ("problems_out_of_range", [], "problems.npy",
     [_write("folder/extrapolate.problems.npy", lambda p: np.save(p, np.array([[0, 5, 10 ** 9]])))], "fresh"),
    ("resume_nothing", ["--resume"], "no checkpoint", [], "fresh"),
    ("resume_a_checkpoint_file", ["--resume", "--out_dir", "TMP/out/ckpt_latest.pt"],
     "--resume: TMP/out/ckpt_latest.pt is a file; give the run's folder, TMP/out", [], "resume"),
    ("ckpt_truncated", ["--resume"], "truncated", [_write("out/ckpt_latest.pt", lambda p: p.write_bytes(p.read_bytes()[:5000]))],
     "resume"),
    ("ckpt_garbage", ["--resume"], "not a readable checkpoint",
     [_write("out/ckpt_latest.pt", lambda p: p.write_bytes(os.urandom(3000)))], "resume"),
    ("ckpt_not_training", ["--resume"], "not a training checkpoint",
     [_write("out/ckpt_latest.pt", lambda p: shutil.copy(p.parent / "ckpt_best.pt", p))], "resume"),
    ("ckpt_format", ["--resume"], "format", [_tamper("format", lambda ck: ck.update(format=1))], "resume"),
    ("ckpt_other_model_flag", ["--resume", "--model", "tango"], "--model", [], "resume"),
    ("ckpt_other_model", ["--resume"], "another model",
     [_tamper("config", lambda ck: ck["config"].update(model="untied"))], "resume"),
    ("ckpt_other_tokenizer", ["--resume"], "other data",
     [_tamper("data", lambda ck: ck["data"].update(tokenizer="gpt2", vocab_size=50257))], "resume"),
    ("ckpt_tensors_do_not_fit", ["--resume"], "does not fit", [_tamper("shape", _set_shape)], "resume"),
    ("ckpt_best_missing", ["--resume"], "ckpt_best.pt", [_write("out/ckpt_best.pt", lambda p: p.unlink())],
     "resume"),
    ("ckpt_best_corrupt", ["--resume"], "ckpt_best.pt",
     [_write("out/ckpt_best.pt", lambda p: p.write_bytes(p.read_bytes()[:-100]))], "resume"),
    ("ckpt_max_iters_below", ["--resume", "--max_iters", "3"], "--max_iters", [], "resume"),
    # a finished run: resuming it only evaluated again and replaced summary.json without its tokens/s
    ("resume_finished", ["--resume"], "is finished (update 6 of --max_iters 6, summary.json written); give "
     "--max_iters > 6", [], "resume"),
    ("ckpt_seed_conflict", ["--resume", "--seed", "5"], "--seed", [], "resume"),
]


def test_catalogue_has_20_cases():
    assert len(CASES) >= 20 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_one_line_exit_2_nothing_written(case, runs, mdm, data_root, tmp_path, capsys, monkeypatch):
    name, extra, needle, setups, mode = case
    if name == "device_cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    prepared = next(data_root.iterdir())
    root = tmp_path / "data"
    shutil.copytree(prepared, root / prepared.name)  # a private copy to corrupt
    out = tmp_path / "out"
    if mode == "resume":
        shutil.copytree(runs["out"]["A"], out)
    ctx = dict(out=out, folder=root / prepared.name, tmp=tmp_path)
    for step in setups:
        step(ctx)
    argv = flags(mdm, root, out)
    for f in extra:
        if isinstance(f, str) and f.startswith("ENV:"):
            monkeypatch.setenv(*f[4:].split("=", 1))
    extra = [f for f in extra if not (isinstance(f, str) and f.startswith("ENV:"))]
    if None in extra:  # ["--data_dir", None]: leave the flag out
        i = extra.index(None)
        argv.remove(str(mdm))
        argv.remove("--data_dir")
        extra = extra[:i - 1] + extra[i + 1:]
    if "--dataset" in extra:  # another dataset than dmmath: without the dmmath-only --em_samples
        i = argv.index("--em_samples")
        del argv[i:i + 2]
    argv += [f.replace("TMP", str(tmp_path)) for f in extra]
    before = snapshot(out)
    code, err = call_main(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle.replace("TMP", str(tmp_path)) in lines[0], err
    assert snapshot(out) == before  # fresh: out_dir not even created; resume: not a byte changed


def test_bad_input_in_a_real_process(mdm, data_root, tmp_path):
    p = run_train(flags(mdm, data_root, tmp_path / "out", "--resume"), check=False)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [p.stderr.strip()]
    assert p.stderr.startswith("error: --resume: no checkpoint") and not (tmp_path / "out").exists()


def test_a_model_larger_than_the_machine_is_refused_before_anything_is_prepared(mdm, tmp_path, monkeypatch, capsys):
    """A model whose non-embedding weights, gradients and AdamW moments alone (16 bytes a parameter)
    exceed the host's memory (here the host is said to have 1 MB) is one line naming the flags
    that size it and the count, exit 2, before any data is prepared or anything is written:
    --model untied --depth 2000 --size 70M grew until the kernel's OOM killer ended the run
    without a message. --eval_only needs the weights only (4 bytes). A model that fits is
    unaffected (every other test)."""
    argv = flags(mdm, tmp_path / "data", tmp_path / "o")
    n = build_model(model_config(resolve_args(train.parse_args(argv)), 256)[0], device="meta").num_params()
    assert harness_config.device_memory("cpu") > 16 * n > 2**20
    monkeypatch.setattr(harness_config.os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else 256)  # 1 MB
    with pytest.raises(SystemExit) as e:
        run_command(lambda: train.main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == (f"error: --size cpu --depth 2: the model's {n:,} non-embedding parameters need "
                                         f"{16 * n / 1e9:,.1f} GB for its weights, gradients and AdamW moments alone; "
                                         "cpu has 0.0 GB (give a smaller --size, --depth, --width or block count)\n")
    assert not (tmp_path / "o").exists() and not (tmp_path / "data").exists()
    assert harness_config.BYTES_PER_PARAM == {"train": 16, "eval": 4}
    for name, value in [("is_available", lambda: True), ("device_count", lambda: 1), ("set_device", lambda i: None),
                        ("get_device_properties", lambda d: SimpleNamespace(total_memory=2**20))]:
        monkeypatch.setattr(torch.cuda, name, value)  # a GPU of 1 MB: its memory is the one compared
    with pytest.raises(train.UsageError, match=r" need .* GB for its weights, gradients and AdamW moments alone; "
                                               "cuda has 0.0 GB"):
        resolve_args(train.parse_args([*argv, "--device", "cuda", "--dtype", "float32"]))


@pytest.mark.skipif(not sys.platform.startswith("linux") or torch.cuda.is_available(),
                    reason="the cap is for Linux without a GPU (it reads /proc)")
def test_a_batch_past_the_hosts_free_memory_is_one_line_not_the_oom_killer(mdm, data_root, tmp_path, monkeypatch,
                                                                            capsys):
    """On Linux without a GPU, run_command caps the process's data memory at its size now plus the
    host's free memory (harness.cli.host_memory_limit), so a batch past it fails its allocation: one line
    naming the size flags, exit 2, no out_dir, and the limit restored. Without the cap Linux's
    overcommit lets such a batch allocate until the kernel kills the process (exit 137, no message).
    Here the host pretends to have 256 MB free; the batch needs more (it trains without the cap)."""
    import resource
    before = resource.getrlimit(resource.RLIMIT_DATA)
    monkeypatch.setattr(harness.cli, "host_memory_free", lambda: 2 ** 28)
    big = ["--batch_size", "1024", "--max_iters", "1", "--eval_interval", "1"]  # about 4 GB without the cap
    with pytest.raises(SystemExit) as e:
        run_command(lambda: train.main(flags(mdm, data_root, tmp_path / "o", *big)), sizes=train.SIZE_FLAGS)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: out of memory (") and err.count("\n") == 1, err
    assert err.endswith("; give smaller sizes (--size, --depth, --width, --batch_size, --block_size, "
                        "--eval_batch_size)\n")
    assert not (tmp_path / "o").exists() and resource.getrlimit(resource.RLIMIT_DATA) == before


def test_a_batch_that_does_not_fit_leaves_out_dir_as_it_was(runs, mdm, data_root, tmp_path, monkeypatch):
    """A fresh run whose first update fails (here a batch that does not fit in memory: one line,
    exit 2) creates no out_dir, and in an out_dir holding an earlier run leaves its checkpoints,
    summary and log byte for byte (they were removed at start, before anything had trained); a
    fresh run that trains replaces them once its first update has run, and says so."""
    big = ["--batch_size", str(10 ** 12)]  # its first allocation (8 TB of window starts) fails at once anywhere
    p = run_train(flags(mdm, data_root, tmp_path / "new", *big), check=False)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr
    assert p.stderr.startswith("error: out of memory (") and not (tmp_path / "new").exists()
    out = tmp_path / "out"
    shutil.copytree(runs["out"]["A"], out)
    before = snapshot(out)
    p = run_train(flags(mdm, data_root, out, *big), check=False)
    assert p.returncode == 2 and p.stderr.startswith("error: out of memory (") and snapshot(out) == before
    with monkeypatch.context() as m:  # Ctrl-C before the first update: says so, and the earlier run stays
        m.setattr(train, "train_loop", lambda r: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt, match=f"^stopped after update 0; nothing was written to {out} "):
            train.run(train.parse_args(flags(mdm, data_root, out)), set())
    assert snapshot(out) == before
    p = run_train(flags(mdm, data_root, out))  # one that trains replaces the earlier run, and says so
    assert f"note: fresh run in {out}: removed ckpt_latest.pt, ckpt_best.pt, summary.json of an earlier run" in p.stdout
    assert len(records(out, "start")) == 1 and records(out, "start")[0]["resumed_at"] == 0


def test_report_names_how_many_updates_its_throughput_median_covers(capsys):
    """The throughput line says over how many updates the median was taken (a 3-update run has 3)."""
    s = {"non_embedding_params": 10, "unigram_dev": 3.0, "best_iter": 3, "dev_nll": 2.0, "test_nll": 2.1,
         "tok_per_s_median_last100": 1234.4, "tok_per_s_updates": 3,
         "first_update_s": None, "wall_s": 5.0}
    data = SimpleNamespace(test_split="test", meta={}, tokenizer="gpt2")
    args = SimpleNamespace(model="tango", depth=2, dataset="stdlib", size="tiny", em_samples=1, compile=False)
    evaluation.print_report(s, data, args)
    assert "throughput               1234 tokens/s (median of the last 3 updates)\n" in capsys.readouterr().out


def test_em_samples_is_refused_without_dmmath(tmp_path, capsys):
    """train.py --em_samples 5 on a text dataset (only dmmath has problems to score by exact match)
    is one line, exit 2, before any data is prepared or out_dir made, not a run that ignores it."""
    (tmp_path / "t.txt").write_text("some text\n" * 200)
    code, err = call_main(["--dataset", str(tmp_path / "t.txt"), "--tokenizer", "char", "--em_samples", "5",
                           "--data_root", str(tmp_path / "data"), "--out_dir", str(tmp_path / "out"), "--quiet"], capsys)
    assert (code, err) == (2, f"error: --em_samples: only used with --dataset dmmath; --dataset {tmp_path / 't.txt'} "
                              "ignores it (drop the flag)\n")
    assert os.listdir(tmp_path) == ["t.txt"]
    args = train.parse_args(["--dataset", "dmmath", "--em_samples", "5"])
    assert train.check_flags(args, {"dataset", "em_samples"}).em_samples == 5  # dmmath reads it


def test_docs_tier_defaults_are_the_code_s():
    """docs/training.md said --block_size cpu 256 where the tier's default (and --help) is 128: the
    per-tier line and the CPU and tiny tiers' numbers are checked against config.TIER_DEFAULTS."""
    from harness.config import TIER_DEFAULTS, tier_default
    with open(os.path.join(REPO, "docs", "training.md")) as f:
        doc = " ".join(f.read().split())
    assert "`--block_size`: " + tier_default("block_size").removeprefix("default: ") in doc
    cpu, tiny = TIER_DEFAULTS["cpu"], TIER_DEFAULTS["tiny"]
    assert (f"block_size {cpu['block_size']}, micro-batch {cpu['batch_size']}, no accumulation" in doc
            and cpu["gradient_accumulation_steps"] == 1)
    lr = lambda v: f"{v:.0e}".replace("e-0", "e-")  # 4e-3, as the page writes it
    assert (f"{cpu['max_iters']} updates, peak learning rate {lr(cpu['learning_rate'])}" in doc
            and f"{cpu['warmup_iters']} warmup updates, dev evaluation every {cpu['eval_interval']} updates on "
                f"{cpu['eval_windows']} fixed windows" in doc)
    assert (f"`tiny` (the reproduction grid): block_size {tiny['block_size']}, micro-batch {tiny['batch_size']}, "
            f"{tiny['max_iters']} updates" in doc and f"peak {lr(tiny['learning_rate'])}, dev evaluation every "
            f"{tiny['eval_interval']} updates on {tiny['eval_windows']} windows, W = {tiny['window']}, FLASH chunk "
            f"{tiny['chunk']}, GAU/FLASH s = {tiny['gau_s']}" in doc)
    assert f"(`cpu`: {cpu['window']} and {cpu['chunk']}; paper tiers: {TIER_DEFAULTS['70M']['window']} and " \
           f"{TIER_DEFAULTS['70M']['chunk']})" in doc


def test_eval_only_takes_the_evaluation_flags_of_the_latest_checkpoint(mdm, data_root, tmp_path):
    """--eval_only evaluates as the run's last report did: the evaluation flags (EVAL_FLAGS) come
    from ckpt_latest.pt, which a resumed run rewrites with its own, not from the older ckpt_best.pt
    (here the latest holds --eval_batch_size 3 and --eval_depths 1,2, the best 4 and none)."""
    out = tmp_path / "x"
    train.main(flags(mdm, data_root, out, "--max_iters", "4", "--eval_interval", "2"))
    latest = torch.load(out / "ckpt_latest.pt", weights_only=True)
    latest["args"].update(eval_batch_size=3, eval_depths="1,2")
    torch.save(latest, out / "ckpt_latest.pt")
    assert torch.load(out / "ckpt_best.pt", weights_only=True)["args"]["eval_batch_size"] == 4
    args = train.parse_args(["--eval_only", "--out_dir", str(out)])
    _, changed = checkpoint.eval_only_args(args, {"eval_only", "out_dir"})
    assert (args.eval_batch_size, args.eval_depths, changed) == (3, "1,2", {})
    args = train.parse_args(["--eval_only", "--out_dir", str(out), "--eval_batch_size", "5"])  # given: it wins
    checkpoint.eval_only_args(args, {"eval_only", "out_dir", "eval_batch_size"})
    assert args.eval_batch_size == 5


def test_a_resume_in_another_dtype_recomputes_the_best_checkpoints_dev_nll(mdm, data_root, tmp_path, capsys):
    """The report's dev and test NLL share one dtype: when the best checkpoint was written in
    another --dtype than the run's last one, finish evaluates its dev NLL again instead of printing
    the recorded one. Here the best checkpoint says it was written under bfloat16 with dev NLL 123;
    the run resumed (nothing left to train) under float32 reports the recomputed value, the one
    --eval_only prints."""
    out = tmp_path / "x"
    train.main(flags(mdm, data_root, out, "--max_iters", "4", "--eval_interval", "2"))
    os.remove(out / "summary.json")  # (so the run is not finished: a resume evaluates it again)
    best = torch.load(out / "ckpt_best.pt", weights_only=True)
    best["args"]["dtype"], best["dev_nll"] = "bfloat16", 123.0
    torch.save(best, out / "ckpt_best.pt")
    capsys.readouterr()
    summary = train.run(train.parse_args(flags(mdm, data_root, out, "--resume", "--max_iters", "4",
                                               "--eval_interval", "2", "--dtype", "float32")),
                        {"resume", "max_iters", "eval_interval", "dtype", "out_dir"})
    evaluated = train.eval_only(train.parse_args(["--eval_only", "--out_dir", str(out), "--dtype", "float32"]),
                                {"eval_only", "out_dir", "dtype"})
    assert summary["dev_nll"] != 123.0 and summary["dev_nll"] == evaluated["dev_nll"]
