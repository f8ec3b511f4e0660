"""BF16 in numpy, which has no bfloat16 dtype: values are held as float32 arrays whose values
are exact bfloat16 values (the upper 16 bits of each float32; the lower 16 are zero).

Widening BF16 to float32 is exact, so this form keeps every bit, NaN payloads included; the wire
form is the upper 16 bits. Rounding follows torch: a float64 is first rounded to float32, then to
the nearest bfloat16 (ties to even).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["from_bits", "round_to_bf16", "to_bits"]

_HIGH = np.uint32(0xFFFF0000)
_QUIET = np.uint32(0x00400000)
_MANTISSA = np.uint32(0x007F0000)


def from_bits(bits: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """BF16 bit patterns (any unsigned 16-bit array, either byte order) as float32 values."""
    wide = bits.astype(np.uint32)
    wide <<= np.uint32(16)
    return wide.view(np.float32)


def to_bits(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """The BF16 bit patterns of float32 values that are exact bfloat16 values."""
    return (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def round_to_bf16(values: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """Round real values to the nearest bfloat16 (ties to even), as float32.

    Exact bfloat16 values come back unchanged, bit for bit (NaN payloads included). Values
    beyond the float32 or bfloat16 range become infinities of their sign; other NaNs keep their
    sign and upper payload bits, and stay NaNs.
    """
    with np.errstate(over="ignore"):  # beyond float32: infinity; NaNs' bits wrap, then are replaced
        bits = np.asarray(values, dtype=np.float32).view(np.uint32)
        odd = (bits >> np.uint32(16)) & np.uint32(1)
        rounded = (bits + (np.uint32(0x7FFF) + odd)) & _HIGH
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():  # truncate; set the quiet bit where truncating would leave an infinity
        high = bits & _HIGH
        rounded = np.where(nan, high | np.where(high & _MANTISSA, np.uint32(0), _QUIET), rounded)
    return rounded.view(np.float32)
