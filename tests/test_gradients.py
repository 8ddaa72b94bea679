"""Every trainable parameter of every registered model gets a gradient, at every setting the model
accepts: depth and model flags, the extremes included.

A parameter that no forward uses (LoopFold's predictor and corrector without a stage of two loops,
PLT's gates and cross-loop scales at N = 1) gets no gradient; under torchrun DDP then waits for its
reduction forever ("Expected to have finished reduction in the prior iteration") or the ranks drift
apart. Such a parameter must not be created. One training forward and backward per setting lists
the parameters whose gradient is None (it listed LoopFold's five at f = 1 and PLT's at N = 1).
"""
from dataclasses import replace

import pytest
import torch

import train
from common import ModelConfig, UsageError
from models import model_flags
from models import REGISTRY, build_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DEPTHS = (1, 2, 3, 5)
# values of each model flag besides the default, extremes first; a callable takes the depth
VALUES = {
    "window": [1, 8], "chunk": [1, 8], "gau_s": [64],
    "mu_rec": [1, 5], "mu_bwd": [1, 5], "n_prelude": [0, 2], "n_coda": [0, 2], "n_core": [1, 2],
    "da_stride": [-1, 1, lambda K: K], "da_recent": [0, 1, lambda K: K],
    "n_thoughts": [0, 2], "jacobi": [0, 1], "jacobi_random": [False],
    "lrt_src": [0, lambda K: K - 1], "lrt_tgt": [0, lambda K: K - 1], "lrt_kv": [True], "lrt_subsets": [1, 9],
    "lrt_detach_init": [True],
    "plt_window": [1, 64], "plt_shift": [False],
    "fold": [1, 2, 3, 4], "fold_rank": [1, 8], "fold_layout": ["last"],
}
# flags that only make sense together: every combination, for each model that reads all of them
# (LoopFold's stages come from all three)
JOINT = [[dict(fold=f, fold_layout=lay) for f in (1, 2, 3, 4) for lay in ("first", "last")],
         [dict(plt_shift=s, plt_window=w) for s in (True, False) for w in (1, 64)],
         [dict(n_thoughts=n, jacobi=j, jacobi_random=r) for n in (0, 1, 2) for j in (0, 2) for r in (True, False)]]


def settings(name):
    """The settings tried for `name`: each depth with the defaults, with one read flag changed (or
    tie_unit for GAU/FLASH), and with each JOINT combination."""
    flags = [f for f, users in model_flags().items() if name in users]
    for K in DEPTHS:
        yield dict(depth=K)
        for f in flags:
            for v in VALUES[f]:
                yield dict(depth=K, **{f: v(K) if callable(v) else v})
        if name in ("gau", "flash"):
            yield dict(depth=K, tie_unit=False)
        for kw in (kw for group in JOINT if set(group[0]) <= set(flags) for kw in group):
            yield dict(depth=K, **kw)


def params_without_gradient(cfg):
    """Names of cfg's trainable parameters whose gradient is None after one seeded training forward
    and backward (train.py's draws for micro-batch 0 of update 0)."""
    torch.manual_seed(0)
    model = build_model(cfg).train()
    train.seed_random_draws(model, 1337, 0, 0)
    x = torch.arange(16).view(2, 8) % cfg.vocab_size
    _, loss = model(x, x)
    loss.backward()
    return [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]


BASE = dict(vocab_size=23, block_size=8, n_embd=32, n_head=1, width=32, window=4, chunk=4, gau_s=32,
            n_prelude=1, n_core=1, n_coda=1, plt_window=4)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_parameter_gets_a_gradient_at_every_setting(name):
    base = ModelConfig(model=name, **BASE)
    tried, missing = 0, {}
    for kw in settings(name):
        cfg = replace(base, **kw)
        try:
            build_model(cfg, device="meta")
        except UsageError:  # a setting the model refuses is not one it accepts
            continue
        tried += 1
        none = params_without_gradient(cfg)
        if none:
            missing[str(kw)] = none
    assert tried >= len(DEPTHS) - (name == "tango-3set") * 2
    assert not missing, missing


def test_single_loop_stages_have_no_idle_parameters():
    """LoopFold with one loop per stage (depth 4, f = 1) and PLT at N = 1: the parameters nothing uses are not
    created, so the model is the loop stack (LoopFold) / plain blocks (PLT) with the same names."""
    cfg = ModelConfig(model="loopfold", **{**BASE, "depth": 4, "fold": 1})
    names = {n for n, _ in build_model(cfg).named_parameters()}
    assert names == {n for n, _ in build_model(replace(cfg, model="loopstack")).named_parameters()}
    assert params_without_gradient(cfg) == []
    plt1 = ModelConfig(model="plt", **{**BASE, "depth": 1})
    names = {n for n, _ in build_model(plt1).named_parameters()}
    assert not any("gate" in n or "clp" in n for n in names) and params_without_gradient(plt1) == []
