"""CIFAR10 reproductions of the QPyTorch paper's recipes with lpsim: models, data, recipes,
weight averaging and the trainer (python -m experiments.cifar10.train)."""
