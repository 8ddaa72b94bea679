"""Field faults: cases that real use can get wrong, each test asserting the right value.

1 sampling arguments, 2 loss over scored targets of the whole update, 3 random draws independent
of the world size, 4 latent tokens on half-precision bases, 5 under-determined scaling-law fits,
6 sweep settings, 7 BPE tests without the vocabulary, 8 leftovers (folders, train/eval mode),
9 weight-decay exemptions, 10 CI installs the optional extras the tests use, 11 a newcomer's pass
(one-line errors from every command line, model flags checked before the data, flags a model ignores),
12 the GPU a command names (current device, timers and memory counters of that device).
"""
import argparse
import contextlib
import copy
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data as data_mod
import models
from tools import flops_fit
import latent_tokens as lt
from studies import latent_experiments
from harness import evaluation, tasks
from harness.config import resolve_args
from tools import sweep
from tools import sweep_report
import train
import harness.cli
from common import ModelConfig, UsageError, sample_next
from harness.optim import AdamW, make_optimizer, no_decay_parameters
from models import REGISTRY, build_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def small_cfg(name, **kw):
    base = dict(model=name, vocab_size=23, block_size=16, n_embd=64, n_head=2, depth=3 if name == "tango-3set" else 2,
                width=64, window=8, gau_s=32, chunk=8, n_prelude=1, n_core=1, n_coda=1)
    return ModelConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def long_questions(tmp_path_factory):
    """A DeepMind-Mathematics-layout dataset whose questions (~45 characters) are far longer than
    its answers (1-3 characters): 8-token windows inside a question score no target."""
    root = tmp_path_factory.mktemp("longq")
    rng = np.random.default_rng(0)
    for folder, n in [("train-easy", 200), ("train-medium", 10), ("train-hard", 10), ("dev", 30),
                      ("interpolate", 30), ("extrapolate", 30)]:
        (root / folder).mkdir()
        lines = []
        for a, b in zip(rng.integers(0, 50, n), rng.integers(0, 50, n)):
            lines += [f"Let us consider the following: what is {a} + {b}?", str(a + b)]
        (root / folder / "arith.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path_factory.mktemp("longq_data")
    return root, out, data_mod.Data(data_mod.prepare("dmmath", str(root), str(out)))


# ============================================================================ 1. sampling arguments

@pytest.mark.parametrize("kw,needle", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature="hot"), "temperature"),
    (dict(top_k=0), "top_k"), (dict(top_k=-3), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_k=True), "top_k"),
])
def test_bad_sampling_arguments_raise_naming_the_argument(kw, needle):
    torch.manual_seed(0)
    model = build_model(small_cfg("loop")).eval()
    idx = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"^{needle} .*: must be"):
        model.generate(idx, 4, **kw)
    with pytest.raises(ValueError, match=rf"^{needle} "):
        sample_next(torch.zeros(2, 23), **kw)


@pytest.mark.parametrize("n", [-1, 2.5, "3"])
def test_bad_max_new_tokens_raises(n):
    model = build_model(small_cfg("loop")).eval()
    with pytest.raises(ValueError, match=r"^max_new_tokens .*: must be an int >= 0"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), n)


def test_extreme_but_legal_sampling_values():
    """temperature 1e-30 is the argmax (it overflowed to NaN probabilities before); a huge
    temperature is uniform; top_k > V keeps every token; max_new_tokens 0 returns the prompt."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 23, generator=g) * 50
    for t in (1e-30, 1e-300, 5e-324):
        assert torch.equal(sample_next(logits, t)[:, 0], logits.argmax(-1))
    torch.manual_seed(1)
    draws = sample_next(logits[:1].expand(20000, -1), 1e300)[:, 0]
    counts = torch.bincount(draws, minlength=23).double() / 20000
    assert counts.min() > 0.03 and counts.max() < 0.06  # uniform: 1/23 = 0.0435 each
    torch.manual_seed(2)
    a = sample_next(logits, 1.0, top_k=10 ** 9)
    torch.manual_seed(2)
    assert torch.equal(a, sample_next(logits, 1.0))
    torch.manual_seed(3)  # top_k = 1 at any temperature is the argmax
    assert torch.equal(sample_next(logits, 7.0, top_k=1)[:, 0], logits.argmax(-1))
    model = build_model(small_cfg("loop")).eval()
    idx = torch.tensor([[1, 2, 3]])
    assert torch.equal(model.generate(idx, 0), idx)
    greedy = model.generate(idx, 5, temperature=0)
    assert torch.equal(model.generate(idx, 5, temperature=1e-30), greedy)


def test_negative_temperature_no_longer_samples_the_least_likely_tokens():
    model = build_model(small_cfg("loop")).eval()
    with pytest.raises(ValueError, match=r"temperature -1.0: must be a finite number >= 0 \(0 = greedy\)"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 20, temperature=-1.0)


def test_top_k_draws_follow_the_softmax_of_the_k_largest_logits():
    """1 < top_k < V: every draw is one of the k most likely ids, with frequency softmax(z / t) over
    those k (a top_k acting as 1, or as V, fails); 40000 seeded draws, 4 standard errors at most."""
    z = torch.tensor([2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.5, 0.2])
    top = [3, 0, 6]
    n = 40000
    for t in (1.0, 2.0):
        torch.manual_seed(0)
        draws = sample_next(z.expand(n, -1), temperature=t, top_k=3)[:, 0]
        freq = torch.bincount(draws, minlength=8).double() / n
        want = torch.zeros(8, dtype=torch.float64)
        want[top] = torch.softmax(z[top].double() / t, 0)
        assert set(draws.tolist()) == set(top)
        assert ((freq - want).abs() <= 4 * (want * (1 - want) / n).sqrt() + 1e-12).all(), (freq, want)
    torch.manual_seed(0)  # top_k = V - 1 drops the one smallest logit (index 4), never drawn
    assert set(sample_next(z.expand(n, -1), temperature=5.0, top_k=7)[:, 0].tolist()) == set(range(8)) - {4}


def test_generate_top_k_draws_from_the_models_k_most_likely_tokens():
    """LM.generate with top_k = 4 < V = 23: the first new token of 4000 copies of a prompt is drawn
    from the softmax over the model's 4 largest next-token logits."""
    torch.manual_seed(0)
    model = build_model(small_cfg("loop")).eval()  # top 4 probabilities 0.44, 0.19, 0.19, 0.18
    prompt = torch.tensor([[3, 1, 4]])
    with torch.no_grad():
        z = model(prompt)[0][0, -1].double()
    top = z.topk(4).indices
    want = torch.zeros(23, dtype=torch.float64)
    want[top] = torch.softmax(z[top], 0)
    assert want.max() < 0.9 and want[top].min() > 0.01
    torch.manual_seed(1)
    n = 4000
    out = model.generate(prompt.expand(n, -1), 1, temperature=1.0, top_k=4)
    freq = torch.bincount(out[:, 3], minlength=23).double() / n
    assert set(out[:, 3].tolist()) <= set(top.tolist())
    assert ((freq - want).abs() <= 4 * (want * (1 - want) / n).sqrt() + 1e-12).all(), (freq, want)


@pytest.mark.parametrize("n", [0, 1, 5])
def test_generate_runs_one_forward_per_sampled_token(n):
    """generate(idx, n) runs the prompt once and each sampled token but the last (nothing reads the
    last one's logits): max(n, 1) forwards, not n + 1."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(model="loop", vocab_size=50, block_size=32, n_embd=64, n_head=2, depth=2, width=128))
    calls = []
    model.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[1]))
    out = model.generate(torch.randint(0, 50, (2, 6)), n, temperature=0)
    assert out.shape == (2, 6 + n) and calls == ([6] + [1] * (n - 1) if n else [6])


def test_generate_stops_each_row_at_its_own_stop_token():
    """A batch of 3 rows whose (scripted, greedy) next tokens reach the stop token 2 at steps 3, 1
    and 5: each row ends at its own stop token (what follows it is the stop token again, not more
    sampled tokens), and the call ends when every row has stopped: 5 new tokens of max 10, 5 model
    calls (the prompt and 4 steps; none after the last token)."""
    model = build_model(small_cfg("loop")).eval()
    script = [[5, 7, 2, 9, 9, 9, 9, 9, 9, 9], [2, 4, 4, 4, 4, 4, 4, 4, 4, 4], [4, 4, 4, 4, 2, 6, 6, 6, 6, 6]]
    calls, rows = [], script

    def scripted(idx, targets=None, positions=None, cache=None):  # call k: row i's next token is rows[i][k]
        k, B = len(calls), idx.shape[0]
        calls.append(idx.shape)
        logits = torch.zeros(B, idx.shape[1], 23)
        logits[torch.arange(B), -1, torch.tensor([row[k] for row in rows])] = 10.0
        return logits, None

    model.forward = scripted
    prompt = torch.tensor([[1, 1], [3, 3], [8, 8]])
    out = model.generate(prompt, 10, temperature=0, stop_token=2)
    assert out[:, 2:].tolist() == [[5, 7, 2, 2, 2], [2, 2, 2, 2, 2], [4, 4, 4, 4, 2]]
    assert len(calls) == 5 and calls[0] == (3, 2) and all(c == (3, 1) for c in calls[1:])
    calls.clear()
    rows = script[1:2]
    one = model.generate(prompt[1:2], 10, temperature=0, stop_token=2)  # one row: ends at once
    assert one.tolist() == [[3, 3, 2]] and len(calls) == 1


# ============================================================================ 2. loss of an update

def run_for(d, model, starts, clip=1e9, seed=0):
    return SimpleNamespace(args=SimpleNamespace(device="cpu", block_size=8, grad_clip=clip, seed=seed),
                           dist=train.Dist(), data=d, model=model, train_model=model,
                           optimizer=torch.optim.SGD(model.parameters(), lr=1.0), ctx=contextlib.nullcontext(), it=0)


def test_micro_batch_without_scored_targets(long_questions):
    """One micro-batch of windows inside questions (no scored target): the update's loss is the
    NLL summed over the 3 micro-batches' scored targets / their count (it was NaN, a mean over 0)."""
    _, _, d = long_questions
    n = len(d.tokens("train")) - 9
    counts = {s: int((d.window_batch("train", [s], 8)[1] != -1).sum()) for s in range(0, n, 7)}
    empty = [s for s, c in counts.items() if c == 0][:2]
    full = sorted((s for s, c in counts.items() if c > 0), key=lambda s: -counts[s])[:4]
    assert len(empty) == 2 and len(full) == 4
    starts = [np.array(empty), np.array(full[:2]), np.array(full[2:])]
    torch.manual_seed(0)
    model = build_model(small_cfg("loop", vocab_size=d.vocab_size, block_size=8))
    ref = copy.deepcopy(model)
    nll, count = 0.0, 0
    for s in starts:
        x, y = d.window_batch("train", s, 8)
        total = F.cross_entropy(ref(x)[0].flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
        total.backward()
        nll, count = nll + total.item(), count + int((y != -1).sum())
    assert count == sum(counts[s] for s in full)
    grads = [p.grad / count for p in ref.parameters()]
    m = copy.deepcopy(model)
    loss, _ = train.train_update(run_for(d, m, starts), starts)
    assert math.isfinite(loss) and loss == pytest.approx(nll / count, rel=1e-6)
    for p0, p1, g in zip(model.parameters(), m.parameters(), grads):  # SGD lr 1, no clipping: p0 - p1 = grad
        assert torch.allclose(p0 - p1, g, rtol=1e-4, atol=1e-7)
    m = copy.deepcopy(model)  # an update with no scored target at all: loss 0, zero gradients
    loss, norm = train.train_update(run_for(d, m, starts[:1]), starts[:1])
    assert loss == 0.0 and norm == 0.0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m.parameters()))


@pytest.mark.parametrize("max_iters, first", [(250, 20), (12, 12)])  # a run shorter than --eval_interval: its end
def test_nonfinite_message_says_which_checkpoint_exists(max_iters, first, long_questions, tmp_path):
    _, _, d = long_questions
    model = build_model(small_cfg("loop", vocab_size=d.vocab_size, block_size=8))
    with torch.no_grad():
        model.norm_f.weight.fill_(float("nan"))
    args = SimpleNamespace(device="cpu", block_size=8, grad_clip=1.0, seed=0, eval_interval=20, max_iters=max_iters,
                           out_dir=str(tmp_path))
    r = train.Run(args, train.Dist(), d, model.cfg, 0, model, torch.optim.SGD(model.parameters(), lr=1.0),
                  np.random.default_rng(0), train_model=model, ctx=contextlib.nullcontext())
    starts = [np.array([0, 50])]
    with pytest.raises(train.TrainingError) as e:
        train.train_update(r, starts)
    assert str(e.value).endswith("at update 1; stopped; no checkpoint exists yet "
                                 f"(the first is written after update {first})")
    assert "ckpt_latest.pt" not in str(e.value)
    r.it, r.saved_at = 7, 5
    with pytest.raises(train.TrainingError) as e:
        train.train_update(r, starts)
    assert str(e.value).endswith(f"at update 8; stopped; the last good checkpoint is "
                                 f"{os.path.join(str(tmp_path), 'ckpt_latest.pt')} (update 5)")


@pytest.mark.parametrize("block,windows,split", [(8, 1, "dev"), (5, 3, "interpolate")])
def test_settings_whose_eval_windows_score_nothing_are_refused_before_training(block, windows, split, long_questions,
                                                                               tmp_path, capsys):
    """dmmath scores answer characters only: windows shorter than the questions can hold no scored
    target (a dev NLL of 0.0000 would win every evaluation). Such settings are one line before
    training, exit 2, no out_dir; also when only the test split's windows (interpolate here) are empty."""
    root, data_root, d = long_questions
    starts = d.eval_windows(split, block, windows)
    assert len(starts) == windows and not (d.window_batch(split, starts, block)[1] != -1).any()
    other = "dev" if split != "dev" else d.test_split
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(["--model", "loop", "--depth", "2", "--size", "tiny", "--width", "64", "--block_size", str(block),
                    "--eval_windows", str(windows), "--max_iters", "4", "--eval_interval", "2", "--sample_tokens", "0",
                    "--dataset", "dmmath", "--data_dir", str(root), "--data_root", str(data_root),
                    "--out_dir", str(tmp_path / "out"), "--quiet"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"error: --block_size {block} / --eval_windows {windows}: the {windows} fixed {split} windows hold no "
        f"scored target ({d.folder} scores answer tokens only); use a larger --block_size or more --eval_windows\n")
    assert not (tmp_path / "out").exists()
    if split != "dev":  # the dev windows do hold targets: only the test split stopped it
        s = d.eval_windows(other, block, windows)
        assert (d.window_batch(other, s, block)[1] != -1).any()


def test_evaluation_over_no_scored_target_is_never_a_number(long_questions):
    """evaluate (dev, test, the depth sweep, reflux) over windows without a scored target is a
    UsageError naming the split, never 0 / max(0, 1) = 0. Over windows that hold some, it is the
    NLL sum over the scored targets / their count (empty windows add nothing)."""
    from harness import evaluation
    _, _, d = long_questions
    torch.manual_seed(0)
    model = build_model(small_cfg("loop", vocab_size=d.vocab_size, block_size=8))
    empty = d.eval_windows("dev", 8, 1)
    run = lambda starts: train.evaluate(model, d, "dev", starts, 8, 4, "cpu", contextlib.nullcontext())
    with pytest.raises(UsageError, match=rf"^{d.folder}: the 1 dev windows of 8 tokens hold no scored target"):
        run(empty)
    with pytest.raises(UsageError, match="hold no scored target"):
        evaluation.depth_sweep(model, [1, 3], lambda: run(empty))
    assert model.body.depth == 2
    mixed = d.eval_windows("dev", 8, 8)
    x, y = d.window_batch("dev", mixed, 8)
    assert 0 < int((y != -1).sum()) and ((y != -1).sum(1) == 0).any()
    with torch.no_grad():
        total = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
    assert run(mixed) == pytest.approx(total.item() / int((y != -1).sum()), rel=1e-5)


# ============================================================================ 3. random draws

def seeded_forward(model, global_seed, micro_batch):
    train.seed_random_draws(model, 1337, 0, micro_batch)
    torch.manual_seed(global_seed)
    x = torch.arange(2 * 16).view(2, 16) % 23
    return model(x)[0]


@pytest.mark.parametrize("name", list(REGISTRY))
def test_training_draws_depend_only_on_seed_update_and_micro_batch(name):
    """A training forward of every model is a function of (seed, update, micro-batch index): torch's
    global RNG state does not enter (Parcae's and RDM's depths and h_0 came from it)."""
    torch.manual_seed(0)
    model = build_model(small_cfg(name, depth=3, mu_rec=3)).train()
    a, b = seeded_forward(model, 1, 0), seeded_forward(model, 2, 0)
    assert torch.equal(a, b)
    if any(hasattr(m, "rng_seed") for m in model.modules()):  # the models that draw: another index, other draws
        # (PonderLM-2 draws one of two Jacobi counts, so other indices may draw the same: try eight)
        assert any(not torch.equal(a, seeded_forward(model, 1, i)) for i in range(1, 9))


def drawing_models():
    """The registered models with a module that draws in training (an rng_seed attribute), at their defaults."""
    return [n for n in REGISTRY if any(hasattr(m, "rng_seed") for m in build_model(small_cfg(n)).modules())]


def test_the_drawing_models_are_the_nominal_ones():
    """A model draws a random depth or iteration count in training (Parcae, RDM; PonderLM-2 its Jacobi
    count) exactly when flops.py calls its training FLOPs nominal: two sources, one set."""
    import flops
    assert drawing_models() and set(drawing_models()) == set(flops.TRAIN_FLOPS_NOMINAL)


def run_train(argv, torchrun=2):
    """train.py under torchrun with that many processes (gloo on CPU)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(torchrun)]
    p = subprocess.run([*launcher, os.path.join(REPO, "train.py"), *argv], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def log_of(out, event):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["event"] == event]


@pytest.mark.parametrize("name", drawing_models())
def test_ddp_equals_one_process_for_models_that_draw(name, long_questions, tmp_path):
    """Models that draw random depths (Parcae, RDM) or Jacobi counts (PonderLM-2), under DDP: 2
    updates of 2 micro-batches, once alone and once under torchrun with 2 processes: parameters
    within 1e-6, equal losses and dev NLL (the draws depend on the update and the micro-batch, not
    on the rank). Parametrized by the models that draw (drawing_models)."""
    root, data_root, _ = long_questions
    model_flags = ["--n_prelude", "1", "--n_core", "1", "--n_coda", "1"] if name != "ponder" else ["--size", "tiny"]
    flags = ["--model", name, "--depth", "2", *model_flags,
             "--block_size", "32", "--batch_size", "2", "--gradient_accumulation_steps", "2", "--max_iters", "2",
             "--eval_interval", "1", "--eval_windows", "4", "--eval_batch_size", "4", "--em_samples", "2",
             "--sample_tokens", "0", "--dataset", "dmmath", "--data_dir", str(root), "--data_root", str(data_root),
             "--quiet"]
    one_process_equals_ddp(flags, tmp_path)


def one_process_equals_ddp(flags, tmp_path):
    """train.py with `flags` alone and under torchrun with 2 processes: parameters within 1e-6,
    equal training losses and dev NLL at every evaluation."""
    train.main([*flags, "--out_dir", str(tmp_path / "one")])  # in this process: saves a start-up
    run_train([*flags, "--out_dir", str(tmp_path / "ddp")], torchrun=2)
    a = torch.load(tmp_path / "one" / "ckpt_latest.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "ddp" / "ckpt_latest.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    one, ddp = log_of(tmp_path / "one", "train"), log_of(tmp_path / "ddp", "train")
    assert len(one) == len(ddp) and [r["loss"] for r in ddp] == pytest.approx([r["loss"] for r in one], rel=1e-6)
    one, ddp = log_of(tmp_path / "one", "eval"), log_of(tmp_path / "ddp", "eval")
    assert len(one) == len(ddp) and [r["dev_nll"] for r in ddp] == pytest.approx([r["dev_nll"] for r in one], rel=1e-6)


@pytest.mark.parametrize("model_flags", [["--model", "loopfold", "--depth", "4", "--fold", "1"],
                                         ["--model", "plt", "--depth", "1"]])
def test_ddp_trains_models_at_settings_that_could_leave_parameters_idle(model_flags, long_questions, tmp_path):
    """LoopFold at f = 1 (and PLT at N = 1), where a predictor and corrector without a gradient
    would stop DDP ("Expected to have finished reduction in the prior iteration") or leave the ranks
    with different weights: 3 updates of 2 micro-batches under torchrun equal the one-process run
    (tests/test_gradients.py checks every model)."""
    root, data_root, _ = long_questions
    flags = [*model_flags, "--n_core", "1", "--size", "tiny", "--width", "64", "--block_size", "16",
             "--batch_size", "2", "--gradient_accumulation_steps", "2", "--max_iters", "3", "--eval_interval", "1",
             "--eval_windows", "4", "--eval_batch_size", "4", "--em_samples", "2", "--sample_tokens", "0",
             "--dataset", "dmmath", "--data_dir", str(root), "--data_root", str(data_root), "--quiet"]
    one_process_equals_ddp(flags, tmp_path)


# ============================================================================ 4. latent tokens, half precision

def tiny_llama(dtype):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional)",
                                       exc_type=ImportError)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=13, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_latent_table_and_adam_state_stay_float32(dtype):
    base = tiny_llama(dtype)
    llm = lt.LatentLM(base, "Comma_2", marker_ids=[2])
    assert llm.Z.dtype == torch.float32 and base.get_input_embeddings().weight.dtype == dtype
    rng = np.random.default_rng(0)
    augs = [llm.augment([1] + list(rng.integers(3, 13, 12)) + [2] + list(rng.integers(3, 13, 6)), 6)
            for _ in range(16)]
    z0 = llm.Z.detach().clone()
    llm.train()
    losses = lt.train_latents(llm, augs, epochs=3, batch_size=4, lr=5e-2, min_lr=5e-5, warmup=0.01)
    assert llm.training and not base.training  # the mode it found (the base stays frozen in eval)
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    assert llm.Z.dtype == torch.float32
    assert (llm.Z.detach() != z0).float().mean().item() > 0.99  # every entry moved, also late in the schedule
    # the last update (lr at the floor 5e-5) still moves Z: it is not lost to half-precision rounding
    z1 = llm.Z.detach().clone()
    opt = torch.optim.AdamW([llm.Z], lr=5e-5, weight_decay=1e-4)
    llm.loss(augs[:4]).backward()
    opt.step()
    assert all(s.dtype == torch.float32 for s in opt.state[llm.Z].values() if torch.is_tensor(s) and s.dim())
    assert (llm.Z.detach() != z1).float().mean().item() > 0.99


def task_base(tmp_path, name, fill):
    """A tiny loop Transformer++ checkpoint on the task vocabulary whose body matrices are `fill`."""
    cfg = ModelConfig(model="loop", vocab_size=len(tasks.TASK_VOCAB), block_size=64, n_embd=32, n_head=1, depth=1,
                      width=64)
    state = {k: v.clone() for k, v in build_model(cfg).state_dict().items()}
    for k, v in state.items():
        if k.startswith("body.") and v.dim() == 2:
            v.fill_(fill)
    torch.save({"model": state, "config": cfg.to_dict(),
                "data": {"tokenizer": "task", "vocab_size": len(tasks.TASK_VOCAB), "itos": tasks.TASK_VOCAB}},
               tmp_path / name)
    return str(tmp_path / name)


def latent_run(base, capsys):
    """A tiny latent-token run on the base checkpoint at path base; returns (exit code, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        latent_experiments.main(["--base", base, "--task", "summation", "--policy", "Comma_2",
                                 "--n_train", "8", "--epochs", "1", "--n_test", "2"])
    return e.value.code, capsys.readouterr().err


def test_latent_tokens_nonfinite_loss_exits_1(tmp_path, capsys):
    """A base whose forward overflows (finite weights of 1e30, so the residual stream reaches inf
    and the loss NaN): the run stops with one line and exit code 1, not a 0 % accuracy and exit 0."""
    code, err = latent_run(task_base(tmp_path, "huge.pt", 1e30), capsys)
    assert code == 1
    assert re.fullmatch(r"error: non-finite loss \(nan\) or gradient norm \(nan\) at step 1 \(epoch 1\); stopped\n",
                        err), err


def test_a_base_with_nan_weights_is_a_damaged_file(tmp_path, capsys):
    """NaN in a checkpoint's weights is refused at load (one line naming the file and a tensor,
    exit 2): train.py stops at a non-finite dev NLL before it saves, so such a file is damaged."""
    base = task_base(tmp_path, "nan.pt", float("nan"))
    code, err = latent_run(base, capsys)
    assert code == 2
    assert err == (f"error: --base {base}: non-finite weights (body.blocks.0.attn.qkv.weight and 3 more); "
                   "the file is damaged\n"), err


# ============================================================================ 5. scaling-law fits

def test_fit_skips_a_law_whose_variables_do_not_vary():
    """Five runs of one model and size (one N, one D): the training law is skipped with its reason
    instead of printing E = 4.4e-12, A = 1.4e-12; a depth sweep over 2 depths likewise."""
    runs = [{"path": f"run{i}", "model": "loop", "N": 1e6, "D": 2e7, "mu_rec": 4, "dev_nll": 2.0 + 0.01 * i,
             "sweep_depths": [1, 1, 2, 2, 2] if i == 0 else None, "sweep_nll": [3, 2.9, 2.5, 2.4, 2.5]}
            for i in range(5)]
    rows = {r["law"]: r for r in flops_fit.fit_runs(runs, restarts=2)}
    assert "params" not in rows["training"] and "params" not in rows["depth"] and "params" not in rows["unified"]
    assert rows["training"]["error"] == "training law: N takes 1 distinct value in these runs; " \
                                        "fitting its exponent needs >= 3"
    assert rows["depth"]["error"] == "depth law: T takes 2 distinct values in these runs; fitting its exponent needs >= 3"
    with pytest.raises(UsageError, match="D takes 2 distinct values"):
        flops_fit.fit_training_law([1e6, 2e6, 4e6, 8e6, 1.6e7], [1e7, 1e7, 2e7, 2e7, 2e7], [3, 2.8, 2.6, 2.5, 2.4])


def parcae_runs(depths, iters_per_depth):
    """read_run dicts of Parcae runs at these depths (tiny-like widths), --max_iters proportional to
    the depth (iters_per_depth each; 8 x 256 tokens per update), their dev NLL from a training law."""
    import flops
    runs = []
    for k in depths:
        cfg = ModelConfig(model="parcae", vocab_size=4096, block_size=256, n_embd=128, n_head=4, depth=k, width=128,
                          n_prelude=1, n_core=1, n_coda=1)
        N, D = flops.unrolled_params(cfg), float(iters_per_depth * k * 8 * 256)
        runs.append({"path": f"run-K{k}", "model": "parcae", "N": N, "D": D, "mu_rec": k, "sweep_depths": None,
                     "sweep_nll": None, "dev_nll": 1.5 + 300.0 * N ** -0.35 + 400.0 * D ** -0.3})
    return runs


def test_fit_names_a_design_that_cannot_identify_its_exponents(tmp_path, capsys):
    """Five Parcae runs at depth k with --max_iters proportional to k: N and D both grow with k
    (correlation 0.99 in logs), so the training law's a and b trade off against each other; the fit
    comes with a warning naming the reason, printed and in --out. N exactly proportional to D (a
    rank-deficient design) is refused; a grid of N and D is fit without a word."""
    runs = parcae_runs([1, 2, 3, 4, 5], 200)
    (row,) = flops_fit.fit_runs(runs, "training", restarts=2)
    assert "params" in row and row["warning"].startswith(
        "training law: log N and log D move together in these runs (correlation 0.98")
    cond, (u, v, r) = flops_fit.design_condition(**{"log N": torch.tensor([x["N"] for x in runs]).log(),
                                                    "log D": torch.tensor([x["D"] for x in runs]).log()})
    assert 10 < cond < 30 and (u, v) == ("log N", "log D") and 0.98 < r < 0.99
    assert row["warning"].endswith(f"the design in log N, log D has condition number {cond:.3g} > 10): a and b are "
                                   "weakly identified (the fit trades one for another); vary N and D independently "
                                   "(e.g. two --max_iters per depth)")
    with pytest.raises(UsageError, match=r"^training law: log N and log D move together in these runs \(correlation "
                                         r"1\.0000; the design in log N, log D is rank deficient\): a and b cannot be "
                                         r"identified; vary N and D independently"):
        flops_fit.fit_training_law([1e6 * k for k in range(1, 6)], [4e8 * k for k in range(1, 6)],
                                   [3.0, 2.8, 2.7, 2.6, 2.55])
    grid = parcae_runs([1, 3, 5], 200) + parcae_runs([1, 3, 5], 600)
    for i, r in enumerate(grid):
        r["path"] = f"grid{i}"
    (row,) = flops_fit.fit_runs(grid, "training", restarts=2)
    assert "params" in row and "warning" not in row
    cond, _ = flops_fit.design_condition(**{"log N": torch.tensor([x["N"] for x in grid]).log(),
                                            "log D": torch.tensor([x["D"] for x in grid]).log()})
    assert cond < 10 and math.isfinite(cond)
    for i, r in enumerate(runs):  # the command line: the fit, then the warning
        fit_log_parcae(tmp_path / f"K{i + 1}", r)
    capsys.readouterr()
    assert flops_fit.main([str(tmp_path / f"K{i}") for i in range(1, 6)] + ["--law", "training", "--restarts", "2",
                                                                           "--out", str(tmp_path / "fits.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("training parcae     5 pts  E=") and out[1].startswith(
        "         warning: training law: log N and log D move together") and len(out) == 2
    assert json.load(open(tmp_path / "fits.json"))[0]["warning"] == out[1].split("warning: ", 1)[1]


def fit_log_parcae(folder, run):
    """A finished Parcae run's log.jsonl whose N and D are run's (the depth k of its path)."""
    os.makedirs(folder, exist_ok=True)
    k = int(run["path"].split("K")[1])
    cfg = ModelConfig(model="parcae", vocab_size=4096, block_size=256, n_embd=128, n_head=4, depth=k, width=128,
                      n_prelude=1, n_core=1, n_coda=1)
    events = [{"event": "start", "config": cfg.to_dict(), "args": {"batch_size": 8, "gradient_accumulation_steps": 1}},
              {"event": "summary", "best_iter": 0, "dev_nll": run["dev_nll"], "tokens": run["D"]}]
    with open(os.path.join(folder, "log.jsonl"), "w") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events))


def fit_log(folder, dev_nll, sweep=None):
    """A finished train.py run for flops_fit.read_run: log.jsonl with a start, a summary and, with
    sweep = (depths, dev NLLs), a depth_sweep event."""
    os.makedirs(folder, exist_ok=True)
    cfg = ModelConfig(model="tango", vocab_size=64, block_size=16, n_embd=32, n_head=1, depth=2, width=32)
    events = [{"event": "start", "config": cfg.to_dict(), "args": {"batch_size": 2, "gradient_accumulation_steps": 1},
               "non_embedding_params": 1000},
              {"event": "summary", "best_iter": 10, "dev_nll": dev_nll, "tokens": 320}]
    if sweep:
        events.append({"event": "depth_sweep", "depths": sweep[0], "dev_nll": sweep[1]})
    with open(os.path.join(folder, "log.jsonl"), "w") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events))
    return str(folder)


@pytest.mark.parametrize("law, message", [
    ("depth", "depth law: no run has a depth_sweep event (train.py --eval_depths, e.g. 1,2,4,8,16)"),
    ("all", "depth law: no run has a depth_sweep event (train.py --eval_depths, e.g. 1,2,4,8,16); tango: training "
            "law: 1 points cannot determine 5 parameters; tango: unified law: no run has a depth_sweep event (train.py "
            "--eval_depths, e.g. 1,2,4,8,16)"),
])
def test_fit_with_nothing_to_fit_is_an_error_and_writes_nothing(law, message, tmp_path, capsys):
    """Nothing fittable (--law depth without any depth_sweep) is one line naming what is missing,
    exit 2, no --out file (not an empty [] and exit 0)."""
    run = fit_log(tmp_path / "run", 2.0)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        flops_fit.main([run, "--law", law, "--restarts", "1", "--out", str(tmp_path / "fits.json")])
    assert e.value.code == 2
    assert capsys.readouterr() == ("", f"tools.flops_fit: error: nothing could be fit (a law is fit per model): {message}\n")
    assert os.listdir(tmp_path) == ["run"]


@pytest.mark.parametrize("again", ["run", "run/", "run/log.jsonl", "link"])
def test_fit_refuses_a_run_given_twice(again, tmp_path, monkeypatch, capsys):
    """The same run named twice (its folder, with a slash, its log, a link to it) is refused: it
    counted as two data points and made a fit of too few runs look determined."""
    monkeypatch.chdir(tmp_path)
    fit_log(tmp_path / "run", 2.0)
    os.symlink("run", "link")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        flops_fit.main(["run", again, "--law", "training", "--restarts", "1"])
    assert e.value.code == 2
    assert capsys.readouterr() == ("", f"tools.flops_fit: error: {again}: the same run as run (each run at most once)\n")


def test_fit_n_counts_the_unembedding_for_every_model(tmp_path):
    """N of the fits is Parcae's: non-embedding parameters plus the unembedding V d (the tied E once),
    for a fixed-depth model as for a looped one (flops.unrolled_params), from the run's config."""
    r = flops_fit.read_run(fit_log(tmp_path / "run", 2.0))
    assert r["N"] == models.count_params(r["config"]) + 64 * 32 and r["N"] != 1000 + 64 * 32


def test_fit_says_skipped_for_every_law_it_cannot_fit(tmp_path, capsys):
    """--law all says "skipped: ..." for every law it cannot fit, the depth law included when no run
    has a sweep. --out in a missing folder is created (as every command's output paths); --out
    under a file is refused before the fits."""
    swept = fit_log(tmp_path / "a", 2.0, ([1, 2, 4, 8], [3.0, 2.5, 2.2, 2.1]))
    rows = flops_fit.fit_runs([flops_fit.read_run(fit_log(tmp_path / "b", 2.1))], "all", restarts=1)
    assert [(r["law"], r["label"], r["error"]) for r in rows if r["law"] == "depth"] == [
        ("depth", "every run", flops_fit.NO_SWEEP.format("depth"))]
    capsys.readouterr()
    assert flops_fit.main([swept, str(tmp_path / "b"), "--law", "all", "--restarts", "1",
                           "--out", str(tmp_path / "new" / "fits.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["depth", "training", "unified"]
    assert "L_inf=" in out[0] and "skipped: training law: 2 points" in out[1] and "skipped: unified law" in out[2]
    assert [r["law"] for r in json.load(open(tmp_path / "new" / "fits.json"))] == ["depth", "training", "unified"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as e:
        flops_fit.main(["no-such-run", "--out", str(tmp_path / "afile" / "f.json")])
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"tools.flops_fit: error: --out {tmp_path / 'afile' / 'f.json'}: {tmp_path / 'afile'} is a file, not a folder\n")


# ============================================================================ 6. sweep settings

def fake_run(folder, argv, summary):
    """A finished run folder: log.jsonl with train.py's resolved flags for argv, and summary.json."""
    os.makedirs(folder, exist_ok=True)
    a = vars(resolve_args(train.parse_args([*argv, "--out_dir", str(folder)])))
    with open(os.path.join(folder, "log.jsonl"), "w") as f:
        f.write(json.dumps({"event": "start", "args": a}) + "\n")
    if summary is not None:
        with open(os.path.join(folder, "summary.json"), "w") as f:
            json.dump(summary, f)


SUMMARY = dict(model="tango-windowed", depth=2, size="tiny", dataset="dmmath", width=100, non_embedding_params=1000,
               params=2000, best_iter=4, dev_nll=2.0, test_split="interpolate", test_nll=2.1, unigram_dev=3.0,
               tokens=100, tok_per_s_median_last100=10.0, data_seed=1, world_size=1, wall_s=1.0)


def test_sweep_run_refuses_a_run_trained_with_other_flags(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    fake_run(root / "dmmath" / "tango-windowed-K2-s1",
             ["--model", "tango-windowed", "--depth", "2", "--dataset", "dmmath", "--seed", "1", "--data_seed", "1",
              "--size", "tiny", "--window", "8"], dict(SUMMARY, seed=1))
    started = []
    monkeypatch.setattr(sweep, "prepare_data", lambda *a: started.append("prepare"))
    monkeypatch.setattr(sweep, "run_process", lambda cmd, stdout, env: started.append(cmd) or 0)
    argv = ["run", "--root", str(root), "--models", "tango-windowed", "--depths", "2", "--datasets", "dmmath"]
    with pytest.raises(UsageError) as e:
        sweep.main([*argv, "--seeds", "2", "--", "--size", "tiny", "--window", "16"])
    assert str(e.value) == (f"{root / 'dmmath' / 'tango-windowed-K2-s1'}: trained with --window 8, this sweep asks "
                            "for --window 16; use another --root (or delete that run) to change a setting")
    assert started == []  # nothing prepared, nothing trained
    assert sweep.main([*argv, "--seeds", "2", "--", "--size", "tiny", "--window", "8"]) == 0  # same flags: fine
    assert started[0] == "prepare" and len(started) == 2 and "--seed" in started[1] and "2" in started[1]


def test_sweep_report_refuses_a_cell_of_mixed_settings(tmp_path):
    root = tmp_path / "runs"
    common = ["--model", "tango-windowed", "--depth", "2", "--dataset", "dmmath", "--size", "tiny"]
    fake_run(root / "dmmath" / "a-s1", [*common, "--seed", "1", "--window", "8"], dict(SUMMARY, seed=1))
    fake_run(root / "dmmath" / "a-s2", [*common, "--seed", "2", "--window", "16"], dict(SUMMARY, seed=2))
    with pytest.raises(UsageError, match=r"dmmath/tango-windowed/2: .*a-s1 has --window 8, .*a-s2 has --window 16"):
        sweep_report.report(str(root))
    with pytest.raises(UsageError, match="--window 8"):
        sweep_report.load_runs(str(root))
    fake_run(root / "dmmath" / "a-s2", [*common, "--seed", "2", "--window", "8"], dict(SUMMARY, seed=2))
    assert "| tango-windowed | 2 | 2 |" in sweep_report.report(str(root))  # only the seed differs: one cell of 2 runs
    # collected runs (summary.json only): the summaries' settings are compared
    os.remove(root / "dmmath" / "a-s1" / "log.jsonl")
    with open(root / "dmmath" / "a-s1" / "summary.json", "w") as f:
        json.dump(dict(SUMMARY, seed=1, width=128), f)
    with pytest.raises(UsageError, match="has width 128, .* has width 100"):
        sweep_report.report(str(root))


# ============================================================================ 7. BPE tests without the vocabulary

def test_bpe_tests_skip_with_the_reason_without_the_vocabulary(tmp_path):
    missing = str(tmp_path / "missing.tiktoken")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "tests/test_data.py::test_gpt2_encoder_from_file", "tests/test_data.py::test_batches_and_windows",
                        "tests/test_data.py::test_bin_uint32_round_trip"],
                       capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={**os.environ, "GPT2_BPE_FILE": missing, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:]
    assert "1 passed, 2 skipped" in p.stdout
    assert p.stdout.count(f"GPT2_BPE_FILE={missing} does not exist; the GPT-2 BPE tests need it "
                          "(tests never download the vocabulary)") == 2


def test_every_test_that_needs_the_vocabulary_skips_with_the_one_reason(tmp_path):
    """GPT2_BPE_FILE naming a missing file: no test of these files fails (a UsageError or exit 2
    from the tokenizer); every skip is the shared gpt2_bpe fixture's (conftest.py), with its reason,
    or the optional `datasets` extra's."""
    missing = str(tmp_path / "missing.tiktoken")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "tests/test_values.py", "tests/test_hf_data.py", "tests/test_data.py"],
                       capture_output=True, text=True, cwd=REPO, timeout=600,
                       env={**os.environ, "GPT2_BPE_FILE": missing, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0 and " failed" not in p.stdout and " error" not in p.stdout, p.stdout[-3000:]
    skips = [line for line in p.stdout.splitlines() if line.startswith("SKIPPED")]
    reason = (f"GPT2_BPE_FILE={missing} does not exist; the GPT-2 BPE tests need it "
              "(tests never download the vocabulary)")
    assert len(skips) >= 10 and all(line.endswith(reason) or "pip install datasets" in line for line in skips), skips


# ============================================================================ 8. leftovers

def test_offline_bpe_error_leaves_no_data_root(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPT2_BPE_FILE", str(tmp_path / "missing.tiktoken"))
    (tmp_path / "text.txt").write_text("some text " * 100)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(["--dataset", str(tmp_path / "text.txt"), "--tokenizer", "gpt2", "--data_root", str(tmp_path / "new" / "data"),
                    "--out_dir", str(tmp_path / "out"), "--quiet"])
    assert e.value.code == 2 and "GPT2_BPE_FILE" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["text.txt"]  # neither data root (nor its parent) nor out_dir


def test_helpers_restore_the_mode_they_found(long_questions):
    _, _, d = long_questions
    model = build_model(small_cfg("parcae", vocab_size=d.vocab_size, block_size=8))
    ctx = contextlib.nullcontext()
    starts = d.eval_windows("dev", 8, 4)
    for setting in ("eval", "train", "mixed"):
        model.train(setting != "eval")
        if setting == "mixed":
            model.body.eval()
        before = [m.training for m in model.modules()]
        train.evaluate(model, d, "dev", starts, 8, 2, "cpu", ctx)
        assert [m.training for m in model.modules()] == before, setting
        train.exact_match(model, d, "interpolate", 2, "cpu", ctx)
        assert [m.training for m in model.modules()] == before, setting
        train.print_sample(model, d, SimpleNamespace(sample_tokens=3, seed=0, block_size=8), "cpu", ctx)
        assert [m.training for m in model.modules()] == before, setting


def test_the_end_of_training_sample_notes_positions_past_the_trained_context(long_questions, capsys):
    """train.py's sample says on stderr, as sample.py does, when its tokens pass --block_size (the
    last sampled token is never fed): prompt + n - 1 fed positions. The prompt is one end-of-text
    token on text, a problem's question on dmmath."""
    _, _, mdm = long_questions
    q0, a0, _ = mdm.problems(mdm.test_split)[0]
    text = SimpleNamespace(problems=lambda split: None, test_split="test", eot=0, decode=lambda ids: "x" * len(ids))
    ctx = contextlib.nullcontext()
    for d, prompt in ((text, 1), (mdm, a0 - q0)):
        model = build_model(small_cfg("loop", vocab_size=mdm.vocab_size, block_size=8))
        for block_size, note in ((prompt + 3, False), (prompt + 2, True)):  # 4 new tokens: prompt + 3 positions fed
            train.print_sample(model, d, SimpleNamespace(sample_tokens=4, seed=0, block_size=block_size), "cpu", ctx)
            err = capsys.readouterr().err
            want = (f"note: {prompt} prompt + 4 new tokens exceed the trained context of {block_size} by more than "
                    "the last token: the later tokens are sampled at positions never trained on\n")
            assert err == (want if note else ""), (prompt, block_size, err)


# ============================================================================ 9. weight decay

@pytest.mark.parametrize("name", list(REGISTRY))
def test_only_weight_matrices_are_decayed(name):
    """AdamW's decayed group is the weight matrices and the embedding, by the rule every model
    declares (harness.optim.no_decay_parameters): every vector and scalar (norm gains, biases, TANGO's
    log_tau and null, Parcae's A_log and dt_bias, PLT's a, b and gate bias) is exempt, and a matrix
    is exempt only where its module class names it in no_decay (GAU/FLASH's gamma and beta, which
    are (n_qk, s) matrices; Parcae's B and C). No list per model: a new model is held to the rule."""
    model = build_model(small_cfg(name, **({"depth": 3} if name == "loopfold" else {})))  # a stage of two loops
    opt = make_optimizer(model, 1e-3, AdamW(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, exempt = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and exempt["weight_decay"] == 0.0
    assert len(decayed["params"]) + len(exempt["params"]) == len(names)
    declared = {id(p) for p in no_decay_parameters(model)}
    assert [names[id(p)] for p in decayed["params"] if p.dim() < 2] == []  # no gain, bias or scalar decays
    assert [names[id(p)] for p in exempt["params"] if id(p) not in declared] == []
    assert [names[id(p)] for p in decayed["params"]] == [n for n, p in model.named_parameters()
                                                         if p.dim() >= 2 and id(p) not in declared]
    assert "wte.weight" in [names[id(p)] for p in decayed["params"]]  # the tied embedding decays
    matrices = {names[id(p)].rsplit(".", 1)[-1] for p in exempt["params"] if p.dim() >= 2}
    assert matrices <= {"gamma", "beta", "B", "C"}, matrices  # the matrices the papers keep out of the decay


# ============================================================================ 10. CI extras

def ci_installs():
    """The pip install lines of .ci/run and the requirement lines of the files they name (-r FILE)."""
    lines = [line for line in open(os.path.join(REPO, ".ci", "run")).read().splitlines()
             if "pip install" in line and not line.lstrip().startswith("#")]
    for name in re.findall(r"-r\s+(\S+)", " ".join(lines)):
        lines += [line.split("#")[0].strip() for line in open(os.path.join(REPO, name)).read().splitlines()]
    return lines


def test_ci_installs_every_optional_extra_the_tests_import():
    """Every package a test imports with pytest.importorskip is installed by .ci/run, so those tests
    run (not skip) on every submission."""
    wanted = set()
    for folder in (REPO, os.path.join(REPO, "tests")):
        for f in os.listdir(folder):
            if f.startswith("test_") and f.endswith(".py"):
                wanted |= set(re.findall(r"importorskip\(\s*\"(\w+)\"", open(os.path.join(folder, f)).read()))
    assert {"transformers", "matplotlib"} <= wanted
    installs = " ".join(ci_installs())
    assert all(re.search(rf"\b{w}\b", installs) for w in wanted), (wanted, installs)


def test_ci_installs_the_test_packages_a_new_user_gets():
    """The test packages are declared where a user installs them (requirements-dev.txt, pytest
    among them), and CI installs that file with --upgrade: the versions a new user gets today
    (pytest 9.2's monkeypatch undo broke the suite where CI kept the machine's older pytest), with
    torch held at its pin in the same command."""
    dev = [line.split("#")[0].strip() for line in open(os.path.join(REPO, "requirements-dev.txt"))]
    assert "pytest" in dev and "matplotlib==3.11.2" in dev
    (line,) = [line for line in open(os.path.join(REPO, ".ci", "run")).read().splitlines()
               if "pip install" in line and not line.lstrip().startswith("#")]
    args = line.split()
    assert "--upgrade" in args and "torch==2.13.0" in args, line
    assert [args[i + 1] for i, a in enumerate(args) if a == "-r"] == ["requirements.txt", "requirements-dev.txt"]


# ============================================================================ 11. a newcomer's pass

def run_cli(script, argv, monkeypatch, capsys):
    """python SCRIPT ARGV in this process (runpy: the file's __main__ block, as on the command line);
    returns (exit code, stdout, stderr)."""
    import runpy
    monkeypatch.setattr(sys, "argv", [script, *argv])
    capsys.readouterr()
    code = 0
    try:
        if script.endswith(".py"):
            runpy.run_path(os.path.join(REPO, script), run_name="__main__")
        else:  # python -m PACKAGE.MODULE, in a fresh module object as on the command line
            monkeypatch.delitem(sys.modules, script, raising=False)
            runpy.run_module(script, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("script,argv,needle", [
    ("train.py", ["--depth", "x"], "--depth"),
    ("data.py", ["--num_proc", "x"], "--num_proc"),
    ("tools.sweep", [], "{run,collect,plot,report}"),
    ("tools.sweep", ["run", "--seeds", "x"], "--seeds"),
    ("tools.sweep", ["report"], "--root"),
    ("tools.bench", ["--depth", "x"], "--depth"),
    ("tools.bench", ["decode", "--depth", "x"], "--depth"),
    ("flops.py", ["--depth", "x"], "--depth"),
    ("tools.flops_fit", [], "runs"),
    ("studies.reflux_cli", ["--xi", "x"], "--xi"),
    ("studies.reflux_cli", ["sweep", "--base"], "--base"),
    ("studies.latent_experiments", ["--task", "summation"], "--base"),
    ("studies.latent_experiments", ["pretrain", "--steps", "x"], "--steps"),
    ("studies.latent_experiments", ["sweep", "--seeds", "x"], "--seeds"),
    # a flag's prefix is not that flag (argparse would read --out as --out_dir, past every check by name)
    ("train.py", ["--out", "x"], "--out"),
    ("sample.py", ["--out", "x"], "--out"),
    ("data.py", ["--datas", "x"], "--datas"),
    ("tools.sweep", ["run", "--roo", "x"], "--roo"),
    ("tools.sweep", ["run", "--root", "x", "--", "--out", "y"], "--out"),
    ("tools.bench", ["--mod", "tango"], "--mod"),
    ("flops.py", ["--mod", "tango"], "--mod"),
    ("tools.flops_fit", ["x", "--ou", "y"], "--ou"),
    ("studies.reflux_cli", ["--bas", "x"], "--bas"),
    ("studies.latent_experiments", ["pretrain", "--out", "x"], "--out"),
    ("data.py", ["--max_tokens", "inf"], "--max_tokens"),
    ("train.py", ["--max_tokens", "1e400"], "--max_tokens"),
    ("results/gpu_estimate.py", ["--mod", "tango"], "--mod"),
    ("results/gpu_estimate.py", ["--depths", "x"], "--depths x: comma-separated whole numbers >= 1"),
    ("results/gpu_estimate.py", ["--models", "nope"], "--models nope: comma-separated train.py --model names"),
    ("results/gpu_estimate.py", ["--eval_interval", "0"], "--eval_interval 0: must be >= 1"),
    ("results/gpu_estimate.py", ["--assume", "1.5"], "--assume 1.5: comma-separated pairs AxF"),
    ("results/gpu_estimate.py", ["--decode_steps", "nan"], "--decode_steps nan: must be a finite number > 0"),
    ("results/gpu_estimate.py", ["--models", "tango,tango-3set", "--depths", "4,2"],
     "--models tango-3set --depths 2: --depth 2: --model tango-3set needs depth >= 3"),
])
def test_every_cli_reports_a_bad_flag_on_one_line_with_exit_code_2(script, argv, needle, tmp_path, monkeypatch,
                                                                     capsys):
    """A flag argparse rejects (a missing, mistyped or valueless one) is one line on stderr naming the
    flag, exit code 2, for every command line (no argparse usage block); a flag's prefix is not the flag."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(script, argv, monkeypatch, capsys)
    assert code == 2 and out == "", (code, out)
    assert err.count("\n") == 1 and re.match(r"(\S+ )*error: ", err) and needle in err, err
    assert os.listdir(tmp_path) == []


def test_gpu_estimate_prints_small_kernel_counts_with_two_digits(monkeypatch, capsys):
    """Counts below 10M kernels keep two significant digits (0.16M evaluations, not 0M); larger ones
    whole millions, each equal to the same sum printed unrounded."""
    gpu_estimate = __import__("runpy").run_path(os.path.join(REPO, "results/gpu_estimate.py"))
    assert [gpu_estimate["millions"](n) for n in (162_000, 1_530_000, 9_990_000, 10_400_000, 457_000_000)] == \
        ["0.16M", "1.5M", "10M", "10M", "457M"]
    code, out, _ = run_cli("results/gpu_estimate.py", ["--models", "tango", "--depths", "4"], monkeypatch, capsys)
    line = next(x for x in out.splitlines() if x.startswith("eager kernels"))
    assert code == 0 and " 0M" not in line and re.search(r"evaluations 0\.\d\dM", line), line


@pytest.mark.parametrize("script,argv,message", [
    ("data.py", ["--dataset", "stdlib", "--data_root", "afile"], "error: --data_root afile: exists and is not a folder"),
    ("train.py", ["--out_dir", "afile/run"], "error: --out_dir afile/run: TMP/afile is a file, not a folder"),
    ("tools.flops_fit", ["run", "--out", "afile/f.json"],
     "tools.flops_fit: error: --out afile/f.json: TMP/afile is a file, not a folder"),
    ("tools.flops_fit", ["run", "--out", "."], "tools.flops_fit: error: --out .: is a folder; give a file path"),
    ("studies.latent_experiments", ["--base", "x.pt", "--task", "summation", "--save", "afile/z.pt"],
     "error: --save afile/z.pt: TMP/afile is a file, not a folder"),
    ("studies.latent_experiments", ["--base", "x.pt", "--task", "summation", "--json", "."],
     "error: --json .: is a folder; give a file path"),
    ("studies.latent_experiments", ["pretrain", "--out_dir", "afile"], "error: --out_dir afile: exists and is not a folder"),
    ("studies.latent_experiments", ["sweep", "--base", "x.pt", "--out_dir", "afile"],
     "error: --out_dir afile: exists and is not a folder"),
    ("studies.reflux_cli", ["--base", "afile", "--json", "."], "error: --json .: is a folder; give a file path"),
    ("studies.reflux_cli", ["sweep", "--base", "afile", "--data_root", "afile"],
     "error: --data_root afile: exists and is not a folder"),
    ("train.py", ["--out_dir", ""], 'error: --out_dir "": an empty path; give a folder ("." for this one)'),
    ("data.py", ["--dataset", "stdlib", "--data_root", ""],
     'error: --data_root "": an empty path; give a folder ("." for this one)'),
    ("tools.sweep", ["run", "--models", "tango", "--depths", "4", "--seeds", "1", "--datasets", "stdlib", "--root", ""],
     'error: --root "": an empty path; give a folder ("." for this one)'),
    ("studies.latent_experiments", ["pretrain", "--out_dir", ""],
     'error: --out_dir "": an empty path; give a folder ("." for this one)'),
    ("studies.latent_experiments", ["--base", "x.pt", "--task", "summation", "--json", ""],
     'error: --json "": an empty path; give a file path'),
    ("studies.latent_experiments", ["--base", "x.pt", "--task", "summation", "--json", "o.pt", "--save", "o.pt"],
     "error: --json o.pt: the same file as --save; give another path"),
    ("tools.bench", ["--json", "b.json", "--md", "b.json"], "bench.py: error: --md b.json: the same file as --json; give another path"),
    ("tools.bench", ["decode", "--json", "d.md"], "bench.py decode: error: --json's .md d.md: the same file as --json; give another path"),
    ("tools.bench", ["decode", "--json", "afile.json"], "bench.py decode: error: --json's .md afile.md: is a folder; give a file path"),
])
def test_every_cli_checks_its_output_paths_before_any_work(script, argv, message, tmp_path, monkeypatch, capsys):
    """An output folder that is a file, an output file under a file or that is a folder, and two
    outputs of one command naming the same file: one line naming the flag, exit 2, before anything
    is read or written (harness.cli.check_output_folder / check_output_file(s); a missing folder is
    created, not refused), not a traceback after the work."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "afile.md").mkdir()
    code, out, err = run_cli(script, argv, monkeypatch, capsys)
    assert (code, out, err) == (2, "", message.replace("TMP", str(tmp_path)) + "\n")
    assert sorted(os.listdir(tmp_path)) == ["afile", "afile.md"]


SWEEP = ["run", "--root", "r", "--models", "loop", "--depths", "2", "--datasets", "dmmath"]
HAS_DATASETS = importlib.util.find_spec("datasets") is not None


def swept(flag, value):
    argv = list(SWEEP)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    return argv + ([] if flag in SWEEP else [flag, value])


@pytest.mark.parametrize("script,argv,message", [
    ("tools.sweep", swept("--models", "loop,untied,loop"), "error: --models loop,untied,loop: loop given twice"),
    ("tools.sweep", swept("--depths", "2,02"), "error: --depths 2,02: 2 given twice"),
    ("tools.sweep", swept("--datasets", "dmmath,dmmath"), "error: --datasets dmmath,dmmath: dmmath given twice"),
    ("tools.bench", ["--models", "loop,loop"], "bench.py: error: --models loop,loop: loop given twice"),
    ("tools.bench", ["--models", "loop", "--block_sizes", "64,32,64"], "bench.py: error: --block_sizes 64,32,64: 64 given twice"),
    ("tools.bench", ["decode", "--models", "loop,loop"], "bench.py decode: error: --models loop,loop: loop given twice"),
    ("train.py", ["--model", "loop", "--eval_depths", "1,2,1"], "error: --eval_depths 1,2,1: 1 given twice"),
    pytest.param("train.py", ["--dataset", "hf:json", "--hf_data_files", "afile,afile"],
                 "error: --hf_data_files TMP/afile,TMP/afile: TMP/afile given twice",  # (as recorded: absolute)
                 marks=pytest.mark.skipif(not HAS_DATASETS, reason="hf: data needs the optional extra datasets")),
    ("studies.reflux_cli", ["--base", "afile", "--edge", "1:0", "--edge", "1:0"], "error: --edge 1:0: given twice"),
    ("studies.reflux_cli", ["sweep", "--base", "afile", "--alphas", "0.2,0.5,0.2"], "error: --alphas: 0.2 given twice"),
    ("studies.reflux_cli", ["sweep", "--base", "afile", "--edges", "1:0,1:0"], "error: --edges: 1:0 given twice"),
    ("studies.reflux_cli", ["sweep", "--base", "afile", "--schedules", "stream,stream"],
     "error: --schedules: stream given twice"),
    ("studies.latent_experiments", ["sweep", "--base", "afile", "--tasks", "summation,summation", "--out_dir", "o"],
     "error: --tasks summation,summation: summation given twice"),
])
def test_every_cli_refuses_a_list_entry_given_twice(script, argv, message, tmp_path, monkeypatch, capsys):
    """A list flag naming one entry twice is one line naming the flag and the entry, exit 2,
    nothing written (harness.cli.repeated): it used to be run or timed twice (tools.bench), dropped
    without a word (tools.sweep), or printed as two writes that were one (ReFlux's --edge)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    code, out, err = run_cli(script, argv, monkeypatch, capsys)
    assert (code, out, err) == (2, "", message.replace("TMP", str(tmp_path)) + "\n")
    assert os.listdir(tmp_path) == ["afile"]


RUN_FOLDER = 'error: --out_dir "": an empty path; give the run\'s folder ("." for this one)'
NO_DMMATH = 'error: --data_dir "": an empty path; give the DeepMind Mathematics folder'
NO_ROOT = 'error: --root "": an empty path; give the runs\' folder'
NO_BASE = 'error: --base "": an empty path; give a checkpoint file'


@pytest.mark.parametrize("script,argv,message", [
    ("train.py", ["--eval_only", "--out_dir", ""], RUN_FOLDER),
    ("train.py", ["--resume", "--out_dir", ""], RUN_FOLDER),
    ("sample.py", ["--out_dir", ""], RUN_FOLDER),
    ("train.py", ["--dataset", "dmmath", "--data_dir", "", "--out_dir", "o", "--data_root", "d"], NO_DMMATH),
    ("data.py", ["--dataset", "dmmath", "--data_dir", "", "--data_root", "d"], NO_DMMATH),
    ("tools.sweep", ["report", "--root", ""], NO_ROOT),
    ("tools.sweep", ["collect", "--root", "", "--to", "c"], NO_ROOT),
    ("tools.sweep", ["plot", "--root", "", "--out", "p"], NO_ROOT),
    ("studies.reflux_cli", ["sweep", "--base", ""], NO_BASE),
    ("studies.latent_experiments", ["sweep", "--base", "", "--out_dir", "o"], NO_BASE),
])
def test_every_cli_refuses_an_empty_input_path(script, argv, message, tmp_path, monkeypatch, capsys):
    """An input path given as "" is one line naming the flag, exit 2, nothing written: not read as
    the flag's default (dmmath's folder) or as this folder (./ckpt_best.pt), and not "no checkpoint
    at ckpt_best.pt" (harness.cli.check_not_empty)."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(script, argv, monkeypatch, capsys)
    assert (code, out, err) == (2, "", message + "\n")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("script,argv,message", [
    ("train.py", ["--learning_rate", "-1e-3"], "error: --learning_rate -0.001: must be a finite number > 0 (at most 3.4e38, a float32)"),
    ("train.py", ["--weight_decay", "-inf"], "error: --weight_decay -inf: must be a finite number >= 0 (at most 3.4e38, a float32)"),
    ("train.py", ["--seed", "-5e0"], "error: argument --seed: invalid int value: '-5e0' (see python train.py --help)"),
    ("sample.py", ["--out_dir", "o", "--temperature", "-1E-3"], "error: --temperature -0.001: must be a finite number >= 0 (0 = greedy)"),
    ("tools.sweep", ["run", "--root", "r", "--models", "loop", "--depths", "4", "--lrs", "-1e-3"],
     "error: --lrs -1e-3: comma-separated finite learning rates > 0, at most 3.4e38 (1e-3, 0.002, 3E-4, ...)"),
    ("flops.py", ["--size", "tiny", "--depth", "4", "--block_size", "-1e3"], "flops.py: error: argument --block_size: invalid int value: '-1e3'"),
])
def test_a_negative_number_in_any_spelling_is_the_flags_value(script, argv, message, tmp_path, monkeypatch, capsys):
    """-1e-3, -inf, -1E-3 are a flag's value, checked by its own rule, in every parser
    (harness.cli.WholeFlagParser): argparse before Python 3.13 read them as unknown flags and said only
    "expected one argument"."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(script, argv, monkeypatch, capsys)
    assert (code, out, err) == (2, "", message + "\n")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("script,argv,message", [
    ("studies.latent_experiments", ["--base", "x.pt", "--task", "summation", "--lr", "-1"], "--lr -1.0: must be a finite number > 0 (at most 3.4e38, a float32)"),
    ("studies.latent_experiments", ["--base", "x.pt", "--task", "summation", "--warmup", "2"],
     "--warmup 2.0: a fraction of the updates, in [0, 1)"),
    ("studies.latent_experiments", ["pretrain", "--lr", "nan"], "--lr nan: must be a finite number > 0 (at most 3.4e38, a float32)"),
    ("studies.latent_experiments", ["sweep", "--base", "x.pt", "--grad_clip", "-1"],
     "--grad_clip -1.0: must be a finite number >= 0 (at most 3.4e38, a float32) (0 = off)"),
    ("studies.latent_experiments", ["--base", "x.pt", "--task", "summation", "--lr", "1e39"],
     "--lr 1e+39: must be a finite number > 0 (at most 3.4e38, a float32)"),
    ("studies.latent_experiments", ["--base", "x.pt", "--task", "summation", "--lr", "1e38", "--weight_decay", "10"],
     "--lr x --weight_decay = 1e+39: must be at most 3.4e38 (a float32)"),  # AdamW's decoupled decay multiplies them
    ("studies.reflux_cli", ["--base", "x.pt", "--lr", "1e39"], "--lr 1e+39: must be a finite number > 0 (at most 3.4e38, a float32)"),
    ("studies.reflux_cli", ["--base", "x.pt", "--lr", "0"], "--lr 0.0: must be a finite number > 0 (at most 3.4e38, a float32)"),
    ("studies.reflux_cli", ["sweep", "--base", "x.pt", "--lam", "-1"], "--lam -1.0: must be a finite number >= 0"),
    ("studies.reflux_cli", ["--base", "x.pt", "--alpha_max", "inf"], "--alpha_max inf: must be a finite number > 0"),
])
def test_float_flags_out_of_range_are_one_line_errors(script, argv, message, tmp_path, monkeypatch, capsys):
    """studies.latent_experiments and studies.reflux_cli name a negative or NaN learning rate,
    penalty or warmup before anything loads (not after loading the base, or never)."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(script, argv, monkeypatch, capsys)
    assert (code, out, err) == (2, "", f"error: {message}\n")


@pytest.mark.parametrize("argv,message", [
    (["--timeout", "0"], "--timeout 0.0: must be a finite number of seconds > 0"),
    (["--step_budget", "nan"], "--step_budget nan: must be a finite number of seconds > 0"),
    (["--peak_reps", "0"], "--peak_reps 0: must be >= 1"), (["--threads", "-1"], "--threads -1: must be >= 0"),
    # checked up front (reflux_rows would name an --edge 0:0 nobody gave, after every model's row)
    (["--quick", "--depth", "1"], "--depth 1: --reflux (on with --quick) needs --depth >= 2 (an edge S:D writes "
                                  "block S's increment into an earlier block D)"),
])
def test_bench_flags_out_of_range(argv, message, capsys):
    from tools import bench
    with pytest.raises(SystemExit) as e:
        bench.parse(argv)
    assert e.value.code == 2 and capsys.readouterr().err == f"bench.py: error: {message}\n"


@pytest.mark.parametrize("module,command", [
    ("tools/bench_decode.py", "python -m tools.bench decode"), ("tools/sweep_report.py", "python -m tools.sweep report"),
    ("harness/text_data.py", "python data.py"), ("tools/cpu_memory.py", "python -m tools.bench"),
    ("tools/bench_report.py", "python -m tools.bench"),
])
def test_a_module_of_another_command_names_that_command(module, command, monkeypatch, capsys):
    """A module that belongs to another command, run directly with --help, exits 2 with one line naming
    that command (instead of printing nothing and exiting 0)."""
    code, out, err = run_cli(module, ["--help"], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"error: {module} has no command line of its own; use {command}") and err.count("\n") == 1


COMMANDS = [  # every command line and subcommand: (script or module, subcommand argv)
    ("train.py", []), ("sample.py", []), ("data.py", []), ("flops.py", []), ("tools.flops_fit", []),
    ("tools.bench", []), ("tools.bench", ["decode"]), ("tools.sweep", ["run"]), ("tools.sweep", ["collect"]),
    ("tools.sweep", ["plot"]), ("tools.sweep", ["report"]), ("studies.reflux_cli", []),
    ("studies.reflux_cli", ["sweep"]), ("studies.latent_experiments", []), ("studies.latent_experiments", ["pretrain"]),
    ("studies.latent_experiments", ["sweep"]), ("results/gpu_estimate.py", []),
]


def command_parser(script, argv, monkeypatch, capsys):
    """The parser of one of COMMANDS (the one that prints its --help)."""
    shown = []
    format_help = harness.cli.WholeFlagParser.format_help
    monkeypatch.setattr(harness.cli.WholeFlagParser, "format_help", lambda self: shown.append(self) or format_help(self))
    code, out, err = run_cli(script, [*argv, "--help"], monkeypatch, capsys)
    assert code == 0 and err == "" and len(shown) == 1, (code, err)
    return shown[0], out


def test_every_out_of_memory_line_names_flags_of_its_own_command(monkeypatch, capsys):
    """run_command's out-of-memory line names the command's SIZE_FLAGS; it named --num_samples for
    train.py and --width for data.py, flags they lack. Each is a flag of one of the command's
    parsers (COMMANDS), and sweep --seeds 2**40 ... would name --seeds."""
    import runpy
    accepted, sizes = {}, {}
    for script, argv in COMMANDS:
        parser, _ = command_parser(script, argv, monkeypatch, capsys)
        accepted.setdefault(script, set()).update(s for a in parser._actions for s in a.option_strings)
        if script.endswith(".py"):
            sizes[script] = runpy.run_path(os.path.join(REPO, script)).get("SIZE_FLAGS", ())
        else:
            sizes[script] = getattr(__import__(script, fromlist=["_"]), "SIZE_FLAGS", ())
    assert all(sizes[s] for s in ("train.py", "sample.py", "flops.py", "data.py", "tools.bench", "tools.sweep",
                                  "studies.reflux_cli", "studies.latent_experiments"))
    assert "--seeds" in sizes["tools.sweep"] and "--num_samples" in sizes["sample.py"]
    assert "--num_samples" not in sizes["train.py"] and "--width" not in sizes["data.py"]
    assert {"--size", "--depth", "--width"} <= set(sizes["train.py"]) & set(sizes["flops.py"]) & set(sizes["tools.bench"])
    for script, flags in sizes.items():
        assert set(flags) <= accepted[script], (script, set(flags) - accepted[script])


@pytest.mark.parametrize("script,argv", COMMANDS)
def test_every_integer_flag_beyond_int64_is_one_line(script, argv, monkeypatch, capsys):
    """Every integer flag of every command given 2**63 or -2**63 - 1 (--width 1e20 written out): one
    line naming the flag and the range, exit 2. Such a value reached torch or numpy and ended in an
    OverflowError traceback with exit 1. Seeds keep their range [0, 2**64) (harness.cli.seed_flag,
    check_seed): torch.manual_seed takes 2**64 - 1."""
    parser, _ = command_parser(script, argv, monkeypatch, capsys)
    seeds = {a.option_strings[0] for a in parser._actions if a.type is harness.cli.seed_flag}
    if script == "train.py":
        assert seeds == {"--seed", "--data_seed"}
        assert train.parse_args(["--seed", str(2**64 - 1), "--data_seed", str(2**64 - 1)]).seed == 2**64 - 1
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.type is int]
    assert flags or script in ("tools.sweep", "tools.flops_fit", "studies.reflux_cli") and argv != ["run"]
    for flag in flags:
        for v in (2**63, -2**63 - 1):
            code, out, err = run_cli(script, [*argv, flag, str(v)], monkeypatch, capsys)
            assert code == 2 and err.count("\n") == 1, (flag, code, err)
            bound = "most 2**63 - 1" if v > 0 else "least -2**63"
            assert f"argument {flag}: {v}: beyond a 64-bit integer (at {bound})" in err, err


@pytest.mark.parametrize("script,argv", COMMANDS)
def test_every_commands_help_states_each_flags_default(script, argv, monkeypatch, capsys):
    """--help of every command line (and subcommand) prints help text for every flag and states, in
    it, the default of each flag that has one to show, once (a --x/--no-x pair: which side); a
    switch that is off unless given, or a flag without a default (None, ""), at most what happens
    without it, never "(default: False)" or "(default: )"."""
    parser, out = command_parser(script, argv, monkeypatch, capsys)
    assert "(default: None)" not in " ".join(out.split()) and "(default: )" not in " ".join(out.split())
    printed = {}  # flag -> its help entry as printed, whitespace folded
    for entry in re.split(r"\n(?=  -)", out)[1:]:
        printed[entry.split()[0].rstrip(",")] = " ".join(entry.split())
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help" and not a.required]
    for a in flags:
        text = printed[a.option_strings[0]]
        assert a.help and len(text) > len(" ".join(a.option_strings)) + 8, (a.option_strings, text)  # help text
        switch = a.nargs == 0 and not isinstance(a, argparse.BooleanOptionalAction)
        if switch or a.default in (None, "", argparse.SUPPRESS):  # its help may say what happens without it
            assert text.count("default") <= 1 and not (switch and "(default: False)" in text), text
        else:
            assert text.count("default") == 1, text
    assert any(a.nargs != 0 for a in flags) or argv in (["collect"], ["plot"], ["report"])


RESULTS_SCRIPTS = sorted(os.path.relpath(os.path.join(d, f), REPO) for d, _, fs in os.walk(os.path.join(REPO, "results"))
                         for f in fs if f.endswith(".py"))


@pytest.mark.parametrize("script", RESULTS_SCRIPTS)
def test_a_results_script_answers_help_without_running(script):
    """python results/.../x.py --help prints its usage and exits 0 at once (not its benchmark or
    its tables); an unknown flag exits 2."""
    run = lambda *a: subprocess.run([sys.executable, script, *a], capture_output=True, text=True, cwd=REPO, timeout=60)
    p = run("--help")
    assert p.returncode == 0 and ("usage" in p.stdout or f"python {script}" in p.stdout), p.stdout + p.stderr
    assert run("--no_such_flag").returncode == 2


@pytest.fixture
def text_file(tmp_path):
    (tmp_path / "text.txt").write_text("".join(f"line {i}: some text to tokenize\n" for i in range(400)))
    return tmp_path / "text.txt"


def train_main_fails(argv, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main([*argv, "--quiet"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("model,flags,message", [
    ("loop", ["--width", "100"], "--width 100: must be a positive multiple of 8 for --model loop"),
    ("tango", ["--width", "130"], "--width 130: must be a positive multiple of 4 for --model tango"),
    ("tango-3set", ["--depth", "2"], "--depth 2: --model tango-3set needs depth >= 3"),
    ("parcae", ["--n_core", "0"], "--n_core 0 / --n_coda 2: need --n_core >= 1"),
    ("rdm", ["--mu_rec", "-1"], "--mu_rec -1 / --mu_bwd 0: must be >= 1"),
    ("gau", ["--gau_s", "40"], "--gau_s 40: must be a positive multiple of 32"),
    ("depth-attn", ["--da_stride", "-2"], "--da_stride -2: must be >= -1"),
    ("ponder", ["--jacobi", "-1"], "--jacobi -1: must be >= 0"),
    ("lrt", ["--lrt_src", "9"], "--lrt_src 9: must be -1 (floor(2K/3)) or a block 0..7"),
    ("lrt-think", ["--n_thoughts", "-1"], "--n_thoughts -1: must be >= 0"),
    ("plt", ["--plt_window", "0"], "--plt_window 0: must be >= 1"),
    ("loopfold", ["--fold", "0"], "--fold 0: must be >= 1"),
    ("loopstack", ["--n_core", "0"], "--n_core 0: must be >= 1"),
])
def test_a_value_the_model_rejects_stops_the_run_before_the_data_is_prepared(model, flags, message, text_file,
                                                                              capsys):
    """The model's checks run in meta-device builds (models.count_params), so a bad model value is reported
    in a second, not after the dataset was tokenized (a GPT-2 stdlib preparation takes minutes), and
    neither --data_root nor --out_dir is created."""
    root = text_file.parent
    err = train_main_fails(["--model", model, *flags, "--dataset", str(text_file), "--tokenizer", "char",
                            "--data_root", str(root / "data"), "--out_dir", str(root / "out")], capsys)
    assert message in err
    assert sorted(os.listdir(root)) == ["text.txt"]


def test_a_flag_the_model_does_not_read_is_an_error(text_file, capsys):
    """A model flag given to a model that does not read it (--model tango --plt_window 8) is a
    one-line error, as --data_dir without dmmath is; every model flag with every model that ignores it."""
    from models import model_flags
    root = text_file.parent
    parser = train.build_parser()
    for flag, users in model_flags().items():
        action = parser._option_string_actions[f"--{flag}"]
        value = [] if action.nargs == 0 else [str(action.choices[0]) if action.choices else "2"]
        for model in (m for m in REGISTRY if m not in users):
            err = train_main_fails(["--model", model, f"--{flag}", *value, "--dataset", str(text_file),
                                    "--data_root", str(root / "data"), "--out_dir", str(root / "out")], capsys)
            listed = users[0] if len(users) == 1 else f"{', '.join(users[:-1])} or {users[-1]}"
            assert err == f"error: --{flag}: only used with --model {listed}; --model {model} ignores it (drop the flag)\n"
    assert sorted(os.listdir(root)) == ["text.txt"]
    # the users of a flag accept it (the check itself; the runs are in the model tests)
    from harness.config import check_model_flags
    for flag, users in model_flags().items():
        for model in users:
            check_model_flags(model, {flag, "depth", "model"})


def test_sweep_gives_a_model_flag_only_to_the_models_that_read_it():
    extra = ["--size", "tiny", "--window", "16", "--n_core=3", "--no-plt_shift", "--data_dir", "/d", "--lrt_src", "-1"]
    assert sweep.flags_for("dmmath", extra) == extra  # no model given: only --data_dir is filtered
    assert sweep.flags_for("stdlib", extra, "tango") == ["--size", "tiny"]
    assert sweep.flags_for("stdlib", extra, "tango-windowed") == ["--size", "tiny", "--window", "16"]
    assert sweep.flags_for("dmmath", extra, "plt") == ["--size", "tiny", "--n_core=3", "--no-plt_shift",
                                                       "--data_dir", "/d"]
    assert sweep.flags_for("stdlib", extra, "lrt") == ["--size", "tiny", "--lrt_src", "-1"]
    # a model flag that no model of the sweep reads is refused before anything starts
    with pytest.raises(UsageError, match=r"^-- --window: no model of --models loop,plt reads it \(used by tango-windowed\)$"):
        sweep.main(["run", "--root", "unused", "--models", "loop,plt", "--", "--window", "16", "--n_core", "2"])
    with pytest.raises(UsageError, match=r"^-- --plt_shift: no model of --models loop reads it"):
        sweep.main(["run", "--root", "unused", "--models", "loop", "--", "--no-plt_shift"])


# a value of each model flag other than BEHAVIOUR_CFG's, valid for every model
CHANGED = dict(window=4, chunk=4, gau_s=64, mu_rec=2, mu_bwd=1, n_prelude=2, n_core=2, n_coda=2, da_stride=-1,
               da_recent=1, n_thoughts=2, jacobi=2, jacobi_random=False, lrt_src=1, lrt_tgt=1, lrt_kv=True,
               lrt_subsets=1, lrt_detach_init=True, plt_window=2, plt_shift=False, fold=1, fold_rank=4,
               fold_layout="last")
# depth 4: Depth-Attention's stride 2 leaves room for --da_recent; jacobi 1: training with
# --no-jacobi_random differs from the U{2, 3} draw
BEHAVIOUR_CFG = dict(n_embd=32, n_head=1, width=32, depth=4, block_size=8, jacobi=1)


def behaviour(cfg):
    """What a model does: its parameters' shapes, a seeded training step (logits and gradients)
    and an evaluation forward, from the same initial seed."""
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.arange(8).view(1, 8)
    out = [tuple(p.shape) for p in model.parameters()]
    train.seed_random_draws(model.train(), 1337, 0, 0)
    logits, loss = model(x, x)
    loss.backward()
    out += [logits.detach()] + [p.grad for p in model.parameters()]
    with evaluation.eval_mode(model), torch.no_grad():
        out.append(model(x)[0])
    return out


def same(a, b):
    def eq(u, v):
        if torch.is_tensor(u) or torch.is_tensor(v):
            return torch.is_tensor(u) and torch.is_tensor(v) and torch.equal(u, v)
        return u == v
    return len(a) == len(b) and all(eq(u, v) for u, v in zip(a, b))


def test_model_flags_lists_exactly_the_models_each_flag_changes():
    """models.model_flags (which models read a flag; the others refuse it) checked against the models:
    changing the flag's value changes a model's parameters, training or evaluation iff it is listed."""
    from models import model_flags
    MODEL_FLAGS = model_flags()
    assert set(CHANGED) == set(MODEL_FLAGS)
    for name in REGISTRY:
        base = small_cfg(name, **BEHAVIOUR_CFG)
        ref = behaviour(base)
        changes = [f for f, v in CHANGED.items() if not same(ref, behaviour(replace(base, **{f: v})))]
        assert changes == [f for f in CHANGED if name in MODEL_FLAGS[f]], name


def test_reflux_refuses_a_checkpoint_without_training_flags_before_preparing_data(tmp_path, monkeypatch, capsys):
    """A base written by studies.latent_experiments pretrain (an untied Transformer++ without
    train.py's flags) records no dataset: one line, exit 2, nothing written, before any data is
    prepared (its dataset is not taken for the default stdlib)."""
    from studies import reflux_cli
    cfg = ModelConfig(model="untied", vocab_size=13, block_size=16, n_embd=32, n_head=1, depth=2, width=32)
    torch.save({"model": build_model(cfg).state_dict(), "config": cfg.to_dict(),
                "data": {"tokenizer": "task", "vocab_size": 13}}, tmp_path / "base.pt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPT2_BPE_FILE", str(tmp_path / "missing.tiktoken"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        reflux_cli.cli(["--base", "base.pt"])
    assert e.value.code == 2
    assert capsys.readouterr().err == ("error: --base base.pt: not a train.py checkpoint (it records no --dataset, so "
                                       "the data it was trained on is unknown); ReFlux evaluates a train.py run's "
                                       "ckpt_best.pt\n")
    assert os.listdir(tmp_path) == ["base.pt"]


def test_sweep_resumes_a_root_whose_runs_got_flags_their_model_ignores(tmp_path, monkeypatch):
    """Before flags_for sent --window to tango-windowed only, every run of `-- --window 16` recorded it;
    the same command on that root must still find its loop run trained as asked (--window is not a loop setting)."""
    root = tmp_path / "runs"
    fake_run(root / "dmmath" / "loop-K2-s1", ["--model", "loop", "--depth", "2", "--dataset", "dmmath", "--seed", "1",
                                              "--data_seed", "1", "--size", "tiny", "--window", "16"],
             dict(SUMMARY, model="loop", seed=1))
    started = []
    monkeypatch.setattr(sweep, "prepare_data", lambda *a: started.append("prepare"))
    monkeypatch.setattr(sweep, "run_process", lambda cmd, stdout, env: started.append(cmd) or 0)
    assert sweep.main(["run", "--root", str(root), "--models", "loop,tango-windowed", "--depths", "2", "--datasets",
                       "dmmath", "--", "--size", "tiny", "--window", "16"]) == 0
    assert started[0] == "prepare" and len(started) == 2  # the loop run is done; tango-windowed trains, with --window
    assert "tango-windowed" in started[1] and started[1][-2:] == ["--window", "16"]
    with pytest.raises(UsageError, match="trained with --eval_interval 20, this sweep asks for --eval_interval 50"):
        sweep.main(["run", "--root", str(root), "--models", "loop", "--depths", "2", "--datasets", "dmmath"])


def test_sweep_report_cell_ignores_flags_the_model_does_not_read(tmp_path):
    """A seed recorded with -- --window 16 (older sweeps passed it to every model) and a seed without
    it are one loop cell; a loop setting that differs still splits it."""
    root = tmp_path / "runs"
    common = ["--model", "loop", "--depth", "2", "--dataset", "dmmath", "--size", "tiny"]
    fake_run(root / "dmmath" / "a-s1", [*common, "--seed", "1", "--window", "16"], dict(SUMMARY, model="loop", seed=1))
    fake_run(root / "dmmath" / "a-s2", [*common, "--seed", "2"], dict(SUMMARY, model="loop", seed=2))
    assert "| loop | 2 | 2 |" in sweep_report.report(str(root))
    fake_run(root / "dmmath" / "a-s2", [*common, "--seed", "2", "--max_iters", "7"], dict(SUMMARY, model="loop", seed=2))
    with pytest.raises(UsageError, match="a-s1 has --lr_decay_iters 120, .*a-s2 has --lr_decay_iters 7"):
        sweep_report.report(str(root))


@pytest.mark.parametrize("error, line", [
    (MemoryError("Unable to allocate 7.45 TiB for an array"), "Unable to allocate 7.45 TiB for an array"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 4096 bytes.\nmore"),
     "[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
     "4096 bytes."),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "CUDA out of memory. Tried to allocate 2.00 GiB"),
    (RuntimeError("Storage size calculation overflowed with sizes=[9223372036854775807, 512]"),
     "Storage size calculation overflowed with sizes=[9223372036854775807, 512]"),
    (ValueError("array is too big; `arr.size * arr.dtype.itemsize` is larger than the maximum possible size."),
     "array is too big; `arr.size * arr.dtype.itemsize` is larger than the maximum possible size."),
])
def test_out_of_memory_is_one_line_with_exit_code_2(error, line, capsys):
    """A size this machine cannot hold (train.py --width 40000000, --batch_size 1000000, sample.py
    --num_samples 10000000) or no machine can (flops.py --vocab_size 2**63-1, train.py --batch_size
    2**63-1: torch's and numpy's size errors): every command's run_command prints one line naming
    the sizes to reduce, exit 2, not a MemoryError/RuntimeError/ValueError traceback; other errors
    still raise."""
    def main():
        raise error
    with pytest.raises(SystemExit) as e:
        harness.cli.run_command(main, sizes=("--batch_size", "--block_size"))
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: out of memory ({line}); give smaller sizes (--batch_size, --block_size)\n"
    with pytest.raises(SystemExit) as e:
        harness.cli.run_command(main)  # a command without size flags (tools.flops_fit)
    assert e.value.code == 2 and capsys.readouterr().err == f"error: out of memory ({line})\n"
    with pytest.raises(RuntimeError, match="^shape mismatch$"):
        harness.cli.run_command(lambda: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(ValueError, match="^bad value$"):
        harness.cli.run_command(lambda: (_ for _ in ()).throw(ValueError("bad value")))


@pytest.mark.parametrize("argv,message", [
    (["--lrs", "1e-3", "--", "--learning_rate", "0.5"],
     "error: -- --learning_rate: --lrs sets each run's learning rate; give the rates to --lrs only"),
    (["--lrs", "1e-3,0.001"], "error: --lrs 1e-3,0.001: 0.001 given twice (as the same number)"),
    (["--datasets", "a/multi,b/multi/"],
     "error: --datasets: a/multi and b/multi/ would share the runs' folder multi/ under --root; rename one of them"),
    (["--", "--out_dir=elsewhere"], "error: -- --out_dir: the sweep sets this itself per run; use --models/--depths/"
                                    "--seeds/--datasets/--lrs/--root instead"),
    (["--seeds", str(2**40)], "error: --models (1) x --depths (1) x --seeds (1,099,511,627,776) x --datasets (1) x "
                              "--lrs (1) = 1,099,511,627,776 runs; at most 100,000 per sweep"),
])
def test_sweep_refuses_flags_that_would_merge_or_override_grid_runs(argv, message, tmp_path, monkeypatch, capsys):
    """Flags that would make a sweep train fewer or other runs than its grid names are one line,
    exit 2, nothing made: two datasets of one folder name (one folder for both), -- --learning_rate
    beside --lrs (--lrs would win), one rate written twice (1e-3, 0.001) and a flag the sweep sets;
    a grid of more runs than a sweep lists and checks (--seeds 2**40 grew a list until memory ran out)."""
    monkeypatch.chdir(tmp_path)
    for d in ("a/multi", "b/multi"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "x.txt").write_text("some text\n" * 50)
    argv = ["run", "--root", "runs", "--models", "loop", "--depths", "1", *argv]
    code, out, err = run_cli("tools.sweep", argv, monkeypatch, capsys)
    assert (code, out, err) == (2, "", message + "\n")
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_flops_fit_refuses_a_log_line_that_is_not_an_object(tmp_path, monkeypatch, capsys):
    (tmp_path / "log.jsonl").write_text('[1, 2]\n')
    code, out, err = run_cli("tools.flops_fit", [str(tmp_path / "log.jsonl")], monkeypatch, capsys)
    assert (code, out) == (2, "") and err == (f"tools.flops_fit: error: {tmp_path / 'log.jsonl'}: not a JSON-lines "
                                              "log (a line is not a JSON object)\n")


# ----------------------------------------------------------------------------- 12 the GPU a command names
def test_a_single_process_run_on_cuda_n_makes_n_the_current_gpu(monkeypatch):
    """--device cuda:1 (simulated: two GPUs) makes GPU 1 current, so torch.cuda calls that take no
    device, and new CUDA contexts, go there rather than to cuda:0."""
    from harness.config import Dist, resolve_device
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    resolve_device(SimpleNamespace(device="cuda:1"), Dist())
    resolve_device(SimpleNamespace(device="cuda"), Dist())
    assert current == [1, 0]


def test_timers_wait_for_the_gpu_they_time(monkeypatch):
    """harness.cli.synchronizer(device) waits for that device: torch.cuda.synchronize() with no argument
    waits for the current GPU (cuda:0 unless set), so a timer of work on cuda:1 would stop early."""
    from harness.cli import synchronizer
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    synchronizer("cuda:1")()
    synchronizer("cpu")()
    assert waited == ["cuda:1"]


def test_every_cuda_call_of_the_project_names_its_device():
    """The torch.cuda calls whose device defaults to the current GPU are given one, in every file."""
    import glob
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = [p for pattern in ("*.py", "harness/*.py", "tools/*.py", "studies/*.py")
             for p in glob.glob(os.path.join(root, pattern))]
    bare = re.compile(r"torch\.cuda\.(synchronize|memory_allocated|max_memory_allocated|reset_peak_memory_stats"
                      r"|memory_reserved|max_memory_reserved|get_rng_state|set_rng_state|mem_get_info)\(\)")
    found = [f"{os.path.relpath(p, root)}: {m.group(0)}" for p in files for m in bare.finditer(open(p).read())]
    assert len(files) > 20 and found == []

