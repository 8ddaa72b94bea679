"""Tests for tasks.py, the synthetic tasks of *Enhancing Latent Computation in Transformers with
Latent Tokens* (arXiv 2505.12629, §4.1-4.3): the vocabulary, each generator's format and ranges on
the paper's own examples, the metrics, seeding, and the teacher-forced metric shortcut."""
import re

import numpy as np
import pytest

from harness import tasks
from common import UsageError

TOK = tasks.task_tokenizer()


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
    char = tasks.CharTokenizer(tasks.TASK_ALPHABET)
    assert char.decode(char.encode(text)) == text and len(char.encode("44@47=83,")) == 9


def test_generation_format_and_metric():
    gen = tasks.TASKS["generation"]
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
    summ = tasks.TASKS["summation"]
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
    rep = tasks.TASKS["repetition"]
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
    for task in tasks.TASKS.values():
        a = [task.sample(np.random.default_rng(7)) for _ in range(3)]
        b = [task.sample(np.random.default_rng(7)) for _ in range(3)]
        assert [(s.query, s.response) for s in a] == [(s.query, s.response) for s in b]
        for lv in task.levels:
            s = tasks.test_set(task, lv, 5)[0]
            assert s.query == tasks.test_set(task, lv, 5)[0].query
            TOK.encode(s.query + s.response)  # raises on a character outside the vocabulary
    v, q = tasks.encode_sample(TOK, tasks.TASKS["summation"], tasks.Sample("Var0=11, Var0+Var0=", "11+11=22"))
    assert v[0] == TOK.bos and v[-1] == TOK.eos and TOK.decode(v[1:q]) == "Var0=11, Var0+Var0="
    v, q = tasks.encode_sample(TOK, tasks.TASKS["generation"], tasks.TASKS["generation"].sample(np.random.default_rng(0)))
    assert v[-1] == TOK.encode(",")[0]  # Generation responses have no ending token


def test_teacher_forced_metrics_on_known_answers():
    """With a base that always predicts the reference (an oracle), every metric is perfect; the
    same samples scored with a corrupted reference get the partial/zero scores."""
    for task in tasks.TASKS.values():
        s = tasks.test_set(task, list(task.levels)[0], 1)[0]
        v, q = tasks.encode_sample(TOK, task, s)
        full = task.score_prefix(TOK.decode(v[q:]), s.response, True)
        assert full == (len(s.response) // 9 if task.name == "generation" else 1.0)
        half = task.score_prefix(TOK.decode(v[q:q + 8]), s.response, False)  # 1 equation + 2 tokens
        assert half == (1 if task.name == "generation" else 0.0)
