"""Model registry: built-ins, import-path factories, model files and Triton model repositories.

What a model author needs comes from here: ``from asyncinfer.models import Model, InputSpec,
OutputSpec, StreamStep, StreamRows, Batch, ModelOptions, Request, SequenceBatching,
SequenceState, InvalidRequest, TransientError`` (the base class, its declared inputs and outputs,
a decoupled model's steps and rows, a batch, the batching options a model declares, the request
:meth:`Model.validate`, :meth:`Model.signature` and :meth:`Model.row_cost` are given, a stateful
model's sequence batching and state: docs/sequences.md; and the two errors a model raises on
purpose, defined in asyncinfer/errors.py: a request that does not fit, HTTP 400, and a failure
worth retrying). The contract: docs/models.md."""

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.errors import InvalidRequest, TransientError
from asyncinfer.models.base import Batch, InputSpec, Model, OutputSpec, StreamRows, StreamStep
from asyncinfer.models.registry import Registry
from asyncinfer.models.sequence import SequenceBatching, SequenceState
from asyncinfer.wire.protocol import Request

__all__ = ["Batch", "InputSpec", "InvalidRequest", "Model", "ModelOptions", "OutputSpec",
           "Registry", "Request", "SequenceBatching", "SequenceState", "StreamRows", "StreamStep",
           "TransientError"]
