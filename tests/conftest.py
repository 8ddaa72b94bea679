"""Tests in this folder import the project's modules from the repository root; fixtures they share."""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data as data_mod  # noqa: E402


@pytest.fixture
def one_thread():
    """Run the test on one intra-op thread, then restore the count. The tensors here are tiny:
    more threads only add contention on a shared CPU (up to 100x slower). A module opts in with
    pytestmark = pytest.mark.usefixtures("one_thread")."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def f64():
    """Build and run the test in float64 (torch's default dtype), then restore float32."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def _write_mdm(root, n_train, n_extrapolate, n_eval=60):
    """A small dataset in the official DeepMind Mathematics layout under root (a pathlib.Path):
    "What is a + b?" / answer lines, n_train problems in each train-* folder, n_eval in dev and
    n_eval + 25 in interpolate (the test split: other lengths give other evaluation windows, so
    test NLL on dev's windows shows); returns root."""
    rng = np.random.default_rng(0)
    for folder, n in [("train-easy", n_train), ("train-medium", n_train), ("train-hard", n_train), ("dev", n_eval),
                      ("interpolate", n_eval + 25), ("extrapolate", n_extrapolate)]:
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
    root = tmp_path_factory.mktemp("data")
    data_mod.prepare("dmmath", str(mdm), str(root))
    return root
