"""The committed golden data (tests/golden/nano) are current: the checkpoint generator still produces the
fingerprinted checkpoint, and the reference still reproduces the stored tensors bit for bit."""
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "tests", "golden", "nano")
GEN = os.path.join(ROOT, "reference", "make_checkpoint.py")

sys.path.insert(0, os.path.join(ROOT, "reference"))
from k3ref.loader import Checkpoint  # noqa: E402
from k3ref.model import Model  # noqa: E402


def test_committed_golden_reproduces(tmp_path):
    meta = json.load(open(os.path.join(GOLDEN, "golden.json")))
    d = str(tmp_path / "nano")
    subprocess.run([sys.executable, GEN, "--config", "nano", "--out", d, "--seed", "1"], check=True,
                   stdout=subprocess.DEVNULL)
    ck = Checkpoint(d)
    assert ck.fingerprint() == meta["checkpoint"]["sha256"], "checkpoint generator output changed: regenerate golden"
    stored = load_file(os.path.join(GOLDEN, meta["tensor_file"]))
    m = Model(ck)
    for case in meta["cases"]:
        if case["name"] not in ("short", "medium"):
            continue
        cap = {}
        m.prefill(case["tokens"], m.new_state(), cap)
        for name in case["tensors"]:
            got = cap[name[len(case["name"]) + 1:]]
            want = stored[name]
            assert torch.equal(got.to(want.dtype), want), name
