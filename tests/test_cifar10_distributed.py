"""The CIFAR10 trainer under torchrun: two CPU processes with DistributedDataParallel over gloo
train a stochastic-rounding recipe, and their weights stay bit-identical."""

import os
import pathlib
import subprocess
import sys

import torch
from test_cifar10 import read_log, run_args, write_tiny_cifar10

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_two_gloo_processes_keep_identical_weights(tmp_path):
    write_tiny_cifar10(tmp_path / "data")
    out = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "experiments.cifar10.train",
        *run_args(tmp_path / "data", out, "block8", "--epochs", "2", "--device", "cpu"),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "(2 processes on cpu)" in done.stdout
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["config"]["world_size"] == 2
    digests = state["rank_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert [row["epoch"] for row in read_log(out)] == ["1", "2"]
