"""The optimizer and the learning-rate schedule of train.py (MATH.md, "Training protocol"), as
values: each is a small dataclass whose fields are its flags (common.flag: type, default, help),
so a new option is one field here, read where it is used.

    sched = Schedule(max_iters=600, learning_rate=2e-3, warmup_iters=60)
    sched.lr_at(it)                                  # the learning rate of update it (0-based)
    opt = make_optimizer(model, sched.learning_rate, AdamW(weight_decay=0.1), device="cuda")
"""
import math
from dataclasses import dataclass

import torch

from common import flag


@dataclass(frozen=True)
class Schedule:
    """Linear warmup to the peak (positive from update 0), then cosine down to min_lr_ratio x peak
    at update lr_decay_iters - 1 (None: max_iters - 1) and constant after. A schedule no longer than
    its warmup has no cosine: the floor follows the warmup. A function of the update alone, so a
    resumed run continues the same schedule. Tier fields are None until harness.config resolves them."""
    max_iters: int = flag(None, "number of optimizer updates", tier=True)
    learning_rate: float = flag(None, "peak learning rate", tier=True)
    warmup_iters: int = flag(None, "updates of linear warmup", tier=True)
    lr_decay_iters: int = flag(None, "length of the cosine schedule (set it to stop a run early with the schedule of "
                               "a longer one); default: --max_iters")
    min_lr_ratio: float = flag(0.1, "final learning rate / peak")

    @property
    def decay_iters(self):
        return self.lr_decay_iters or self.max_iters

    def lr_at(self, it):
        """The learning rate of update it (0-based)."""
        peak, warm, total = self.learning_rate, self.warmup_iters, self.decay_iters
        if it < warm:
            return peak * (it + 1) / (warm + 1)
        if total <= warm:  # the decay ended inside the warmup: past it, the floor (as after any decay)
            return peak * self.min_lr_ratio
        progress = min(1.0, (it - warm) / max(1, total - 1 - warm))
        return peak * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def notes(self, resumed):
        """The notes a run prints about its schedule: a resumed run whose updates go past the
        schedule's end (e.g. --max_iters raised, the schedule's length kept) runs those at the floor;
        a run that ends inside its warmup never decays; a schedule whose decay ends within one update
        of the warmup's end has no cosine: the rate drops from the warmup's last to the floor."""
        notes = []
        end = max(self.decay_iters, self.warmup_iters)  # the warmup runs first, however short the schedule
        if resumed and end < self.max_iters:
            why = ("--lr_decay_iters" if self.decay_iters > self.warmup_iters else
                   f"--warmup_iters; --lr_decay_iters {self.decay_iters} ends inside the warmup")
            notes.append(f"note: the learning-rate schedule ends at update {end} ({why}); the updates after it, to "
                         f"--max_iters {self.max_iters}, run at its floor ({self.min_lr_ratio} x --learning_rate); "
                         "give --lr_decay_iters to lengthen it")
        if self.warmup_iters >= self.max_iters:  # a short test run with the tier's warmup: say what it trains at
            notes.append(f"note: --warmup_iters {self.warmup_iters} >= --max_iters {self.max_iters}: the run ends "
                         f"inside the warmup, its last update at {self.lr_at(self.max_iters - 1) / self.learning_rate:.2f}"
                         " x --learning_rate (no decay)")
        elif self.decay_iters <= self.warmup_iters + 1 and not notes:
            top = self.warmup_iters  # the last update before the floor (0-based): the peak, or the warmup's last
            top -= self.decay_iters <= self.warmup_iters
            where = "inside" if top < self.warmup_iters else "one update after"
            then = (f"then runs at its floor ({self.min_lr_ratio} x)" if top + 1 < self.max_iters else
                    "where the run ends (no decay)")
            end = f"--lr_decay_iters {self.decay_iters}" + (" (its default, --max_iters)"
                                                             if self.decay_iters == self.max_iters else "")
            notes.append(f"note: {end} ends {where} the warmup (--warmup_iters "
                         f"{self.warmup_iters}): no cosine; the rate rises to {self.lr_at(top) / self.learning_rate:.2f}"
                         f" x --learning_rate at update {top + 1}, {then}")
        return notes


@dataclass(frozen=True)
class AdamW:
    """AdamW's hyperparameters besides the learning rate (betas 0.9, 0.95; eps 1e-8)."""
    weight_decay: float = flag(0.1, "AdamW weight decay of the weight matrices and embedding")


def no_decay_parameters(model):
    """The parameters exempt from weight decay, by the rule each model declares: a module class
    lists the names of its own parameters that are gains, scales, offsets, temperatures, null
    scores or state-space coefficients in a class attribute ``no_decay`` (RMSNorm: weight; TANGO:
    log_tau, null; GAU/FLASH: gamma, beta; Parcae: A_log, dt_bias, B, C). Every other parameter
    (the weight matrices and the embedding) decays, whatever its rank. Returns a list without
    duplicates (a shared module counts once). TypeError for a no_decay name that is no parameter."""
    out = {}
    for m in model.modules():
        for name in getattr(m, "no_decay", ()):
            p = getattr(m, name)
            if not isinstance(p, torch.nn.Parameter):
                raise TypeError(f"{type(m).__name__}.no_decay names {name!r}, which is not a parameter")
            out[id(p)] = p
    return list(out.values())


def param_groups(model, weight_decay):
    """AdamW parameter groups: [decayed (weight_decay), exempt (0)] (see no_decay_parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    exempt = {id(p) for p in no_decay_parameters(model)}
    return [{"params": [p for p in params if id(p) not in exempt], "weight_decay": weight_decay},
            {"params": [p for p in params if id(p) in exempt], "weight_decay": 0.0}]


def make_optimizer(model, learning_rate, hp=AdamW(), device="cpu"):
    """torch.optim.AdamW (betas 0.9, 0.95) over param_groups(model, hp.weight_decay) at learning_rate;
    fp32 states; on a CUDA device the fused implementation (one kernel for all parameters instead of
    a few per tensor)."""
    fused = {"fused": True} if str(device).startswith("cuda") else {}
    return torch.optim.AdamW(param_groups(model, hp.weight_decay), lr=learning_rate, betas=(0.9, 0.95), eps=1e-8,
                             **fused)
