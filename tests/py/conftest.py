"""Shared fixtures for the end-to-end tests: the kestrel binary and generated checkpoints."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def kestrel_bin():
    path = pathlib.Path(os.environ.get("KESTREL_BIN", ROOT / "build" / "src" / "cli" / "kestrel"))
    if not path.exists():
        raise RuntimeError(f"kestrel binary not found at {path}: build first (scripts/build.sh)")
    return str(path)


def make_checkpoint(out, config="nano", *extra):
    subprocess.run([sys.executable, str(ROOT / "reference" / "make_checkpoint.py"), "--config", config,
                    "--out", str(out), "--seed", "1", *extra], check=True)
    return out


@pytest.fixture(scope="session")
def nano_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("nano") / "ckpt")


@pytest.fixture
def nano_copy(nano_dir, tmp_path):
    """A private copy of the nano checkpoint that a test may corrupt."""
    dst = tmp_path / "ckpt"
    shutil.copytree(nano_dir, dst)
    return dst


def run_kestrel(kestrel_bin, *args, timeout=120, input_text=None):
    return subprocess.run([kestrel_bin, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          input=input_text)
