"""Regional compilation: each body's repeated unit compiles once, whatever the depth.

Graphs are counted with torch._dynamo's CompileCounter backend: dynamo captures the same graphs
and checks the same guards whatever the backend, so the counts are those of an inductor run, and
the counter runs each graph eagerly (no C++ compile: seconds, not minutes, on CPU). A real
inductor compile of every model is a manual check (python -m tools.bench --device cuda), too slow here.
"""
import functools
import sys

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.testing import CompileCounter

import common
import harness.cli
import models
import train
from checks import ONE_BLOCK_PER_LOOP
from common import ModelConfig, compile_regions

EVAL_AND_CHECKPOINT = train.eval_and_checkpoint


def compiled_region_names(model):
    """Sorted qualified names of the compiled regions of a model (after compile_regions)."""
    return sorted({f"{type(m).__name__}.{n}" for m in model.modules() for n in m.__dict__.get("_compiled_regions", {})})


@pytest.fixture(autouse=True)
def fresh_dynamo():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(n)


MDM_SIZE = (100, 40)  # the shared mini-dmmath of tests/conftest.py (mdm, data_root), smaller


def compiled_run(mdm, data_root, tmp_path, monkeypatch, depth):
    """train.py --compile on a tiny TANGO: 4 updates, evaluations after 2 and 4 (6 dev windows in
    batches of 4: a short last batch), test evaluation, exact match on 2 x 3 problems and a printed
    sample. Returns the graph count after the first update, after each evaluation and at the end,
    and the compiled variants per region."""
    cnt = CompileCounter()
    monkeypatch.setattr(train, "compile_regions", functools.partial(compile_regions, backend=cnt))
    seen, regions = [], {}

    def eval_and_checkpoint(r, dev_starts):
        seen.append(cnt.frame_count)  # before this evaluation
        EVAL_AND_CHECKPOINT(r, dev_starts)
        seen.append(cnt.frame_count)
        regions.update({n: r.model for n in compiled_region_names(r.model)})

    monkeypatch.setattr(train, "eval_and_checkpoint", eval_and_checkpoint)
    s = train.run(train.parse_args(
        ["--model", "tango", "--depth", str(depth), "--size", "tiny", "--block_size", "32", "--batch_size", "2",
         "--max_iters", "4", "--eval_interval", "2", "--eval_windows", "6", "--eval_batch_size", "4",
         "--em_samples", "3", "--sample_tokens", "6", "--quiet", "--compile", "--dataset", "dmmath",
         "--data_dir", str(mdm), "--data_root", str(data_root), "--out_dir", str(tmp_path / f"K{depth}")]))
    variants = {"Tango.update": len(_debug_get_cache_entry_list(models.tango.Tango.update.region.__code__)),
                "LM.head": len(_debug_get_cache_entry_list(common.LM.head.region.__code__))}
    return seen, cnt.frame_count, sorted(regions), variants, s


def test_tango_compiles_each_region_once_for_training_once_for_evaluation(mdm, data_root, tmp_path, monkeypatch,
                                                                          capsys):
    counts = {}
    for K in (4, 8):
        torch._dynamo.reset()
        seen, end, regions, variants, summary = compiled_run(mdm, data_root, tmp_path, monkeypatch, K)
        assert regions == ["LM.head", "Tango.update"]
        # training: one graph for the head, three for the TANGO update on CPU (queries and keys up to
        # the call of tango_kernels.gated_update, then its grouped path before and after the eager
        # chunked kernels, tango_kernels.py "Compilation"); the first evaluation (no grad) as many
        # again; the second evaluation, test NLL, exact-match decoding and the sample: none
        assert seen == [4, 8, 8, 8] and end == 8, (K, seen, end)
        assert variants == {"Tango.update": 2, "LM.head": 2}
        assert summary["first_update_s"] > 0 and summary["exact_match_interpolate"] >= 0
        counts[K] = (seen, end, variants)
    assert counts[4] == counts[8]
    out = capsys.readouterr().out
    assert "first update after" in out and ", compile included)" in out and "--- sample" in out


@pytest.mark.parametrize("name", list(models.REGISTRY))
def test_graphs_do_not_grow_with_the_context(name, monkeypatch):
    """A Python loop over the context traced into a compiled region is unrolled into its graph, so
    compile time grows with T (TANGO's chunked kernels loop over T / C query chunks and run eagerly,
    tango_kernels.py "Compilation"; the fused path: tests/test_tango_fused.py). Every
    model's graphs, with every subgraph dynamo nests in them, hold as many nodes at T = 8 as at
    T = 32 (2 and 8 chunks of TANGO, FLASH, the windows)."""
    import tango_kernels
    monkeypatch.setattr(tango_kernels, "WINDOW_CHUNK", 4)
    monkeypatch.setattr(tango_kernels, "ATTN_CHUNK", 4)
    sizes = []

    def count_nodes(gm, example_inputs):
        sizes[-1] += sum(len(m.graph.nodes) for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
        return gm.forward

    for T in (8, 32):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = models.build_model(ModelConfig(model=name, vocab_size=61, block_size=T, n_embd=64, n_head=2,
                                               depth=3, width=64, window=4, chunk=4, gau_s=32, plt_window=4,
                                               mu_rec=3, mu_bwd=1, **ONE_BLOCK_PER_LOOP.get(name, {})))
        sizes.append(0)
        compile_regions(model, backend=count_nodes)
        idx = torch.randint(0, 61, (2, T))
        model(idx, idx)[1].backward()
    assert sizes[0] == sizes[1] and sizes[0] > 0, sizes


def _small(name, depth):
    # Parcae/RDM: a fixed training recurrence (mean 4, 1 step backpropagated: so some steps run
    # without grad, a graph of their own) whatever the evaluation depth K
    return ModelConfig(model=name, vocab_size=61, block_size=16, n_embd=64, n_head=2, depth=depth, width=96,
                       window=4, gau_s=32, chunk=4, mu_rec=4, mu_bwd=1)


@pytest.mark.parametrize("name", list(models.REGISTRY))
def test_every_model_graph_count_independent_of_depth_and_equal_to_eager(name):
    """A training step, an evaluation at another batch size and cached greedy decoding, with the
    compiled regions: outputs and gradients equal the eager model's, decoding adds no graph, and
    the graph count is the same at K = 3 and K = 4 (untied blocks/units share their graph)."""
    counts = []
    for K in (3, 4):
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager = models.build_model(_small(name, K))
        compiled = models.build_model(_small(name, K))
        compiled.load_state_dict(eager.state_dict())
        cnt = CompileCounter()
        compile_regions(compiled, backend=cnt)
        idx = torch.randint(0, 61, (3, 16))
        losses, grads = [], []
        for m in (eager, compiled):
            torch.manual_seed(1)  # Parcae/RDM draw their depth and initial state from it
            loss = m(idx, idx)[1]
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad for p in m.parameters()])
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        for a, b in zip(grads[1], grads[0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        for m in (eager, compiled):
            m.eval()
        with torch.no_grad():
            torch.testing.assert_close(compiled(idx[:2])[0], eager(idx[:2])[0], rtol=1e-5, atol=1e-5)
        n = cnt.frame_count
        assert compiled.generate(idx[:1, :5], 4, temperature=0).tolist() == eager.generate(idx[:1, :5], 4, temperature=0).tolist()
        assert cnt.frame_count == n  # decoding runs eagerly
        counts.append(n)
    assert counts[0] == counts[1] and counts[0] >= 4, counts


# ----------------------------------------------------------------------------- shared parts
@pytest.mark.parametrize("name", list(models.REGISTRY))
def test_vocabulary_padding_is_never_predicted_sampled_or_counted(name):
    cfg = _small(name, 3)  # V = 61: E has 64 rows
    torch.manual_seed(0)
    model = models.build_model(cfg).eval()  # the models that draw a depth in training: one function per call
    d = cfg.n_embd
    assert tuple(model.wte.weight.shape) == (64, d) and model.wte.weight[61:].abs().sum() == 0
    assert model.num_params(non_embedding=False) == model.num_params() + 61 * d
    assert model.num_params() == sum(p.numel() for p in model.body.parameters()) + d  # + final norm
    idx = torch.randint(0, 61, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 61)
    # the loss is the NLL over the 61 real entries, recomputed from the hidden state by hand
    h = model.norm_f(model.body(model.wte(idx), *common.rope_cos_sin(torch.arange(16))))
    manual = h @ model.wte.weight[:61].t()
    torch.testing.assert_close(logits, manual)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(manual.reshape(-1, 61), idx.reshape(-1)))
    with torch.no_grad():
        model.wte.weight[61:] = 100.0  # padding rows that would dominate every softmax if they were scored
    out = model.generate(idx[:, :3], 20, temperature=2.0)
    assert int(out.max()) < 61
    # ... and do not enter the loss (-inf columns): the same NLL, no gradient to the padding rows
    for dtype in (torch.float32, torch.bfloat16):
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits, loss2 = model(idx, idx)
            ref = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 61), idx.reshape(-1))
        assert logits.shape == (2, 16, 61) and torch.isfinite(loss2)
        torch.testing.assert_close(loss2, ref, rtol=0, atol=1e-6)
        if dtype == torch.float32:
            torch.testing.assert_close(loss2, loss, rtol=0, atol=1e-6)
        loss2.backward()
        assert model.wte.weight.grad[61:].abs().sum() == 0 and model.wte.weight.grad[:61].abs().sum() > 0


def test_rope_tables_built_once_per_forward_in_the_compute_dtype(monkeypatch):
    model = models.build_model(_small("loop", 3))
    seen, calls = [], []
    body_forward = model.body.forward
    monkeypatch.setattr(model.body, "forward", lambda x, cos, sin, cache=None: seen.append(cos.dtype) or body_forward(x, cos, sin, cache))
    rope = common.rope_cos_sin
    monkeypatch.setattr(common, "rope_cos_sin", lambda *a, **k: calls.append(1) or rope(*a, **k))
    idx = torch.randint(0, 61, (2, 16))
    model(idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx)
    assert seen == [torch.float32, torch.bfloat16] and len(calls) == 2  # K = 3 applications, one table each forward


# ----------------------------------------------------------------------------- host synchronizations (train.py)
def _tiny_run(mdm, data_root, out, *extra):
    return train.run(train.parse_args(
        ["--model", "loop", "--depth", "2", "--size", "tiny", "--block_size", "32", "--batch_size", "2",
         "--max_iters", "12", "--eval_interval", "6", "--eval_windows", "4", "--eval_batch_size", "4",
         "--em_samples", "2", "--sample_tokens", "4", "--quiet", "--dataset", "dmmath", "--data_dir", str(mdm),
         "--data_root", str(data_root), "--out_dir", str(out), *extra]))


def _train_records(out):
    import json
    with open(out / "log.jsonl") as f:
        return [r for r in map(json.loads, f) if r["event"] == "train"]


def test_deferred_reads_log_every_update_with_one_read_per_interval(mdm, data_root, tmp_path, monkeypatch):
    """On CUDA (deferred_reads, forced here on CPU) train_update returns the loss and gradient norm
    as device tensors and the loop reads them back on the first update, every READ_EVERY updates
    and before each evaluation: reads after updates 1, 5, 6 (evaluation), 10, 12. Every update is
    still logged, with the loss of the NLL computed in the model's head (mean x count) within 1e-5
    of the eager run's summed NLL, the same gradient norms, and a finite tokens/s."""
    _tiny_run(mdm, data_root, tmp_path / "eager")
    eager = _train_records(tmp_path / "eager")
    reads = []
    read_updates = train.read_updates
    monkeypatch.setattr(train, "deferred_reads", lambda r: True)
    monkeypatch.setattr(train, "READ_EVERY", 5)
    monkeypatch.setattr(train, "read_updates", lambda r, pending, *a: reads.append([p[0] for p in pending])
                        or read_updates(r, pending, *a))
    seen = []
    monkeypatch.setattr(train, "check_finite", lambda r, it, loss, norm: seen.append(type(loss)) or (loss, norm))
    _tiny_run(mdm, data_root, tmp_path / "deferred")
    deferred = _train_records(tmp_path / "deferred")
    assert reads == [[1], [2, 3, 4, 5], [6], [7, 8, 9, 10], [11, 12]]
    assert seen == [float] * 12  # read as floats from the device tensors
    assert [r["iter"] for r in deferred] == list(range(1, 13)) == [r["iter"] for r in eager]
    for a, b in zip(deferred, eager):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["tok_per_s"] > 0 and a["lr"] == b["lr"]


def test_deferred_reads_do_not_count_evaluation_as_training_time(mdm, data_root, tmp_path, monkeypatch):
    """Deferred, each update gets the mean rate since the last read: the evaluation and checkpoints
    after update 6 (made to take 1000 s of a shifted clock) must not land in updates 7-12's rate,
    which would put each of them at ~170 s and 2 x 32 / 170 ~ 0.4 tokens/s."""
    import time as real_time
    from types import SimpleNamespace
    shift = [0.0]
    monkeypatch.setattr(train, "time", SimpleNamespace(time=lambda: real_time.time() + shift[0]))
    evaluate = train.eval_and_checkpoint
    def slow_eval(r, starts):
        evaluate(r, starts)
        shift[0] += 1000.0
    monkeypatch.setattr(train, "eval_and_checkpoint", slow_eval)
    monkeypatch.setattr(train, "deferred_reads", lambda r: True)
    monkeypatch.setattr(train, "READ_EVERY", 5)
    _tiny_run(mdm, data_root, tmp_path / "deferred")
    rates = {r["iter"]: r["tok_per_s"] for r in _train_records(tmp_path / "deferred")}
    assert sorted(rates) == list(range(1, 13))
    assert min(rates.values()) > 2 * 32 / 100  # every update took < 100 s of the clock, not 1000 / 6


def test_deferred_reads_count_the_work_still_queued_on_the_device(mdm, data_root, tmp_path, monkeypatch):
    """Deferred, a read first waits for the device (harness.cli.synchronizer: torch.cuda.synchronize), and
    that wait is training time: made to take 50 s of a shifted clock at each of the 5 reads, the
    logged rates must add up to at least 5 x 50 s of updates (timed before the wait: ~0 s)."""
    import time as real_time
    from types import SimpleNamespace
    shift, waits = [0.0], []
    monkeypatch.setattr(train, "time", SimpleNamespace(time=lambda: real_time.time() + shift[0]))
    def slow_device(device):
        def wait():
            waits.append(device)
            shift[0] += 50.0
        return wait
    monkeypatch.setattr(train, "synchronizer", slow_device)
    monkeypatch.setattr(train, "deferred_reads", lambda r: True)
    monkeypatch.setattr(train, "READ_EVERY", 5)
    _tiny_run(mdm, data_root, tmp_path / "deferred")
    seconds = [2 * 32 / r["tok_per_s"] for r in _train_records(tmp_path / "deferred")]
    assert len(waits) == 5 and len(seconds) == 12
    assert 250 <= sum(seconds) < 250 + 60
    assert min(seconds[1:5]) >= 50 / 4  # updates 2-5 share the second read's wait


def test_deferred_reads_log_each_update_s_own_diagnostics(mdm, data_root, tmp_path, monkeypatch):
    """Parcae logs its state norms, sampled depth and Abar per update. Deferred, they are taken as
    device tensors at the update and read later: each update's record must equal the eager run's,
    not repeat the newest update's (the sampled depths differ between updates)."""
    args = ["--model", "parcae", "--n_prelude", "1", "--n_core", "1", "--n_coda", "1"]
    _tiny_run(mdm, data_root, tmp_path / "eager", *args)
    eager = [r["diag"] for r in _train_records(tmp_path / "eager")]
    monkeypatch.setattr(train, "deferred_reads", lambda r: True)
    monkeypatch.setattr(train, "READ_EVERY", 5)
    _tiny_run(mdm, data_root, tmp_path / "deferred", *args)
    deferred = [r["diag"] for r in _train_records(tmp_path / "deferred")]
    assert len({d["depth_mean"] for d in eager[1:5]}) > 1  # updates 2-5 (one read) differ
    assert len(deferred) == len(eager) == 12
    for a, b in zip(deferred, eager):
        assert a["depth_mean"] == b["depth_mean"] and a["steps"] == b["steps"]
        assert a["state_norm"] == pytest.approx(b["state_norm"], rel=1e-5)
        assert a["abar_max"] == pytest.approx(b["abar_max"], rel=1e-6)
        assert isinstance(a["abar_max"], float) and isinstance(a["state_norm_max"], float)


@pytest.mark.parametrize("signal_error,word,code", [(KeyboardInterrupt, "interrupted", 130),
                                                    (harness.cli.Terminated, "terminated", 143)])
def test_ctrl_c_is_one_line_naming_the_checkpoint_to_resume_from(mdm, data_root, tmp_path, monkeypatch, capsys,
                                                                signal_error, word, code):
    """Ctrl-C (or SIGTERM, harness.cli.Terminated) in training: the exception carries the update and the
    checkpoint left (or that there is none); harness.cli.run_command prints it on one line and exits
    130 (143), not a traceback."""
    loop = train.train_loop
    def interrupted_after_8(r):
        monkeypatch.setattr(r.args, "max_iters", 8)  # train 8 updates (checkpoints at 6 and 8), then Ctrl-C
        loop(r)
        raise signal_error
    monkeypatch.setattr(train, "train_loop", interrupted_after_8)
    with pytest.raises(signal_error) as e:
        _tiny_run(mdm, data_root, tmp_path / "run")
    assert str(e.value) == (f"stopped after update 8; the last good checkpoint is {tmp_path / 'run' / 'ckpt_latest.pt'} "
                            f"(update 8); --resume --out_dir {tmp_path / 'run'} continues from it")
    def main():
        raise e.value
    with pytest.raises(SystemExit) as done:
        harness.cli.run_command(main)
    assert done.value.code == code and capsys.readouterr().err == f"{word}: {e.value}\n"


def test_deferred_reads_still_stop_on_a_non_finite_loss(mdm, data_root, tmp_path, monkeypatch):
    """A non-finite gradient norm read late (after update 6, the first read after update 1) still
    stops the run before any checkpoint, naming the update where it happened: with a learning rate
    of 1e30 the first update's step makes the second update's gradient overflow."""
    monkeypatch.setattr(train, "deferred_reads", lambda r: True)
    with pytest.raises(train.TrainingError, match=r"or gradient norm \(nan\) at update 2; stopped; no checkpoint exists yet"):
        _tiny_run(mdm, data_root, tmp_path / "nan", "--learning_rate", "1e30", "--warmup_iters", "0")


def test_adamw_is_fused_on_cuda_only():
    from harness.optim import AdamW, make_optimizer
    model = models.build_model(_small("loop", 3))
    for device, fused in (("cuda", True), ("cuda:1", True), ("cpu", None)):
        opt = make_optimizer(model, 1e-3, AdamW(weight_decay=0.1), device)
        assert opt.defaults.get("fused") is fused, device


def test_depth_attention_compiles_one_graph_per_candidate_count_past_dynamos_limit():
    """Depth-Attention's block traces one graph per candidate count |C(l)|: --da_stride 1 at K = 12 has
    12 counts, more than Dynamo's default recompile limit (8), past which the block ran eagerly after a
    warning. compile_regions raises the limit for the model's variants (compile_variants): the graphs
    beyond the blocks' are the same at K = 12 as at K = 4 (3 counts)."""
    extra = []
    for depth, stride, counts in ((4, 0, 3), (12, 1, 12)):
        torch._dynamo.reset()
        cfg = ModelConfig(model="depth-attn", vocab_size=64, block_size=16, n_embd=64, n_head=2, depth=depth,
                          width=96, da_stride=stride)
        model = models.build_model(cfg)
        assert model.body.compile_variants == counts
        cnt = CompileCounter()
        # torch's own patch restores the default afterwards under every pytest (a monkeypatch's undo can hide it)
        with torch._dynamo.config.patch(recompile_limit=8):
            compile_regions(model, backend=cnt)
            model(torch.randint(0, 64, (1, 16)))
        extra.append(cnt.frame_count - counts)
    assert extra[0] == extra[1] >= 0


def test_deferred_reads_leave_every_value_on_the_device_between_reads(mdm, data_root, tmp_path, monkeypatch):
    """Along the deferred path (CUDA; forced here) an update makes no host read and no blocking copy:
    its loss, gradient norm and diagnostics (Parcae's state norms) stay tensors until read_updates
    reads READ_EVERY updates at once, and the windows go to the device with non_blocking copies.
    Recorded on CPU: what read_updates receives, and every Tensor.to that train_update makes."""
    monkeypatch.setattr(train, "deferred_reads", lambda r: True)
    batches, copies = [], []
    read_updates = train.read_updates

    def record_reads(r, pending, *a):
        batches.append([(it, loss, grad_norm, diag) for it, _, loss, grad_norm, _, diag in pending])
        return read_updates(r, pending, *a)
    monkeypatch.setattr(train, "read_updates", record_reads)
    to = torch.Tensor.to

    def record_to(self, *a, **kw):
        caller = sys._getframe(1)
        if train.train_update.__code__ in (caller.f_code, caller.f_back.f_code):  # (or its list comprehension)
            copies.append(kw.get("non_blocking", False))
        return to(self, *a, **kw)
    monkeypatch.setattr(torch.Tensor, "to", record_to)
    _tiny_run(mdm, data_root, tmp_path / "run", "--model", "parcae", "--max_iters", "12", "--eval_interval", "12")
    assert [[it for it, *_ in b] for b in batches] == [[1], list(range(2, 11)), [11, 12]]  # first, every 10th, eval
    values = [v for b in batches for _, loss, grad_norm, diag in b
              for v in (loss, grad_norm, diag["diag"]["abar_max"], diag["diag"]["state_norm_max"],
                        *diag["diag"]["state_norm"])]
    assert len(values) == 12 * 4 + sum(len(d["diag"]["state_norm"]) for b in batches for *_, d in b)
    assert all(torch.is_tensor(v) for v in values)  # nothing read before read_updates
    assert copies and all(copies) and len(copies) == 12 * 2  # x and y of each update, non_blocking
