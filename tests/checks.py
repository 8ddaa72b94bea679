"""Checks shared by the per-family test files (imported as `checks`; pytest puts tests/ on sys.path)."""
import torch


def assert_causal(model, idx, t, vocab=61):
    """Changing tokens t.. of idx (B, T) leaves logits[:, :t] bit-identical and moves logits[:, t:]."""
    other = idx.clone()
    other[:, t:] = (other[:, t:] + 1) % vocab
    with torch.no_grad():
        a, b = model(idx)[0], model(other)[0]
    assert torch.equal(a[:, :t], b[:, :t]) and (a[:, t:] - b[:, t:]).abs().max() > 1e-4
