"""Quantisers for training: differentiable quantisation of activations and errors, modules, and
injection of quantisers into existing models."""
