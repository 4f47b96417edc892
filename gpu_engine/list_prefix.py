"""ListPrefix: the first n items of a list that only grows at its end, read in place.

An unfinished RequestOutput's token_ids and logprobs are ListPrefixes of its sequence's own lists (a sequence only
ever appends to them), so that an output costs O(1) at every token instead of an O(n) copy of both lists; at 1,024
tokens x 192 requests those copies (and the garbage collector's walks over them) were most of a decode step's host
time (bench/engine_host_overhead.py). It reads as the list it stands for: len, indexing, slices (lists), iteration,
== with lists, + with lists; copy and pickle give a plain list. It is not a list, though: json.dumps refuses it,
isinstance(x, list) is False, and dataclasses.asdict turns it into a list of copies of its items (TokenLogprobs, not
dicts); call tolist() first.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class ListPrefix(Sequence[T], Generic[T]):
    __slots__ = ("_items", "_n")

    def __init__(self, items: list[T], n: int) -> None:
        """`items[:n]`, as long as `items` is only appended to."""
        self._items = items
        self._n = n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            return self._items[start:stop] if step == 1 else self.tolist()[index]
        i = index + self._n if index < 0 else index
        if not 0 <= i < self._n:
            raise IndexError("list index out of range")
        return self._items[i]

    def __iter__(self) -> Iterator[T]:
        return islice(self._items, self._n)

    def tolist(self) -> list[T]:
        return self._items[: self._n]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ListPrefix):
            other = other.tolist()
        if not isinstance(other, list):
            return NotImplemented
        return len(other) == self._n and self._items[: self._n] == other

    __hash__ = None  # type: ignore[assignment]  # unhashable, as a list is

    def __add__(self, other: list[T] | ListPrefix[T]) -> list[T]:
        return self.tolist() + list(other)

    def __radd__(self, other: list[T]) -> list[T]:
        return list(other) + self.tolist()

    def __repr__(self) -> str:
        return repr(self.tolist())

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (self.tolist(),)
