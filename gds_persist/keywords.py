"""Keywords that 0.1 took and 0.2 moved: a call that still passes one raises a TypeError naming
the new spelling (``docs/USAGE.md``, "Moving from 0.1"), not Python's bare "unexpected keyword"."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
P = ParamSpec("P")
R = TypeVar("R")


def as_settings(*names: str) -> dict[str, str]:
    """I/O tuning keywords that became settings only."""
    return {n: f"{n} is a setting since 0.2: use `with gds_persist.settings.set({n}=...)` "
               "(or call gds_persist.settings.set once, for the whole process)" for n in names}


def in_options(options: str, *names: str) -> dict[str, str]:
    """Rarer keywords that moved into an options object."""
    return {n: f"{n} moved into the options object in 0.2: use "
               f"options=gds_persist.{options}({n}=...)" for n in names}


def refuse_moved(where: str, given: Iterable[str], moved: dict[str, str]) -> None:
    """TypeError naming the new spelling of the first of the keywords ``given`` that ``moved``
    lists (for callables that take ``**options`` and pass them on)."""
    old = sorted(set(given) & moved.keys())
    if old:
        raise TypeError(f"{where}({old[0]}=...): {moved[old[0]]}")


def removed_keywords(moved: dict[str, str]) -> Callable[[F], F]:
    """Decorate a function (or ``__init__``) whose 0.1 keywords ``moved`` (name -> what to use
    instead) are gone: passing one raises a TypeError saying so."""
    def decorate(f: F) -> F:
        where = f.__qualname__.removesuffix(".__init__").rsplit("<locals>.", 1)[-1]

        @functools.wraps(f)
        def checked(*args: Any, **kwargs: Any) -> Any:
            refuse_moved(where, kwargs, moved)
            return f(*args, **kwargs)
        return checked  # type: ignore[return-value]
    return decorate


def same_keywords(model: Callable[P, Any]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Give the decorated ``f(path, **keywords)`` the parameters of ``model`` (for help() and
    type checkers), its own return type kept: one signature for two entry points."""
    def decorate(f: Callable[..., R]) -> Callable[P, R]:
        signature = inspect.signature(model)

        @functools.wraps(f)
        def checked(*args: Any, **kwargs: Any) -> R:
            try:  # an unknown keyword is f's, not model's
                signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{f.__name__}(): {e}") from None
            return f(*args, **kwargs)
        checked.__signature__ = signature.replace(  # type: ignore[attr-defined]
            return_annotation=inspect.signature(f).return_annotation)
        return checked
    return decorate
