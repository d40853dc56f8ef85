"""Optimizers for low-precision training."""
