"""Shared test set-up: the GPT-2 vocabulary of the BPE tests.

The BPE tests read the vocabulary from GPT2_BPE_FILE (default ../shared/data/gpt2.tiktoken next to
this repository); nothing downloads at test time, so where that file is missing they skip, with
the reason, through the session fixture gpt2_bpe.
"""
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BPE = os.path.abspath(os.environ.get("GPT2_BPE_FILE") or os.path.join(HERE, "..", "shared", "data", "gpt2.tiktoken"))
# absolute for the whole session: tests run train.py from other folders, and the README's test
# command gives a path relative to the repository
os.environ["GPT2_BPE_FILE"] = BPE


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
    """One torch intra-op thread inside the test: the tensors in these tests are tiny, and on a
    shared CPU spinning threads make them many times slower."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def dmmath_sample():
    """The DeepMind Mathematics sample (../shared/data/dmmath beside this repository, train.py's
    default --data_dir); skips the test, with the reason, where a clone has no such folder."""
    from harness import dmmath
    if not os.path.isdir(os.path.join(dmmath.DEFAULT, "train-easy")):
        pytest.skip(f"no DeepMind Mathematics sample at {os.path.normpath(dmmath.DEFAULT)} (train.py's default --data_dir)")
    return dmmath.DEFAULT
