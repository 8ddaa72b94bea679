"""Tests for latent_tokens.py (*Enhancing Latent Computation in Transformers with Latent Tokens*,
arXiv 2505.12629, §3; MATH.md "Latent tokens"): augmented sequences and position ids on hand-built
examples for every policy and position mode, the loss mask, frozen base, cached decoding == full
forward (every REGISTRY model, and tiny Hugging Face Llama / GPT-2 when transformers is installed),
teacher-forced scoring == greedy decoding, the one training loop, and the command line (one-line
errors with exit code 2, a tiny end-to-end run, the committed results table regenerated from its
runs). The task generators and metrics are tested in test_tasks.py."""
import json
import math
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness import latent_bases
from studies import latent_experiments
import latent_tokens as lt
import models
from harness import tasks
from common import ModelConfig, UsageError

B, C = 0, 9  # beginning token and marker (',') in the hand-built examples


pytestmark = pytest.mark.usefixtures("one_thread")


def pol(spec, groups="shared"):
    return lt.Policy(spec, groups=groups, marker_ids=[C])


def show(a):
    """Compact view: verbal ids as ints, latents as 'g.s'."""
    return [t if t >= 0 else f"{g}.{s}" for t, g, s in zip(a.tokens, a.latent_group, a.latent_slot)]


# ----------------------------------------------------------------------------- augment

V1, Q1 = [B, 5, C, 6, 7, C, 8], 3  # query "B 5 ,", response "6 7 , 8"


def test_comma_prepend_append_increase():
    a = lt.augment(V1, Q1, pol("Comma_2"))
    assert show(a) == [B, 5, C, "0.0", "0.1", 6, 7, C, "0.0", "0.1", 8]
    assert a.is_latent == [False] * 3 + [True] * 2 + [False] * 3 + [True] * 2 + [False]
    assert a.latent_slot == [-1, -1, -1, 0, 1, -1, -1, -1, 0, 1, -1]
    assert a.verbal_index == [0, 1, 2, -1, -1, 3, 4, 5, -1, -1, 6]
    assert a.position_ids == [0, 1, 2, 3, 3, 3, 4, 5, 6, 6, 6]  # PREPEND: id of the next verbal token
    # only response targets; the item before a latent predicts nothing; the last latent predicts
    assert a.targets == [-1, -1, -1, -1, 6, 7, C, -1, -1, 8, -1]
    ap = lt.augment(V1, Q1, pol("Comma_2"), "append")
    assert ap.tokens == a.tokens and ap.targets == a.targets
    assert ap.position_ids == [0, 1, 2, 2, 2, 3, 4, 5, 5, 5, 6]  # APPEND: id of the verbal token before
    inc = lt.augment(V1, Q1, pol("Comma_2"), "increase")
    assert inc.position_ids == list(range(11)) and inc.targets == a.targets


def test_start_end_k():
    s = lt.augment(V1, Q1, pol("Start_1"))
    assert show(s) == ["0.0", B, 5, C, 6, 7, C, 8]
    assert s.position_ids == [0, 0, 1, 2, 3, 4, 5, 6]
    assert lt.augment(V1, Q1, pol("Start_1"), "append").position_ids == [0, 0, 1, 2, 3, 4, 5, 6]
    assert s.targets == [-1, -1, -1, 6, 7, C, 8, -1]
    e = lt.augment(V1, Q1, pol("End_2"))
    assert show(e) == [B, 5, C, "0.0", "0.1", 6, 7, C, 8]
    assert e.position_ids == [0, 1, 2, 3, 3, 3, 4, 5, 6]
    assert lt.augment(V1, Q1, pol("End_2"), "append").position_ids == [0, 1, 2, 2, 2, 3, 4, 5, 6]
    assert e.targets == [-1, -1, -1, -1, 6, 7, C, 8, -1]  # the pause tokens' last one predicts the answer
    k = lt.augment(V1, Q1, pol("2_1"))  # one latent after every 2 verbal tokens (slots 2, 4, 6)
    assert show(k) == [B, 5, "0.0", C, 6, "0.0", 7, C, "0.0", 8]
    assert k.position_ids == [0, 1, 2, 2, 3, 4, 4, 5, 6, 6]
    assert lt.augment(V1, Q1, pol("2_1"), "increase").position_ids == list(range(10))
    assert k.targets == [-1, -1, -1, 6, -1, 7, C, -1, 8, -1]
    # score_from=1: every verbal target but the first
    assert lt.augment(V1, Q1, pol("2_1"), score_from=1).targets == [5, -1, C, 6, -1, 7, C, -1, 8, -1]
    none = lt.augment(V1, Q1, pol("none"))
    assert none.tokens == V1 and none.position_ids == list(range(7)) and none.targets == [-1, -1, 6, 7, C, 8, -1]


V2, Q2 = [B, 5, C, 6, C, 7, 8, C, 5], 5  # commas inside the query, at its end, inside the response


def test_function_specialization_and_combinations():
    fs = lt.augment(V2, Q2, pol("Start_1+Comma_1", "fs"))  # sites: start 0, query 1, end 2, response 3
    assert show(fs) == ["0.0", B, 5, C, "1.0", 6, C, "2.0", 7, 8, C, "3.0", 5]
    assert pol("Start_1+Comma_1", "fs").n_groups == 4
    rule = lt.augment(V2, Q2, pol("Start_1+Comma_1", "rule"))  # the paper's Comma_1 (w/ FS): two vectors
    assert show(rule) == ["0.0", B, 5, C, "1.0", 6, C, "1.0", 7, 8, C, "1.0", 5]
    assert pol("Start_1+Comma_1", "rule").n_groups == 2
    shared = lt.augment(V2, Q2, pol("Start_1+Comma_2"))  # one group; Start uses its first slot
    assert show(shared) == ["0.0", B, 5, C, "0.0", "0.1", 6, C, "0.0", "0.1", 7, 8, C, "0.0", "0.1", 5]
    p = pol("Start_1+Comma_2")
    assert (p.n_groups, p.max_m) == (1, 2)
    both = lt.augment(V2, Q2, pol("End_1+Comma_1", "rule"))  # one slot, two groups, in the order written
    assert show(both) == [B, 5, C, "1.0", 6, C, "0.0", "1.0", 7, 8, C, "1.0", 5]
    assert both.position_ids == [0, 1, 2, 3, 3, 4, 5, 5, 5, 6, 7, 8, 8]
    fs_k = pol("2_1", "fs")  # periodic latents: query, end, response groups
    assert show(lt.augment([B, 1, 2, 3, 4, 5, 6], 4, fs_k)) == [B, 1, "0.0", 2, 3, "1.0", 4, 5, "2.0", 6]


@pytest.mark.parametrize("readout", lt.READOUTS)
@pytest.mark.parametrize("groups", lt.GROUPINGS)
def test_every_latent_lands_in_a_group_the_policy_has(groups, readout):
    """Markers at every position (v_0 and the last included), every query length and the trailing
    slot: each latent's group is one of the policy's n_groups, and under "fs" the group of its site
    (a verbal-readout Comma_m before a marker at v_0 sits at the start site)."""
    p = lt.Policy("Start_1+End_1+Comma_1+2_1", groups=groups, marker_ids=[C], readout=readout)
    used = set()
    for verbal in ([C, 5, C, 6, C], [C, C, C], [5, 6, 7, C]):
        for q in range(len(verbal) + 1):
            a = lt.augment(verbal, q, p, trailing=True)
            groups_seen = [g for g in a.latent_group if g >= 0]
            assert all(0 <= g < p.n_groups for g in groups_seen), (verbal, q, a.latent_group)
            used |= set(groups_seen)
    if groups == "fs":
        assert p.site_group == {s: i for i, s in enumerate(lt.SITES)} and used == set(range(4))
    lone = lt.Policy("Comma_1", groups="fs", marker_ids=[C], readout=readout)
    first = lt.augment([C, 5, C], 2, lone)
    start = lone.site_group.get("start")
    assert (start is not None) == (readout == "verbal")
    assert show(first)[0] == (f"{start}.0" if readout == "verbal" else C)


def test_readout_verbal_ablation():
    """Paper-literal reading: only verbal positions predict (across latents), Comma_m sits before
    the marker, End_m latents do not affect the first response token."""
    p = lt.Policy("Comma_2", marker_ids=[C], readout="verbal")
    a = lt.augment(V1, Q1, p)
    assert show(a) == [B, 5, "0.0", "0.1", C, 6, 7, "0.0", "0.1", C, 8]
    assert a.position_ids == [0, 1, 2, 2, 2, 3, 4, 5, 5, 5, 6]
    assert a.targets == [-1, -1, -1, -1, 6, 7, C, -1, -1, 8, -1]
    e = lt.augment(V1, Q1, lt.Policy("End_2", readout="verbal"))
    assert show(e) == [B, 5, C, "0.0", "0.1", 6, 7, C, 8]
    assert e.targets == [-1, -1, 6, -1, -1, 7, C, 8, -1]
    with pytest.raises(UsageError):
        lt.Policy("End_2", readout="sideways")


def test_trailing_slot_for_decoding():
    a = lt.augment([B, 5, C], 3, pol("Comma_1"), trailing=True)
    assert show(a) == [B, 5, C, "0.0"] and a.position_ids == [0, 1, 2, 3]
    assert lt.augment([B, 5, 6], 3, pol("Comma_1"), trailing=True).tokens == [B, 5, 6]


def test_policy_parsing():
    assert [str(r) for r in lt.parse_policy("Start_1+Comma_2+8_2+End_3")] == ["Start_1", "Comma_2", "8_2", "End_3"]
    assert lt.parse_policy("comma", m=2) == (lt.Rule("marker", 2),)
    assert lt.parse_policy("none") == ()
    with pytest.raises(UsageError, match=r"^--policy: 'Comma' needs a count \(e.g. Comma_2\)$"):  # (no --m flag)
        lt.parse_policy("Comma")
    for bad in ("Foo_2", "Comma", "0_1", "Start_0", "Comma_2+", "4-1"):
        with pytest.raises(UsageError):
            lt.parse_policy(bad)
    with pytest.raises(UsageError):
        lt.Policy("Comma_1", groups="bogus", marker_ids=[C])
    with pytest.raises(UsageError):
        lt.Policy("Comma_1")  # no marker ids
    with pytest.raises(UsageError):
        lt.augment(V1, Q1, pol("Comma_1"), "sideways")


# ----------------------------------------------------------------------------- models

def small_cfg(model, **kw):
    base = dict(model=model, vocab_size=13, block_size=16, n_embd=64, n_head=2, depth=3,
                width=48, gau_s=64, chunk=4, window=6,
                jacobi=64,  # PonderLM-2's Jacobi prefill is exact (cached = full forward) at jacobi >= T - 1
                lrt_subsets=128)  # LRT's parallel prefill is exact at one slot per subset (lrt-think: 2 T slots)
    base.update(kw)
    return ModelConfig(**base)


def loud(model, seed=0):
    """float64 with weights big enough that mixing and positions move the logits a lot (at the
    default init the attention barely changes anything and comparisons would be vacuous)."""
    torch.manual_seed(seed)
    model = model.to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
            elif "gamma" in name or "beta" in name:
                p.normal_(0.0, 0.5)
    return model


def latent_model(name, policy, groups="shared", mode="prepend", **kw):
    base = loud(models.build_model(small_cfg(name, **kw)))
    llm = lt.LatentLM(base, policy, groups=groups, position_mode=mode, marker_ids=[C])
    with torch.no_grad():
        llm.Z.normal_(0.0, 1.0)
    return llm


def test_loss_mask_and_frozen_base():
    llm = latent_model("untied", "Start_1+Comma_2", groups="rule")
    augs = [llm.augment(V1, Q1), llm.augment(V2, Q2)]
    loss = llm.loss(augs)
    # manual: cross entropy over exactly the positions with a scored target
    logits, tgt = llm.logits(augs)
    keep = tgt >= 0
    assert int(keep.sum()) == 4 + 4
    ref = F.cross_entropy(logits[keep], tgt[keep])
    torch.testing.assert_close(loss, ref)
    llm.train()
    assert not llm.base.training
    loss.backward()
    for name, p in llm.base.named_parameters():
        assert not p.requires_grad and p.grad is None, name
    assert llm.Z.grad is not None and llm.Z.grad.abs().sum() > 0
    assert [n for n, p in llm.named_parameters() if p.requires_grad] == ["Z"]
    # a batch without commas reaches only the Start group
    llm.Z.grad = None
    llm.loss([llm.augment([B, 5, 6, 7], 2)]).backward()
    assert llm.Z.grad[0].abs().sum() > 0 and llm.Z.grad[1].abs().sum() == 0


def test_latents_change_only_later_predictions():
    """Causality: latents in slot j leave every prediction before them unchanged, and the base
    alone is the plain model."""
    llm = latent_model("untied", "End_2")
    base_logits, _ = llm.base(torch.tensor([V1]))
    none = lt.LatentLM(llm.base, "none")
    torch.testing.assert_close(none.logits([none.augment(V1, Q1)])[0], base_logits)
    aug_logits, _ = llm.logits([llm.augment(V1, Q1)])
    torch.testing.assert_close(aug_logits[0, :Q1], base_logits[0, :Q1])
    assert not torch.allclose(aug_logits[0, Q1 + 2:], base_logits[0, Q1:])


def check_cached_equals_full(llm, query, cont):
    new, steps = llm.generate(query, len(cont), forced=cont, return_logits=True)
    assert new == cont and steps.shape[0] == len(cont)
    logits, tgt = llm.logits([llm.augment(query + cont, len(query))])
    full = logits[0][tgt[0] >= 0]
    assert full.shape == steps.shape
    torch.testing.assert_close(steps, full.to(steps.dtype), rtol=1e-6, atol=1e-6)


QUERY = [B, 3, 4, C, 5, C, 6, 2, C]
CONT = [7, 1, C, 2, 3, 4, C, 5, 6, 7, 8, C, 1, 2]  # crosses markers, period boundaries, FLASH chunks


@pytest.mark.parametrize("name", list(models.REGISTRY))
def test_cached_decode_equals_full_forward(name):
    llm = latent_model(name, "Start_1+End_2+Comma_2+5_1", groups="fs")
    check_cached_equals_full(llm, QUERY, CONT)


@pytest.mark.parametrize("mode", lt.POSITION_MODES)
def test_cached_decode_position_modes(mode):
    check_cached_equals_full(latent_model("tango", "Comma_2+3_1", mode=mode), QUERY, CONT)


def test_a_group_longer_than_the_context_is_refused():
    """A policy whose m exceeds the base's context (block_size) is one line before Z is made
    (Start_99999999 made a table of 10^8 d numbers and the process was killed for memory)."""
    base = models.build_model(small_cfg("untied"))
    T = base.cfg.block_size
    assert lt.LatentLM(base, f"Start_{T}").Z.shape[:2] == (1, T)
    with pytest.raises(UsageError, match=rf"^policy Start_99999999: 99999999 latents in one group, more than the base's "
                                         rf"context of {T} positions; give m <= {T}$"):
        lt.LatentLM(base, "Start_99999999")


@pytest.mark.parametrize("name", list(models.REGISTRY))
def test_cached_decode_readout_verbal(name):
    base = loud(models.build_model(small_cfg(name)))
    llm = lt.LatentLM(base, "Start_1+End_2+Comma_2+5_1", groups="fs", marker_ids=[C], readout="verbal")
    with torch.no_grad():
        llm.Z.normal_(0.0, 1.0)
    check_cached_equals_full(llm, QUERY, CONT)


def test_greedy_decode_matches_teacher_forced_scoring():
    """The evaluation shortcut: teacher forcing on a reference counts exactly the leading tokens
    greedy decoding reproduces (policy decisions depend only on the prefix)."""
    llm = latent_model("loop", "Comma_1+4_2")
    greedy = llm.generate(QUERY, 12)
    ref = list(greedy)
    ref[7] = (ref[7] + 1) % 13  # the reference departs from the greedy output at response token 7
    (r, total), = lt.correct_prefix_lengths(llm, [llm.augment(QUERY + ref, len(QUERY))])
    assert (r, total) == (7, 12)
    (r, total), = lt.correct_prefix_lengths(llm, [llm.augment(QUERY + greedy, len(QUERY))])
    assert r == total == 12


def _tiny_hf(kind):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional)",
                                       exc_type=ImportError)
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=13, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=13, n_embd=64, n_layer=2, n_head=2, n_positions=64)
        model = transformers.GPT2LMHeadModel(cfg)
    model = model.to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return model


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_cached_decode_equals_full_forward(kind):
    model = _tiny_hf(kind)
    for mode in lt.POSITION_MODES:
        llm = lt.LatentLM(model, "Start_1+Comma_2+5_1", groups="fs", position_mode=mode, marker_ids=[C])
        with torch.no_grad():
            llm.Z.normal_(0.0, 1.0)
        check_cached_equals_full(llm, QUERY, CONT)
    loss = llm.loss([llm.augment(QUERY + CONT, len(QUERY))])
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    assert llm.Z.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- training

def test_cosine_lr_values():
    """Warmup to the peak over `warmup` updates, the peak again at update `warmup`, cosine to the
    floor at update `total` (hand values: cos(pi/2) = 0)."""
    lrs = [lt.cosine_lr(s, 10, 1.0, 0.1, 2) for s in range(11)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert lrs[6] == pytest.approx(0.55, abs=1e-15) and lrs[10] == pytest.approx(0.1, abs=1e-15)
    assert lt.cosine_lr(40, 10, 1.0, 0.1, 2) == pytest.approx(0.1, abs=1e-15)


def test_train_latents_is_adamw_on_z_by_hand():
    """train_latents == an independent float64 loop: the same epoch permutations, cosine_lr,
    clipping to grad_clip, AdamW (betas 0.9, 0.999, eps 1e-8, decoupled decay) on Z alone."""
    llm = latent_model("untied", "Start_1+Comma_2", groups="rule")
    augs = [llm.augment(V1, Q1), llm.augment(V2, Q2), llm.augment(QUERY + CONT, len(QUERY))]
    z0 = llm.Z.detach().clone()
    base0 = {k: v.clone() for k, v in llm.base.state_dict().items()}
    losses = lt.train_latents(llm, augs, epochs=2, batch_size=2, lr=1e-2, min_lr=1e-4, warmup=0.25,
                              weight_decay=0.1, grad_clip=0.5, seed=4)
    ref = lt.LatentLM(llm.base, llm.policy)
    with torch.no_grad():
        ref.Z.copy_(z0)
    m, v, want, rng, t = torch.zeros_like(z0), torch.zeros_like(z0), [], np.random.default_rng(4), 0
    for _ in range(2):
        perm = rng.permutation(3)
        for b in range(2):
            lr = 1e-2 * (t + 1) if t < 1 else 1e-4 + (1e-2 - 1e-4) * 0.5 * (1 + math.cos(math.pi * (t - 1) / 3))
            loss = ref.loss([augs[i] for i in perm[2 * b:2 * b + 2]])
            g, = torch.autograd.grad(loss, ref.Z)
            g = g * min(1.0, 0.5 / (float(g.norm()) + 1e-6))
            t += 1
            m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
            with torch.no_grad():
                ref.Z.mul_(1 - lr * 0.1)
                ref.Z.sub_(lr / (1 - 0.9 ** t) * m / (v.sqrt() / math.sqrt(1 - 0.999 ** t) + 1e-8))
            want.append(loss.item())
    assert losses == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(llm.Z.detach(), ref.Z.detach(), rtol=1e-10, atol=1e-12)
    assert all(torch.equal(base0[k], w) for k, w in llm.base.state_dict().items())  # the base is frozen


# ----------------------------------------------------------------------------- CLI

def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        latent_experiments.main(argv)
    err = capsys.readouterr().err.strip()
    return e.value.code, err


def test_cli_errors(tmp_path, capsys):
    code, err = run_cli(["--base", str(tmp_path / "missing.pt"), "--task", "summation"], capsys)
    assert code == 2 and err.startswith("error: --base: no checkpoint") and "\n" not in err
    code, err = run_cli(["--base", "x.pt", "--task", "sorting"], capsys)
    assert code == 2 and "unknown task" in err and "\n" not in err
    code, err = run_cli(["--base", "x.pt", "--task", "summation", "--policy", "Middle_2"], capsys)
    assert code == 2 and "unknown part" in err and "\n" not in err
    code, err = run_cli(["pretrain", "--task", "sorting"], capsys)
    assert code == 2 and "unknown task" in err
    out = tmp_path / "base"  # a bad --model or --width fails before anything is written
    code, err = run_cli(["pretrain", "--model", "nope", "--out_dir", str(out)], capsys)
    assert code == 2 and err.startswith("error: --model nope: choose one of tango") and not out.exists()
    code, err = run_cli(["pretrain", "--model", "tango", "--width", "63", "--n_samples", "8", "--n_dev", "2",
                         "--out_dir", str(out)], capsys)
    assert code == 2 and "width 63" in err and not out.exists()


@pytest.mark.parametrize("argv, message", [
    # numpy's default_rng refused a negative seed with a traceback (exit 1); sweep also left an empty --out_dir
    (["--base", "x.pt", "--task", "generation", "--seed", "-1"], "--seed -1: must be >= 0"),
    (["--base", "x.pt", "--task", "generation", "--seed", str(2 ** 64)], f"--seed {2 ** 64}: must be < 2**64"),
    (["pretrain", "--seed", "-1", "--steps", "1", "--out_dir", "out"], "--seed -1: must be >= 0"),
    (["sweep", "--base", "x.pt", "--seeds", "-1", "--out_dir", "out"], "--seeds -1: must be >= 0"),
    (["sweep", "--base", "x.pt", "--seeds", "0", "1", "0", "--out_dir", "out"], "--seeds 0 1 0: each seed at most once"),
    (["pretrain", "--width", "0", "--out_dir", "out"], "--width 0: must be >= 1 (leave it out for the default 4 d)"),
    # sweep's errors named run's --task and --policy
    (["sweep", "--base", "x.pt", "--tasks", "foo", "--out_dir", "out"],
     "--tasks: unknown task 'foo'; give all or a comma list of generation, summation, repetition"),
    (["sweep", "--base", "x.pt", "--tasks", "all,summation", "--out_dir", "out"],
     "--tasks: unknown task 'all'; give all or a comma list of generation, summation, repetition"),
    (["pretrain", "--task", "summation,", "--out_dir", "out"],
     "--task: unknown task ''; give all or a comma list of generation, summation, repetition"),
    (["sweep", "--base", "x.pt", "--extra", "foo", "--out_dir", "out"],
     "--extra: unknown part 'foo' in 'foo'; use Start_m, End_m, Comma_m, k_m (e.g. 4_1), combinations with '+', "
     "or none"),
])
def test_cli_seeds_tasks_and_extra_are_one_line_errors_naming_the_flag(argv, message, tmp_path, monkeypatch, capsys):
    """One line naming the flag, exit 2, before anything is read or written."""
    monkeypatch.chdir(tmp_path)
    assert run_cli(argv, capsys) == (2, f"error: {message}")
    assert os.listdir(tmp_path) == []


def test_cli_marker_outside_the_vocabulary_names_marker(tmp_path, capsys):
    """--marker "🦜" said "error: '🦜' is not in the base's vocabulary" without naming the flag."""
    cfg = ModelConfig(model="untied", vocab_size=len(tasks.TASK_VOCAB), block_size=64, n_embd=32, n_head=1, depth=1,
                      width=64)
    torch.save({"model": models.build_model(cfg).state_dict(), "config": cfg.to_dict(),
                "data": {"tokenizer": "task", "vocab_size": len(tasks.TASK_VOCAB), "itos": tasks.TASK_VOCAB}},
               tmp_path / "base.pt")
    js = tmp_path / "out" / "r.jsonl"
    code, err = run_cli(["--base", str(tmp_path / "base.pt"), "--task", "generation", "--marker", "🦜",
                         "--json", str(js)], capsys)
    assert (code, err) == (2, "error: --marker '🦜': '🦜' is not in the base's vocabulary (the marker must be one "
                              "token of it)")
    assert os.listdir(tmp_path) == ["base.pt"]


def test_pretrain_stops_on_a_non_finite_dev_nll_and_writes_nothing(tmp_path, capsys):
    """pretrain --lr 1e12 printed "dev NLL nan", went on and died later, leaving train.txt and
    meta.json without a checkpoint: a non-finite dev NLL is one line (exit 1), and the data files
    are written with the first checkpoint, so nothing is left."""
    code, err = run_cli(["pretrain", "--out_dir", str(tmp_path / "base"), "--d", "32", "--depth", "1", "--steps", "3",
                         "--eval_interval", "1", "--n_samples", "30", "--n_dev", "6", "--lr", "1e12"], capsys)
    assert code == 1 and re.fullmatch(r"error: (update 1: dev NLL nan|.*non-finite.*); stopped; no checkpoint was saved",
                                      err), err
    assert not (tmp_path / "base").exists()


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "base"
    latent_experiments.main(["pretrain", "--out_dir", str(out), "--d", "32", "--depth", "1", "--steps", "3", "--eval_interval", "3",
             "--n_samples", "30", "--n_dev", "6", "--n_test", "4"])
    ck = torch.load(out / "ckpt_best.pt", map_location="cpu", weights_only=True)
    assert set(ck) == {"model", "config", "data", "iter", "best_dev", "dev_nll"}
    assert ck["data"]["tokenizer"] == "task" and ck["data"]["itos"] == tasks.TASK_VOCAB
    meta = json.load(open(out / "meta.json"))
    assert meta["itos"] == ck["data"]["itos"]
    assert open(out / "train.txt").read().startswith("\n")
    assert sorted(os.listdir(out)) == ["ckpt_best.pt", "meta.json", "train.txt"]  # no temporary file left
    assert "update 3: train loss " in capsys.readouterr().out.replace(" nats/token (best, saved)", "=")  # with its unit
    js = tmp_path / "r.jsonl"
    latent_experiments.main(["--base", str(out / "ckpt_best.pt"), "--task", "repetition", "--policy", "Start_1+Comma_1",
             "--groups", "rule", "--n_train", "8", "--epochs", "1", "--n_test", "4", "--json", str(js),
             "--save", str(tmp_path / "z.pt")])
    text = capsys.readouterr().out
    assert "ID  1-5" in text and "OOD 8-10" in text
    rec = json.loads(open(js).read())
    assert rec["latent_vectors"] == 2 and set(rec["metrics"]) == {"1-5", "6-7", "8-10"}
    assert torch.load(tmp_path / "z.pt", weights_only=True)["Z"].shape == (2, 1, 32)
    latent_experiments.main(["pretrain", "--out_dir", str(tmp_path / "cbase"), "--vocab", "char", "--d", "32", "--depth", "1",
             "--steps", "1", "--eval_interval", "1", "--n_samples", "6", "--n_dev", "3", "--n_test", "2"])
    base, tok = latent_bases.load_base(str(tmp_path / "cbase" / "ckpt_best.pt"))
    assert tok.kind == "char" and tok.itos == list(tasks.TASK_ALPHABET)
    latent_experiments.main(["--base", str(out / "ckpt_best.pt"), "--task", "generation", "--policy", "none", "--n_test", "2",
             "--eval_mode", "generate"])
    assert "equations" in capsys.readouterr().out
    latent_experiments.main(["sweep", "--base", str(out / "ckpt_best.pt"), "--out_dir", str(tmp_path / "res"), "--tasks", "summation",
             "--seeds", "0", "1", "--n_train", "4", "--epochs", "1", "--n_test", "2"])
    table = open(tmp_path / "res" / "README_table.md").read()
    assert "frozen base alone" in table and "Comma_2** (paper's method)" in table and "(matched tokens)" in table
    runs = json.load(open(tmp_path / "res" / "results_summation.json"))
    assert len(runs) == 1 + 5 * 2
    assert "python -m studies.latent_experiments pretrain --out_dir" in table and "python -m studies.latent_experiments sweep" in table


def test_committed_table_regenerates_from_its_runs():
    """results/latent_tokens/README_table.md holds make_table over the committed runs, byte for byte."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "latent_tokens")
    runs = [r for name in tasks.TASKS for r in json.load(open(os.path.join(root, f"results_{name}.json")))]
    assert len(runs) == 57
    table = latent_experiments.make_table(runs)
    assert table.count("| frozen base alone |") == 3
    assert table in open(os.path.join(root, "README_table.md")).read()


def test_load_base_reads_a_local_hugging_face_folder(tmp_path):
    """load_base('hf:DIR') loads a saved model and tokenizer offline; a folder without a model is a
    one-line UsageError naming --base."""
    from harness import latent_bases
    model = _tiny_hf("llama")
    tokenizers = pytest.importorskip("tokenizers", exc_type=ImportError)
    import transformers
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + list("0123456789"))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    model.save_pretrained(tmp_path / "m")
    fast.save_pretrained(tmp_path / "m")
    base, t = latent_bases.load_base(f"hf:{tmp_path / 'm'}")
    assert t.vocab_size == 13 and t.encode("427") == [7, 5, 10]  # "0" is id 3
    ids = torch.tensor([t.encode("427")])
    torch.testing.assert_close(base(ids).logits, model(ids).logits)
    with pytest.raises(UsageError, match=r"^--base hf:.*nope: cannot load a Hugging Face model"):
        latent_bases.load_base(f"hf:{tmp_path / 'nope'}")


def test_pretrain_mix_weights_beyond_the_samples_build_only_the_turns_used(tmp_path):
    """--mix 1099511627776,1 built a rotation list of 2**40 entries (memory until the OOM killer);
    only the first max(n_samples, n_dev) turns are reached, so it writes what a weight of exactly
    that many writes: every sample from the first task."""
    common = ["--task", "repetition,summation", "--d", "32", "--depth", "1", "--steps", "1", "--eval_interval", "1",
              "--n_samples", "6", "--n_dev", "3", "--n_test", "2"]
    for name, mix in (("huge", str(2**40) + ",1"), ("six", "6,1")):
        latent_experiments.main(["pretrain", "--out_dir", str(tmp_path / name), "--mix", mix, *common])
    texts = [open(tmp_path / n / "train.txt").read() for n in ("huge", "six")]
    assert texts[0] == texts[1] and texts[0].count("\n") >= 6
    assert json.load(open(tmp_path / "huge" / "meta.json"))["mix"] == [2**40, 1]
