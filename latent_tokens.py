"""Latent tokens on a frozen decoder: *Enhancing Latent Computation in Transformers with Latent
Tokens* (arXiv 2505.12629, §3 method, App. A positions, §4 synthetic tasks, App. B.1 recipe).

Trainable embeddings ("latent tokens") are inserted into the input of a frozen causal LM; the table
Z (G groups x m slots x d) is the only thing trained. MATH.md ("Latent tokens") collects the
equations and the choices below.

Insertion (§3.1-3.3). Verbal ids v_0..v_{n-1}, the first query_len of them the query (v_0 is the
beginning token). A *slot* j sits just before verbal token v_j; the policy puts 0 or more groups
of latents into each slot, deciding from v_0..v_{j-1} and query_len only (so decoding decides after
each emitted token):

    Start_m   m latents in slot 0 (before the first verbal token)
    End_m     m latents in slot query_len (end of the query: pause tokens)
    k_m       m latents in every slot j > 0 with j % k == 0 (after every k verbal tokens)
    Comma_m   m latents in every slot j > 0 with v_{j-1} a marker (default ','): after the marker
              (§4 puts them before it: readout="verbal"; MATH.md says why)
    A+B       both (groups in the same slot follow the order written)

Position ids (`position_mode`; §3.1, App. A.2, App. B.4):

    prepend   (default) a group in slot j gets position j, the id of the verbal token after it;
              verbal tokens keep their ids 0..n-1
    append    a group in slot j gets position j-1, the id of the verbal token before it (0 in slot 0)
    increase  (ablation) plain 0..L-1 over the augmented sequence: later tokens shift

Loss (§3.2): the NLL of the verbal targets only, in nats/token,
    L(Z) = - mean over scored verbal v_j of log p(v_j | items before v_j, latents included);
the item before a latent has a latent next and is not scored, so the last latent of a group
predicts the verbal token after it; by default only the response (j >= query_len) is scored.
readout="verbal" is the ablation where only verbal items predict (across latents) and Comma_m's
group sits before the marker: MATH.md says why the default reads §3.1 the other way.

Function specialization (`groups`, §3.3): "shared" (G = 1: every group uses Z[0, :m]), "fs" (one
group per site: start of query (slot 0), inside the query, end of query (slot query_len), inside
the response), "rule" (one group per policy part: "Start_1+Comma_1" with groups="rule" is the
paper's Repetition method "Comma_1 (w/ FS)", two vectors in all).

Z init (default "embedding"): copies of random rows of the frozen embedding E, at the scale of the
inputs the base knows; "normal" is N(0, 0.02). On our tiny task base the rows did better at equal
budget (Repetition ID 84 % vs 75 %, 128 updates, seed 0). Z is float32 at least (float64 on a
float64 base) and cast to the base's dtype at use; the base is frozen and stays in eval mode.

Bases (latent_bases.py): this project's `common.LM` (any models.REGISTRY model) or a Hugging Face
causal LM, both driven with input embeddings, explicit position ids and a decoding cache.

Training (App. B.1, Table 2): AdamW (harness.optim.param_groups) on Z alone, lr 5e-2, warmup 1 %, cosine
to 5e-5, weight decay 1e-4, batch 16, 10 epochs; clipping 1.0 is our addition. `fit` is the one
training loop, for Z and for the small task base (latent_experiments.py). Evaluation is
teacher-forced greedy ("tf", default): one batched forward over query + reference; greedy decoding
reproduces the first r reference tokens iff the argmax at each of those r scored positions is
right (the policy sees only the prefix), so exact match and the Generation count equal greedy
decoding's; --eval_mode generate runs the cached decoder. Tasks and metrics: tasks.py.

    python -m studies.latent_experiments --base CKPT --task summation --policy Comma_2
    python -m studies.latent_experiments --base CKPT --task repetition --policy Start_1+Comma_1 --groups rule
    python -m studies.latent_experiments --base CKPT --task generation --policy none        # frozen base alone
    python -m studies.latent_experiments pretrain --help; python -m studies.latent_experiments sweep --help  # latent_experiments.py

Bad input (unknown policy/task, missing checkpoint, ...): one line, exit code 2; a non-finite loss
or gradient norm: one line, exit code 1.
"""
import math
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.optim import param_groups
from common import UsageError
from harness.latent_bases import make_backend
from harness.tasks import encode_sample, test_set
from harness.cli import TrainingError

POSITION_MODES = ("prepend", "append", "increase")
READOUTS = ("latent", "verbal")
GROUPINGS = ("shared", "fs", "rule")
SITES = ("start", "query", "end", "response")


def choose(flag, value, allowed):
    if value not in allowed:
        raise UsageError(f"--{flag} {value}: choose one of {', '.join(allowed)}")
    return value


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


def parse_policy(spec, m=None, flag="--policy"):
    """'Start_1+Comma_2', '4_1', 'End_8', 'none' -> tuple of Rules. A part written without its count
    ('Comma') takes m. Raises UsageError naming flag (the option that gave spec) for anything else."""
    spec = (spec or "").strip()
    if spec.lower() in ("", "none"):
        return ()
    rules = []
    for part in spec.split("+"):
        mt = _PART.match(part.strip())
        if not mt:
            raise UsageError(f"{flag}: unknown part '{part}' in '{spec}'; use Start_m, End_m, Comma_m, "
                             f"k_m (e.g. 4_1), combinations with '+', or none")
        if mt.group(1):
            count = mt.group(2)
            if count is None:
                if m is None:
                    raise UsageError(f"{flag}: '{part}' needs a count (e.g. {part}_2)")  # (m: Policy's argument)
                count = m
            kind = {"start": "start", "end": "end", "comma": "marker"}[mt.group(1).lower()]
            rules.append(Rule(kind, int(count)))
        else:
            rules.append(Rule("every", int(mt.group(4)), int(mt.group(3))))
    for r in rules:
        if r.m < 1 or (r.kind == "every" and r.k < 1):
            raise UsageError(f"{flag}: '{r}' needs m >= 1 and k >= 1")
    return tuple(rules)


class Policy:
    """Where latent groups go and which row of Z each uses (see the module docstring).

    rules: tuple of Rule (or a spec string for parse_policy); groups: shared | fs | rule;
    marker_ids: token ids that trigger Comma_m; readout: latent | verbal. Z has the shape
    (n_groups, max_m, d).
    """

    def __init__(self, rules, m=None, groups="shared", marker_ids=(), readout="latent"):
        self.rules = parse_policy(rules, m) if isinstance(rules, str) or rules is None else tuple(rules)
        self.groups, self.readout = choose("groups", groups, GROUPINGS), choose("readout", readout, READOUTS)
        self.marker_ids = frozenset(int(i) for i in marker_ids)
        if any(r.kind == "marker" for r in self.rules) and not self.marker_ids:
            raise UsageError("Comma_m needs marker token ids (the marker is not in the vocabulary)")
        self.max_m = max((r.m for r in self.rules), default=0)
        if groups == "fs":
            used = set()
            for r in self.rules:  # the sites where schedule can place r's latents
                used |= {"start"} if r.kind == "start" else {"end"} if r.kind == "end" else {"query", "end", "response"}
                if r.kind == "marker" and self.readout == "verbal":  # before a marker at v_0, too
                    used.add("start")
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


# =============================================================================== insertion

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

    def __len__(self):
        return len(self.tokens)


def augment(verbal_ids, query_len, policy, position_mode="prepend", score_from=None, trailing=False):
    """Insert the policy's latent groups into verbal_ids (see the module docstring).

    verbal_ids: sequence of ints; query_len: how many of them are the query; policy: Policy;
    score_from: first verbal index whose prediction is scored (default query_len, the response);
    trailing: also add the latents of slot n = len(verbal_ids) (decoding: the latents that come
    before the next, not yet known, token).
    """
    choose("position_mode", position_mode, POSITION_MODES)
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


# =============================================================================== the LatentLM wrapper

class LatentLM(nn.Module):
    """Frozen causal LM + trainable latent table Z (G, m, d).

    LatentLM(base, policy="Comma_2", m=None, groups="shared", position_mode="prepend",
             marker_ids=(...), init="embedding", init_std=0.02, readout="latent")
    policy: Policy or spec string ('none' = the base alone, Z empty); m: count for parts written
    without one; marker_ids: ids that trigger Comma_m (tokenizer.marker_ids(',')).

    augment(verbal, query_len) -> Augmented; logits(augs) -> ((B, L, V) logits, (B, L) targets);
    loss(augs) -> scalar NLL (nats/token) over the scored targets; generate(query, max_new_tokens,
    stop_id) -> new verbal ids, greedy, with a decoding cache. UsageError for a policy whose m exceeds
    the base's context (block_size, or a Hugging Face model's max_position_embeddings).
    """

    def __init__(self, base, policy="none", m=None, groups="shared", position_mode="prepend",
                 marker_ids=(), init="embedding", init_std=0.02, readout="latent"):
        super().__init__()
        self.position_mode = choose("position_mode", position_mode, POSITION_MODES)
        self.backend = make_backend(base)
        self.base = base
        base.requires_grad_(False)
        base.eval()
        self.policy = policy if isinstance(policy, Policy) else Policy(policy, m, groups, marker_ids, readout)
        emb = self.backend.embedding().weight
        G, M, d = self.policy.n_groups, self.policy.max_m, self.backend.d
        if self.backend.context and M > self.backend.context:  # (Z alone would be G M d numbers)
            raise UsageError(f"policy {self.policy}: {M} latents in one group, more than the base's context of "
                             f"{self.backend.context} positions; give m <= {self.backend.context}")
        if choose("init", init, ("embedding", "normal")) == "normal":
            z = torch.randn(G, M, d) * init_std
        else:
            rows = torch.randint(0, self.backend.vocab_size, (G * M,))  # not the LM's padding rows
            z = emb.detach()[rows].float().cpu().view(G, M, d).clone()
        # at least float32 whatever the base's dtype (cast at use, in embed): in float16/bfloat16
        # AdamW's eps and the late, small updates of the schedule vanish below the format's resolution
        self.Z = nn.Parameter(z.to(device=emb.device, dtype=torch.promote_types(emb.dtype, torch.float32)))

    def train(self, mode=True):
        super().train(mode)
        self.base.eval()  # the base stays in eval mode (frozen)
        return self

    def augment(self, verbal, query_len, **kw):
        return augment(verbal, query_len, self.policy, self.position_mode, **kw)

    def latent_rows(self, group, slot):
        """Row of Z.reshape(G * m, d) for each item, -1 for verbal items."""
        return torch.where(group >= 0, group * max(self.policy.max_m, 1) + slot, -1)

    def collate(self, augs):
        """Right-pad a list of Augmented into (B, L) tensors tokens, latent rows, positions, targets
        (causal, so padding never reaches real items)."""
        L = max(len(a) for a in augs)
        tok = torch.zeros(len(augs), L, dtype=torch.long)
        lat = torch.full((len(augs), L), -1, dtype=torch.long)
        pos = torch.zeros(len(augs), L, dtype=torch.long)
        tgt = torch.full((len(augs), L), -1, dtype=torch.long)
        for b, a in enumerate(augs):
            n = len(a)
            tok[b, :n] = torch.tensor(a.tokens).clamp_min(0)
            lat[b, :n] = self.latent_rows(torch.tensor(a.latent_group), torch.tensor(a.latent_slot))
            p = torch.tensor(a.position_ids)
            pos[b, :n] = p
            pos[b, n:] = (p.max() + 1 if n else 0) + torch.arange(L - n)
            tgt[b, :n] = torch.tensor(a.targets)
        dev = self.Z.device
        return tok.to(dev), lat.to(dev), pos.to(dev), tgt.to(dev)

    def embed(self, tok, lat):
        """Input embeddings (B, L, d): the frozen E for verbal items, rows of Z for latents."""
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

    # ---- cached decoding (§3.1)
    def _feed(self, a, start, cache):
        """Run items a[start:] through the base with the cache; returns logits (1, n, V)."""
        dev = self.Z.device
        tok = torch.tensor([a.tokens[start:]], device=dev).clamp_min(0)
        lat = self.latent_rows(torch.tensor([a.latent_group[start:]], device=dev),
                               torch.tensor([a.latent_slot[start:]], device=dev))
        pos = torch.tensor([a.position_ids[start:]], device=dev)
        return self.backend.forward(self.embed(tok, lat), pos, cache)

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
        logits, cache = self._feed(a, 0, self.backend.new_cache())
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


# =============================================================================== training and evaluation

def cosine_lr(step, total, peak, floor, warmup):
    """Linear warmup to peak over `warmup` updates, then cosine from peak at update `warmup` to
    floor at update `total` (absolute floor). This is the progress term of Hugging Face's cosine
    schedule, with which the paper trained (App. B.1); harness.optim.Schedule differs (warmup to update
    warmup + 1, floor reached at the last update), so the committed tables keep this one."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def fit(loss_of, batches, params, opt, lr_of, grad_clip, where):
    """The training loop (latent tables and the task base): per batch, set lr_of(update) on every
    parameter group, loss_of(batch) backward, clip the gradient norm of params to grad_clip
    (0 = no clipping), AdamW step. Yields (update, loss) after each step. A non-finite loss or
    gradient norm raises TrainingError naming where(update), before the step."""
    for step, batch in enumerate(batches):
        for g in opt.param_groups:
            g["lr"] = lr_of(step)
        loss = loss_of(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip else math.inf)
        if not (math.isfinite(loss.item()) and math.isfinite(float(norm))):
            raise TrainingError(f"non-finite loss ({loss.item()}) or gradient norm ({float(norm)}) at {where(step)}")
        opt.step()
        yield step, loss.item()


def train_latents(llm, augs, epochs=10, batch_size=16, lr=5e-2, min_lr=5e-5, warmup=0.01,
                  weight_decay=1e-4, grad_clip=1.0, seed=0, log=None):
    """Train Z on a list of Augmented (App. B.1: AdamW, cosine_lr from lr to min_lr after a warmup
    fraction, shuffled every epoch with numpy seed). Z and AdamW's states are float32 whatever the
    base's dtype. Returns the losses (nats/token); TrainingError when a loss or gradient norm is
    not finite (Z is left as it was before that step). llm's train/eval mode is restored."""
    if llm.Z.numel() == 0:
        return []
    opt = torch.optim.AdamW(param_groups(llm, weight_decay), lr=lr)
    per_epoch = math.ceil(len(augs) / batch_size)
    total = epochs * per_epoch
    warm = max(1, math.ceil(warmup * total))
    rng = np.random.default_rng(seed)

    def batches():
        for _ in range(epochs):
            perm = rng.permutation(len(augs))
            for b in range(per_epoch):
                yield [augs[i] for i in perm[b * batch_size:(b + 1) * batch_size]]

    was_training = llm.training
    llm.train()
    losses = []
    for step, loss in fit(llm.loss, batches(), [llm.Z], opt, lambda s: cosine_lr(s, total, lr, min_lr, warm),
                          grad_clip, lambda s: f"step {s + 1} (epoch {s // per_epoch + 1}); stopped"):
        losses.append(loss)
        if log and (step + 1) % per_epoch == 0:
            log(f"  epoch {(step + 1) // per_epoch}/{epochs}: mean loss {np.mean(losses[-per_epoch:]):.4f} nats/token")
    llm.train(was_training)
    return losses


@torch.no_grad()
def correct_prefix_lengths(llm, augs, batch_size=32):
    """Per sample: (how many leading scored targets the argmax gets right, how many there are)."""
    order = sorted(range(len(augs)), key=lambda i: len(augs[i]))  # similar lengths share a batch
    res = {}
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        logits, tgt = llm.logits([augs[i] for i in idx])
        ok = logits.argmax(-1) == tgt
        for r, i in enumerate(idx):
            m = tgt[r] >= 0
            bad = (~ok[r][m]).nonzero()
            res[i] = (int(bad[0]) if len(bad) else int(m.sum()), int(m.sum()))
    return [res[i] for i in range(len(augs))]


def evaluate(llm, tok, task, level, n_test=256, batch_size=32, mode="tf"):
    """Mean metric (equations or accuracy) on the fixed test set of a level; mode tf | generate."""
    samples = test_set(task, level, n_test)
    scores = []
    if choose("eval_mode", mode, ("tf", "generate")) == "tf":
        enc = [encode_sample(tok, task, s) for s in samples]
        augs = [llm.augment(v, q) for v, q in enc]
        for (v, q), (r, total), s in zip(enc, correct_prefix_lengths(llm, augs, batch_size), samples):
            scores.append(task.score_prefix(tok.decode(v[q:q + r]), s.response, r == total))
    else:
        for s in samples:
            q = [tok.bos] + tok.encode(s.query)
            budget = len(tok.encode(s.response)) + (2 if task.eos else 0)
            budget = max(budget, {"summation": 10, "repetition": 200}.get(task.name, 0))  # Table 2's budgets
            new = llm.generate(q, budget, stop_id=tok.eos if task.eos else None)
            stopped = bool(new) and new[-1] == tok.eos
            scores.append(task.score(s.query, tok.decode(new[:-1] if stopped else new), stopped))
    return float(np.mean(scores))
