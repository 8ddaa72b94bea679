"""Literal expected values and independent computations for the code around the models: the
learning-rate schedule, resume of a run that draws random numbers (Parcae), the logged learning
rate, dev/test NLL, the exact-match scorer, the strict width solver, the document split and the
latent-token position ids. Every run here is in-process (train.main) and tiny."""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data as data_mod
import latent_tokens as lt
import models
from checks import one_per_file
from harness.optim import Schedule
import train
from common import ModelConfig, UsageError



pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ----------------------------------------------------------------------------- learning-rate schedule

def sched(lr=1e-3, warm=4, total=11, decay=None, floor=0.1):
    return Schedule(learning_rate=lr, warmup_iters=warm, max_iters=total, lr_decay_iters=decay or total,
                    min_lr_ratio=floor)


# peak 1e-3, 4 warmup updates, 11 updates, floor 0.1: warmup (it + 1) / 5 of the peak, then
# 0.1 + 0.9 * (1 + cos(pi k / 6)) / 2 for k = 0..6, then constant
LR_11 = [2e-4, 4e-4, 6e-4, 8e-4, 1e-3, 9.397114317029974e-4, 7.75e-4, 5.5e-4, 3.25e-4, 1.6028856829700260e-4,
         1e-4]


def test_lr_schedule_literal_values():
    got = [sched().lr_at(i) for i in range(11)]
    assert got == pytest.approx(LR_11, rel=1e-12, abs=0)
    assert [sched().lr_at(i) for i in (11, 50)] == pytest.approx([1e-4, 1e-4], rel=1e-12)
    # no warmup: the peak at update 0; a longer decay than the run keeps the longer schedule
    assert sched(warm=0).lr_at(0) == 1e-3
    assert [sched(warm=1, total=3, decay=5).lr_at(i) for i in range(3)] == \
        pytest.approx([5e-4, 1e-3, 7.75e-4], rel=1e-12)


# ----------------------------------------------------------------------------- in-process runs

MDM_SIZE = (200, 30)  # tests/conftest.py's fixtures mdm and data_root: 200 problems per train folder


PARCAE = ["--model", "parcae", "--size", "tiny", "--depth", "2", "--n_prelude", "1", "--n_core", "1",
          "--n_coda", "1", "--block_size", "32", "--batch_size", "2", "--eval_windows", "4",
          "--eval_batch_size", "4", "--sample_tokens", "0", "--em_samples", "2", "--quiet",
          "--learning_rate", "1e-3", "--warmup_iters", "2", "--eval_interval", "3", "--dataset", "dmmath"]
# peak 1e-3, 2 warmup updates, 6 updates, floor 0.1: 1/3, 2/3 of the peak, then cos(pi k / 3), k = 0..3
LR_6 = [1e-3 / 3, 2e-3 / 3, 1e-3, 7.75e-4, 3.25e-4, 1e-4]


def main(argv):
    """train.main in this process; a bad exit fails the test."""
    try:
        train.main([str(a) for a in argv])
    except SystemExit as e:
        raise AssertionError(f"train.py exited with {e.code}") from None


def records(out_dir, event):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["event"] == event]


@pytest.fixture(scope="module")
def parcae_runs(mdm, data_root, tmp_path_factory):
    """A: 6 Parcae updates. B: 3 updates on A's schedule, then --resume to 6."""
    root = tmp_path_factory.mktemp("parcae")
    where = ["--data_dir", mdm, "--data_root", data_root]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before the function-scoped one_thread
    try:
        main([*PARCAE, *where, "--out_dir", root / "A", "--max_iters", "6"])
        main([*PARCAE, *where, "--out_dir", root / "B", "--max_iters", "3", "--lr_decay_iters", "6"])
        main([*PARCAE, *where, "--out_dir", root / "B", "--max_iters", "6", "--resume"])
    finally:
        torch.set_num_threads(threads)
    return dict(A=root / "A", B=root / "B")


def test_parcae_resume_is_bit_identical(parcae_runs):
    """Parcae draws every sequence's depth and h_0 from generators seeded per micro-batch, so a
    resumed run must redraw what the uninterrupted one drew: this fails unless resume restores
    the update count those seeds come from, numpy's data order and the optimizer (the global RNG
    states: test_restore_sets_every_rng_state)."""
    A, B = parcae_runs["A"], parcae_runs["B"]
    strip = lambda recs: [{k: v for k, v in r.items() if k != "tok_per_s"} for r in recs]
    ta, tb = strip(records(A, "train")), strip(records(B, "train"))
    assert [r["iter"] for r in tb] == list(range(1, 7))
    assert ta == tb  # loss, lr, grad norm and the sampled depths (diag), bit for bit
    assert len({r["diag"]["depth_mean"] for r in ta}) > 1  # the depths really are drawn
    assert records(A, "eval") == records(B, "eval")
    ca, cb = (torch.load(d / "ckpt_latest.pt", map_location="cpu", weights_only=True) for d in (A, B))
    assert all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"])
    assert torch.equal(ca["rng"]["torch"], cb["rng"]["torch"])


def test_logged_learning_rate_after_resume(parcae_runs):
    for run in ("A", "B"):
        lrs = [r["lr"] for r in records(parcae_runs[run], "train")]
        assert lrs == pytest.approx(LR_6, rel=1e-12, abs=0), run


def hand_nll(model, folder, split, starts, T):
    """Mean NLL over the scored (mask == 1) targets of the windows, from the files on disk."""
    meta = json.load(open(os.path.join(folder, "meta.json")))
    tok = np.fromfile(os.path.join(folder, f"{split}.bin"), dtype=np.dtype(meta["dtype"]).newbyteorder("<"))
    mask = np.fromfile(os.path.join(folder, f"{split}.mask.bin"), dtype=np.uint8)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for s in starts:
            x = torch.tensor(tok[s:s + T].astype(np.int64))[None]
            logp = F.log_softmax(model(x)[0][0].double(), -1)
            for t in range(T):
                if mask[s + 1 + t]:
                    total -= float(logp[t, int(tok[s + 1 + t])])
                    count += 1
    return total / count, count


def best_model(out_dir):
    ck = torch.load(out_dir / "ckpt_best.pt", map_location="cpu", weights_only=True)
    model = models.build_model(ModelConfig.from_dict(ck["config"]))
    model.load_state_dict(ck["model"])
    return model.eval(), ck


def test_evaluate_equals_hand_cross_entropy(parcae_runs, data_root):
    model, _ = best_model(parcae_runs["A"])
    folder = str(next(data_root.iterdir()))
    d = data_mod.Data(folder)
    starts = [0, 45, 301, 777, 1000]
    want, count = hand_nll(model, folder, "dev", starts, 32)
    counts = [int(np.asarray(d.mask("dev"))[s + 1:s + 33].sum()) for s in starts]
    assert sum(counts) == count and len(set(counts)) > 1  # windows with different numbers of targets
    ctx = torch.autocast("cpu", enabled=False)
    for bs in (1, 2, 5):
        got = train.evaluate(model, d, "dev", np.array(starts), 32, bs, "cpu", ctx)
        assert got == pytest.approx(want, rel=1e-6)


def test_logged_dev_and_test_nll_equal_hand_cross_entropy(parcae_runs, data_root):
    model, ck = best_model(parcae_runs["A"])
    folder = str(next(data_root.iterdir()))
    d = data_mod.Data(folder)
    summary = json.loads((parcae_runs["A"] / "summary.json").read_text())
    dev, _ = hand_nll(model, folder, "dev", d.eval_windows("dev", 32, 4), 32)
    test, _ = hand_nll(model, folder, "interpolate", d.eval_windows("interpolate", 32, 4), 32)
    assert ck["dev_nll"] == pytest.approx(dev, rel=1e-6) and summary["dev_nll"] == ck["dev_nll"]
    assert summary["test_nll"] == pytest.approx(test, rel=1e-6)


def test_eval_windows_literal():
    """Consecutive non-overlapping windows from the start of the split, evenly subsampled."""
    d = SimpleNamespace(tokens=lambda split: np.zeros(330, np.uint16))
    starts = data_mod.Data.eval_windows(d, "dev", 32)  # (330 - 1) // 32 = 10 windows
    assert starts.tolist() == [0, 32, 64, 96, 128, 160, 192, 224, 256, 288]
    assert data_mod.Data.eval_windows(d, "dev", 32, 4).tolist() == [0, 64, 160, 224]


# ----------------------------------------------------------------------------- exact match

class StubData:
    """Character data with five problems; problems(split) gives [q0, a0, a1) offsets."""
    QA = [("1+1", "2"), ("2+3", "5"), ("9+9", "18"), ("5+5", "10"), ("7+8", "15")]

    def __init__(self):
        text = "".join(q + "\n" + a + "\n" for q, a in self.QA)
        self.itos = sorted(set(text + "0123456789"))
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.eot = self.stoi["\n"]
        self._tok = np.array([self.stoi[c] for c in text], dtype=np.uint16)
        offs, q0 = [], 0
        for q, a in self.QA:
            offs.append([q0, q0 + len(q) + 1, q0 + len(q) + 1 + len(a)])
            q0 += len(q) + len(a) + 2
        self._probs = np.array(offs, dtype=np.int64)

    def problems(self, split):
        return self._probs

    def tokens(self, split):
        return self._tok

    def decode(self, ids):
        return "".join(self.itos[int(i)] for i in ids)


class StubModel(torch.nn.Module):
    """'Generates' a fixed reply per question: right, wrong, a prefix, longer, right."""
    REPLY = {"1+1": "2\n", "2+3": "6\n", "9+9": "1\n", "5+5": "100\n", "7+8": "15\n5"}

    def __init__(self, data):
        super().__init__()
        self.data, self.calls = data, []

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, stop_token=None):
        self.calls.append((max_new_tokens, temperature, stop_token))
        question = self.data.decode(idx[0].tolist())
        assert question.endswith("\n")
        reply = [self.data.stoi[c] for c in self.REPLY[question[:-1]]][:max_new_tokens]
        return torch.cat((idx, torch.tensor([reply])), 1)


def test_exact_match_counts_only_exact_answers():
    d = StubData()
    model = StubModel(d)
    ctx = torch.autocast("cpu", enabled=False)
    assert train.exact_match(model, d, "interpolate", 5, "cpu", ctx) == 2 / 5
    assert all(t == 0 and stop == d.eot for _, t, stop in model.calls)  # greedy, stops at the newline
    assert [n for n, _, _ in model.calls] == [3, 3, 4, 4, 4]  # answer length + 2
    # 3 of 5 problems, evenly spaced: 0 (right), 2 (a prefix), 4 (right)
    assert train.exact_match(model, d, "interpolate", 3, "cpu", ctx) == 2 / 3
    assert train.exact_match(model, d, "interpolate", 1, "cpu", ctx) == 1.0  # problem 0 only


# ----------------------------------------------------------------------------- width solver

def test_strict_width_solver_rejects_more_than_0_2_percent():
    """Untied Transformer++, d = 64, K = 2, target 400,000: the count K(4d^2 + 3dF + 2d) + d =
    33,088 + 384 F moves in steps of 3,072 (0.77 %) per 8 of width, so the best width 952 gives
    398,656 (-0.336 %): outside 0.20 %, inside a tolerance ten times looser."""
    cfg = ModelConfig(model="untied", n_embd=64, n_head=2, depth=2)
    assert [models.count_params(models._with(cfg, width=w)) for w in (944, 952, 960)] == [395584, 398656, 401728]
    assert abs(398656 / 400_000 - 1) > 0.002
    with pytest.raises(UsageError, match="--size.*400,000.*-0.34%"):
        models.solve_width(cfg, 400_000)
    assert models.solve_width(cfg, 400_000, strict=False).width == 952
    # d = 128, K = 2, target 1,000,000: width 1128 gives 998,016 (-0.198 %): inside, strict passes
    cfg = ModelConfig(model="untied", n_embd=128, n_head=4, depth=2)
    assert models.solve_width(cfg, 1_000_000).width == 1128
    assert models.count_params(models._with(cfg, width=1128)) == 998016



def test_width_flag_sets_the_block_shape_without_solving():
    """--width F skips the solver (equal block shape): untied, d = 64, K = 2, F = 952 gives the
    literal count 33,088 + 384 * 952 = 398,656 of the docstring above; a width that is not a
    multiple of the model's granularity (8; TANGO: its n_head) is a UsageError naming --width."""
    from harness import checkpoint
    from harness import config
    args = train.parse_args(["--model", "untied", "--depth", "2", "--size", "tiny", "--width", "952"])
    cfg, target = config.model_config(args, 61)
    assert (cfg.width, target) == (952, 400_000)
    assert models.build_model(cfg).num_params() == 398656
    for model, bad in (("untied", 950), ("tango", 63), ("untied", -8)):
        args = train.parse_args(["--model", model, "--size", "tiny", "--width", str(bad)])
        with pytest.raises(UsageError, match=f"--width {bad}: must be a positive multiple"):
            config.model_config(args, 61)
    assert config.model_config(train.parse_args(["--model", "tango", "--size", "tiny", "--width", "64"]), 61)[0].width == 64
    assert "width" in checkpoint.IDENTITY_FLAGS

# ----------------------------------------------------------------------------- document split

# sha256(path)[:8] as an integer % 100: < 90 train, < 95 dev, else test (values in the comments)
SPLITS = {"os.py": "train",                   # 56
          "asyncio/tasks.py": "dev",          # 93
          "collections/__init__.py": "test",  # 97
          "f8.txt": "train",                  # 89
          "f24.txt": "dev",                   # 90
          "f16.txt": "dev",                   # 94
          "f4.txt": "test",                   # 95
          "f7.txt": "test",                   # 98
          "f0.txt": "train"}                  # 5


def test_document_split_literal():
    assert {p: data_mod.split_of(p) for p in SPLITS} == SPLITS


def test_folder_split_by_file_literal(gpt2_bpe, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    names = ["f0.txt", "f4.txt", "f7.txt", "f8.txt", "f16.txt", "f24.txt"]
    texts = {n: f"document {n} says {' '.join(['hello'] * (i + 1))}\n" for i, n in enumerate(names)}
    for n, t in texts.items():
        (src / n).write_text(t)
    d = data_mod.Data(data_mod.prepare(str(src), out_root=str(tmp_path / "out")))
    enc = data_mod.gpt2_encoder()
    want = {"train": ["f0.txt", "f8.txt"], "dev": ["f16.txt", "f24.txt"], "test": ["f4.txt", "f7.txt"]}
    assert d.meta["n_files"] == {"train": 2, "dev": 2, "test": 2}
    for split, files in want.items():
        ids = [i for f in files for i in enc.encode_ordinary(texts[f]) + [data_mod.EOT]]
        assert np.asarray(d.tokens(split)).tolist() == ids, split


# ----------------------------------------------------------------------------- latent tokens

B_TOK, COMMA = 0, 9
VERBAL, QLEN = [B_TOK, 5, COMMA, 6, 7, COMMA, 8], 3  # Comma_2: two latents after each comma
POSITIONS = {"prepend": [0, 1, 2, 3, 3, 3, 4, 5, 6, 6, 6],
             "append": [0, 1, 2, 2, 2, 3, 4, 5, 5, 5, 6],
             "increase": list(range(11))}


@pytest.mark.parametrize("name", one_per_file())
@torch.no_grad()
def test_latent_logits_are_the_base_with_explicit_positions(name):
    torch.manual_seed(0)
    base = models.build_model(ModelConfig(model=name, vocab_size=61, block_size=32, n_embd=64, n_head=2,
                                          depth=2, width=32)).double()
    for p in base.parameters():
        p.normal_(0, 0.3)
    logits = {}
    for mode, pos in POSITIONS.items():
        llm = lt.LatentLM(base, "Comma_2", position_mode=mode, marker_ids=[COMMA])
        llm.Z.copy_(torch.randn(llm.Z.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
        E, Z = base.wte.weight, llm.Z[0]
        x = torch.stack([E[B_TOK], E[5], E[COMMA], Z[0], Z[1], E[6], E[7], E[COMMA], Z[0], Z[1], E[8]])
        want, _ = base.forward_embeds(x[None], None, torch.tensor(pos))
        got, tgt = llm.logits([llm.augment(VERBAL, QLEN)])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert tgt[0].tolist() == [-1, -1, -1, -1, 6, 7, COMMA, -1, -1, 8, -1]
        logits[mode] = got
    modes = list(POSITIONS)
    for i in range(3):
        for j in range(i + 1, 3):
            assert (logits[modes[i]] - logits[modes[j]]).abs().max() > 1e-3, (modes[i], modes[j])


def test_restore_sets_every_rng_state():
    """checkpoint.restore puts python's, numpy's (the data sampler) and torch's RNG back to the
    checkpoint's states: the next draws equal the draws right after the save. (Training draws no
    longer touch torch's global RNG, seeded per update instead, so a resume test cannot see it.)"""
    import random

    import numpy as np

    from harness import checkpoint
    from models import build_model
    model = build_model(ModelConfig(model="loop", vocab_size=61, block_size=16, n_embd=32, n_head=1, depth=1, width=8))
    opt = torch.optim.AdamW(model.parameters())
    torch.manual_seed(5)
    random.seed(5)
    rng = np.random.default_rng(5)
    ck = {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": checkpoint.rng_state(rng, "cpu")}
    expected = (torch.rand(3).tolist(), random.random(), rng.random())
    torch.rand(7), random.random(), rng.random()  # move every generator on
    rng = np.random.default_rng(0)
    checkpoint.restore(ck, "ckpt", model, opt, rng, "cpu")
    assert (torch.rand(3).tolist(), random.random(), rng.random()) == expected
