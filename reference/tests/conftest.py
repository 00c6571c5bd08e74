import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3ref.fixture import write_checkpoint  # noqa: E402
from k3ref.loader import Checkpoint  # noqa: E402
from k3ref.model import Model  # noqa: E402

torch.set_num_threads(1)  # tiny ops: threading only adds overhead (and spins on a busy machine)


@pytest.fixture(scope="session")
def nano_dir(tmp_path_factory):
    """Random nano-sized checkpoint in the released layout (own fixture, independent of make_checkpoint.py)."""
    return write_checkpoint(str(tmp_path_factory.mktemp("nano")), seed=0, n_shards=3)


@pytest.fixture(scope="session")
def ckpt(nano_dir):
    return Checkpoint(nano_dir)


@pytest.fixture(scope="session")
def model(ckpt):
    return Model(ckpt)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def prompt(n, seed, vocab=1024):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab - 16, (n,), generator=g).tolist()
