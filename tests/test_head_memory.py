"""The loss in common.LM.head: under bf16 it keeps no float32 copy of all the logits for backward
(chunks of CE_ROWS tokens, widened and recomputed in backward), with the same loss and gradients
as one float32 cross-entropy; float32 and float64 keep the single call, to the bit."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import LM, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Passthrough(nn.Module):
    """A body that returns its input (the head alone is under test)."""

    def forward(self, x, cos, sin, cache=None):
        return x


def saved_bytes(fn, skip):
    """Bytes of the distinct storages autograd saves while fn() runs, besides those of skip."""
    skip_ptrs = {t.untyped_storage().data_ptr() for t in skip}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip_ptrs:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def head_inputs(B=4, T=64, V=1000, d=32):
    torch.manual_seed(0)
    model = LM(ModelConfig(model="untied", vocab_size=V, block_size=T, n_embd=d, n_head=1, depth=1, width=8),
               Passthrough())
    x = torch.randn(B, T, d, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    targets[0, :5] = -1  # not scored
    return model, x, targets


def test_bf16_loss_keeps_no_float32_copy_of_the_logits(monkeypatch):
    """bf16 autocast, 256 tokens in chunks of 100 (the last one partial), V = 1000 (1024 padded):
    the head keeps at most the bf16 logits (256 x 1024 x 2 bytes) and d-wide tensors (the bf16
    copy of E, 1024 x 32, and activations of 256 x 32) for backward, where one float32
    cross-entropy keeps more than 256 x 1024 x 4 bytes; loss and input gradient equal the single
    float32 call's within float32 rounding."""
    monkeypatch.setattr(common, "CE_ROWS", 100)
    model, x, targets = head_inputs()
    params = list(model.parameters()) + [model.vocab_bias]
    N, Vp = targets.numel(), model.wte.weight.shape[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept, (_, loss) = saved_bytes(lambda: model.head(x, targets), params)
        padded = F.linear(model.norm_f(x), model.wte.weight, model.vocab_bias)
        whole, want = saved_bytes(lambda: F.cross_entropy(padded.float().view(N, Vp), targets.view(-1),
                                                          ignore_index=-1) * 1.0, params + [padded])
    assert padded.dtype == torch.bfloat16
    assert kept <= N * Vp * 2 + Vp * 32 * 2 + 4 * N * 32 * 4 < N * Vp * 4 < whole, (kept, whole)
    assert abs(loss.item() - want.item()) < 1e-6 * want.item()
    (gx,) = torch.autograd.grad(loss, x)
    (gw,) = torch.autograd.grad(want, x)
    assert (gx - gw).abs().max() < 1e-6 * gw.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float_loss_is_the_single_cross_entropy_to_the_bit(monkeypatch, dtype):
    """float32/float64 logits: the loss is one F.cross_entropy over all tokens (CE_ROWS does not
    apply), bit for bit: a CPU run's NLL does not depend on the chunking of bf16 losses."""
    monkeypatch.setattr(common, "CE_ROWS", 32)
    model, x, targets = head_inputs()
    model, x = model.to(dtype), x.detach().to(dtype)
    _, loss = model.head(x, targets)
    padded = F.linear(model.norm_f(x), model.wte.weight, model.vocab_bias)
    want = F.cross_entropy(padded.view(-1, padded.size(-1)), targets.view(-1), ignore_index=-1, reduction="sum")
    assert torch.equal(loss, want / (targets != -1).sum())


def test_chunked_bf16_loss_traces_in_one_graph(monkeypatch):
    """The head's chunked bf16 loss (a checkpoint per chunk) compiles with fullgraph=True (no graph
    break) and gives the eager loss."""
    monkeypatch.setattr(common, "CE_ROWS", 100)
    model, x, targets = head_inputs()
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model.head(x, targets)[1]
        compiled = torch.compile(LM.head.region, backend="aot_eager", fullgraph=True)(model, x, targets)[1]
    torch._dynamo.reset()
    assert abs(compiled.item() - eager.item()) < 1e-6 * eager.item()
