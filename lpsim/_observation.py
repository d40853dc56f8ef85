"""The observer that the quantising call sites report their roundings to.

``current`` is None while nothing observes: then a call site costs one attribute lookup and a
branch, allocates nothing and adds no autograd node. lpsim.diagnostics.recorder.Recorder sets it
while it is attached (and while the step it is at is one it records) to an object with two
methods:

- ``wants(category) -> bool``: whether roundings of ``category`` are observed. Call sites that
  round in place (OptimLP) ask before copying a tensor's value from before the rounding.
- ``observe(owner, category, x, rounded, quantiser, training)``: ``x`` was rounded to
  ``rounded`` by ``quantiser`` (a QuantSpec, a ScalerCall, or any function tensor -> tensor).
  ``owner`` is the module whose tensor it is (lpsim.nn.inject's sites and the Quantizer module)
  or the parameter (OptimLP's sites); ``training`` says whether the module rounded in training
  mode (OptimLP always does).

The call sites and their categories:

- lpsim.nn.inject: "weight" and "bias" (the parametrisations, in forward), "input" (the
  forward pre-hook), "output" (the forward hook) and "error" (the gradient flowing into the
  outputs, in backward);
- lpsim.nn.Quantizer: "output" (forward) and "error" (backward);
- lpsim.optim.OptimLP: "grad", "momentum" (every rounded state tensor), "accumulator" and
  "weight" (the weight rounding that ends a step).

A module's forward that runs while a backward pass is running is a forward recomputed by
activation checkpointing (torch.utils.checkpoint); ``recomputing()`` tells. The call sites report
its roundings as any others; the Recorder does not record them again, and a DelayedScaler refuses
them (lpsim.nn.quantizer.ScalerCall).
"""

from __future__ import annotations

import torch

current = None  # the observer of every rounding, or None

# How many passes that are not part of the run are under way now (lpsim.nn.inject.unobserved_pass:
# Shadow.compare's two, report(example=...)'s): while it is nonzero, a DynamicLossScaler's watches
# record no overflow, so that such a pass cannot make the run's next step skip.
hidden = 0


def recomputing() -> bool:
    """Whether a forward tensor quantised now belongs to a forward recomputed by activation
    checkpointing: whether a backward pass is running (the forward of a checkpointed module runs
    again inside it). Always False while torch.compile traces. Only forward tensors (a module's
    inputs, outputs and parametrised tensors) are asked about: an optimizer stepping in a
    post-accumulate-grad hook also runs inside a backward pass, and is no recomputation."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1
