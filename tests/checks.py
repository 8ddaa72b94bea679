"""Checks shared by the per-family test files (imported as `checks`; pytest puts tests/ on sys.path)."""
import torch

from dataclasses import replace

from common import UsageError, rope_cos_sin
from models import REGISTRY, Choice, build_model

# Tests choose models by what the registry says of them, not by lists of names (a new model joins
# every choice its row qualifies it for).
# The headline grids (results/chargrid, results/cpugrid*): the TANGO paper's section 4.1 models and Parcae.
GRID_MODELS = tuple(name for name, spec in REGISTRY.items() if spec.paper_grid) + ("parcae",)


def one_per_file():
    """One model per model file: the first registered of each (tango, loop, parcae, ...)."""
    picks = {}
    for name, spec in REGISTRY.items():
        picks.setdefault(spec.build.__module__, name)
    return list(picks.values())


def readers(flag):
    """The registered models whose registry row declares the model flag, in registry order."""
    return [name for name, spec in REGISTRY.items() if flag in spec.flags]


def first_readers(*flags):
    """One model per behaviour: the first registered model reading each flag, and the first reading
    none of them (registry order, without repeats)."""
    picks = [readers(f)[0] for f in flags]
    picks.append(next(name for name, spec in REGISTRY.items() if not set(flags) & set(spec.flags)))
    return list(dict.fromkeys(picks))


# parallel loops (parallel_loops.py): one block per loop, so K = 3 loops are 3 block applications like the other
# models (6 applications of random 0.1-std blocks wash the input out: the logits no longer depend on it)
ONE_BLOCK_PER_LOOP = {name: dict(n_core=1) for name, spec in REGISTRY.items()
                      if spec.build.__module__ == "parallel_loops"}


def flag_values(cfg):
    """(flag, value) pairs of cfg.model's model flags (its ModelSpec.flags) beside cfg's own: every
    value of a Choice; for a Range its lowest two values, one above cfg's, and half and twice cfg's,
    those the model builds at with cfg's other values (a value it refuses is no computation)."""
    out = []
    for flag, allowed in REGISTRY[cfg.model].flags.items():
        base = getattr(cfg, flag)
        values = allowed.values if isinstance(allowed, Choice) else \
            sorted({allowed.lo, allowed.lo + 1, base + 1, base // 2, 2 * base} - {base})
        for v in values:
            try:
                build_model(replace(cfg, **{flag: v}), device="meta")
            except UsageError:
                continue
            out.append((flag, v))
    return out


def assert_causal(model, idx, t, vocab=61):
    """Changing tokens t.. of idx (B, T) leaves logits[:, :t] bit-identical and moves logits[:, t:]."""
    other = idx.clone()
    other[:, t:] = (other[:, t:] + 1) % vocab
    with torch.no_grad():
        a, b = model(idx)[0], model(other)[0]
    assert torch.equal(a[:, :t], b[:, :t]) and (a[:, t:] - b[:, t:]).abs().max() > 1e-4


def assert_finite_differences(f, params, at=None, rtol=1e-5):
    """Each float64 parameter's gradient (p.grad, left by f().backward()) at one entry (the flat index
    `at`, default the entry of largest gradient) equals f's central finite difference there (step 1e-6)."""
    eps = 1e-6
    for p in params:
        i = int(p.grad.abs().argmax()) if at is None else at
        with torch.no_grad():
            p.view(-1)[i] += eps
            up = f()
            p.view(-1)[i] -= 2 * eps
            down = f()
            p.view(-1)[i] += eps
        torch.testing.assert_close((up - down) / (2 * eps), p.grad.view(-1)[i], rtol=rtol, atol=1e-10)


def tokens(B=2, T=12, seed=1, vocab=61):
    """Random token ids (B, T) in [0, vocab), from their own seeded generator."""
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def embed(m, idx):
    """A body's inputs for idx (B, T): the embeddings and the RoPE tables of positions 0..T-1 in m's dtype."""
    cos, sin = rope_cos_sin(torch.arange(idx.shape[1]), dtype=m.wte.weight.dtype)
    return m.wte(idx), cos, sin


def idle_check(argv):
    """train.py's flag checks (harness.config.check_flags) of argv at the tiny tier on the CPU: the
    resolved args, or the UsageError's message."""
    import train
    from common import UsageError
    from harness.config import check_flags
    argv = [*argv, "--size", "tiny", "--device", "cpu"]
    try:
        return check_flags(train.parse_args(argv), train.given_flags(argv))
    except UsageError as e:
        return str(e)
