"""The CIFAR10 trainer under torchrun: two CPU processes with DistributedDataParallel over gloo
train a stochastic-rounding recipe, and their weights stay bit-identical."""

import torch
from support import run_two_gloo_processes
from test_cifar10 import read_log, run_args, write_tiny_cifar10


def test_two_gloo_processes_keep_identical_weights(tmp_path):
    write_tiny_cifar10(tmp_path / "data")
    out = tmp_path / "run"
    args = run_args(tmp_path / "data", out, "block8", "--epochs", "2", "--device", "cpu")
    stdout = run_two_gloo_processes("experiments.cifar10.train", args)
    assert "(2 processes on cpu)" in stdout
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["config"]["world_size"] == 2
    digests = state["rank_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert [row["epoch"] for row in read_log(out)] == ["1", "2"]
