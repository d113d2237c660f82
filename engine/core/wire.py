"""What crosses between an API process and the engine core: msgpack messages whose numpy arrays travel as
their raw bytes (dtype, shape, buffer; a frame's audio is its 1920 float32 samples as bytes), and whose
typed values (frames, turn stats, scheduler stats, sampling settings) and errors are named explicitly.
Nothing is pickled: a message decodes to the types below or is refused.

A message is a list: ``[kind, stream_id_or_call_id, payload...]`` (:mod:`engine.core.process` lists the
kinds).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgpack
import numpy as np

from engine import errors
from engine.core.local import EngineSnapshot
from engine.kv.parking import ParkingStats
from engine.kv.prefix import PrefixStats
from engine.model.sampling import SamplingParams
from engine.serving.scheduler import SchedulerStats
from engine.serving.stream import FinishReason, Frame, TurnStats

ARRAY, RECORD, ENUM, ERROR = 1, 2, 3, 4

RECORDS: dict[str, type] = {c.__name__: c for c in (Frame, TurnStats, SchedulerStats, PrefixStats, ParkingStats,
                                                    SamplingParams, EngineSnapshot)}
ENUMS: dict[str, type[enum.Enum]] = {"FinishReason": FinishReason}
# errors that cross by name: the engine's own (each route maps them to the catalogue), and Python's
ERRORS: dict[str, type[Exception]] = {
    **{name: cls for name, cls in vars(errors).items() if isinstance(cls, type) and issubclass(cls, Exception)},
    "ValueError": ValueError, "TypeError": TypeError, "TimeoutError": TimeoutError}


class WireError(Exception):
    """A message that is not one of ours."""


def _enum(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return msgpack.ExtType(ENUM, msgpack.packb([type(value).__name__, value.value]))
    return value


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return msgpack.ExtType(ARRAY, msgpack.packb([arr.dtype.str, list(arr.shape), arr.tobytes()]))
    if isinstance(obj, np.generic):
        return _default(np.asarray(obj))
    if isinstance(obj, enum.Enum):
        return _enum(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and type(obj).__name__ in RECORDS:
        # a str-valued enum is packed as its str before ``default`` sees it: name it here
        fields = {f.name: _enum(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return msgpack.ExtType(RECORD, msgpack.packb([type(obj).__name__, fields], default=_default))
    if isinstance(obj, BaseException):
        name = type(obj).__name__ if type(obj).__name__ in ERRORS else "EngineError"
        return msgpack.ExtType(ERROR, msgpack.packb([name, str(obj)]))
    raise TypeError(f"cannot send {type(obj).__name__} to the engine core")


def _ext(code: int, data: bytes) -> Any:
    if code == ARRAY:
        dtype, shape, raw = msgpack.unpackb(data)
        # a copy: the receiver owns (and may change) what it got, apart from the message's buffer
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    if code == ENUM:
        name, value = msgpack.unpackb(data)
        return ENUMS[name](value)
    if code == RECORD:
        name, fields = msgpack.unpackb(data, ext_hook=_ext)
        if name not in RECORDS:
            raise WireError(f"unknown record {name!r}")
        return RECORDS[name](**fields)
    if code == ERROR:
        name, message = msgpack.unpackb(data)
        return ERRORS.get(name, errors.EngineError)(message)
    raise WireError(f"unknown extension {code}")


def pack(message: list[Any]) -> bytes:
    """One message as bytes."""
    data: bytes = msgpack.packb(message, default=_default, use_bin_type=True)
    return data


def unpack(data: bytes) -> list[Any]:
    """One message from bytes (WireError when it is not a list)."""
    message = msgpack.unpackb(data, ext_hook=_ext, raw=False, strict_map_key=False)
    if not isinstance(message, list) or not message:
        raise WireError("a message is a non-empty list")
    return message
