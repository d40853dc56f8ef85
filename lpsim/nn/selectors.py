"""Module selectors, shared by lpsim.nn.inject and lpsim.nn.quantize_functions: module types
(subclasses match), glob patterns on qualified module names, callables (name, module) -> bool, or
tuples of these (any matches)."""

from __future__ import annotations

import fnmatch

from torch import nn

__all__ = ["check_selector", "matches", "module_names"]


def check_selector(selector) -> None:
    """Raises TypeError unless ``selector`` is a selector (a module instance is refused with the
    ways to select it)."""
    if isinstance(selector, tuple):
        for s in selector:
            check_selector(s)
    elif isinstance(selector, nn.Module):
        raise TypeError(
            f"config keys select modules by type, name pattern or predicate; got the module "
            f"instance {type(selector).__name__}(...). Use its type ({type(selector).__name__}), "
            "its qualified name, or lambda name, m: m is that_module"
        )
    elif not isinstance(selector, (type, str)) and not callable(selector):
        raise TypeError(
            "config keys must be module types, name patterns, callables (name, module) -> bool, "
            f"or tuples of these; got {selector!r}"
        )


def matches(selector, name: str, module: nn.Module) -> bool:
    """Whether ``selector`` selects the module called ``name``."""
    if isinstance(selector, tuple):
        return any(matches(s, name, module) for s in selector)
    if isinstance(selector, type):
        return isinstance(module, selector)
    if isinstance(selector, str):
        return fnmatch.fnmatchcase(name, selector)
    return bool(selector(name, module))


def module_names(model: nn.Module) -> dict[int, list[str]]:
    """Every qualified name of each module of ``model``, by id: a module registered under several
    names (shared by two parents) has them all, which a selector matches when it matches any of
    them (nn.Module.named_modules names it once, by its first name)."""
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    return names
