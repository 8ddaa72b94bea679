"""The three synthetic tasks of *Enhancing Latent Computation in Transformers with Latent Tokens*
(arXiv 2505.12629, §4.1-4.3): sample generators, metrics and the vocabulary our small task bases
use. latent_tokens.py trains and evaluates latent tokens on them; the choices the paper leaves open
are noted in each class and in MATH.md ("Latent tokens").

    generation   "\\n" + five chained equations "a1a2@b1b2=f1f2," -> more of them (no ending token);
                 f1 = |a1+b1| mod 9, f2 = |a2-b2| mod 9; training responses have 1..10 equations;
                 metric: leading correct chained equations within a budget of N equations
                 (levels 10 = in distribution (ID), 20, 40 = out of distribution (OOD))
    summation    "\\nVar0=29, ..., VarN=17, Vari+Varj=" -> "a+b=c\\n"; values in [10, 30), i != j;
                 5..14 variables in training; accuracy (levels 5-14 ID, 15-29, 30-49 OOD)
    repetition   "\\nPlease repeat the following equation n times: " + s1 copies of "a+b=c," ->
                 s2 more copies + "\\n"; a, b in 1..100, s1 in 1..5; s2 in 1..5 in training;
                 accuracy (levels s2 1-5 ID, 6-7, 8-10 OOD)

Vocabulary (`TASK_VOCAB`): the generators' texts split the way Llama-3's tokenizer splits them
(the paper's "44@47=83," is six Llama-3.2-1B tokens): runs of digits in chunks of up to three
digits, words with their leading space, every other character alone; `TASK_ALPHABET` is the
one-character-per-token alternative. The newline is the beginning and the ending token.
Bad input (an unknown task, a piece outside the vocabulary) raises common.UsageError.
"""
import re
from dataclasses import dataclass, field

import numpy as np

from common import UsageError

DIGIT_TOKENS = [str(i) for i in range(10)] + [f"{i:02d}" for i in range(100)] + [str(i) for i in range(100, 201)]
TASK_VOCAB = (["\n", " ", ",", ":", "=", "+", "@", "Var", " Var", "Please", " repeat", " the", " following",
               " equation", " times"] + DIGIT_TOKENS)  # every token the three generators can emit
TASK_PATTERN = re.compile(r" ?[A-Za-z]+|\d{1,3}|[^A-Za-z\d]")
TASK_ALPHABET = "\n" + "".join(sorted(set("".join(TASK_VOCAB)) - {"\n"}))  # characters, for char bases


class Tokenizer:
    """What latent_tokens.py needs of a tokenizer: bos, eos, vocab_size, encode(text) -> ids,
    decode(ids) -> text, marker_ids(marker) -> [id]."""

    def marker_ids(self, marker):
        """[id] of a one-token marker (Comma_m's ','); UsageError naming --marker otherwise."""
        try:
            ids = self.encode(marker)
        except UsageError as e:  # encode's message names no flag
            raise UsageError(f"--marker {marker!r}: {e} (the marker must be one token of it)") from None
        if len(ids) != 1:
            raise UsageError(f"--marker {marker!r}: must be one token")
        return ids


class CharTokenizer(Tokenizer):
    """A vocabulary given as itos; kind "char" (one character per token) or "task" (TASK_PATTERN
    pieces, e.g. TASK_VOCAB). '\\n' is the beginning and ending token (bos = eos)."""

    def __init__(self, itos, kind="char"):
        self.itos, self.kind = list(itos), kind
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        if "\n" not in self.stoi:
            raise UsageError("vocabulary has no newline (the beginning/ending token)")
        self.bos = self.eos = self.stoi["\n"]
        self.vocab_size = len(self.itos)

    def pieces(self, text):
        return list(text) if self.kind == "char" else TASK_PATTERN.findall(text)

    def encode(self, text):
        try:
            return [self.stoi[c] for c in self.pieces(text)]
        except KeyError as e:
            raise UsageError(f"{e.args[0]!r} is not in the base's vocabulary") from None

    def decode(self, ids):
        return "".join(self.itos[i] for i in ids)


def task_tokenizer():
    return CharTokenizer(TASK_VOCAB, "task")


@dataclass
class Sample:
    query: str        # without the beginning token
    response: str     # without the ending token
    info: dict = field(default_factory=dict)


def _op(a, b):
    """The Generation task's @: (a1a2, b1b2) -> f1f2, f1 = |a1+b1| mod 9, f2 = |a2-b2| mod 9."""
    return f"{abs(int(a[0]) + int(b[0])) % 9}{abs(int(a[1]) - int(b[1])) % 9}"


class Generation:
    """§4.1. Query: five chained equations; response: the chain continued.

    Choice: the first two numbers have digits 0-9 (the paper's example starts 44@47); every later
    digit is a result mod 9. Each equation is 9 characters (6 task-vocabulary tokens) with its comma.
    """
    name, eos, metric = "generation", False, "equations"
    levels = {"10": 10, "20": 20, "40": 40}  # budget in equations; training responses have 1..10
    id_levels = ("10",)

    @staticmethod
    def chain(a, b, n):
        out = []
        for _ in range(n):
            f = _op(a, b)
            out.append(f"{a}@{b}={f},")
            a, b = b, f
        return out

    def sample(self, rng, level="train"):
        a = f"{rng.integers(10)}{rng.integers(10)}"
        b = f"{rng.integers(10)}{rng.integers(10)}"
        n_resp = int(rng.integers(1, 11)) if level == "train" else self.levels[level]
        eqs = self.chain(a, b, 5 + n_resp)
        return Sample("".join(eqs[:5]), "".join(eqs[5:]), {"n": n_resp})

    @staticmethod
    def score(query, generated, stopped=False):
        """Number of leading generated equations that are well formed, chained to the previous one
        (a = previous b, b = previous f) and obey the rule; stops at the first violation."""
        last = re.findall(r"(\d\d)@(\d\d)=(\d\d),", query)[-1]
        a, b = last[1], last[2]
        count, i = 0, 0
        while i + 9 <= len(generated):
            mt = re.fullmatch(r"(\d\d)@(\d\d)=(\d\d),", generated[i:i + 9])
            if not mt or mt.group(1) != a or mt.group(2) != b or mt.group(3) != _op(a, b):
                break
            a, b = b, mt.group(3)
            count, i = count + 1, i + 9
        return count

    @staticmethod
    def score_prefix(correct_prefix, response, complete):
        """The metric from the longest correctly predicted prefix of the reference response."""
        return correct_prefix.count(",")


class _ExactAnswer:
    """Accuracy tasks: the generated text must be the answer and end with the ending token."""
    eos, metric = True, "accuracy"

    def score(self, query, generated, stopped):
        return float(stopped and generated == self.answer(query))

    @staticmethod
    def score_prefix(correct_prefix, response, complete):
        return float(complete)


class Summation(_ExactAnswer):
    """§4.2. 'Var0=29, Var1=24, ..., Var1+Var2=' -> '24+20=44'; values in [10, 30).

    Choice: the two asked variables are distinct; every variable, the last one included, is
    followed by ', ' (as in the paper's example).
    """
    name = "summation"
    levels = {"5-14": (5, 15), "15-29": (15, 30), "30-49": (30, 50)}  # variable counts [lo, hi)
    id_levels = ("5-14",)

    def sample(self, rng, level="train"):
        lo, hi = (5, 15) if level == "train" else self.levels[level]
        n = int(rng.integers(lo, hi))
        vals = [int(v) for v in rng.integers(10, 30, size=n)]
        i, j = (int(x) for x in rng.choice(n, size=2, replace=False))
        query = "".join(f"Var{k}={v}, " for k, v in enumerate(vals)) + f"Var{i}+Var{j}="
        return Sample(query, f"{vals[i]}+{vals[j]}={vals[i] + vals[j]}", {"n": n})

    @staticmethod
    def answer(query):
        vals = {int(k): int(v) for k, v in re.findall(r"Var(\d+)=(\d+), ", query)}
        i, j = (int(x) for x in re.search(r"Var(\d+)\+Var(\d+)=$", query).groups())
        return f"{vals[i]}+{vals[j]}={vals[i] + vals[j]}"


class Repetition(_ExactAnswer):
    """§4.3. 'Please repeat the following equation n times: ' + s1 copies of 'a+b=c,'
    -> s2 = n - s1 more copies; a, b in 1..100 (inclusive), s1 in 1..5.

    Choice: the paper writes both 'equation' and 'equations'; we use its example's singular, and its
    example's space after the colon and comma after every copy.
    """
    name = "repetition"
    levels = {"1-5": (1, 6), "6-7": (6, 8), "8-10": (8, 11)}  # s2 ranges [lo, hi)
    id_levels = ("1-5",)

    def sample(self, rng, level="train"):
        lo, hi = (1, 6) if level == "train" else self.levels[level]
        a, b = int(rng.integers(1, 101)), int(rng.integers(1, 101))
        s1, s2 = int(rng.integers(1, 6)), int(rng.integers(lo, hi))
        eq = f"{a}+{b}={a + b},"
        query = f"Please repeat the following equation {s1 + s2} times: " + eq * s1
        return Sample(query, eq * s2, {"s1": s1, "s2": s2})

    @staticmethod
    def answer(query):
        mt = re.fullmatch(r"Please repeat the following equation (\d+) times: ((\d+)\+(\d+)=(\d+),)+", query)
        n, eq = int(mt.group(1)), mt.group(2)
        s1 = query.count(",")
        return eq * (n - s1)


TASKS = {t.name: t for t in (Generation(), Summation(), Repetition())}


def get_task(name):
    if name not in TASKS:
        raise UsageError(f"--task: unknown task '{name}'; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def encode_sample(tok, task, s):
    """(verbal ids, query_len): beginning token + query, then response (+ ending token)."""
    q = [tok.bos] + tok.encode(s.query)
    r = tok.encode(s.response) + ([tok.eos] if task.eos else [])
    return q + r, len(q)


def test_set(task, level, n, seed=12345):
    """Fixed evaluation samples for a level (independent of the training seed)."""
    rng = np.random.default_rng([seed, list(TASKS).index(task.name), list(task.levels).index(level)])
    return [task.sample(rng, level) for _ in range(n)]

