"""Tests in this folder import the project's modules from the repository root; fixtures they share."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def one_thread():
    """Run the test on one intra-op thread, then restore the count. The tensors here are tiny:
    more threads only add contention on a shared CPU (up to 100x slower). A module opts in with
    pytestmark = pytest.mark.usefixtures("one_thread")."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
