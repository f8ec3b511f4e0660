"""Model registry: built-ins, import-path factories, TorchScript and torch.export files."""

from asyncinfer.models.base import InputSpec, Model
from asyncinfer.models.registry import Registry

__all__ = ["InputSpec", "Model", "Registry"]
