"""Hook plumbing shared by lpsim.nn.inject, lpsim.nn.functions and lpsim.compat.qtorch.auto_low:
applying a quantiser to every floating-point tensor of a module's inputs or outputs, making
torch.compile see the hooks, and naming function calls for lpsim.nn.quantize_functions."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
from collections.abc import Callable, Iterator

import torch

# The name under which lpsim.nn.quantize_functions selects the function calls made inside a
# ``named_function`` block (the attention steps of lpsim.nn.functional's multi-head attention).
_FUNCTION_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "lpsim_function_name", default=None
)


# The attribute name of the submodule that the calls made inside a ``submodule_call`` block are
# made for (the out projection of lpsim.nn.functional's multi-head attention: "out_proj", a
# submodule whose forward nn.MultiheadAttention bypasses, passing its weight and bias).
_SUBMODULE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "lpsim_submodule", default=None
)


def submodule_name() -> str | None:
    """The attribute name of the current ``submodule_call`` block, None outside one."""
    return _SUBMODULE.get()


@contextlib.contextmanager
def submodule_call(name: str) -> Iterator[None]:
    """Calls made inside are made for the running module's submodule ``name``, whose forward the
    running module bypasses: lpsim.nn.quantize_functions decides them as if it ran."""
    token = _SUBMODULE.set(name)
    try:
        yield
    finally:
        _SUBMODULE.reset(token)


def function_name() -> str | None:
    """The name of the current ``named_function`` block, None outside one."""
    return _FUNCTION_NAME.get()


@contextlib.contextmanager
def named_function(name: str) -> Iterator[None]:
    """Calls made inside are selected by lpsim.nn.quantize_functions under ``name``."""
    token = _FUNCTION_NAME.set(name)
    try:
        yield
    finally:
        _FUNCTION_NAME.reset(token)


def compiled_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model that ``model`` wraps if it is torch.compile's wrapper (whose modules are named
    "_orig_mod.<name>"), the innermost where compiled wrappers are nested; None otherwise."""
    wrapped = None
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = wrapped = model._orig_mod
    return wrapped


def map_tensors(value, fn: Callable[[torch.Tensor], torch.Tensor]):
    """value with fn applied to every floating-point tensor inside it (see map_placed_tensors)."""
    return map_placed_tensors(value, lambda x, place: fn(x))


def map_placed_tensors(
    value,
    fn: Callable[[torch.Tensor, str], torch.Tensor],
    place=None,
    on_complex: Callable[[torch.Tensor, str], None] | None = None,
):
    """value with ``fn(x, place)`` applied to every floating-point tensor x inside tuples, lists,
    dicts and dataclass instances, each container rebuilt as the type it had (a named tuple, an
    OrderedDict, a dict subclass with attribute access such as HuggingFace's ModelOutput: see
    same_mapping; a dataclass: see same_fields), so that the code reading it still finds its
    fields. A container none of whose tensors fn changed is returned itself.

    ``place`` tells fn where x lies in ``value``: "0" for value itself, "i" for item i of a tuple
    or list, the key for an entry of a dict (see dict_places) and the field's name for a
    dataclass's, the levels below the first joined by "-" ("0-1": item 1 of item 0). Distinct
    places of one value have distinct names.

    ``on_complex(x, place)``, where given, is called for every complex tensor (which fn does not
    take), to refuse it."""
    if isinstance(value, torch.Tensor):
        if on_complex is not None and value.is_complex():
            on_complex(value, place or "0")
        return fn(value, place or "0") if value.is_floating_point() else value
    here = (lambda key: str(key)) if place is None else (lambda key: f"{place}-{key}")
    if isinstance(value, (tuple, list)):
        items = [map_placed_tensors(v, fn, here(i), on_complex) for i, v in enumerate(value)]
        if all(new is old for new, old in zip(items, value)):
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # named tuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        places = dict_places(value)
        items = {
            k: map_placed_tensors(v, fn, here(places[k]), on_complex) for k, v in value.items()
        }
        if all(items[k] is v for k, v in value.items()):
            return value
        return same_mapping(value, items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        old = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        items = {k: map_placed_tensors(v, fn, here(k), on_complex) for k, v in old.items()}
        if all(items[k] is v for k, v in old.items()):
            return value
        return same_fields(value, items)
    return value


def dict_places(mapping: dict) -> dict:
    """The place name of each key of ``mapping``: dict_key_place(key), distinct for distinct str
    keys; a key of another type whose name another key of the mapping has (1 and "1", None and
    "None") gets "%k" and its position in the mapping after it ("1%k0"), which no dict_key_place
    name holds, so that every entry of the mapping has a place of its own."""
    names = {key: dict_key_place(key) for key in mapping}
    counts: dict[str, int] = {}
    for name in names.values():
        counts[name] = counts.get(name, 0) + 1
    return {
        key: name if isinstance(key, str) or counts[name] == 1 else f"{name}%k{position}"
        for position, (key, name) in enumerate(names.items())
    }


def dict_key_place(key) -> str:
    """The place name of a dict's entry: its key as a str, with "%", "." and "-" written "%25",
    "%2E" and "%2D" (a module name, which a place becomes for a DelayedScaler, holds no ".", and
    "-" joins the levels of a place), and "%" for the empty key; so distinct str keys ("a.b" and
    "a_b", "a-1" and item 1 of "a") have distinct places."""
    text = str(key)
    if not text:
        return "%"
    return text.replace("%", "%25").replace(".", "%2E").replace("-", "%2D")


def floating_tensors(value) -> list[torch.Tensor]:
    """The floating-point tensors inside value, in map_placed_tensors' order."""
    found: list[torch.Tensor] = []
    map_tensors(value, lambda x: found.append(x) or x)
    return found


def same_fields(value, items: dict):
    """A copy of the dataclass instance ``value`` with the fields in ``items`` set (also for a
    frozen dataclass; __init__ and __post_init__ are not run again), so that it keeps its class,
    its other fields and attributes."""
    rebuilt = copy.copy(value)
    for k, v in items.items():
        object.__setattr__(rebuilt, k, v)
    return rebuilt


def same_mapping(value: dict, items: dict) -> dict:
    """A mapping of value's type holding ``items`` (value's keys, in its order), so that the code
    reading it still finds its fields (an OrderedDict, a defaultdict, HuggingFace's ModelOutput
    with its attribute access). A dict subclass is copied (copy.copy keeps its class, its
    attributes and a defaultdict's factory) and its items are set through its own __setitem__
    (ModelOutput's also sets the attribute); a subclass that refuses either is made from the items
    by its constructor."""
    if type(value) is dict:
        return items
    try:
        rebuilt = copy.copy(value)
        for k, v in items.items():
            rebuilt[k] = v
    except Exception:  # a mapping that cannot be copied or refuses item assignment
        return type(value)(items)
    return rebuilt


def guard_hooks_under_compile() -> None:
    """Make torch.compile guard on module hooks. By default dynamo skips those guards, so a graph
    compiled for a module class without hooks is reused for an injected module of the same class,
    and its quantisers silently vanish from the compiled model. With the guards, adding or removing
    hooks recompiles. Graphs compiled before the guards were on carry none, so the first time this
    clears dynamo's caches (models compiled earlier recompile on their next call)."""
    import torch._dynamo  # noqa: PLC0415 - 2 s to import: only when injecting

    if torch._dynamo.config.skip_nnmodule_hook_guards:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.reset()
