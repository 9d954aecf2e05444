"""A GGUF model run by llama.cpp as a `CacheBackend`: one sequence id per cache handle.

All sessions share ONE model and ONE llama.cpp context; each cache handle is a sequence id in that
context's KV memory, taken from a free list of `max_sequences` ids. The low-level ctypes API is
used because the high-level `llama_cpp.Llama` object tracks a single sequence (it keeps one token
list and crops everything past it), whereas here many sessions are cut back and extended
independently through `llama_memory_seq_rm` and per-token sequence ids in a `llama_batch`.

The KV memory is not unified: every sequence gets its own stream of `n_ctx` cells (total
`n_ctx * max_sequences`), so a session can always hold `n_ctx` tokens and attention for one
sequence never scans the others' cells.

KV export and import work on token ranges of one sequence, so that a content-addressed store can
keep fixed-size chunks of a session's KV and restore them into a fresh worker. llama.cpp only
copies whole sequences (`llama_state_seq_get_data` / `_set_data`), so export reads a sequence's
state once and cuts the ranges out of it, and import reads the sequence's current state, splices
the new cells in behind it and writes the whole state back in one call. The state is parsed with
the byte format of `llama_kv_cache::state_write` (checked against its total length, so a llama.cpp
that changes it fails loudly rather than silently): a context header (magic, source sequence id),
n_stream, then per stream its cell count and, for the one stream that holds the sequence, per cell
(pos, n_seq_id = 1, seq_id), then v_trans, n_layer, per layer (K type, row bytes, one row per
cell), and per layer V either as (type, row bytes, rows) or, transposed, as (type, element bytes,
n_embd_v, and per embedding component the cells' elements). A blob is canonical and token-major:
per token, its K rows of all layers then its V rows of all layers (transposed V is turned back
into rows), a fixed `bytes per token` with no positions in it; blobs of consecutive ranges
concatenate into the blob of their union. The byte layout is probed once at start-up by decoding
one token into a scratch sequence.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading

import llama_cpp
import numpy as np
import torch

from specdec_core.engine.kvcache import logits_per_item

logger = logging.getLogger(__name__)

_GGML_LOG_LEVEL_ERROR = 3
_STATE_MAGIC = 0xAF143CD8  # the first u32 of llama_state_seq_get_data's output (llama-cpp-python 0.3.36)


@llama_cpp.llama_log_callback
def _log_errors_only(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if level == _GGML_LOG_LEVEL_ERROR:
        logger.error("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())


class LlamaCppBackend:
    name = "llama.cpp"
    device = "cpu"
    dtype = "gguf"
    # an export copies the whole sequence's state (12 ms at 1,500 tokens of SmolLM2 on an idle
    # core, several times that under load): the KV tier gathers 8 chunks per export, so that a
    # decoding session pays under 1 ms per round (benchmarks/results/kvstore.json)
    kv_export_chunks = 8

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
        self.num_parameters = int(llama_cpp.llama_model_n_params(self._model))
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
        try:  # a scratch token in sequence 0 shows the KV byte layout
            self._decode([(0, [0], 0)], [(0, 0, False)])
            _, _, _, self._kv_spec = self._read_state(0)
        except Exception:
            self.close()
            raise
        llama_cpp.llama_memory_seq_rm(self._memory, 0, -1, -1)
        v_trans, k_specs, v_specs = self._kv_spec
        self.kv_bytes_per_token = sum(row for _, row in k_specs) + sum(self._v_width(v) for v in v_specs)

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

    def kv_layout(self) -> str:
        """Identifies the byte layout of exported KV: backends that give the same string take each
        other's blobs. It names the KV types and row sizes per layer, and v_trans: a transposed V
        gives the same canonical bytes, but it means flash attention is off, which computes other
        numbers, so such blobs are kept apart. It does not name the model: key stored blobs by both."""
        v_trans, k_specs, v_specs = self._kv_spec

        def specs(rows: list[tuple[int, int]]) -> str:
            names = [f"(type {t},row {r})" for t, r in rows]
            return f"{len(names)}x{names[0]}" if len(set(names)) == 1 else ";".join(names)

        return (f"llama.cpp-kv-v1 v_trans={v_trans} layers={len(k_specs)} k={specs(k_specs)} "
                f"v={specs([(v[0], self._v_width(v)) for v in v_specs])} bytes/token={self.kv_bytes_per_token}")

    def export_kv(self, handle: int, ranges: list[tuple[int, int]]) -> list[bytes]:
        """The KV of positions [start, end) of sequence `handle`, one blob per range (each inside
        the `num_cached(handle)` tokens the sequence holds), `kv_bytes_per_token` bytes per token,
        token-major (see the module docstring). One llama_state_seq_get_data call copies the whole
        sequence; every range is cut out of that copy."""
        with self._lock:
            self._check_open()
            cached = self.num_cached(handle)
            for lo, hi in ranges:
                if not 0 <= lo <= hi <= cached:
                    raise ValueError(f"range [{lo}, {hi}) is not inside the {cached} tokens of sequence {handle}")
            if not ranges:
                return []
            pos, ks, vs, _ = self._read_state(handle)
            order = np.argsort(pos, kind="stable")
            if not np.array_equal(pos[order], np.arange(len(pos))):
                raise RuntimeError(f"sequence {handle} does not hold positions 0..{cached - 1} once each")
            in_order = np.array_equal(order, np.arange(len(pos)))
            blobs = []
            for lo, hi in ranges:
                cells = slice(lo, hi) if in_order else order[lo:hi]
                rows = [a[cells].reshape(hi - lo, -1) for a in (*ks, *vs)] if hi > lo else []
                blobs.append(np.concatenate(rows, axis=1).tobytes() if rows else b"")
            return blobs

    def import_kv(self, handle: int, start: int, blobs: list[bytes], token_ids: list[int] | None = None) -> int:
        """Append the cells of consecutive blobs (as export_kv made them) at positions start,
        start + 1, ... to sequence `handle`, which holds exactly `start` tokens; returns the new
        length. (`token_ids`, the tokens they hold, is not needed: sequences share no cells.) The sequence's state is read (when start > 0), the new cells are spliced in behind
        its cells (put in position order) and the whole is written back with one
        llama_state_seq_set_data call.

        Raises ValueError when a blob is not a whole number of tokens, the sequence does not hold
        `start` tokens or the result would not fit; the sequence is then untouched. Should llama.cpp
        refuse the state (it empties the sequence when it does), the original state is written back
        and the sequence holds its `start` tokens again (emptied only if even that is refused, which
        the message says) before the ValueError is raised: never a half-imported sequence."""
        with self._lock:
            self._check_open()
            width = self.kv_bytes_per_token
            for i, blob in enumerate(blobs):
                if len(blob) % width:
                    raise ValueError(f"blob {i} has {len(blob)} bytes, not a multiple of {width} per token")
            added = sum(len(b) for b in blobs) // width
            cached = self.num_cached(handle)
            if cached != start:
                raise ValueError(f"sequence {handle} holds {cached} tokens, not {start}")
            if start + added > self.max_context:
                raise ValueError(f"{start} + {added} tokens exceed {self.max_context}")
            if added == 0:
                return start
            new = np.frombuffer(b"".join(blobs), dtype=np.uint8).reshape(added, width)
            old = self._state_bytes(handle) if start else None
            state = self._build_state(handle, old, new)
            if llama_cpp.llama_state_seq_set_data(self._ctx, self._u8(state), len(state), handle) != len(state):
                restored = old is not None and llama_cpp.llama_state_seq_set_data(
                    self._ctx, self._u8(old), len(old), handle) == len(old)
                if not restored:
                    llama_cpp.llama_memory_seq_rm(self._memory, handle, -1, -1)
                raise ValueError(f"llama.cpp refused the imported KV of sequence {handle}; it now holds "
                                 f"{start if restored else 0} tokens")
            return start + added

    @staticmethod
    def _u8(data: np.ndarray):
        return data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))

    @staticmethod
    def _v_width(spec: tuple[int, ...]) -> int:
        """Bytes per token of one layer's V: (type, row bytes) or, transposed, (type, element bytes, n_embd_v)."""
        return spec[1] if len(spec) == 2 else spec[1] * spec[2]

    def _state_bytes(self, handle: int) -> np.ndarray:
        size = llama_cpp.llama_state_seq_get_size(self._ctx, handle)
        data = np.empty(size, dtype=np.uint8)
        if llama_cpp.llama_state_seq_get_data(self._ctx, self._u8(data), size, handle) != size:
            raise RuntimeError(f"llama.cpp could not copy the state of sequence {handle}")
        return data

    def _read_state(self, handle: int, data: np.ndarray | None = None):
        """The sequence's state (read now unless given) parsed: cell positions [n], per layer K
        [n, row] and V [n, row] or, transposed, [n, n_embd_v, element] (views into the state
        bytes), and the layout spec (v_trans, K specs, V specs)."""
        data = self._state_bytes(handle) if data is None else data
        off = 0

        def block(size: int) -> np.ndarray:
            nonlocal off
            if off + size > len(data):
                raise RuntimeError("llama.cpp's sequence state is shorter than its format says")
            off += size
            return data[off - size : off]

        def take(fmt: str) -> tuple[int, ...]:
            return struct.unpack(fmt, block(struct.calcsize(fmt)))

        magic, _, n_stream = take("<III")
        if magic != _STATE_MAGIC:
            raise RuntimeError(f"unknown llama.cpp sequence state format (magic {magic:#x})")
        pos, ks, vs, spec = np.zeros(0, dtype=np.int32), [], [], None
        for _ in range(n_stream):
            (n,) = take("<I")
            if n == 0:
                continue
            if spec is not None:
                raise RuntimeError(f"sequence {handle} lies in more than one KV stream")
            meta = block(12 * n).view("<i4").reshape(n, 3)  # pos, n_seq_id, seq_id
            if not (meta[:, 1] == 1).all():
                raise RuntimeError("unexpected per-cell sequence ids in llama.cpp's state")
            pos = meta[:, 0].copy()
            v_trans, n_layer = take("<II")
            k_specs, v_specs = [], []
            for _ in range(n_layer):
                k_specs.append(take("<iQ"))
                ks.append(block(n * k_specs[-1][1]).reshape(n, -1))
            for _ in range(n_layer):
                if v_trans:  # the state holds [n_embd_v, n, element]
                    v_specs.append(take("<iII"))
                    _, el, n_embd = v_specs[-1]
                    vs.append(block(n * n_embd * el).reshape(n_embd, n, el).transpose(1, 0, 2))
                else:
                    v_specs.append(take("<iQ"))
                    vs.append(block(n * v_specs[-1][1]).reshape(n, -1))
            spec = (v_trans, k_specs, v_specs)
        if off != len(data):
            raise RuntimeError(f"llama.cpp's sequence state has {len(data) - off} bytes more than its format")
        return pos, ks, vs, spec

    def _build_state(self, handle: int, old: np.ndarray | None, new: np.ndarray) -> np.ndarray:
        """A state of sequence `handle`: the cells of the state `old` (or none) in position order,
        then the token-major rows `new` [m, kv_bytes_per_token] at the positions after them."""
        v_trans, k_specs, v_specs = self._kv_spec
        ks, vs, start = [None] * len(k_specs), [None] * len(v_specs), 0
        if old is not None:
            pos, ks, vs, spec = self._read_state(handle, old)
            order = np.argsort(pos, kind="stable")
            if spec != self._kv_spec or not np.array_equal(pos[order], np.arange(len(pos))):
                raise RuntimeError(f"sequence {handle}'s state is not positions 0.. in the start-up KV layout")
            if not np.array_equal(order, np.arange(len(pos))):
                ks, vs = [k[order] for k in ks], [v[order] for v in vs]
            start = len(pos)
        m = len(new)
        n = start + m
        meta = np.empty((n, 3), dtype="<i4")
        meta[:, 0], meta[:, 1], meta[:, 2] = np.arange(n), 1, handle
        n_stream = self.max_sequences  # kv_unified=False: one stream per sequence
        counts = np.zeros(n_stream, dtype="<u4")
        counts[handle] = n
        parts = [struct.pack("<III", _STATE_MAGIC, handle, n_stream), counts[: handle + 1].tobytes(),
                 meta.tobytes(), struct.pack("<II", v_trans, len(k_specs))]

        def joined(prev: np.ndarray | None, cur: np.ndarray) -> np.ndarray:
            return cur if prev is None else np.concatenate([prev, cur])

        col = 0
        for (k_type, k_row), prev in zip(k_specs, ks):
            parts += [struct.pack("<iQ", k_type, k_row), joined(prev, new[:, col : col + k_row]).tobytes()]
            col += k_row
        for v_spec, prev in zip(v_specs, vs):
            cur = new[:, col : col + self._v_width(v_spec)]
            col += self._v_width(v_spec)
            if v_trans:  # back to [n_embd_v, n, element]
                cur = cur.reshape(m, v_spec[2], v_spec[1])
                parts += [struct.pack("<iII", *v_spec), joined(prev, cur).transpose(1, 0, 2).tobytes()]
            else:
                parts += [struct.pack("<iQ", *v_spec), joined(prev, cur).tobytes()]
        parts.append(counts[handle + 1 :].tobytes())
        return np.frombuffer(b"".join(parts), dtype=np.uint8)

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
