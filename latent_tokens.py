"""Latent tokens on a frozen decoder (SPEC.md section 6; Sun, Chen, Li, Ding 2025, seeds/003_*.txt).

Trainable embeddings ("latent tokens") are inserted into the input of a frozen causal LM; the
table Z (G groups x m slots x d) is the only thing trained. Commands:

    python latent_tokens.py pretrain --task all --out_dir out/latent_base      # tiny base, ~6 CPU min
    python latent_tokens.py --base out/latent_base/ckpt_best.pt --task summation --policy Comma_2
    python latent_tokens.py --base CKPT --task repetition --policy Start_1+Comma_1 --groups rule
    python latent_tokens.py --base CKPT --task generation --policy none        # frozen base alone
    python latent_tokens.py sweep --base CKPT --out_dir results/latent_tokens \
        --n_train 1024 --epochs 3 --n_test 256 --ablate_readout                 # the README table

Augmented sequence (pure function `augment`, SPEC section 6). Verbal ids v_0..v_{n-1}, the first
query_len of them the query (v_0 is the beginning token in the tasks below). A *slot* j sits just
before verbal token v_j; the policy puts 0 or more latent groups into each slot:

    Start_m   m latents in slot 0 (before the first verbal token)
    End_m     m latents in slot query_len (end of the query: pause tokens)
    k_m       m latents in every slot j > 0 with j % k == 0 (after every k verbal tokens)
    Comma_m   m latents in every slot j > 0 with v_{j-1} a marker token (default ','), i.e. right
              after the marker and before the next verbal token
    A+B       both (groups in the same slot follow the order written)

The decision for slot j depends on v_0..v_{j-1} (and query_len) only, so decoding can take it
after each emitted token. Position ids (`position_mode`):

    prepend   (default) a group in slot j gets position j, the id of the verbal token after it;
              verbal tokens keep their original ids 0..n-1
    append    a group in slot j gets position j-1, the id of the verbal token before it (0 for slot 0)
    increase  (ablation) plain 0..L-1 over the augmented sequence: later tokens shift

Loss (SPEC section 6): next-token NLL on verbal targets only. The item before a latent has a latent
as next item and is dropped, so the last latent of a group predicts the next verbal token; by
default only verbal targets j >= query_len (the response) are scored.

Function specialization (`groups`): "shared" (G = 1: every group uses Z[0, :m]), "fs" (SPEC: one
group per *site* the latents land on: start-of-query (slot 0), inside-query (0 < j < query_len),
end-of-query (j = query_len), inside-response (j > query_len)), "rule" (one group per policy part:
"Start_1+Comma_1" with groups="rule" is the paper's Repetition method "Comma_1 (w/ FS)": one latent
at the start of the query and one other latent after every comma, two vectors in all).

Our reading of the paper vs SPEC (noted, SPEC followed): the paper's section 3.1 / eq. (4) can be
read as "latents prepended before s_{t+1} are fed only after s_{t+1} was generated, and only
verbal positions predict" (Comma_m would then sit *before* each comma). SPEC fixes the other
reading - latents after the marker, the last latent predicts - which is also what decoding
with "feed the m latents in one step, take the logits from the last one" needs. For Start, End
and k_m both readings give the same sequences and position ids and differ only in which position
predicts the verbal token after a group; for Comma_m they also differ in the slot (before vs
after the comma).

Z init (default "embedding"): copies of randomly sampled rows of the frozen embedding E, so the
latents start at the scale of the inputs the base was trained on; init="normal" is N(0, 0.02),
the repo's embedding init (SPEC section 1). On our tiny task base the sampled rows did better at
equal budget (Repetition ID 84 % vs 75 %, 128 updates, seed 0), so they are the default. The
base, its embedding and head are frozen (requires_grad False) and kept in eval mode.

Bases: this project's `common.LM` (any REGISTRY model: `base.wte`, `base.forward_embeds` with
explicit position ids and a dict cache) or, when `transformers` is installed, a Hugging Face
causal LM through `inputs_embeds` / `position_ids` / a DynamicCache (imported lazily). The HF path
always passes an explicit attention mask: without one, recent transformers take position ids that
do not step by one (repeated latent ids) for packed sequences and mask across them.

Tasks (paper section 4; `TASKS`). Our own bases use `TASK_VOCAB`, the generators' pieces split
the way Llama-3 splits them (numbers of up to three digits are one token, words keep their
leading space: the paper's "44@47=83," is six tokens, as it says for Llama-3.2-1B); a plain
character vocabulary (`TASK_ALPHABET`) is available with `pretrain --vocab char`. The newline is
the beginning token and the ending token:

    generation   "\\n" + five chained equations "a1a2@b1b2=f1f2," -> more of them (no ending token);
                 f1 = |a1+b1| mod 9, f2 = |a2-b2| mod 9; train 1..10 response equations; metric:
                 number of leading correct chained equations within a budget of N equations
                 (levels 10 = ID, 20, 40 = OOD)
    summation    "\\nVar0=29, ..., VarN=17, Vari+Varj=" -> "a+b=c\\n"; values in [10, 30), i != j;
                 5..14 variables in training; accuracy (levels 5-14 ID, 15-29, 30-49 OOD)
    repetition   "\\nPlease repeat the following equation n times: " + s1 copies of "a+b=c," ->
                 s2 more copies + "\\n"; a, b in 1..100, s1 in 1..5; s2 in 1..5 in training;
                 accuracy (levels s2 1-5 ID, 6-7, 8-10 OOD)

Evaluation is teacher-forced greedy ("tf", default): one batched forward over query + reference
response; a sample's greedy decode reproduces the first r reference tokens iff the argmax at each
of those r scored positions equals the reference (the policy's decisions depend only on the
prefix, which is then the reference prefix). So exact match = all scored argmaxes right, and the
Generation count = complete equations before the first wrong argmax - the same numbers greedy
decoding gives, at a fraction of the cost. --eval_mode generate runs the real cached decoder and
rule-based scorers instead (slow; the tests check cached decoding against the full forward).
Bad input (unknown policy/task, missing checkpoint, ...): one-line error, exit code 2.
"""
import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common import LM, ModelConfig, UsageError

POSITION_MODES = ("prepend", "append", "increase")
READOUTS = ("latent", "verbal")
GROUPINGS = ("shared", "fs", "rule")
SITES = ("start", "query", "end", "response")


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss or gradient norm); exit code 1 at the command line."""


# =============================================================================== policies

@dataclass(frozen=True)
class Rule:
    """One policy part: kind start | end | every | marker, m latents per group, period k (every)."""
    kind: str
    m: int
    k: int = 0

    def __str__(self):
        if self.kind == "every":
            return f"{self.k}_{self.m}"
        return {"start": "Start", "end": "End", "marker": "Comma"}[self.kind] + f"_{self.m}"


_PART = re.compile(r"^(?:(start|end|comma)(?:_(\d+))?|(\d+)_(\d+))$", re.IGNORECASE)


def parse_policy(spec, m=None):
    """'Start_1+Comma_2', '4_1', 'End_8', 'none' -> tuple of Rules. A part written without its count
    ('Comma') takes m. Raises UsageError for anything else."""
    spec = (spec or "").strip()
    if spec.lower() in ("", "none"):
        return ()
    rules = []
    for part in spec.split("+"):
        mt = _PART.match(part.strip())
        if not mt:
            raise UsageError(f"--policy: unknown part '{part}' in '{spec}'; use Start_m, End_m, Comma_m, "
                             f"k_m (e.g. 4_1), combinations with '+', or none")
        if mt.group(1):
            count = mt.group(2)
            if count is None:
                if m is None:
                    raise UsageError(f"--policy: '{part}' needs a count (e.g. {part}_2) or --m")
                count = m
            kind = {"start": "start", "end": "end", "comma": "marker"}[mt.group(1).lower()]
            rules.append(Rule(kind, int(count)))
        else:
            rules.append(Rule("every", int(mt.group(4)), int(mt.group(3))))
    for r in rules:
        if r.m < 1 or (r.kind == "every" and r.k < 1):
            raise UsageError(f"--policy: '{r}' needs m >= 1 and k >= 1")
    return tuple(rules)


class Policy:
    """Where latent groups go and which table row each uses (see the module docstring).

    rules: tuple of Rule (or a spec string for parse_policy); groups: shared | fs | rule;
    marker_ids: token ids that trigger Comma_m. n_groups x max_m is the shape of Z (less d).
    readout: "latent" (SPEC: the last latent of a group predicts the next verbal token; Comma_m
    after the marker) or "verbal" (the paper-literal ablation: only verbal positions predict, the
    group in slot j is inserted once v_j is known, Comma_m before the marker).
    """

    def __init__(self, rules, m=None, groups="shared", marker_ids=(), readout="latent"):
        self.rules = parse_policy(rules, m) if isinstance(rules, str) or rules is None else tuple(rules)
        if groups not in GROUPINGS:
            raise UsageError(f"--groups {groups}: choose one of {', '.join(GROUPINGS)}")
        if readout not in READOUTS:
            raise UsageError(f"--readout {readout}: choose one of {', '.join(READOUTS)}")
        self.groups, self.readout = groups, readout
        self.marker_ids = frozenset(int(i) for i in marker_ids)
        if any(r.kind == "marker" for r in self.rules) and not self.marker_ids:
            raise UsageError("Comma_m needs marker token ids (the marker is not in the vocabulary)")
        self.max_m = max((r.m for r in self.rules), default=0)
        if groups == "fs":
            used = set()
            for r in self.rules:
                used |= {"start"} if r.kind == "start" else {"end"} if r.kind == "end" else {"query", "end", "response"}
            self.site_group = {s: i for i, s in enumerate(s for s in SITES if s in used)}
            self.n_groups = len(self.site_group)
        else:
            self.n_groups = (1 if self.rules else 0) if groups == "shared" else len(self.rules)

    def __str__(self):
        name = "+".join(str(r) for r in self.rules) or "none"
        name = name if self.groups == "shared" or not self.rules else f"{name} ({self.groups})"
        return name if self.readout == "latent" else f"{name} [readout verbal]"

    @staticmethod
    def site(j, query_len):
        return "start" if j == 0 else "query" if j < query_len else "end" if j == query_len else "response"

    def schedule(self, verbal, query_len, j):
        """Latents in slot j (just before verbal token j) as a list of (group, slot). Readout
        "latent" uses only verbal[:j] and query_len (decoding asks once v_{j-1} is emitted);
        readout "verbal" may also use v_j (asked once v_j is emitted, before feeding it)."""
        out = []
        for i, r in enumerate(self.rules):
            if r.kind == "start":
                hit, site = j == 0, "start"
            elif r.kind == "end":
                hit, site = j == query_len, "end"
            elif r.kind == "every":
                hit, site = j > 0 and j % r.k == 0, self.site(j, query_len)
            else:
                if self.readout == "latent":
                    hit = j > 0 and int(verbal[j - 1]) in self.marker_ids
                else:
                    hit = j < len(verbal) and int(verbal[j]) in self.marker_ids
                site = self.site(j, query_len)
            if hit:
                g = 0 if self.groups == "shared" else i if self.groups == "rule" else self.site_group[site]
                out.extend((g, s) for s in range(r.m))
        return out


# =============================================================================== augment

@dataclass
class Augmented:
    """An augmented sequence, one entry per item (verbal token or latent), all plain lists.

    tokens: verbal id, -1 for a latent; verbal_index: j of v_j, -1 for a latent;
    latent_group / latent_slot: row of Z, -1 for verbal; position_ids; targets: the id the item
    predicts (the next item's id when that is a scored verbal token), -1 = not scored.
    """
    tokens: list
    verbal_index: list
    latent_group: list
    latent_slot: list
    position_ids: list
    targets: list
    query_len: int = 0

    @property
    def is_latent(self):
        return [t < 0 for t in self.tokens]

    @property
    def target_mask(self):
        return [t >= 0 for t in self.targets]

    def __len__(self):
        return len(self.tokens)


def augment(verbal_ids, query_len, policy, position_mode="prepend", score_from=None, trailing=False):
    """Insert the policy's latent groups into verbal_ids (see the module docstring).

    verbal_ids: sequence of ints; query_len: how many of them are the query; policy: Policy;
    score_from: first verbal index whose prediction is scored (default query_len, the response);
    trailing: also add the latents of slot n = len(verbal_ids) (decoding: the latents that come
    before the next, not yet known, token).
    """
    if position_mode not in POSITION_MODES:
        raise UsageError(f"--position_mode {position_mode}: choose one of {', '.join(POSITION_MODES)}")
    verbal = [int(v) for v in verbal_ids]
    n = len(verbal)
    score_from = query_len if score_from is None else score_from
    a = Augmented([], [], [], [], [], [], query_len)
    for j in range(n + (1 if trailing else 0)):
        for g, s in policy.schedule(verbal, query_len, j):
            pos = j if position_mode == "prepend" else max(j - 1, 0) if position_mode == "append" else len(a.tokens)
            a.tokens.append(-1), a.verbal_index.append(-1), a.latent_group.append(g)
            a.latent_slot.append(s), a.position_ids.append(pos)
        if j < n:
            a.tokens.append(verbal[j]), a.verbal_index.append(j), a.latent_group.append(-1)
            a.latent_slot.append(-1), a.position_ids.append(j if position_mode != "increase" else len(a.tokens) - 1)
    a.targets = [-1] * len(a.tokens)
    if policy.readout == "latent":  # each item predicts the next item when that is a scored verbal token
        for p in range(len(a.tokens) - 1):
            j = a.verbal_index[p + 1]
            if j >= 0 and j >= score_from:
                a.targets[p] = verbal[j]
    else:  # only verbal items predict: v_j -> v_{j+1}, across any latents between them
        for p, j in enumerate(a.verbal_index):
            if j >= 0 and j + 1 < n and j + 1 >= score_from:
                a.targets[p] = verbal[j + 1]
    return a


# =============================================================================== backends

class _OwnBackend:
    """This project's LM: base.wte, base.forward_embeds(x, None, positions, cache-dict)."""

    def __init__(self, lm):
        self.lm = lm
        self.d = lm.cfg.n_embd
        self.vocab_size = lm.cfg.vocab_size

    def embedding(self):
        return self.lm.wte

    def forward(self, x, positions, cache=None):
        logits, _ = self.lm.forward_embeds(x, None, positions, cache)
        return logits, cache

    def new_cache(self):
        return {}


class _HFBackend:
    """A Hugging Face causal LM (Llama, GPT-2, ...): inputs_embeds, position_ids, past_key_values."""

    def __init__(self, model):
        try:
            import transformers  # noqa: F401  (lazy: only this path needs it)
        except ImportError:
            raise UsageError("a Hugging Face base needs the transformers package: pip install transformers") from None
        import inspect
        self.lm = model
        self.d = model.get_input_embeddings().weight.shape[1]
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        # transformers >= 5.2x names the cache argument `cache` (past_key_values is deprecated and
        # its output field stays empty); older versions only know past_key_values
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def embedding(self):
        return self.lm.get_input_embeddings()

    def forward(self, x, positions, cache=None):
        kw = {self.cache_kw: cache} if cache is not None else {}
        # An explicit all-ones mask is required: without one, recent transformers read position ids
        # that do not step by 1 (our repeated latent ids) as *packed sequences* and silently switch
        # to a block-diagonal mask. Right padding needs no mask entries (causal).
        past = cache.get_seq_length() if cache is not None else 0
        mask = torch.ones(x.shape[0], past + x.shape[1], dtype=torch.long, device=x.device)
        out = self.lm(inputs_embeds=x, position_ids=positions, attention_mask=mask,
                      use_cache=cache is not None, return_dict=True, **kw)
        return out.logits, cache  # a DynamicCache is updated in place

    def new_cache(self):
        from transformers import DynamicCache
        try:
            return DynamicCache(config=self.lm.config)
        except TypeError:  # older transformers: no config argument
            return DynamicCache()


def make_backend(base):
    if isinstance(base, LM):
        return _OwnBackend(base)
    if hasattr(base, "get_input_embeddings") and hasattr(base, "config"):
        return _HFBackend(base)
    raise UsageError(f"latent tokens need this project's LM or a Hugging Face causal LM, not {type(base).__name__}")


# =============================================================================== the wrapper

class LatentLM(nn.Module):
    """Frozen causal LM + trainable latent table Z (G, m, d) (SPEC section 6); Z is float32
    for a float16/bfloat16/float32 base (float64 for a float64 one) and cast to the base's dtype at use.

    LatentLM(base, policy="Comma_2", m=None, groups="shared", position_mode="prepend",
             marker_ids=(...), init="embedding", init_std=0.02, readout="latent")
    policy: Policy or spec string ('none' = the base alone, Z empty); m: count for parts written
    without one; marker_ids: ids that trigger Comma_m (CharTokenizer.marker_ids(',')).

    augment(verbal, query_len) -> Augmented; loss(augs) -> scalar NLL over scored targets;
    logits(augs) -> (B, L, V) with the batch tensors; generate(query, max_new_tokens, stop_id)
    -> new verbal ids, greedy, with a decoding cache.
    """

    def __init__(self, base, policy="none", m=None, groups="shared", position_mode="prepend",
                 marker_ids=(), init="embedding", init_std=0.02, readout="latent"):
        super().__init__()
        if position_mode not in POSITION_MODES:
            raise UsageError(f"--position_mode {position_mode}: choose one of {', '.join(POSITION_MODES)}")
        self.backend = make_backend(base)
        self.base = base
        base.requires_grad_(False)
        base.eval()
        self.policy = policy if isinstance(policy, Policy) else Policy(policy, m, groups, marker_ids, readout)
        self.position_mode = position_mode
        emb = self.backend.embedding().weight
        G, M, d = self.policy.n_groups, self.policy.max_m, self.backend.d
        if init == "normal":
            z = torch.randn(G, M, d) * init_std
        elif init == "embedding":
            rows = torch.randint(0, self.backend.vocab_size, (G * M,))  # not the LM's padding rows
            z = emb.detach()[rows].float().cpu().view(G, M, d).clone()
        else:
            raise UsageError(f"--init {init}: choose normal or embedding")
        # at least float32 whatever the base's dtype (cast at use, in embed): in float16/bfloat16
        # AdamW's eps and the late, small updates of the schedule vanish below the format's resolution
        self.Z = nn.Parameter(z.to(device=emb.device, dtype=torch.promote_types(emb.dtype, torch.float32)))

    def train(self, mode=True):
        super().train(mode)
        self.base.eval()  # the base stays in eval mode (frozen)
        return self

    def augment(self, verbal, query_len, **kw):
        return augment(verbal, query_len, self.policy, self.position_mode, **kw)

    # ---- batches
    def collate(self, augs):
        """Right-pad a list of Augmented into tensors (causal, so padding never reaches real items)."""
        L = max(len(a) for a in augs)
        dev = self.Z.device
        tok = torch.zeros(len(augs), L, dtype=torch.long)
        lat = torch.full((len(augs), L), -1, dtype=torch.long)
        pos = torch.zeros(len(augs), L, dtype=torch.long)
        tgt = torch.full((len(augs), L), -1, dtype=torch.long)
        for b, a in enumerate(augs):
            n = len(a)
            tok[b, :n] = torch.tensor(a.tokens).clamp_min(0)
            g, s = torch.tensor(a.latent_group), torch.tensor(a.latent_slot)
            lat[b, :n] = torch.where(g >= 0, g * max(self.policy.max_m, 1) + s, -1)
            p = torch.tensor(a.position_ids)
            pos[b, :n] = p
            pos[b, n:] = (p.max() + 1 if n else 0) + torch.arange(L - n)
            tgt[b, :n] = torch.tensor(a.targets)
        return tok.to(dev), lat.to(dev), pos.to(dev), tgt.to(dev)

    def embed(self, tok, lat):
        """Input embeddings: the frozen E for verbal items, rows of Z for latents."""
        x = self.backend.embedding()(tok)
        if self.Z.numel() and bool((lat >= 0).any()):
            z = self.Z.reshape(-1, self.Z.shape[-1])[lat.clamp_min(0)]
            x = torch.where((lat >= 0)[..., None], z.to(x.dtype), x)
        return x

    def logits(self, augs):
        tok, lat, pos, tgt = self.collate(augs)
        logits, _ = self.backend.forward(self.embed(tok, lat), pos)
        return logits, tgt

    def loss(self, augs):
        logits, tgt = self.logits(augs)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 -> fp32, fp64 stays
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-1)

    def forward(self, augs):
        return self.loss(augs)

    # ---- decoding
    def _feed(self, a, start, cache):
        """Run items a[start:] through the base with the cache; returns logits (1, n, V)."""
        tok = torch.tensor([a.tokens[start:]], device=self.Z.device).clamp_min(0)
        g = torch.tensor([a.latent_group[start:]], device=self.Z.device)
        s = torch.tensor([a.latent_slot[start:]], device=self.Z.device)
        lat = torch.where(g >= 0, g * max(self.policy.max_m, 1) + s, -1)
        pos = torch.tensor([a.position_ids[start:]], device=self.Z.device)
        logits, cache = self.backend.forward(self.embed(tok, lat), pos, cache)
        return logits, cache

    @torch.no_grad()
    def generate(self, query_ids, max_new_tokens, stop_id=None, forced=None, return_logits=False):
        """Greedy decoding with a cache. After each emitted verbal token the policy is asked
        whether latents come next (marker just emitted, k-th token, end of query); the token and
        those latents are fed in one step and the next token is read from the last item.

        query_ids: list of ints (the prompt, = the query); forced: optional list of ids to emit
        instead of the argmax (tests); returns the new ids (stop_id included when emitted) and,
        with return_logits, the (n, V) logits each new id was chosen from.
        """
        verbal = [int(v) for v in query_ids]
        qlen = len(verbal)
        trailing = self.policy.readout == "latent"  # "verbal": slot j is decided once v_j is known
        a = self.augment(verbal, qlen, trailing=trailing)
        cache = self.backend.new_cache()
        logits, cache = self._feed(a, 0, cache)
        fed, steps = len(a), []
        n_new = max_new_tokens if forced is None else min(max_new_tokens, len(forced))
        for i in range(n_new):
            last = logits[0, -1]
            steps.append(last)
            nxt = int(last.argmax()) if forced is None else int(forced[i])
            verbal.append(nxt)
            if (stop_id is not None and nxt == stop_id) or i == n_new - 1:
                break
            a = self.augment(verbal, qlen, trailing=trailing)  # same prefix, plus the new items
            logits, cache = self._feed(a, fed, cache)
            fed = len(a)
        new = verbal[qlen:]
        return (new, torch.stack(steps) if steps else torch.empty(0)) if return_logits else new


def latent_params(llm):
    """What a trained latent run saves: Z and how to rebuild the policy."""
    return {"Z": llm.Z.detach().cpu(), "policy": "+".join(str(r) for r in llm.policy.rules) or "none",
            "groups": llm.policy.groups, "position_mode": llm.position_mode, "readout": llm.policy.readout}


# =============================================================================== tokenizers

# The task vocabulary for our own bases, split the way Llama-3's tokenizer splits these texts
# (the paper: an equation "44@47=83," is six Llama-3 tokens): runs of digits in chunks of up to
# three digits, words with their leading space, every other character alone. It lists every token
# the three generators can emit; '\n' is the beginning and ending token.
DIGIT_TOKENS = [str(i) for i in range(10)] + [f"{i:02d}" for i in range(100)] + [str(i) for i in range(100, 201)]
TASK_VOCAB = (["\n", " ", ",", ":", "=", "+", "@", "Var", " Var", "Please", " repeat", " the", " following",
               " equation", " times"] + DIGIT_TOKENS)
TASK_PATTERN = re.compile(r" ?[A-Za-z]+|\d{1,3}|[^A-Za-z\d]")
TASK_ALPHABET = "\n" + "".join(sorted(set("".join(TASK_VOCAB)) - {"\n"}))  # characters, for char bases


class CharTokenizer:
    """A vocabulary given as itos; kind "char" (one character per token) or "task" (TASK_PATTERN
    pieces, e.g. TASK_VOCAB). '\n' is the beginning and ending token."""

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

    def marker_ids(self, marker):
        ids = self.encode(marker)
        if len(ids) != 1:
            raise UsageError(f"--marker {marker!r}: must be one token")
        return ids


def task_tokenizer():
    return CharTokenizer(TASK_VOCAB, "task")


class GPT2Tokenizer:
    """GPT-2 BPE (train.py's stdlib checkpoints); <|endoftext|> begins and ends a sample."""

    kind = "gpt2"

    def __init__(self):
        import data as data_mod
        self.enc = data_mod.gpt2_encoder()
        self.bos = self.eos = data_mod.EOT
        self.vocab_size = data_mod.EOT + 1

    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode([i for i in ids if i != self.eos])

    def marker_ids(self, marker):
        ids = self.encode(marker)
        if len(ids) != 1:
            raise UsageError(f"--marker {marker!r}: must be one GPT-2 token")
        return ids


# =============================================================================== tasks

@dataclass
class Sample:
    query: str        # without the beginning token
    response: str     # without the ending token
    info: dict = field(default_factory=dict)


def _op(a, b):
    """The Generation task's @: (a1a2, b1b2) -> f1f2, f1 = |a1+b1| mod 9, f2 = |a2-b2| mod 9."""
    return f"{abs(int(a[0]) + int(b[0])) % 9}{abs(int(a[1]) - int(b[1])) % 9}"


class Generation:
    """Paper section 4.1. Query: five chained equations; response: the chain continued.

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
        return correct_prefix.count(",")


class Summation:
    """Paper section 4.2. 'Var0=29, Var1=24, ..., Var1+Var2=' -> '24+20=44'; values in [10, 30).

    Choice: the two asked variables are distinct; every variable, the last one included, is
    followed by ', ' (as in the paper's example).
    """
    name, eos, metric = "summation", True, "accuracy"
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

    def score(self, query, generated, stopped):
        return float(stopped and generated == self.answer(query))

    @staticmethod
    def score_prefix(correct_prefix, response, complete):
        return float(complete)


class Repetition:
    """Paper section 4.3. 'Please repeat the following equation n times: ' + s1 copies of 'a+b=c,'
    -> s2 = n - s1 more copies; a, b in 1..100 (inclusive), s1 in 1..5.

    Choice: the paper writes both 'equation' and 'equations'; we use its example's singular, and its
    example's space after the colon and comma after every copy.
    """
    name, eos, metric = "repetition", True, "accuracy"
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

    def score(self, query, generated, stopped):
        return float(stopped and generated == self.answer(query))

    @staticmethod
    def score_prefix(correct_prefix, response, complete):
        return float(complete)


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


# =============================================================================== train / evaluate

def cosine_lr(step, total, peak, floor, warmup):
    """Linear warmup over `warmup` steps, then cosine from peak to floor (absolute)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train_latents(llm, augs, epochs=10, batch_size=16, lr=5e-2, min_lr=5e-5, warmup=0.01,
                  weight_decay=1e-4, grad_clip=1.0, seed=0, log=None):
    """Paper recipe (Table 2): AdamW, lr 5e-2 cosine to 5e-5, warmup 1 %, wd 1e-4, batch 16.
    Gradient clipping 1.0 is our addition (Hugging Face Trainer's default). Z and AdamW's states
    are float32 whatever the base's dtype. Returns the losses; TrainingError (exit code 1 at the
    command line) when a loss or gradient norm is not finite (Z is left as it was before that step)."""
    if llm.Z.numel() == 0:
        return []
    opt = torch.optim.AdamW([llm.Z], lr=lr, weight_decay=weight_decay)
    per_epoch = math.ceil(len(augs) / batch_size)
    total = epochs * per_epoch
    warm = max(1, math.ceil(warmup * total))
    rng = np.random.default_rng(seed)
    was_training = llm.training
    llm.train()
    losses, step = [], 0
    for ep in range(epochs):
        perm = rng.permutation(len(augs))
        for b in range(per_epoch):
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, total, lr, min_lr, warm)
            loss = llm.loss([augs[i] for i in perm[b * batch_size:(b + 1) * batch_size]])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_([llm.Z], grad_clip if grad_clip else math.inf)
            if not (math.isfinite(loss.item()) and math.isfinite(float(norm))):
                raise TrainingError(f"non-finite loss ({loss.item()}) or gradient norm ({float(norm)}) at step "
                                    f"{step + 1} (epoch {ep + 1}); stopped")
            opt.step()
            losses.append(loss.item())
            step += 1
        if log:
            log(f"  epoch {ep + 1}/{epochs}: mean loss {np.mean(losses[-per_epoch:]):.4f}")
    llm.train(was_training)  # the mode it found
    return losses


@torch.no_grad()
def correct_prefix_lengths(llm, augs, batch_size=32):
    """Per sample: how many leading scored targets the argmax gets right, and how many there are."""
    out = []
    order = sorted(range(len(augs)), key=lambda i: len(augs[i]))  # similar lengths share a batch
    res = {}
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        logits, tgt = llm.logits([augs[i] for i in idx])
        ok = logits.argmax(-1) == tgt
        for r, i in enumerate(idx):
            m = tgt[r] >= 0
            good = ok[r][m]
            bad = (~good).nonzero()
            res[i] = (int(bad[0]) if len(bad) else int(m.sum()), int(m.sum()))
    for i in range(len(augs)):
        out.append(res[i])
    return out


def evaluate(llm, tok, task, level, n_test=256, batch_size=32, mode="tf"):
    """Mean metric (equations or accuracy) on the fixed test set of a level."""
    samples = test_set(task, level, n_test)
    scores = []
    if mode == "tf":
        enc = [encode_sample(tok, task, s) for s in samples]
        augs = [llm.augment(v, q) for v, q in enc]
        for (v, q), (r, total), s in zip(enc, correct_prefix_lengths(llm, augs, batch_size), samples):
            prefix = tok.decode(v[q:q + r])
            scores.append(task.score_prefix(prefix, s.response, r == total))
    elif mode == "generate":
        for s in samples:
            q = [tok.bos] + tok.encode(s.query)
            budget = len(tok.encode(s.response)) + (2 if task.eos else 0)
            if task.name == "summation":
                budget = max(budget, 10)  # the paper's budget (Table 2)
            if task.name == "repetition":
                budget = max(budget, 200)
            new = llm.generate(q, budget, stop_id=tok.eos if task.eos else None)
            stopped = bool(new) and new[-1] == tok.eos
            text = tok.decode(new[:-1] if stopped else new)
            scores.append(task.score(s.query, text, stopped))
    else:
        raise UsageError(f"--eval_mode {mode}: choose tf or generate")
    return float(np.mean(scores))


def mean_latents(llm, augs):
    return float(np.mean([sum(a.is_latent) for a in augs])) if augs else 0.0


# =============================================================================== checkpoints

def _save_atomic(obj, path):
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_base(path):
    """(frozen base, tokenizer) from a checkpoint in train.py's format, or 'hf:PATH' for a local
    Hugging Face model folder (needs transformers). UsageError for anything unusable."""
    if path.startswith("hf:"):
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError:
            raise UsageError("--base hf:...: needs the transformers package (pip install transformers)") from None
        try:
            model = AutoModelForCausalLM.from_pretrained(path[3:], local_files_only=True)
            hf_tok = AutoTokenizer.from_pretrained(path[3:], local_files_only=True)
        except Exception as e:
            raise UsageError(f"--base {path}: cannot load a Hugging Face model ({type(e).__name__})") from None
        return model, _HFTokenizer(hf_tok)
    if not os.path.isfile(path):
        raise UsageError(f"--base: no checkpoint at {path}")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
        cfg = ModelConfig.from_dict(ck["config"])
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"--base {path}: not a readable checkpoint ({type(e).__name__})") from None
    from models import build_model
    model = build_model(cfg)
    model.load_state_dict(ck["model"])
    info = ck.get("data", {})
    if info.get("tokenizer") in ("char", "task"):
        if "itos" not in info:
            raise UsageError(f"--base {path}: {info['tokenizer']} checkpoint without its vocabulary (data.itos)")
        tok = CharTokenizer(info["itos"], info["tokenizer"])
    elif info.get("tokenizer") == "gpt2":
        tok = GPT2Tokenizer()
    else:
        raise UsageError(f"--base {path}: unknown tokenizer {info.get('tokenizer')!r}")
    if tok.vocab_size != cfg.vocab_size:
        raise UsageError(f"--base {path}: vocabulary {tok.vocab_size} != model vocab {cfg.vocab_size}")
    return model, tok


class _HFTokenizer:
    kind = "hf"

    def __init__(self, t):
        self.t = t
        self.bos = t.bos_token_id if t.bos_token_id is not None else t.eos_token_id
        self.eos = t.eos_token_id
        self.vocab_size = len(t)

    def encode(self, text):
        return self.t.encode(text, add_special_tokens=False)

    def decode(self, ids):
        return self.t.decode([i for i in ids if i != self.eos])

    def marker_ids(self, marker):
        ids = self.encode(marker)
        if len(ids) != 1:
            raise UsageError(f"--marker {marker!r}: must be one token")
        return ids


# =============================================================================== pretraining

def pretrain(args):
    """Train a small base on the tasks' in-distribution data, write the task mix as text (train.txt:
    the token stream; meta.json: tokenizer kind and itos), save ckpt_best.pt in train.py's format
    (its "data" entry also holds itos).

    Rows are single samples (beginning token, query, response, ending token where the task has
    one), loss on every token; AdamW, warmup then cosine to 10 %, wd 0.1 (train.py's groups:
    matrices minus the exemptions each model declares), clip 1.0; a non-finite loss raises
    TrainingError."""
    from models import build_model
    from train import eval_mode, param_groups
    torch.manual_seed(args.seed)
    names = list(TASKS) if args.task == "all" else [get_task(t).name for t in args.task.split(",")]
    mix = args.mix or ("1,2,1" if args.task == "all" else ",".join("1" * len(names)))
    try:
        weights = [int(w) for w in mix.split(",")]
    except ValueError:
        weights = []
    if len(weights) != len(names) or min(weights) < 1:
        raise UsageError(f"--mix {args.mix}: one positive integer weight per task ({', '.join(names)})")
    cycle = [n for n, w in zip(names, weights) for _ in range(w)]  # the mix, in a fixed rotation
    tok = task_tokenizer() if args.vocab == "task" else CharTokenizer(TASK_ALPHABET)
    rng = np.random.default_rng(args.seed)
    rows = []
    for i in range(args.n_samples):
        task = TASKS[cycle[i % len(cycle)]]
        rows.append(encode_sample(tok, task, task.sample(rng, "train"))[0])
    dev_rng = np.random.default_rng(args.seed + 1)
    dev = []
    for i in range(args.n_dev):
        task = TASKS[cycle[i % len(cycle)]]
        dev.append(encode_sample(tok, task, task.sample(dev_rng, "train"))[0])
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "train.txt"), "w") as f:
        f.write("".join(tok.decode(r) for r in rows))
    with open(os.path.join(args.out_dir, "meta.json"), "w") as f:
        json.dump({"tokenizer": tok.kind, "vocab_size": tok.vocab_size, "itos": tok.itos, "tasks": names,
                   "mix": weights, "n_samples": args.n_samples, "seed": args.seed,
                   "command": getattr(args, "command", None)}, f, indent=1)
    block = max(len(r) for r in rows + dev)
    width = args.width or 4 * args.d
    cfg = ModelConfig(model=args.model, vocab_size=tok.vocab_size, block_size=block, n_embd=args.d,
                      n_head=args.d // 32, depth=args.depth, width=width, window=block,
                      gau_s=max(32, args.d), chunk=64)
    model = build_model(cfg)
    print(f"pretrain {args.model} d={args.d} depth={args.depth} width={width}: "
          f"{model.num_params():,} non-embedding params, vocab {tok.vocab_size}, rows <= {block} tokens, "
          f"{len(rows):,} samples of {', '.join(names)}")

    def batch(rs):
        L = max(len(r) for r in rs)
        x = torch.zeros(len(rs), L, dtype=torch.long)
        y = torch.full((len(rs), L), -1, dtype=torch.long)
        for b, r in enumerate(rs):
            x[b, :len(r)] = torch.tensor(r)
            y[b, :len(r) - 1] = torch.tensor(r[1:])
        return x, y

    @torch.no_grad()
    def dev_nll():
        with eval_mode(model):
            tot, cnt = 0.0, 0
            for b in range(0, len(dev), 64):
                x, y = batch(dev[b:b + 64])
                logits, _ = model(x)
                tot += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum").item()
                cnt += int((y >= 0).sum())
        return tot / cnt

    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    best, t0, path = float("inf"), time.time(), os.path.join(args.out_dir, "ckpt_best.pt")
    warm = max(1, args.steps // 50)
    model.train()
    for it in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(it, args.steps, args.lr, 0.1 * args.lr, warm)
        idx = rng.integers(len(rows), size=args.batch_size)
        x, y = batch([rows[i] for i in idx])
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not (math.isfinite(loss.item()) and math.isfinite(float(norm))):
            raise TrainingError(f"non-finite loss ({loss.item()}) or gradient norm ({float(norm)}) at update "
                                f"{it + 1}; stopped; {path if best < float('inf') else 'no checkpoint was saved'}")
        opt.step()
        if (it + 1) % args.eval_interval == 0 or it + 1 == args.steps:
            d = dev_nll()
            tag = ""
            if d < best:
                best, tag = d, " (best, saved)"
                state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
                _save_atomic({"model": state, "config": cfg.to_dict(),
                              "data": {"tokenizer": tok.kind, "vocab_size": tok.vocab_size, "itos": tok.itos},
                              "iter": it + 1, "best_dev": best, "dev_nll": d}, path)
            print(f"update {it + 1}: train loss {loss.item():.4f}  dev NLL {d:.4f}{tag}  ({time.time() - t0:.0f} s)",
                  flush=True)
    base, tok = load_base(path)
    llm = LatentLM(base, "none")
    for name in names:
        task = TASKS[name]
        res = {lv: evaluate(llm, tok, task, lv, args.n_test) for lv in task.levels}
        print(f"frozen base on {name}: " + "  ".join(f"{lv}: {v:.3f}" for lv, v in res.items()))
    print(f"saved {path} (best dev NLL {best:.4f}); {time.time() - t0:.0f} s")
    return path


# =============================================================================== runs

def run_one(base, tok, task, policy, groups="shared", position_mode="prepend", marker=",", seed=0,
            n_train=4096, epochs=10, batch_size=16, lr=5e-2, min_lr=5e-5, warmup=0.01,
            weight_decay=1e-4, grad_clip=1.0, n_test=1024, eval_mode="tf", levels=None, init="embedding",
            readout="latent", log=None):
    """Train latents for one (task, policy, seed) on a frozen base and evaluate every level."""
    torch.manual_seed(seed)
    rules = parse_policy(policy)
    marker_ids = tok.marker_ids(marker) if any(r.kind == "marker" for r in rules) else ()
    llm = LatentLM(base, Policy(rules, None, groups, marker_ids, readout), position_mode=position_mode, init=init)
    rng = np.random.default_rng([seed, list(TASKS).index(task.name)])
    train = [encode_sample(tok, task, task.sample(rng, "train")) for _ in range(n_train)]
    augs = [llm.augment(v, q) for v, q in train]
    t0 = time.time()
    losses = train_latents(llm, augs, epochs, batch_size, lr, min_lr, warmup, weight_decay, grad_clip,
                           seed, log) if llm.Z.numel() else []
    t_train = time.time() - t0
    levels = levels or list(task.levels)
    metrics = {lv: evaluate(llm, tok, task, lv, n_test, mode=eval_mode) for lv in levels}
    return {"task": task.name, "policy": policy, "groups": groups, "position_mode": position_mode,
            "init": init, "readout": readout, "seed": seed, "latent_vectors": int(llm.Z.shape[0] * llm.Z.shape[1]),
            "latents_per_train_sample": mean_latents(llm, augs),
            "final_loss": float(np.mean(losses[-8:])) if losses else None,
            "train_s": round(t_train, 1), "eval_s": round(time.time() - t0 - t_train, 1),
            "metric": task.metric, "metrics": metrics}, llm


# Rows of the README table per task: (label, policy, groups). "matched" = Start/End with as many
# latents as the paper's method inserts on average per training sample (paper section 4.4).
PAPER_METHOD = {"generation": ("Comma_2", "shared"), "summation": ("Comma_2", "shared"),
                "repetition": ("Start_1+Comma_1", "rule")}


def sweep(args, base, tok):
    tasks = [get_task(t) for t in (list(TASKS) if args.tasks == "all" else args.tasks.split(","))]
    os.makedirs(args.out_dir, exist_ok=True)
    kw = dict(n_train=args.n_train, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
              min_lr=args.min_lr, warmup=args.warmup, weight_decay=args.weight_decay,
              grad_clip=args.grad_clip, n_test=args.n_test, position_mode=args.position_mode, init=args.init)
    kw_readout = args.readout
    t0 = time.time()
    for task in tasks:
        # one raw file per task, so tasks can run as parallel processes into the same out_dir
        raw_path = os.path.join(args.out_dir, f"results_{task.name}.json")
        runs = json.load(open(raw_path)) if args.resume and os.path.exists(raw_path) else []
        done = {(r["task"], r["policy"], r["groups"], r.get("readout", "latent"), r["seed"]) for r in runs}
        paper, pgroups = PAPER_METHOD[task.name]
        probe = LatentLM(base, Policy(paper, None, pgroups, tok.marker_ids(",")))
        rng = np.random.default_rng([0, list(TASKS).index(task.name)])
        M = round(mean_latents(probe, [probe.augment(*encode_sample(tok, task, task.sample(rng, "train")))
                                       for _ in range(args.n_train)]))
        r0 = kw_readout
        rows = [("none", "shared", r0), ("Start_2", "shared", r0), ("End_2", "shared", r0), (paper, pgroups, r0),
                (f"Start_{M}", "shared", r0), (f"End_{M}", "shared", r0)] + [(p, "shared", r0) for p in args.extra]
        if args.ablate_readout:  # the paper's method with the other readout
            rows.append((paper, pgroups, "verbal" if r0 == "latent" else "latent"))
        for policy, groups, readout in rows:
            for seed in (args.seeds if policy != "none" else args.seeds[:1]):
                if (task.name, policy, groups, readout, seed) in done:
                    continue
                rec, _ = run_one(base, tok, task, policy, groups, seed=seed, readout=readout, **kw)
                rec["row"] = ("paper" if (policy, groups) == (paper, pgroups) else
                              "matched" if policy in (f"Start_{M}", f"End_{M}") else "")
                rec["command"] = args.command
                runs.append(rec)
                print(f"[{time.time() - t0:5.0f} s] {task.name:10s} {policy:16s} {groups:6s} {readout:6s} seed {seed}: "
                      + "  ".join(f"{k} {v:.3f}" for k, v in rec["metrics"].items())
                      + f"  (train {rec['train_s']} s, eval {rec['eval_s']} s)", flush=True)
                with open(raw_path, "w") as f:
                    json.dump(runs, f, indent=1)
    runs = []
    for name in TASKS:  # the table covers every task's results in out_dir
        path = os.path.join(args.out_dir, f"results_{name}.json")
        if os.path.exists(path):
            runs += json.load(open(path))
    table = make_table(runs, args)
    with open(os.path.join(args.out_dir, "README_table.md"), "w") as f:
        f.write(table_header(args, runs) + table)
    print(table)
    return runs


def table_header(args, runs=()):
    """The exact commands: the base's pretraining (from its meta.json, when there) and the sweeps
    that produced the runs."""
    meta_path = os.path.join(os.path.dirname(os.path.abspath(args.base)), "meta.json")
    pre = None
    if os.path.exists(meta_path):
        pre = json.load(open(meta_path)).get("command")
    cmds = []
    for r in runs:
        if r.get("command") and r["command"] not in cmds:
            cmds.append(r["command"])
    lines = ["Commands:", "", "```"] + ([pre] if pre else []) + (cmds or [getattr(args, "command", "")]) + ["```", ""]
    return "\n".join(lines) + "\n"


def make_table(runs, args=None):
    """Markdown: one table per task, rows = methods, columns = levels, mean +- std over seeds."""
    lines = []
    for name in TASKS:
        rs = [r for r in runs if r["task"] == name]
        if not rs:
            continue
        task = TASKS[name]
        levels = list(task.levels)
        head = {"generation": "correct equations within a budget of N equations (N = 10 ID; 20, 40 OOD)",
                "summation": "accuracy; number of variables (5-14 ID; 15-29, 30-49 OOD)",
                "repetition": "accuracy; copies to produce s2 (1-5 ID; 6-7, 8-10 OOD)"}[name]
        lines += [f"**{name}** - {head}", "",
                  "| method | latent vectors | latents / train sample | seeds | "
                  + " | ".join(f"{lv}{' (ID)' if lv in task.id_levels else ''}" for lv in levels) + " |",
                  "|---|---|---|---|" + "---|" * len(levels)]
        keys = []
        for r in rs:
            k = (r["policy"], r["groups"], r.get("readout", "latent"))
            if k not in keys:
                keys.append(k)
        for k in keys:
            g = [r for r in rs if (r["policy"], r["groups"], r.get("readout", "latent")) == k]
            label = k[0] if k[1] == "shared" else f"{k[0]} (groups={k[1]})"
            if k[2] != "latent":
                label += f" [readout {k[2]}]"
            if g[0].get("row") == "paper":
                label = f"**{label}** (paper's method)"
            elif g[0].get("row") == "matched":
                label += " (matched tokens)"
            if k[0] == "none":
                label = "frozen base alone"
            cells = []
            for lv in levels:
                v = np.array([r["metrics"][lv] for r in g])
                scale = 100 if task.metric == "accuracy" else 1
                unit = "%" if task.metric == "accuracy" else ""
                cells.append(f"{v.mean() * scale:.1f}{unit}" if len(v) == 1 else
                             f"{v.mean() * scale:.1f} ± {v.std(ddof=1) * scale:.1f}{unit}")
            lines.append(f"| {label} | {g[0]['latent_vectors']} | {g[0]['latents_per_train_sample']:.1f} | "
                         f"{len(g)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# =============================================================================== CLI

def _train_flags(p):
    a = p.add_argument
    a("--n_train", type=int, default=4096, help="training samples (paper 4096)")
    a("--epochs", type=int, default=10, help="epochs (paper 10)")
    a("--batch_size", type=int, default=16, help="batch size (paper 16)")
    a("--lr", type=float, default=5e-2, help="peak learning rate (paper 5e-2)")
    a("--min_lr", type=float, default=5e-5, help="final learning rate of the cosine (paper 5e-5)")
    a("--warmup", type=float, default=0.01, help="warmup fraction (paper 1 %%)")
    a("--weight_decay", type=float, default=1e-4, help="AdamW weight decay (paper 1e-4)")
    a("--grad_clip", type=float, default=1.0, help="gradient clipping (0 = off)")
    a("--n_test", type=int, default=1024, help="test samples per level (paper 1024)")
    a("--position_mode", default="prepend", help=f"one of {', '.join(POSITION_MODES)}")
    a("--init", default="embedding", help="Z init: embedding (sampled rows of E) or normal (N(0, 0.02))")
    a("--readout", default="latent", help="latent (SPEC: the last latent predicts) or verbal (paper-literal ablation)")
    a("--threads", type=int, default=1, help="torch intra-op threads (1 on a shared CPU)")


def parse_args(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "pretrain":
        p = argparse.ArgumentParser(prog="latent_tokens.py pretrain", description=pretrain.__doc__.split("\n")[0],
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        a = p.add_argument
        a("--task", default="all", help="all or a comma list of " + ", ".join(TASKS))
        a("--mix", default=None, help="integer weights per task (default 1,2,1 for all: Summation's retrieval "
                                      "needs the most updates; equal otherwise)")
        a("--out_dir", default="out/latent_base")
        a("--model", default="untied", help="a models.REGISTRY name")
        a("--d", type=int, default=64, help="width (multiple of 32)")
        a("--depth", type=int, default=3)
        a("--width", type=int, default=None, help="expansion width (default 4 d)")
        a("--steps", type=int, default=4000)
        a("--batch_size", type=int, default=32)
        a("--lr", type=float, default=6e-3)
        a("--vocab", default="task", help="task (Llama-3-like pieces: numbers of up to 3 digits are one token) or char")
        a("--n_samples", type=int, default=30000, help="training samples written to train.txt")
        a("--n_dev", type=int, default=384)
        a("--n_test", type=int, default=256, help="samples per level for the final base evaluation")
        a("--eval_interval", type=int, default=500)
        a("--seed", type=int, default=0)
        a("--threads", type=int, default=1)
        args = p.parse_args(argv[1:])
        args.cmd = "pretrain"
        return args
    if argv and argv[0] == "sweep":
        p = argparse.ArgumentParser(prog="latent_tokens.py sweep", description="README table: every task x method x seed",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        a = p.add_argument
        a("--base", required=True, help="checkpoint (ckpt_best.pt) or hf:PATH")
        a("--out_dir", default="results/latent_tokens")
        a("--tasks", default="all")
        a("--seeds", type=int, nargs="+", default=[0, 1, 2])
        a("--extra", nargs="*", default=[], help="more policies (shared groups) to add to every task")
        a("--resume", action="store_true", help="skip runs already in results.json")
        a("--ablate_readout", action="store_true", help="add the paper's method with the other --readout")
        _train_flags(p)
        args = p.parse_args(argv[1:])
        args.cmd = "sweep"
        return args
    p = argparse.ArgumentParser(description="Train latent tokens on a frozen base and evaluate (SPEC section 6)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="subcommands: 'pretrain' (a tiny base for the tasks), 'sweep' (the README table)")
    a = p.add_argument
    a("--base", required=True, help="checkpoint (ckpt_best.pt) or hf:PATH")
    a("--task", required=True, help=", ".join(TASKS))
    a("--policy", default="Comma_2", help="Start_m, End_m, Comma_m, k_m, A+B, or none (the base alone)")
    a("--groups", default="shared", help=f"{', '.join(GROUPINGS)} (function specialization)")
    a("--marker", default=",", help="Comma_m marker token")
    a("--eval_mode", default="tf", help="tf (teacher-forced greedy, exact and fast) or generate (cached decoding)")
    a("--seed", type=int, default=0)
    a("--save", default=None, help="write the trained latents (Z, policy) here")
    a("--json", default=None, help="append the result as one JSON line here")
    _train_flags(p)
    args = p.parse_args(argv)
    args.cmd = "run"
    return args


def check_args(args):
    for flag in ("n_train", "epochs", "batch_size", "n_test", "threads"):
        if getattr(args, flag, 1) < 1:
            raise UsageError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    if getattr(args, "readout", "latent") not in READOUTS:
        raise UsageError(f"--readout {args.readout}: choose one of {', '.join(READOUTS)}")
    if getattr(args, "position_mode", "prepend") not in POSITION_MODES:
        raise UsageError(f"--position_mode {args.position_mode}: choose one of {', '.join(POSITION_MODES)}")
    if args.cmd == "pretrain":
        if args.d % 32 or args.d < 32:
            raise UsageError(f"--d {args.d}: must be a multiple of 32")
        if args.vocab not in ("task", "char"):
            raise UsageError(f"--vocab {args.vocab}: choose task or char")
        if args.task != "all":
            for t in args.task.split(","):
                get_task(t)
        for flag in ("steps", "batch_size", "n_samples", "n_dev", "eval_interval", "depth"):
            if getattr(args, flag) < 1:
                raise UsageError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    if args.cmd == "run":
        get_task(args.task)
        parse_policy(args.policy)
        if args.groups not in GROUPINGS:
            raise UsageError(f"--groups {args.groups}: choose one of {', '.join(GROUPINGS)}")
        if args.eval_mode not in ("tf", "generate"):
            raise UsageError(f"--eval_mode {args.eval_mode}: choose tf or generate")
    if args.cmd == "sweep" and args.tasks != "all":
        for t in args.tasks.split(","):
            get_task(t)
    for p in getattr(args, "extra", []):
        parse_policy(p)


def main(argv=None):
    try:
        args = parse_args(argv)
        args.command = "python latent_tokens.py " + " ".join(sys.argv[1:] if argv is None else argv)
        check_args(args)
        torch.set_num_threads(args.threads)
        if args.cmd == "pretrain":
            pretrain(args)
            return
        base, tok = load_base(args.base)
        if args.cmd == "sweep":
            sweep(args, base, tok)
            return
        task = get_task(args.task)
        t0 = time.time()
        rec, llm = run_one(base, tok, task, args.policy, args.groups, args.position_mode, args.marker, args.seed,
                           args.n_train, args.epochs, args.batch_size, args.lr, args.min_lr, args.warmup,
                           args.weight_decay, args.grad_clip, args.n_test, args.eval_mode, init=args.init,
                           readout=args.readout, log=print)
        print(f"{task.name} / {llm.policy} / {args.position_mode}: {rec['latent_vectors']} latent vectors, "
              f"{rec['latents_per_train_sample']:.1f} latents per training sample")
        for lv, v in rec["metrics"].items():
            kind = "ID " if lv in task.id_levels else "OOD"
            print(f"  {kind} {lv:6s} {task.metric}: {v:.4f}")
        print(f"  ({time.time() - t0:.0f} s)")
        if args.save:
            torch.save(latent_params(llm), args.save)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rec) + "\n")
    except (UsageError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, UsageError) else 1)


if __name__ == "__main__":
    main()
