"""A GGUF model run by llama.cpp as a `CacheBackend`: one sequence id per cache handle.

All sessions share ONE model and ONE llama.cpp context; each cache handle is a sequence id in that
context's KV memory, taken from a free list of `max_sequences` ids. The low-level ctypes API is
used because the high-level `llama_cpp.Llama` object tracks a single sequence (it keeps one token
list and crops everything past it), whereas here many sessions are cut back and extended
independently through `llama_memory_seq_rm` and per-token sequence ids in a `llama_batch`.

The KV memory is not unified: every sequence gets its own stream of `n_ctx` cells (total
`n_ctx * max_sequences`), so a session can always hold `n_ctx` tokens and attention for one
sequence never scans the others' cells.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import llama_cpp
import numpy as np
import torch

from specdec_core.kvcache import logits_per_item

logger = logging.getLogger(__name__)

_GGML_LOG_LEVEL_ERROR = 3


@llama_cpp.llama_log_callback
def _log_errors_only(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if level == _GGML_LOG_LEVEL_ERROR:
        logger.error("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())


class LlamaCppBackend:
    name = "llama.cpp"
    device = "cpu"
    dtype = "gguf"

    def __init__(
        self,
        gguf_path: str,
        n_ctx: int = 2048,
        max_sequences: int = 16,
        n_threads: int | None = None,
        n_batch: int = 512,
    ):
        if not os.path.isfile(gguf_path):
            raise FileNotFoundError(gguf_path)
        llama_cpp.llama_log_set(_log_errors_only, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        self._lock = threading.Lock()
        self._model = self._ctx = self._batch = None

        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(gguf_path.encode(), model_params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        ftype = llama_cpp.llama_ftype_name(llama_cpp.llama_model_ftype(self._model))
        self.ftype = (ftype or b"").decode()  # the weights' quantization, e.g. "Q4_1"

        threads = n_threads or os.cpu_count() or 1
        ctx_params = llama_cpp.llama_context_default_params()
        per_sequence = -(-n_ctx // 256) * 256  # llama.cpp pads context sizes to 256 cells
        ctx_params.n_ctx = per_sequence * max_sequences  # split into max_sequences streams
        ctx_params.n_seq_max = max_sequences
        ctx_params.kv_unified = False
        ctx_params.n_batch = ctx_params.n_ubatch = n_batch
        ctx_params.n_outputs_max_per_seq = 0  # default 1: every fed token needs its logits
        ctx_params.n_threads = ctx_params.n_threads_batch = threads
        self._ctx = llama_cpp.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            self.close()
            raise RuntimeError("llama.cpp could not create a context")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self.max_context = int(llama_cpp.llama_n_ctx_seq(self._ctx))
        if self.max_context < n_ctx:
            self.close()
            raise RuntimeError(f"llama.cpp gives each sequence {self.max_context} < {n_ctx} cells")
        self.max_sequences = int(llama_cpp.llama_n_seq_max(self._ctx))
        self.n_batch = n_batch
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._free_ids = list(range(self.max_sequences - 1, -1, -1))  # pop() hands out 0 first

    @property
    def capacity(self) -> int:
        """Room in sequence slots: each holds up to `max_context` tokens whatever its length."""
        return self.max_sequences

    def units_for(self, length: int) -> int:
        return 1

    def allocate(self) -> int:
        with self._lock:
            if not self._free_ids:
                raise RuntimeError(
                    f"all {self.max_sequences} llama.cpp sequences are in use; free a session first"
                )
            return self._free_ids.pop()

    def _check_open(self) -> None:
        if self._ctx is None:
            raise RuntimeError("the llama.cpp backend is closed")

    def crop(self, handle: int, length: int) -> None:
        with self._lock:
            self._check_open()
            if not llama_cpp.llama_memory_seq_rm(self._memory, handle, length, -1):
                raise RuntimeError(f"llama.cpp could not crop sequence {handle} to {length}")

    def free(self, handle: int) -> None:
        with self._lock:
            self._check_open()
            if handle in self._free_ids or not 0 <= handle < self.max_sequences:
                raise ValueError(f"sequence {handle} is not allocated")
            llama_cpp.llama_memory_seq_rm(self._memory, handle, -1, -1)
            self._free_ids.append(handle)

    def num_cached(self, handle: int) -> int:
        """How many tokens the sequence holds."""
        self._check_open()
        return int(llama_cpp.llama_memory_seq_pos_max(self._memory, handle)) + 1

    def forward(self, handle: int, token_ids: list[int], start: int, num_logits: int | None = None) -> torch.Tensor:
        return self.forward_batch([(handle, token_ids, start)], None if num_logits is None else [num_logits])[0]

    def forward_batch(self, items: list[tuple[int, list[int], int]],
                      num_logits: list[int] | None = None) -> list[torch.Tensor]:
        """Feed several sequences in shared llama_decode calls (up to n_batch tokens each); per
        item, the logits of its last `num_logits[i]` fed tokens (default all) [num_logits[i], V].
        llama.cpp computes and copies out logits only for the tokens flagged for output."""
        keep = logits_per_item(items, num_logits)
        outs = [torch.empty((k, self.vocab_size), dtype=torch.float32) for k in keep]
        flat = [(k, i, i >= len(ids) - keep[k]) for k, (_, ids, _) in enumerate(items) for i in range(len(ids))]
        with self._lock:
            for handle, ids, start in items:
                if start + len(ids) > self.max_context:
                    raise ValueError(f"{start} + {len(ids)} tokens exceed {self.max_context}")
                cached = self.num_cached(handle)
                if cached != start:
                    raise ValueError(f"sequence {handle} holds {cached} tokens, not {start}")
            for lo in range(0, len(flat), self.n_batch):
                chunk = flat[lo : lo + self.n_batch]
                self._decode(items, chunk)
                wanted = [(k, i) for k, i, out in chunk if out]
                if not wanted:
                    continue
                rows = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self._ctx),
                                             shape=(len(wanted), self.vocab_size))  # outputs lie contiguously
                for j, (k, i) in enumerate(wanted):
                    outs[k].numpy()[i - (len(items[k][1]) - keep[k])] = rows[j]
        return outs

    def _decode(self, items: list[tuple[int, list[int], int]], chunk: list[tuple[int, int, bool]]) -> None:
        batch = self._batch
        batch.n_tokens = len(chunk)
        for j, (k, i, out) in enumerate(chunk):
            handle, ids, start = items[k]
            batch.token[j] = ids[i]
            batch.pos[j] = start + i
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = handle
            batch.logits[j] = 1 if out else 0
        rc = llama_cpp.llama_decode(self._ctx, batch)
        if rc != 0:
            for handle, _, start in items:
                llama_cpp.llama_memory_seq_rm(self._memory, handle, start, -1)
            raise RuntimeError(f"llama_decode failed with {rc}")

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of text; special tokens such as <|im_start|> are parsed."""
        data = text.encode()
        buf = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, len(buf), add_special, True)
        if n < 0:
            raise RuntimeError(f"llama_tokenize failed with {n}")
        return list(buf[:n])

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of token_ids, special tokens rendered."""
        buf = ctypes.create_string_buffer(256)
        pieces = []
        for token in token_ids:
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
            pieces.append(buf.raw[: max(n, 0)])
        return b"".join(pieces).decode("utf-8", "replace")

    def close(self) -> None:
        with self._lock:
            if self._batch is not None:
                llama_cpp.llama_batch_free(self._batch)
                self._batch = None
            if self._ctx:
                llama_cpp.llama_free(self._ctx)
                self._ctx = None
            if self._model:
                llama_cpp.llama_model_free(self._model)
                self._model = None
