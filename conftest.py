"""Shared test set-up: the GPT-2 vocabulary of the BPE tests.

The BPE tests read the vocabulary from GPT2_BPE_FILE (default ../shared/data/gpt2.tiktoken next to
this repository); nothing downloads at test time, so where that file is missing they skip, with
the reason, through the session fixture gpt2_bpe.
"""
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BPE = os.environ.get("GPT2_BPE_FILE") or os.path.join(HERE, "..", "shared", "data", "gpt2.tiktoken")


def bpe_missing(path=BPE):
    """None when the GPT-2 BPE file exists, else the reason the BPE tests skip."""
    if os.path.isfile(path):
        return None
    return (f"GPT2_BPE_FILE={path} does not exist; the GPT-2 BPE tests need it "
            "(tests never download the vocabulary)")


@pytest.fixture(scope="session")
def gpt2_bpe():
    """The GPT-2 BPE file's path; skips the test (and any fixture built on it) when it is missing."""
    reason = bpe_missing()
    if reason:
        pytest.skip(reason)
    return BPE


@pytest.fixture
def one_thread():
    """Tiny tensors and in-process runs use one thread, like the subprocesses (OMP_NUM_THREADS=1):
    on a shared 2-core machine intra-op threads make them 10-100x slower. Use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _write_mdm(root, n_train, n_extrapolate, n_eval=60):
    """A small dataset in the official DeepMind Mathematics layout under root (a pathlib.Path):
    "What is a + b?" / answer lines, n_train problems in each train-* folder; returns root."""
    import numpy as np
    rng = np.random.default_rng(0)
    for folder, n in [("train-easy", n_train), ("train-medium", n_train), ("train-hard", n_train), ("dev", n_eval),
                      ("interpolate", n_eval), ("extrapolate", n_extrapolate)]:
        (root / folder).mkdir()
        lines = []
        for a, b, op in zip(rng.integers(0, 50, n), rng.integers(0, 50, n), rng.integers(0, 2, n)):
            lines += [f"What is {a} {'+-'[op]} {b}?", str(a + b if op == 0 else a - b)]
        (root / folder / "arith.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def mdm(request, tmp_path_factory):
    """A small dataset in the official DeepMind Mathematics layout ("What is a + b?" / answer, at
    most 16 characters a question), written once per test module; its size is the module's
    MDM_SIZE = (problems per train-* folder, extrapolate problems), default (300, 60)."""
    n_train, n_extrapolate = getattr(request.module, "MDM_SIZE", (300, 60))
    return _write_mdm(tmp_path_factory.mktemp("mdm"), n_train, n_extrapolate)


@pytest.fixture(scope="module")
def data_root(mdm, tmp_path_factory):
    """mdm prepared once (data.prepare("dmmath", ...)); the module's runs share this data_root."""
    import data
    root = tmp_path_factory.mktemp("data")
    data.prepare("dmmath", str(mdm), str(root))
    return root
