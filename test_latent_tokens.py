"""Tests for latent tokens (latent_tokens.py, SPEC.md section 6): augmented sequences and position
ids on hand-built examples for every policy and position mode, the loss mask, frozen base,
cached decoding == full forward (every REGISTRY model, and tiny Hugging Face Llama / GPT-2 when
transformers is installed), teacher-forced scoring == greedy decoding, the three task generators
and their metrics, and the CLI (one-line errors with exit code 2, a tiny end-to-end run)."""
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import latent_tokens as lt
import models
from common import ModelConfig, UsageError

B, C = 0, 9  # beginning token and marker (',') in the hand-built examples


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
    assert a.target_mask == [t >= 0 for t in a.targets]
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
                jacobi=64)  # PonderLM-2's Jacobi prefill is exact (cached = full forward) at jacobi >= T - 1
    base.update(kw)
    return ModelConfig(**base)


def loud(model, seed=0):
    """float64 with weights big enough that mixing and positions move the logits a lot (at the
    SPEC init the attention barely changes anything and comparisons would be vacuous)."""
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


@pytest.mark.parametrize("name", ["untied", "tango"])
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


# ----------------------------------------------------------------------------- tasks

TOK = lt.task_tokenizer()


def test_task_tokenizer():
    """Llama-3-like pieces: the paper's equation '44@47=83,' is six tokens; numbers of up to three
    digits are one token; words keep their leading space; char mode is one token per character."""
    assert [TOK.itos[i] for i in TOK.encode("44@47=83,")] == ["44", "@", "47", "=", "83", ","]
    assert [TOK.itos[i] for i in TOK.encode("Var10=29, Var1+Var10=")] == [
        "Var", "10", "=", "29", ",", " Var", "1", "+", "Var", "10", "="]
    text = "Please repeat the following equation 6 times: 100+100=200,"
    assert TOK.decode(TOK.encode(text)) == text and len(TOK.encode(text)) == 16
    assert TOK.bos == TOK.eos == TOK.encode("\n")[0] and TOK.marker_ids(",") == TOK.encode(",")
    with pytest.raises(UsageError):
        TOK.encode("201")  # not a token any generator emits
    char = lt.CharTokenizer(lt.TASK_ALPHABET)
    assert char.decode(char.encode(text)) == text and len(char.encode("44@47=83,")) == 9


def test_generation_format_and_metric():
    gen = lt.TASKS["generation"]
    eqs = gen.chain("44", "47", 7)  # the paper's example
    assert "".join(eqs[:5]) == "44@47=83,47@83=34,83@34=21,34@21=53,21@53=72,"
    assert "".join(eqs[5:]) == "53@72=31,72@31=11,"
    q = "".join(eqs[:5])
    assert gen.score(q, "53@72=31,72@31=11,") == 2
    assert gen.score(q, "53@72=31,72@31=11,31@11=") == 2  # an unfinished equation does not count
    assert gen.score(q, "53@72=31,72@31=12,31@12=41,") == 1  # wrong result; the chain breaks there
    assert gen.score(q, "53@72=31,11@11=20,") == 1  # obeys the rule but is not chained
    assert gen.score(q, "53@72=30,") == 0 and gen.score(q, "") == 0
    assert gen.score_prefix("53@72=31,72@31=1", "53@72=31,72@31=11,", False) == 1
    rng = np.random.default_rng(0)
    lens = set()
    for _ in range(200):
        s = gen.sample(rng)
        assert re.fullmatch(r"(\d\d@\d\d=\d\d,){5}", s.query)
        n = len(s.response) // 9
        lens.add(n)
        assert re.fullmatch(r"(\d\d@\d\d=\d\d,)+", s.response) and gen.score(s.query, s.response) == n
    assert lens == set(range(1, 11))
    s = gen.sample(rng, "40")
    assert gen.score(s.query, s.response) == 40


def test_summation_format_and_metric():
    summ = lt.TASKS["summation"]
    q = "Var0=29, Var1=24, Var2=20, Var3=17, Var4=16, Var5=28, Var1+Var2="  # the paper's example
    assert summ.answer(q) == "24+20=44"
    assert summ.score(q, "24+20=44", True) == 1.0
    assert summ.score(q, "24+20=45", True) == 0.0
    assert summ.score(q, "24+20=44", False) == 0.0  # no ending token within the budget
    rng = np.random.default_rng(1)
    ns = set()
    for _ in range(300):
        s = summ.sample(rng)
        mt = re.fullmatch(r"((?:Var\d+=\d\d, )+)Var(\d+)\+Var(\d+)=", s.query)
        vals = re.findall(r"Var(\d+)=(\d\d), ", mt.group(1))
        assert [int(k) for k, _ in vals] == list(range(len(vals)))
        assert all(10 <= int(v) < 30 for _, v in vals) and mt.group(2) != mt.group(3)
        ns.add(len(vals))
        assert s.response == summ.answer(s.query)
    assert ns == set(range(5, 15))
    assert all(30 <= summ.sample(rng, "30-49").info["n"] < 50 for _ in range(20))


def test_repetition_format_and_metric():
    rep = lt.TASKS["repetition"]
    q = "Please repeat the following equation 6 times: 48+19=67,48+19=67,"  # the paper's example
    assert rep.answer(q) == "48+19=67," * 4
    assert rep.score(q, "48+19=67," * 4, True) == 1.0
    assert rep.score(q, "48+19=67," * 5, True) == 0.0 and rep.score(q, "48+19=67," * 3, True) == 0.0
    rng = np.random.default_rng(2)
    s2s = set()
    for _ in range(300):
        s = rep.sample(rng)
        mt = re.fullmatch(r"Please repeat the following equation (\d+) times: ((\d+)\+(\d+)=(\d+),)+", s.query)
        a, b, c = int(mt.group(3)), int(mt.group(4)), int(mt.group(5))
        assert 1 <= a <= 100 and 1 <= b <= 100 and c == a + b
        s1, s2 = s.info["s1"], s.info["s2"]
        assert 1 <= s1 <= 5 and int(mt.group(1)) == s1 + s2 and s.query.count(",") == s1
        assert s.response == mt.group(2) * s2 == rep.answer(s.query)
        s2s.add(s2)
    assert s2s == set(range(1, 6))
    assert all(8 <= rep.sample(rng, "8-10").info["s2"] <= 10 for _ in range(20))


def test_generators_are_seeded_and_in_the_alphabet():
    for task in lt.TASKS.values():
        a = [task.sample(np.random.default_rng(7)) for _ in range(3)]
        b = [task.sample(np.random.default_rng(7)) for _ in range(3)]
        assert [(s.query, s.response) for s in a] == [(s.query, s.response) for s in b]
        for lv in task.levels:
            s = lt.test_set(task, lv, 5)[0]
            assert s.query == lt.test_set(task, lv, 5)[0].query
            TOK.encode(s.query + s.response)  # raises on a character outside the vocabulary
    v, q = lt.encode_sample(TOK, lt.TASKS["summation"], lt.Sample("Var0=11, Var0+Var0=", "11+11=22"))
    assert v[0] == TOK.bos and v[-1] == TOK.eos and TOK.decode(v[1:q]) == "Var0=11, Var0+Var0="
    v, q = lt.encode_sample(TOK, lt.TASKS["generation"], lt.TASKS["generation"].sample(np.random.default_rng(0)))
    assert v[-1] == TOK.encode(",")[0]  # Generation responses have no ending token


def test_teacher_forced_metrics_on_known_answers():
    """With a base that always predicts the reference (an oracle), every metric is perfect; the
    same samples scored with a corrupted reference get the partial/zero scores."""
    for task in lt.TASKS.values():
        s = lt.test_set(task, list(task.levels)[0], 1)[0]
        v, q = lt.encode_sample(TOK, task, s)
        full = task.score_prefix(TOK.decode(v[q:]), s.response, True)
        assert full == (len(s.response) // 9 if task.name == "generation" else 1.0)
        half = task.score_prefix(TOK.decode(v[q:q + 8]), s.response, False)  # 1 equation + 2 tokens
        assert half == (1 if task.name == "generation" else 0.0)


# ----------------------------------------------------------------------------- CLI

def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        lt.main(argv)
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


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "base"
    lt.main(["pretrain", "--out_dir", str(out), "--d", "32", "--depth", "1", "--steps", "3", "--eval_interval", "3",
             "--n_samples", "30", "--n_dev", "6", "--n_test", "4"])
    ck = torch.load(out / "ckpt_best.pt", map_location="cpu", weights_only=True)
    assert set(ck) == {"model", "config", "data", "iter", "best_dev", "dev_nll"}
    assert ck["data"]["tokenizer"] == "task" and ck["data"]["itos"] == lt.TASK_VOCAB
    meta = json.load(open(out / "meta.json"))
    assert meta["itos"] == ck["data"]["itos"]
    assert open(out / "train.txt").read().startswith("\n")
    capsys.readouterr()
    js = tmp_path / "r.jsonl"
    lt.main(["--base", str(out / "ckpt_best.pt"), "--task", "repetition", "--policy", "Start_1+Comma_1",
             "--groups", "rule", "--n_train", "8", "--epochs", "1", "--n_test", "4", "--json", str(js),
             "--save", str(tmp_path / "z.pt")])
    text = capsys.readouterr().out
    assert "ID  1-5" in text and "OOD 8-10" in text
    rec = json.loads(open(js).read())
    assert rec["latent_vectors"] == 2 and set(rec["metrics"]) == {"1-5", "6-7", "8-10"}
    assert torch.load(tmp_path / "z.pt", weights_only=True)["Z"].shape == (2, 1, 32)
    lt.main(["pretrain", "--out_dir", str(tmp_path / "cbase"), "--vocab", "char", "--d", "32", "--depth", "1",
             "--steps", "1", "--eval_interval", "1", "--n_samples", "6", "--n_dev", "3", "--n_test", "2"])
    base, tok = lt.load_base(str(tmp_path / "cbase" / "ckpt_best.pt"))
    assert tok.kind == "char" and tok.itos == list(lt.TASK_ALPHABET)
    lt.main(["--base", str(out / "ckpt_best.pt"), "--task", "generation", "--policy", "none", "--n_test", "2",
             "--eval_mode", "generate"])
    assert "equations" in capsys.readouterr().out
    lt.main(["sweep", "--base", str(out / "ckpt_best.pt"), "--out_dir", str(tmp_path / "res"), "--tasks", "summation",
             "--seeds", "0", "1", "--n_train", "4", "--epochs", "1", "--n_test", "2"])
    table = open(tmp_path / "res" / "README_table.md").read()
    assert "frozen base alone" in table and "Comma_2** (paper's method)" in table and "(matched tokens)" in table
    runs = json.load(open(tmp_path / "res" / "results_summation.json"))
    assert len(runs) == 1 + 5 * 2
    assert "python latent_tokens.py pretrain --out_dir" in table and "python latent_tokens.py sweep" in table
