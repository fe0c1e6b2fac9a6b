"""A small generic name -> object registry, one instance per extension point.

Chips, slices, collective algorithms and models each keep one. Lookups of unknown names raise a
`TpusimError` that suggests the nearest known names (`topologies.validate.one_of`); registering
a name twice is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from topologies.errors import TpusimError
from topologies.validate import one_of, short_repr

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps lower-case names to objects, in registration order."""

    def __init__(self, kind: str, unknown: Callable[[str], str | TpusimError] | None = None, *,
                 listing: str = "") -> None:
        self.kind = kind
        self.listing = listing  # where every name is listed, for the unknown-name message
        self._items: dict[str, T] = {}
        # What to say about an unknown name (a long registry suggests the nearest names
        # instead of listing them all); default: the whole list.
        self._unknown = unknown

    def add(self, name: str, item: T) -> T:
        key = name.lower()
        if key in self._items:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._items[key] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`."""

        def deco(item: T) -> T:
            return self.add(name, item)

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name.lower()]
        except (KeyError, AttributeError, TypeError):
            if self._unknown is not None and isinstance(name, str):
                said = self._unknown(name)  # the message, or the error naming settings
                raise (said if isinstance(said, TpusimError) else TpusimError(said)) from None
            raise TpusimError(
                f"unknown {self.kind} {short_repr(name)}; "
                f"{one_of(name, self._items, listing=self.listing)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._items

    def names(self) -> list[str]:
        return list(self._items)

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(self._items.items())

    def __len__(self) -> int:
        return len(self._items)
