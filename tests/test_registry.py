"""The registry (models.py): a model declares itself in its ModelSpec row, and everything the harness
needs follows from that row: a toy model added by the "Adding a model" checklist trains through
train.py; every declared model flag's range is refused outside it (one line, exit 2, nothing
written); the summed NLL the model returns is the one training uses."""
import json
import math
import os
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import checks
import flops
import models
import train
from common import ModelConfig, RMSNorm, UsageError
from harness.config import check_model_flags, resolve_args
from models import REGISTRY, ModelSpec, Range

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ----------------------------------------------------------------------------- a toy model, by the checklist

class ToyBody(nn.Module):
    """x <- x + W_2 SiLU(W_1 RMSNorm(x)) applied K = depth times (untied): no mixing across tokens,
    so a decoding cache holds nothing. Non-embedding parameters K (2 d F + d) + d."""

    def __init__(self, cfg):
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(cfg.n_embd) for _ in range(cfg.depth))
        self.up = nn.ModuleList(nn.Linear(cfg.n_embd, cfg.width, bias=False) for _ in range(cfg.depth))
        self.down = nn.ModuleList(nn.Linear(cfg.width, cfg.n_embd, bias=False) for _ in range(cfg.depth))
        for m in self.down:
            m.is_residual_out = True

    def forward(self, x, cos, sin, cache=None):
        for norm, up, down in zip(self.norms, self.up, self.down):
            x = x + down(F.silu(up(norm(x))))
        return x


def toy(cfg):
    """The toy model (this file): K (2 d F + d) + d non-embedding parameters."""
    return ToyBody(cfg)


def toy_macs(cfg, T):
    """K applications of 2 d F matrix parameters, no token mixing, the tied head."""
    out = {"linear": 2 * cfg.n_embd * cfg.width * cfg.depth * T, "scores": 0, "mix": 0,
           "head": cfg.vocab_size * cfg.n_embd * T}
    out["total"] = sum(out.values())
    return out


# the toy reads --jacobi (as its own flag, for the test): 0 <= jacobi <= depth
TOY = ModelSpec(toy, width_multiple=8, flags={"jacobi": Range(0, lambda c: (c.depth, "--depth"))}, macs=toy_macs)


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setitem(REGISTRY, "toy", TOY)


@pytest.fixture
def text_file(tmp_path):
    (tmp_path / "text.txt").write_text("".join(f"line {i}: some text to tokenize\n" for i in range(400)))
    return tmp_path / "text.txt"


def test_a_toy_model_registered_by_the_checklist_trains_one_update(toy_registered, text_file, tmp_path, capsys):
    """train.main with --model toy: the width solved to the tier on the toy's multiple of 8, its
    flag accepted and another model's refused, one update whose logged loss is the mean NLL of the
    update's windows under the initial weights, and its MACs from its own formula."""
    out = tmp_path / "out"
    argv = ["--model", "toy", "--depth", "2", "--size", "tiny", "--jacobi", "1", "--dataset", str(text_file),
            "--tokenizer", "char", "--data_root", str(tmp_path / "data"), "--out_dir", str(out), "--max_iters", "1",
            "--eval_interval", "1", "--block_size", "16", "--batch_size", "2", "--eval_windows", "2",
            "--sample_tokens", "3", "--quiet"]
    train.main(argv)
    recs = [json.loads(line) for line in open(out / "log.jsonl")]
    start = next(r for r in recs if r["event"] == "start")
    cfg = ModelConfig(**start["config"])
    assert cfg.model == "toy" and cfg.jacobi == 1 and cfg.width % 8 == 0
    d, K, F_ = cfg.n_embd, cfg.depth, cfg.width
    assert start["non_embedding_params"] == K * (2 * d * F_ + d) + d
    assert abs(start["non_embedding_params"] / 400_000 - 1) < 0.01  # solved to the tiny tier's target
    # the update's loss: the seeded initial model on the update's windows (train.sample_starts)
    import data as data_mod
    data = data_mod.Data(str(next((tmp_path / "data").iterdir())))
    torch.manual_seed(1337)
    model = models.build_model(cfg)
    rng = np.random.default_rng(1337)
    x, y = data.window_batch("train", train.sample_starts(rng, len(data.tokens("train")), 2, 16), 16)
    nll = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
    loss = next(r for r in recs if r["event"] == "train")["loss"]
    assert loss == pytest.approx(nll.item() / int((y != -1).sum()), rel=1e-6)
    assert math.isfinite(json.load(open(out / "summary.json"))["test_nll"])
    assert flops.forward_macs(cfg, 16) == toy_macs(cfg, 16)
    # its flag's range and another model's flag
    with pytest.raises(SystemExit) as e:
        train.main([*argv[:6], "--jacobi", "3", *argv[8:]])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: --jacobi 3: must be <= 2 (--depth) for --model toy\n"
    check_model_flags("toy", {"jacobi"})
    with pytest.raises(SystemExit):
        train.main([*argv, "--window", "4"])
    assert "--window: only used with --model tango-windowed; --model toy ignores it" in capsys.readouterr().err


def test_a_toy_model_registered_by_the_checklist_reaches_every_tool(toy_registered, tmp_path, capsys):
    """The checklist's registry row is all the tools need: flops.py prints the toy's row from its own
    MAC formula (and FlopCounterMode's expected count is the convention's), tools.bench plans it,
    and the sweep report tabulates its runs, with no list of model names edited anywhere."""
    assert flops.main(["--size", "tiny", "--depth", "3", "--block_size", "16", "--vocab_size", "64"]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("toy "))
    cfg = flops.train_config("toy", "tiny", 3, 16, 64, flops.train_flags("tiny"))[0]
    assert row[1:4] == [str(cfg.width), f"{models.count_params(cfg):,}", f"{toy_macs(cfg, 16)['total']:.2e}".replace("e+", "e")]
    assert flops.counter_expected_macs(cfg, 16) == toy_macs(cfg, 16)["total"]  # V = 64: no padding
    from tools import bench, sweep_report
    assert ("toy", False, 32) in bench.plan(bench.parse(["--quick"]))
    for seed, nll in ((1, 2.0), (2, 2.2)):
        run = tmp_path / "grid" / "stdlib" / f"toy-K2-s{seed}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps(dict(model="toy", depth=2, seed=seed, test_nll=nll,
                                                         dev_nll=nll + 0.1, non_embedding_params=1000,
                                                         unigram_dev=5.0, test_split="test")))
    table = sweep_report.report(str(tmp_path / "grid"))
    assert "| toy | 2 | 2 | 1,000 | 2.100 ± 0.141 | 2.200 ± 0.141 | - |\n" in table, table


# ----------------------------------------------------------------------------- every flag's range

def out_of_range():
    """(model, flag, value) for each declared integer range's first value below and, where it has
    one, above it (at the tiny tier, --depth 4, --block_size 32, the default --n_thoughts 1)."""
    cfg = ModelConfig(n_embd=64, n_head=2, depth=4, block_size=32, n_thoughts=1)
    cases = []
    for name, spec in REGISTRY.items():
        for flag, allowed in spec.flags.items():
            if isinstance(allowed, Range):
                cases.append((name, flag, allowed.lo - 1))
                if allowed.hi is not None:
                    cases.append((name, flag, allowed.hi(cfg)[0] + 1))
    return cases


def test_every_model_flag_has_a_declared_range():
    """Every flag of train.py's "model" group but --model, --depth, --size and --width is some
    model's, and every declared flag is a ModelConfig field with a train.py flag."""
    parser = train.build_parser()
    group = next(g for g in parser._action_groups if g.title == "model")
    flags = {a.dest for a in group._group_actions} - {"model", "depth", "size", "width"}
    assert flags == set(models.model_flags())
    assert all(isinstance(a, (Range, models.Choice)) for s in REGISTRY.values() for a in s.flags.values())
    # the ranges that go past a plain lower bound: a rank or dimension above d, a block past the last
    bounded = {(m, f) for m, f, v in out_of_range() if v > 0}
    assert {("loopfold", "fold_rank"), ("gau", "gau_s"), ("flash", "gau_s"), ("lrt", "lrt_src"),
            ("depth-attn", "da_recent")} <= bounded


@pytest.mark.parametrize("model,flag,value", out_of_range())
def test_a_model_flag_outside_its_range_is_refused(model, flag, value, text_file, capsys):
    root = text_file.parent
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(["--model", model, "--size", "tiny", "--depth", "4", "--block_size", "32", f"--{flag}", str(value),
                    "--dataset", str(text_file), "--tokenizer", "char", "--data_root", str(root / "data"),
                    "--out_dir", str(root / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and f"--{flag} {value}" in err, err
    assert sorted(os.listdir(root)) == ["text.txt"]


def test_the_loopfold_rank_above_d_is_refused_naming_the_range(text_file, capsys):
    """--model loopfold --fold_rank 9999 --size tiny built 2.6M non-embedding parameters against the
    tier's 400k; a rank above d = 64 adds parameters but no rank."""
    with pytest.raises(SystemExit):
        train.main(["--model", "loopfold", "--fold_rank", "9999", "--size", "tiny", "--dataset", str(text_file),
                    "--data_root", str(text_file.parent / "data"), "--out_dir", str(text_file.parent / "out")])
    assert capsys.readouterr().err == ("error: --fold_rank 9999: must be <= 64 (the residual width d; a larger one "
                                       "adds parameters, not rank) for --model loopfold\n")
    args = train.parse_args(["--model", "loopfold", "--fold_rank", "64", "--size", "tiny", "--block_size", "32"])
    cfg, _ = models.model_config(resolve_args(args), 61)
    assert cfg.fold_rank == 64  # the bound itself is allowed
    # GAU's shared dimension: a multiple of 32 (the model's own check) and at most d
    args = train.parse_args(["--model", "gau", "--gau_s", "96", "--size", "tiny", "--block_size", "32"])
    with pytest.raises(UsageError, match=r"^--gau_s 96: must be <= 64 \(the residual width d"):
        models.model_config(resolve_args(args), 61)


def test_a_model_without_a_mac_formula_is_a_usage_error(monkeypatch):
    monkeypatch.setitem(REGISTRY, "toy", ModelSpec(toy))
    with pytest.raises(UsageError, match="^flops: no MAC formula for model 'toy'$"):
        flops.forward_macs(ModelConfig(model="toy"), 8)


# ----------------------------------------------------------------------------- the one loss

@pytest.mark.parametrize("name", list(REGISTRY))
def test_the_summed_nll_is_the_mean_times_the_scored_targets(name):
    """LM(idx, targets, reduction="sum") is the cross-entropy summed over the scored targets of the
    returned logits, and the mean is that sum over their count (float64)."""
    cfg = ModelConfig(model=name, vocab_size=61, block_size=16, n_embd=64, n_head=2, depth=4, width=32,
                      window=4, chunk=4, gau_s=64, n_prelude=1, n_core=1, n_coda=1, plt_window=4)
    torch.manual_seed(0)
    model = models.build_model(cfg).double().eval()
    x = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    y = x.roll(-1, 1)
    y[0, :3] = -1
    logits, total = model(x, y, reduction="sum")
    _, mean = model(x, y)
    want = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
    torch.testing.assert_close(total, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(mean, want / 15, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="reduction 'none'"):
        model(x, y, reduction="none")


# ----------------------------------------------------------------------------- initial values

# documented initial constants per model (the hand-computation tests read them from the model)
@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_model_starts_from_its_documented_initial_values(name):
    """Weight matrices N(0, 0.02), residual output projections N(0, 0.02 / sqrt(2 K)) (GPT-2), norm
    gains 1, and each model's own constants, as its modules declare them (init_constants; own_init
    names the matrices drawn otherwise; a new model that copies TANGO inherits TANGO's)."""
    torch.manual_seed(0)
    K = 4
    model = models.build_model(ModelConfig(model=name, vocab_size=61, block_size=32, n_embd=64, n_head=2,
                                           depth=K, width=96))
    residual = {id(m.weight) for m in model.modules() if getattr(m, "is_residual_out", False)}
    own = {id(getattr(m, n)) for m in model.modules() for n in getattr(m, "own_init", ()) if hasattr(m, n)}
    assert residual  # every model has residual branches that mark their output projection
    for n, p in model.named_parameters():
        if p.dim() == 2 and p.numel() >= 1000 and id(p) not in own:
            want = 0.02 / math.sqrt(2 * K) if id(p) in residual else 0.02
            assert abs(p.std().item() / want - 1) < 0.1 and abs(p.mean().item()) < want / 10, (n, p.std().item())
    norms = [m for m in model.modules() if isinstance(m, RMSNorm) and m is not getattr(model.body, "think_norm", None)]
    assert norms and all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    constants = [c for m in model.modules() if hasattr(m, "init_constants") for c in m.init_constants()]
    for got, want in constants:
        if isinstance(want, tuple):  # (value, tolerance) of a statistic of random draws
            assert abs(got.item() - want[0]) < want[1], (name, got.item(), want)
        else:
            want = want if torch.is_tensor(want) else torch.full_like(got, want)
            torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=1e-6)


def test_a_missed_parameter_target_says_why():
    """The solved width misses the tier's target for one of two reasons, and the header (train.py)
    or the error (strict tiers) names which: untied Transformer++ at d = 64, depth 64 has 1,155,136
    non-embedding parameters at its smallest width 8 (target 400,000); at depth 8 a step of the width
    (8) moves the count by 12,288 (3 %), and the closest width, 176, lands at +0.62 %."""
    base = ModelConfig(model="untied", vocab_size=256, block_size=32, n_embd=64, n_head=2)
    deep = models.solve_width(ModelConfig(**{**base.to_dict(), "depth": 64}), 400_000, strict=False)
    assert (deep.width, models.count_params(deep)) == (8, 1_155_136)
    assert models.mismatch_reason(deep, 1_155_136, 400_000).startswith(
        "the smallest width (8) already has 1,155,136: the parameters that do not scale with the width exceed")
    shallow = models.solve_width(ModelConfig(**{**base.to_dict(), "depth": 8}), 400_000, strict=False)
    assert (shallow.width, models.count_params(shallow)) == (176, 402_496)
    assert models.mismatch_reason(shallow, 402_496, 400_000) == ("the width's steps are coarser than 0.20 % at "
                                                                  "this tier and depth")
    assert models.count_params(ModelConfig(**{**shallow.to_dict(), "width": 184})) - 402_496 == 12_288
    assert models.mismatch_reason(shallow, 400_700, 400_000) == ""  # within 0.20 %
    top = max(t for _, _, t in models.TIERS.values())  # no larger --size to give at the largest tier
    assert models.mismatch_reason(deep, 2 * top, top).endswith("exceed the target (give fewer blocks)")
    assert models.mismatch_reason(deep, 1_155_136, 400_000).endswith("(give a larger --size, or fewer blocks)")
    with pytest.raises(UsageError, match=r"\(closest 1,155,136, \+188\.78%: the smallest width \(8\) already has"):
        models.solve_width(ModelConfig(**{**base.to_dict(), "depth": 64}), 400_000, strict=True)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_the_parameter_count_is_affine_in_each_block_count_and_counted_without_building_them(name):
    """models.count_params extrapolates from builds at 3 and 4 blocks (AFFINE_FROM) per block count
    (--depth, --n_core, ...): exact only if every model's count is affine in each block count from
    there on (checked up to 14 by whole meta builds) without cross terms (a point with every count
    large); params_lower_bound, the count at the smallest width, is at most the solved count."""
    assert models.AFFINE_FROM == 3
    built = lambda cfg: models.build_model(cfg, device="meta").num_params()
    # flags that change the count, or need more blocks than AFFINE_FROM, each applied to every model
    # that reads it: flag -> (value, the first depth whose count is affine in it) (--lrt_tgt 5: builds
    # of 6 and 7; --lrt_src 6: 12 and 13)
    extra = {"lrt_tgt": ("5", 7), "lrt_src": ("6", 7), "da_recent": ("5", 6), "fold": ("3", 3),
             "fold_layout": ("last", 3), "n_prelude": ("0", 3), "n_core": ("3", 3), "n_coda": ("1", 3)}
    read = [f for f in extra if f in REGISTRY[name].flags]
    for depth, flags in ((9, []), (14, [x for f in read for x in (f"--{f}", extra[f][0])])):
        args = resolve_args(train.parse_args(["--model", name, "--size", "tiny", "--depth", str(depth),
                                              "--block_size", "32", "--device", "cpu", *flags]))
        cfg = models.flags_config(args, 256)
        smallest = models._with(cfg, width=models.width_multiple(cfg))
        first = max([3] + [extra[f][1] for f in read if flags])
        for f in models.block_counts(cfg):
            counts = [built(models._with(smallest, **{f: k})) for k in range(first if f == "depth" else 3, 15)]
            assert len({b - a for a, b in zip(counts, counts[1:])}) == 1, (f, flags, counts)
        large = models._with(smallest, **{f: 9 + i for i, f in enumerate(models.block_counts(cfg))})
        assert models.count_params(large) == built(large) and models.count_params(smallest) == built(smallest)
        assert models.params_lower_bound(cfg, args.width) == built(smallest), flags
        solved, _ = models.model_config(args, 256)
        assert built(smallest) <= built(solved) == models.count_params(solved)


def record_build_sizes(monkeypatch):
    """Patch models.build_model to record each build's largest block count: (that list, the real build_model)."""
    sizes, build = [], models.build_model
    monkeypatch.setattr(models, "build_model", lambda cfg, **kw: sizes.append(
        max(getattr(cfg, f) for f in models.block_counts(cfg))) or build(cfg, **kw))
    return sizes, build


def test_a_depth_far_beyond_memory_is_refused_without_building_it(monkeypatch):
    """untied Transformer++ at --depth 1,000,000,000 (Parcae at --n_core 10**9) was built block by
    block on the meta device (a millisecond each): check_model refuses it from builds of at most
    7 blocks, with the solved count, or with the count at the smallest width ("at least") where a
    strict tier cannot solve the width."""
    from harness import config
    args = resolve_args(train.parse_args(["--model", "untied", "--size", "tiny", "--depth", "8",
                                          "--block_size", "32", "--device", "cpu"]))
    looped = [resolve_args(train.parse_args(["--model", name, "--size", "tiny", "--depth", "8", "--block_size", "32",
                                             "--device", "cpu"]))
              for name in REGISTRY if "n_core" in REGISTRY[name].flags]
    strict = resolve_args(train.parse_args(["--model", "untied", "--size", "70M", "--depth", "8",
                                            "--block_size", "32", "--device", "cpu"]))
    args.depth = strict.depth = 10**9  # (resolve_args itself calls check_model)
    sizes, build = record_build_sizes(monkeypatch)
    n = models.count_params(models.model_config(args, 256)[0])
    with pytest.raises(UsageError, match=rf"^--size tiny --depth 1000000000: the model's {n:,} "
                                         r"non-embedding parameters need [\d,.]+ GB for its weights, gradients"):
        config.check_model(args)
    assert n > 10**9 * 4 * 64 * 64  # at least the attention's 4 d^2 per block
    bound = models.params_lower_bound(models.flags_config(strict, 256), strict.width)  # 70M: no width within 0.20 % of 44,270,000
    with pytest.raises(UsageError, match=rf"^--size 70M --depth 1000000000: the model's at least {bound:,} "):
        config.check_model(strict)
    # every block count: Parcae's and the loop stacks' --n_core 10**9 too
    assert looped
    for args in looped:
        args.n_core = 10**9
        given = ("--depth 8 --n_prelude 2 --n_core 1000000000 --n_coda 2" if "n_prelude" in REGISTRY[args.model].flags
                 else "--depth 8 --n_core 1000000000")
        with pytest.raises(UsageError, match=rf"^--size tiny {given}: the model's [\d,]+ non-embedding"):
            config.check_model(args)
    assert max(sizes) <= 2 * models.AFFINE_FROM + 1
    # the flags' own errors come first, at any depth: a bad --width, a flag outside its range
    for flags, message in ((["--width", "-8"], "--width -8: must be a positive multiple of 8"),
                           (["--width", "7"], "--width 7: must be a positive multiple of 8"),
                           (["--model", "gau", "--gau_s", "320000000"], "--gau_s 320000000: must be <= 64")):
        args = train.parse_args(["--model", "untied", "--size", "tiny", "--depth", "8", "--block_size", "32",
                                 "--device", "cpu", *flags])
        args.depth = 10**8
        with pytest.raises(UsageError, match="^" + re.escape(message)):
            models.params_lower_bound(models.flags_config(args, 256), args.width)


def test_solving_the_width_of_a_deep_model_builds_no_more_than_seven_blocks(monkeypatch):
    """A deep model that fits (untied Transformer++ at --depth 20000, Parcae at --n_core 20000) had
    its width solved by 8 whole meta builds, minutes before the first update; without a block index
    (--lrt_tgt) count_params's builds have at most 2 AFFINE_FROM + 1 blocks per block count, and its
    count equals the whole build's."""
    sizes, build = record_build_sizes(monkeypatch)
    for name, flag in (("untied", "depth"), ("parcae", "n_core")):
        args = train.parse_args(["--model", name, "--size", "tiny", "--depth", "8", "--block_size", "32",
                                 "--device", "cpu", f"--{flag}", "20000"])
        cfg, _ = models.model_config(args, 256)
        assert max(sizes) <= 2 * models.AFFINE_FROM + 1 and getattr(cfg, flag) == 20000
        whole = [build(models._with(cfg, **{flag: k}), device="meta").num_params() for k in (1000, 1001)]
        assert models.count_params(cfg) == whole[0] + 19000 * (whole[1] - whole[0])


@pytest.mark.parametrize("name", list(REGISTRY))
def test_min_depth_is_the_smallest_depth_trained_and_evaluated(name):
    """A model's ModelSpec.min_depth is the smallest --depth train.py builds it at and, for a
    shared-block model, the smallest test-time depth --eval_depths runs it at; one below is
    refused in one line naming the flag."""
    k = REGISTRY[name].min_depth
    run = lambda *flags: resolve_args(train.parse_args(["--model", name, "--size", "tiny", "--block_size", "32",
                                                        "--device", "cpu", *flags]))
    assert run("--depth", str(k)).depth == k
    with pytest.raises(UsageError, match=rf"^--depth {k - 1}: "):
        run("--depth", str(k - 1))
    if REGISTRY[name].shared_block:
        assert run("--depth", str(k + 1), "--eval_depths", f"{k},{k + 2}").depth_list == [k, k + 2]
        with pytest.raises(UsageError, match=rf"^--eval_depths {k - 1},{k}: --model {name} needs depths >= {k}$"):
            run("--depth", str(k + 1), "--eval_depths", f"{k - 1},{k}")


# the flags that set how close a parallel prefill comes to the sequential recurrence decoding runs
# (ponder.py's Jacobi refinements, latent_recurrence.py's subsets), here at values where it is exact
EXACT_PREFILL = {"jacobi": 48, "lrt_subsets": 128}
DECODE = ModelConfig(n_embd=64, n_head=2, vocab_size=61, block_size=32, window=5, chunk=8, depth=3, width=16,
                     **EXACT_PREFILL)


@pytest.mark.parametrize("name, flag, value", [(n, f, v) for n in REGISTRY
                                                for f, v in checks.flag_values(replace(DECODE, model=n))
                                                if f not in EXACT_PREFILL])
def test_cached_decoding_equals_full_forward_at_every_model_flag_value(name, flag, value):
    """Float64: a prefill of 3 tokens, one 2-token step and single tokens with a cache give the
    full forward's logits, at each model flag's values beside DECODE's (checks.flag_values)."""
    torch.manual_seed(0)
    model = models.build_model(replace(DECODE, model=name, **{flag: value})).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        x = torch.randint(0, 61, (2, 12))
        full, cache = model(x)[0], {}
        steps = [0, 3, 5] + list(range(6, 13))
        parts = [model(x[:, a:b], cache=cache)[0] for a, b in zip(steps, steps[1:])]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)
