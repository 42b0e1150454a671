"""Arrow schemas derived from dataclasses, so a shard's columns follow the dataclass that
`rollart.types` defines instead of a hand-kept copy of it.

Python types map to Arrow as follows (every column nullable, as Arrow fields are by default):

    int -> int64    float -> float64    str -> string    bool -> bool
    X | None -> X   list[X] -> list<X>  dataclass -> struct of its fields
    dict[K, V] -> list<struct<key: K, value: V>>  (how `Trajectory.to_row` writes dicts)

A field that is stored narrower says so in its annotation: `Annotated[int, pa.int32()]`, or the
aliases below (`list[Int32]` for token ids). Annotated is transparent to everything but this.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any

import pyarrow as pa

Int8 = Annotated[int, pa.int8()]
Int32 = Annotated[int, pa.int32()]
Float32 = Annotated[float, pa.float32()]

_SCALARS: dict[Any, pa.DataType] = {
    int: pa.int64(),
    float: pa.float64(),
    str: pa.string(),
    bool: pa.bool_(),
}


def arrow_type(hint: Any) -> pa.DataType:
    """The Arrow type of one (resolved) type hint; TypeError for a type with no mapping."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        explicit = [a for a in args[1:] if isinstance(a, pa.DataType)]
        return explicit[0] if explicit else arrow_type(args[0])
    if origin in (typing.Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        if len(present) != 1:
            raise TypeError(f"only `X | None` unions map to Arrow, got {hint!r}")
        return arrow_type(present[0])
    if origin is list:
        return pa.list_(arrow_type(args[0]))
    if origin is dict:
        return pa.list_(pa.struct([("key", arrow_type(args[0])),
                                   ("value", arrow_type(args[1]))]))
    if dataclasses.is_dataclass(hint):
        return pa.struct(arrow_fields(hint))
    if hint in _SCALARS:
        return _SCALARS[hint]
    raise TypeError(f"no Arrow type for {hint!r}")


def arrow_fields(cls: type) -> list[pa.Field]:
    """One Arrow field per dataclass field of `cls`, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        try:
            out.append(pa.field(f.name, arrow_type(hints[f.name])))
        except TypeError as err:
            raise TypeError(f"{cls.__name__}.{f.name}: {err}") from None
    return out


def arrow_schema(cls: type) -> pa.Schema:
    return pa.schema(arrow_fields(cls))
