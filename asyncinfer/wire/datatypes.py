"""The Open Inference Protocol v2 datatypes, and the codec of their ``data`` in numpy.

One table, :data:`SPECS`, says for every v2 datatype name which numpy dtype holds its decoded
values, which little-endian numpy dtype its raw bytes have on the wire, what kind of Python element
a JSON list may carry, and the range of its integers. Nothing here imports torch: the client
decodes and encodes with numpy alone; :mod:`asyncinfer.wire.tensors` maps the same values to torch.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.bfloat16 import from_bits, round_to_bf16, to_bits

__all__ = [
    "DATATYPES",
    "SPECS",
    "DatatypeSpec",
    "bytes_blob",
    "cast_array",
    "datatype_of_dtype",
    "decode_data",
    "encode_data",
    "spec_for",
]

_RAW = (bytes, bytearray, memoryview)
_SEQ = (list, tuple)
#: The Python element types a JSON/msgpack list may carry, by datatype kind.
_ALLOWED: dict[str, frozenset[type]] = {
    "bool": frozenset({bool, int}),
    "int": frozenset({int}),
    "float": frozenset({int, float}),
    "bytes": frozenset({str, bytes}),
}
_RULE = {
    "bool": "elements must be true/false (or 0/1)",
    "int": "elements must be integers (not float, bool or str)",
    "float": "elements must be numbers (int or float, not bool or str)",
    "bytes": "elements must be str or bytes",
}
_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class DatatypeSpec:
    """How one v2 datatype is held in memory and carried on the wire.

    Attributes:
        name: The v2 name, e.g. ``"FP32"``.
        dtype: The (native byte order) numpy dtype that holds decoded values: ``bool`` for BOOL,
            ``float32`` holding exact bfloat16 values for BF16; None for BYTES (an object array).
        wire: The little-endian numpy dtype of the raw bytes (``<u2`` bit patterns for BF16,
            ``u1`` holding 0/1 for BOOL); None for BYTES.
        kind: ``"bool"``, ``"int"``, ``"float"`` or ``"bytes"``: what list elements must be.
        lo: The smallest integer the datatype holds (integer datatypes only).
        hi: The largest integer the datatype holds (integer datatypes only).
    """

    name: str
    dtype: np.dtype[np.generic] | None
    wire: np.dtype[np.generic] | None
    kind: str
    lo: int | None = None
    hi: int | None = None

    @property
    def itemsize(self) -> int:
        """Bytes per element in the raw little-endian encoding (0 for BYTES)."""
        return 0 if self.wire is None else self.wire.itemsize


def _int(name: str, wire: str, bits: int, signed: bool) -> DatatypeSpec:
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return DatatypeSpec(name, np.dtype(wire).newbyteorder("="), np.dtype(wire), "int", lo, hi)


def _float(name: str, wire: str) -> DatatypeSpec:
    return DatatypeSpec(name, np.dtype(wire).newbyteorder("="), np.dtype(wire), "float")


#: Every v2 datatype, keyed by name, in the order the protocol lists them.
SPECS: dict[str, DatatypeSpec] = {
    s.name: s
    for s in (
        DatatypeSpec("BOOL", np.dtype(np.bool_), np.dtype("u1"), "bool"),
        _int("UINT8", "u1", 8, False),
        _int("UINT16", "<u2", 16, False),
        _int("UINT32", "<u4", 32, False),
        _int("UINT64", "<u8", 64, False),
        _int("INT8", "i1", 8, True),
        _int("INT16", "<i2", 16, True),
        _int("INT32", "<i4", 32, True),
        _int("INT64", "<i8", 64, True),
        _float("FP16", "<f2"),
        DatatypeSpec("BF16", np.dtype(np.float32), np.dtype("<u2"), "float"),
        _float("FP32", "<f4"),
        _float("FP64", "<f8"),
        DatatypeSpec("BYTES", None, None, "bytes"),
    )
}

#: The v2 datatype names: BOOL, UINT8 ... UINT64, INT8 ... INT64, FP16, BF16, FP32, FP64, BYTES.
DATATYPES: tuple[str, ...] = tuple(SPECS)

#: The v2 datatype of each numeric numpy dtype (kind and size); BF16 has no numpy dtype.
_BY_NUMPY: dict[tuple[str, int], str] = {
    (s.dtype.kind, s.dtype.itemsize): s.name
    for s in SPECS.values()
    if s.dtype is not None and s.name != "BF16"
}


def spec_for(datatype: object, where: str) -> DatatypeSpec:
    """Return the spec of a v2 datatype name.

    Args:
        datatype: The name to look up, as it came on the wire.
        where: Prefix of the error message, e.g. ``"request abc: input 'x'"``.

    Raises:
        InvalidRequest: ``datatype`` is not one of :data:`DATATYPES`.
    """
    if isinstance(datatype, str) and datatype in SPECS:
        return SPECS[datatype]
    raise InvalidRequest(
        f"{where}: unknown datatype {datatype!r}; accepted datatypes: {', '.join(DATATYPES)}"
    )


def datatype_of_dtype(where: str, dtype: np.dtype[Any]) -> str:
    """Return the v2 datatype name of a numeric numpy dtype (either byte order).

    Raises:
        InvalidRequest: The dtype has no v2 counterpart (complex, float128, datetime ...).
    """
    try:
        return _BY_NUMPY[dtype.kind, dtype.itemsize]
    except KeyError:
        raise _fail(
            where, f"numpy dtype {dtype} has no v2 datatype; accepted: {', '.join(DATATYPES)}"
        ) from None


def cast_array(where: str, spec: DatatypeSpec, value: object) -> npt.NDArray[Any]:
    """Cast numeric values (a numpy array or anything ``np.asarray`` takes) to ``spec``'s dtype.

    Casting follows numpy (as torch's ``.to`` does): floats to integers truncate, integers wrap.
    BF16 rounds to the nearest bfloat16. An array already of the dtype is returned as it is.

    Raises:
        InvalidRequest: The values are not numeric, or ``spec`` is BYTES.
    """
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise _fail(where, f"a {spec.name} value must be numeric, got numpy dtype {arr.dtype}")
    if spec.dtype is None:
        raise _fail(where, f"cannot make BYTES from numeric values (numpy dtype {arr.dtype})")
    if spec.name == "BF16":
        return round_to_bf16(arr)
    return arr.astype(spec.dtype, copy=False)


def _fail(where: str, rule: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {rule}")


def _tname(x: object) -> str:
    return type(x).__name__


def _flatten(where: str, data: list[Any] | tuple[Any, ...]) -> tuple[list[Any], set[type]]:
    """Flatten nested lists; return the flat list and the set of its element types."""
    flat = data if isinstance(data, list) else list(data)
    while True:
        types = set(map(type, flat))
        if not types & {list, tuple}:
            return flat, types
        if not types <= {list, tuple}:
            raise _fail(where, "data mixes nested lists with scalar elements")
        flat = list(chain.from_iterable(flat))


def _count_error(where: str, n: int, shape: tuple[int, ...], what: str = "data") -> InvalidRequest:
    return _fail(where, f"{what} has {n} elements but shape {list(shape)} needs {math.prod(shape)}")


def _kind_error(where: str, spec: DatatypeSpec, flat: list[Any], bad: set[type]) -> InvalidRequest:
    i, x = next((i, x) for i, x in enumerate(flat) if type(x) in bad)
    return _fail(where, f"data element {i} is a {_tname(x)} ({x!r:.40}); {spec.name} {_RULE[spec.kind]}")


def _range_error(where: str, spec: DatatypeSpec, flat: list[Any], lo: int, hi: int) -> InvalidRequest:
    i, x = next(((i, x) for i, x in enumerate(flat) if not lo <= x <= hi), (None, None))
    what = "a value" if i is None else f"data element {i} = {x!r:.40}"
    return _fail(where, f"{what} is out of range for {spec.name} [{lo}, {hi}]")


def _fits_float(x: int) -> bool:
    try:
        float(x)
    except OverflowError:
        return False
    return True


def _float_from_list(where: str, spec: DatatypeSpec, flat: list[Any]) -> npt.NDArray[Any]:
    assert spec.dtype is not None
    try:
        with np.errstate(over="ignore"):
            arr: npt.NDArray[Any] = np.array(
                flat, dtype=np.float64 if spec.name == "BF16" else spec.dtype
            )
    except OverflowError:  # an int beyond the float64 range
        i = next((i for i, x in enumerate(flat) if type(x) is int and not _fits_float(x)), None)
        what = "a value" if i is None else f"data element {i}"
        raise _fail(where, f"{what} is out of range for {spec.name}") from None
    if spec.name == "BF16":
        arr = round_to_bf16(arr)
    if spec.name != "FP64" and arr.size:
        inf = np.isinf(arr)
        if inf.any():
            bad = inf & np.isfinite(np.array(flat, dtype=np.float64))
            if bad.any():
                i = int(np.argmax(bad))
                raise _fail(where, f"data element {i} = {flat[i]!r} is out of range for {spec.name}")
    return arr


def _numeric_from_list(where: str, spec: DatatypeSpec, flat: list[Any], types: set[type]) -> npt.NDArray[Any]:
    bad = types - _ALLOWED[spec.kind]
    if bad:
        raise _kind_error(where, spec, flat, bad)
    assert spec.dtype is not None
    if spec.kind == "float":
        return _float_from_list(where, spec, flat)
    if spec.kind == "bool":
        if int not in types:
            return np.array(flat, dtype=np.bool_)
        lo, hi = 0, 1
    else:
        assert spec.lo is not None and spec.hi is not None
        lo, hi = spec.lo, spec.hi
    try:
        arr = np.array(flat, dtype=np.int64)
    except OverflowError:  # above the INT64 range: only UINT64 may hold it, with no negatives
        try:
            if spec.name != "UINT64" or min(flat) < 0:
                raise OverflowError
            arr = np.array(flat, dtype=np.uint64)
        except OverflowError:
            raise _range_error(where, spec, flat, lo, hi) from None
    if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
        if spec.kind == "bool":
            i = next(i for i, x in enumerate(flat) if x not in (0, 1))
            raise _fail(where, f"data element {i} is {flat[i]!r}; BOOL {_RULE['bool']}")
        raise _range_error(where, spec, flat, lo, hi)
    return arr.astype(spec.dtype, copy=False)


def _numeric_from_raw(where: str, spec: DatatypeSpec, buf: memoryview, count: int) -> npt.NDArray[Any]:
    assert spec.dtype is not None and spec.wire is not None
    need = count * spec.itemsize
    if buf.nbytes != need:
        raise _fail(
            where,
            f"raw data has {buf.nbytes} bytes but {count} {spec.name} elements need {need} "
            f"({spec.itemsize} bytes each)",
        )
    raw = np.frombuffer(buf, dtype=spec.wire, count=count)
    if spec.name == "BF16":
        return from_bits(raw)
    arr = raw.astype(spec.wire.newbyteorder("="))  # a copy: the buffer may be read-only
    if spec.name == "BOOL":
        if arr.size and int(arr.max()) > 1:
            i = int(np.argmax(arr > 1))
            raise _fail(where, f"raw byte {i} is {int(arr[i])}; BOOL raw bytes must be 0 or 1")
        return arr.astype(np.bool_)
    return arr


def bytes_blob(items: list[Any]) -> bytes:
    """BYTES elements (str as UTF-8, or bytes) in the v2 binary form: each a 4-byte little-endian
    length, then its bytes (what :func:`_parse_bytes_blob` reads)."""
    parts = []
    for x in items:
        b = x.encode("utf-8") if isinstance(x, str) else bytes(x)
        parts += [_LEN.pack(len(b)), b]
    return b"".join(parts)


def _parse_bytes_blob(where: str, blob: bytes, count: int) -> list[bytes]:
    out: list[bytes] = []
    pos, n = 0, len(blob)
    while pos < n and len(out) <= count:
        if pos + 4 > n:
            raise _fail(where, f"malformed BYTES binary data: truncated length prefix at byte {pos}")
        (size,) = _LEN.unpack_from(blob, pos)
        pos += 4
        if pos + size > n:
            raise _fail(
                where,
                f"malformed BYTES binary data: element {len(out)} declares {size} bytes "
                f"but only {n - pos} remain",
            )
        out.append(blob[pos : pos + size])
        pos += size
    if len(out) != count:
        got = f"more than {count}" if pos < n else str(len(out))
        raise _fail(where, f"BYTES binary data has {got} elements but the shape needs {count}")
    return out


def _object_array(items: list[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr.reshape(shape)


def decode_data(
    where: str, spec: DatatypeSpec, shape: tuple[int, ...], data: object
) -> tuple[npt.NDArray[Any], bool]:
    """Decode the ``data`` of one input or output into a numpy array of ``shape``.

    Args:
        where: Prefix of error messages, e.g. ``"request abc: input 'x'"``.
        spec: The datatype.
        shape: The validated shape.
        data: A (nested) list of elements, or raw little-endian bytes (BYTES: the v2 blob).

    Returns:
        The values as an array of ``spec.dtype`` (for BYTES an object array of str/bytes), and
        whether the data came in binary form (raw bytes).

    Raises:
        InvalidRequest: The data breaks a rule: count, byte length, element kind or range.
    """
    count = math.prod(shape)
    if isinstance(data, _RAW):
        try:
            buf = memoryview(data).cast("B")
        except TypeError:
            raise _fail(where, "raw data must be a contiguous byte buffer") from None
        if spec.kind == "bytes":
            return _object_array(_parse_bytes_blob(where, bytes(buf), count), shape), True
        return _numeric_from_raw(where, spec, buf, count).reshape(shape), True
    if not isinstance(data, _SEQ):
        raise _fail(where, f"data must be a list or raw bytes, got {_tname(data)}")
    flat, types = _flatten(where, data)
    if len(flat) != count:
        raise _count_error(where, len(flat), shape)
    if spec.kind == "bytes":
        bad = types - _ALLOWED["bytes"]
        if bad:
            raise _kind_error(where, spec, flat, bad)
        return _object_array(flat, shape), False
    return _numeric_from_list(where, spec, flat, types).reshape(shape), False


def _bytes_element(where: str, x: object) -> str | bytes:
    # Elements keep their kind in both encodings (str stays str, bytes stays bytes), so that
    # BYTES round-trips exactly; msgpack carries both, and JSON requests only ever hold str.
    if isinstance(x, str):
        return x
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x)
    raise _fail(where, f"BYTES elements must be str or bytes, got a {_tname(x)} ({x!r:.40})")


def encode_data(where: str, spec: DatatypeSpec, value: object, count: int, binary: bool) -> Any:
    """Encode values of ``count`` elements as the ``data`` of one v2 input or output.

    Args:
        where: Prefix of error messages.
        spec: The datatype.
        value: A numpy array of ``spec.dtype`` (:func:`cast_array` makes one); for BYTES an
            array or list of str/bytes.
        count: The number of elements the shape needs.
        binary: True for raw little-endian bytes, False for a flat list. BYTES is a list of its
            elements either way, each kept as it is (str or bytes).

    Raises:
        InvalidRequest: The value does not hold ``count`` elements, or is of the wrong kind.
    """
    if spec.kind == "bytes":
        items = np.asarray(value, dtype=object).reshape(-1).tolist()
        if len(items) != count:
            raise _fail(where, f"value has {len(items)} elements but the shape needs {count}")
        return [_bytes_element(where, x) for x in items]
    assert spec.dtype is not None and spec.wire is not None
    arr = np.asarray(value).reshape(-1)
    if arr.dtype != spec.dtype:
        raise TypeError(f"{where}: encode_data needs numpy dtype {spec.dtype}, got {arr.dtype}")
    if arr.size != count:
        raise _fail(where, f"value has {arr.size} elements but the shape needs {count}")
    if not binary:
        return arr.tolist()
    return (to_bits(arr) if spec.name == "BF16" else arr).astype(spec.wire, copy=False).tobytes()
