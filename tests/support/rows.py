"""Requests of the test models, built in one place."""

from __future__ import annotations

import numpy as np


def identity_row(value: float) -> dict[str, np.ndarray]:
    """A request of the ``identity`` model (and of those that read its input): one row of one
    FP32 value, named ``input``."""
    return {"input": np.array([[float(value)]], np.float32)}
