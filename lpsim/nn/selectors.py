"""Module selectors, shared by lpsim.nn.inject and lpsim.nn.quantize_functions: module types
(subclasses match), glob patterns on qualified module names, callables (name, module) -> bool, or
tuples of these (any matches)."""

from __future__ import annotations

import fnmatch

from torch import nn

__all__ = ["check_selector", "matches", "module_names", "selects", "selector_name"]


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


def selects(selector, names: list[str], module: nn.Module, caller: str) -> bool:
    """Whether ``selector`` selects ``module``, which is called by each of ``names``. An exception
    the selector raises (a predicate that fails on some module) gets a note naming the selector,
    the module and ``caller`` (the function that asked, "inject()")."""
    try:
        return any(matches(selector, name, module) for name in names)
    except Exception as error:
        error.add_note(
            f"{caller}: raised by the selector {selector_name(selector)} on the module "
            f"{names[0]!r} ({type(module).__name__})"
        )
        raise


def selector_name(selector) -> str:
    """How messages name a selector: a type's name, a pattern's repr, a function's name."""
    if isinstance(selector, type):
        return selector.__name__
    if isinstance(selector, tuple):
        return "(" + ", ".join(selector_name(s) for s in selector) + ")"
    if isinstance(selector, str):
        return repr(selector)
    return getattr(selector, "__name__", repr(selector))
