"""How messages show what users wrote: long lists and long values shortened, never silently cut."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["names", "clip", "int_list"]

#: Items a message lists before it says ``and N more``.
_LIST_LIMIT = 6


def names(items: Iterable[object], limit: int = _LIST_LIMIT) -> str:
    """Join names for a message, abbreviating long lists as ``a, b, c and 97 more``."""
    shown = [str(x) for x in items]
    if len(shown) > limit:
        return ", ".join(shown[:limit]) + f" and {len(shown) - limit} more"
    return ", ".join(shown)


def clip(text: str, limit: int = 120) -> str:
    """``repr(text)``, shortened in the middle when very long."""
    shown = repr(text)
    if len(shown) <= limit:
        return shown
    half = (limit - 5) // 2
    return f"{shown[:half]}[...]{shown[-half:]}"


def int_list(values: Iterable[int]) -> str:
    """Numbers for a message: the first ten, then ``and N more``."""
    return names(values, limit=10)
