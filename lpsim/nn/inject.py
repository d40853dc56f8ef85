"""Injection of quantisers into an existing model, without editing its code.

    config = {
        "conv1": None,                      # keep the first convolution in full precision
        "fc": None,                         # and the last linear layer
        nn.Conv2d: LayerQuantization(weight=e5m2, output=e5m2, error=e5m2),
        "layer4.*": LayerQuantization(output=(e4m3, "nearest")),
        lambda name, m: isinstance(m, nn.BatchNorm2d): LayerQuantization(output=bf16),
        "default": LayerQuantization(output=bf16, error=bf16),
    }
    lpsim.nn.inject(model, config)
    print(lpsim.nn.report(model))
    lpsim.nn.remove(model)                  # back to the original model exactly

Selectors are module types (subclasses match), glob patterns on qualified module names
("features.*", "classifier.2"), callables (name, module) -> bool, or tuples of these (any
matches). For every module of the model (the model itself excluded) the first matching entry, in
the mapping's order, decides; its value is a LayerQuantization, or None to leave the module as it
is. The entry keyed "default" applies to leaf modules (modules without children) that no other
entry matched.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from lpsim.nn.quantizer import QuantSpec, Spec, as_spec, quantizer
from lpsim.rounding import Rounding

__all__ = ["LayerQuantization", "inject", "remove", "report", "DEFAULT"]

DEFAULT = "default"
_STATE = "_lpsim_injection"  # attribute holding what inject() did to a module


@dataclass(frozen=True)
class LayerQuantization:
    """What to quantise in one layer. Each field is None (not quantised), a format, or a
    (format, rounding) pair; bare formats use ``rounding``.

    Args:
        weight: the module's own parameters whose names end in "weight" (weight, in_proj_weight,
            ...), fake-quantised in every forward pass by a parametrisation (straight-through
            gradient).
        bias: the module's own parameters whose names end in "bias", likewise.
        input: the floating-point tensors passed to forward (positional and keyword), forward only.
        output: the floating-point tensors forward returns (nested tuples, lists and dicts too).
        error: the gradient flowing back into those outputs (the layer's error), in backward.
        rounding: the rule for fields given as bare formats.
    """

    weight: Spec = None
    bias: Spec = None
    input: Spec = None
    output: Spec = None
    error: Spec = None
    rounding: Rounding | str = field(default="stochastic")

    def spec(self, name: str) -> QuantSpec | None:
        return as_spec(getattr(self, name), self.rounding, name)

    def __post_init__(self) -> None:
        Rounding.parse(self.rounding)
        for f in ("weight", "bias", "input", "output", "error"):
            self.spec(f)  # raises TypeError for malformed specs


class _FakeQuantize(nn.Module):
    """Parametrisation: the parameter as seen by forward is its quantised value."""

    def __init__(self, spec: QuantSpec):
        super().__init__()
        self.spec = spec

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return self.spec(value)

    def extra_repr(self) -> str:
        return str(self.spec)


def _matches(selector, name: str, module: nn.Module) -> bool:
    if isinstance(selector, tuple):
        return any(_matches(s, name, module) for s in selector)
    if isinstance(selector, type):
        return isinstance(module, selector)
    if isinstance(selector, str):
        return fnmatch.fnmatchcase(name, selector)
    if callable(selector):
        return bool(selector(name, module))
    raise TypeError(
        "config keys must be module types, name patterns, callables (name, module) -> bool, or "
        f"tuples of these; got {selector!r}"
    )


def _choose(config, name: str, module: nn.Module):
    """The config value of the first entry matching the module, and whether any matched."""
    for selector, settings in config.items():
        if selector == DEFAULT:
            continue
        if _matches(selector, name, module):
            return settings, True
    if DEFAULT in config and not any(True for _ in module.children()):
        return config[DEFAULT], True
    return None, False


def _map_tensors(value, fn):
    """value with fn applied to every floating-point tensor inside tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # named tuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _parameter_names(module: nn.Module, suffix: str) -> list[str]:
    return [n for n, _ in module.named_parameters(recurse=False) if n.endswith(suffix)]


def _inject_module(name: str, module: nn.Module, settings: LayerQuantization) -> dict:
    done = {"type": type(module).__name__, "weight": [], "bias": [], "input": None, "output": None,
            "error": None, "hooks": []}
    for kind in ("weight", "bias"):
        spec = settings.spec(kind)
        if spec is None:
            continue
        for pname in _parameter_names(module, kind):
            parametrize.register_parametrization(module, pname, _FakeQuantize(spec))
            done[kind].append((pname, spec))
    input_spec = settings.spec("input")
    if input_spec is not None:
        def quantize_inputs(mod, args, kwargs):
            return _map_tensors(args, input_spec), _map_tensors(kwargs, input_spec)

        done["hooks"].append(module.register_forward_pre_hook(quantize_inputs, with_kwargs=True))
        done["input"] = input_spec
    output_spec, error_spec = settings.spec("output"), settings.spec("error")
    if output_spec is not None or error_spec is not None:
        apply = quantizer(output_spec, error_spec)

        def quantize_outputs(mod, args, output):
            return _map_tensors(output, apply)

        done["hooks"].append(module.register_forward_hook(quantize_outputs))
        done["output"], done["error"] = output_spec, error_spec
    return done


def _guard_hooks_under_compile() -> None:
    """Make torch.compile guard on module hooks. By default dynamo skips those guards, so a graph
    compiled for a module class without hooks is reused for an injected module of the same class,
    and its quantisers silently vanish from the compiled model. With the guards, adding or removing
    hooks recompiles. Graphs compiled before the guards were on carry none, so the first time this
    clears dynamo's caches (models compiled earlier recompile on their next call)."""
    import torch._dynamo  # noqa: PLC0415 - 2 s to import: only when injecting

    if torch._dynamo.config.skip_nnmodule_hook_guards:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.reset()


def inject(model: nn.Module, config, *, verbose: bool = False) -> nn.Module:
    """Insert quantisers into ``model`` in place, as ``config`` says (see the module docstring),
    and return it. Injecting again into an injected model first removes the earlier injection.

    Also sets ``torch._dynamo.config.skip_nnmodule_hook_guards = False`` for the process (and, the
    first time, clears dynamo's caches), so that torch.compile never reuses a graph compiled
    without the injected hooks: with dynamo's default, a compiled float32 model of the same class
    would lend its graph to the injected one, silently without quantisers.

    Args:
        model: any nn.Module (nested containers, ModuleDict, custom modules).
        config: a mapping (in priority order) from selectors to LayerQuantization or None.
        verbose: print the report table.

    Raises:
        TypeError: a selector or a setting is malformed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not hasattr(config, "items"):
        raise TypeError(f"config must be a mapping from selectors to settings, got {type(config).__name__}")
    for settings in config.values():
        if settings is not None and not isinstance(settings, LayerQuantization):
            raise TypeError(f"config values must be LayerQuantization or None, got {settings!r}")
    _guard_hooks_under_compile()
    remove(model)
    for name, module in list(model.named_modules()):
        if module is model:
            continue
        settings, matched = _choose(config, name, module)
        if matched and settings is not None:
            setattr(module, _STATE, _inject_module(name, module, settings))
    if verbose:
        print(report(model))
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo inject(): remove every hook and parametrisation it added, restoring the original
    parameters (the same Parameter objects). Returns the model."""
    for module in model.modules():
        done = getattr(module, _STATE, None)
        if done is None:
            continue
        for handle in done["hooks"]:
            handle.remove()
        for pname, _ in done["weight"] + done["bias"]:
            parametrize.remove_parametrizations(module, pname, leave_parametrized=False)
        delattr(module, _STATE)
    return model


def injected(model: nn.Module) -> list[tuple[str, nn.Module, dict]]:
    """(name, module, what was injected) for every injected module, in model order."""
    return [(n, m, getattr(m, _STATE)) for n, m in model.named_modules() if hasattr(m, _STATE)]


def report(model: nn.Module) -> str:
    """A table of the quantisers inject() placed in model: one row per module."""
    def cell(entries) -> str:
        if not entries:
            return "-"
        if isinstance(entries, list):
            specs = {str(s) for _, s in entries}
            return ", ".join(sorted(specs))
        return str(entries)

    rows = [("module", "type", "weight", "bias", "input", "output", "error")]
    for name, module, done in injected(model):
        rows.append((name, done["type"], cell(done["weight"]), cell(done["bias"]),
                     cell(done["input"]), cell(done["output"]), cell(done["error"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"{len(rows) - 1} modules quantised")
    return "\n".join(lines)

