"""A transformers causal LM as a `CacheBackend` whose KV caches live in one paged pool, so that
requests of different sessions (each with its own cache length and its own number of new tokens)
run through the model in one forward pass.

How it works (the CPU path of transformers' continuous batching, with our own bookkeeping):
- every layer has one preallocated pool of key slots and one of value slots,
  `[kv_heads, num_blocks * block_size, head_dim]` (head-major, so that a run of slots is a
  view SDPA reads as it is); a session holds a list of blocks (its block
  table) and a length. Position `p` of a session lives in slot `blocks[p // B] * B + p % B`.
- a batch is flattened into one sequence `[1, total_new_tokens]` with each token's own position
  id, so every linear layer reads its weights once for the whole batch. For every layer the model
  calls `cache.update(k, v, layer)` on a per-batch view of the pool, which writes the new
  keys/values into their slots (`index_copy_`).
- attention runs per session: the backend registers an attention function (`specdec_paged`) with
  transformers and switches the model to it. Inside a batch it takes each session's queries and
  that session's keys/values 0..start+n-1 and calls SDPA with grouped-query heads and a causal mask
  over the new positions; outside a batch (the same model object used elsewhere) it calls the
  implementation the model had before. A session never attends over another's keys: an earlier
  version ran one dense block-diagonal masked pass over all of them, which made 8 one-token decodes
  at 600-token contexts cost 512 ms instead of 178 ms. A model whose attention is our CPU kernel
  (`cpu_kernels`, what `models.load_causal_lm` sets up on the CPU) runs every session of a layer
  in one call of that kernel instead, reading each session's keys at its slots (gathering nothing),
  and gives a position the same bits whether it is decoded, verified or prefilled.
- a session's blocks are kept one run of consecutive blocks where the pool has room: a new run
  starts in the first stretch of free blocks that leaves 256 tokens of room on either side, and a
  session grows into the block after its last. Its keys are then a view of the pool, which SDPA reads in place; only a session whose
  blocks are scattered (a shared prefix, a crowded pool) has its keys gathered (`index_select`),
  which at 8 sessions of ~350 tokens had cost a fifth of the decode step.
- the LM head runs only on the rows whose logits the caller reads (`num_logits`).
- Llama-family models run as `lean_pass.LeanPass`: the same operations without transformers'
  module machinery (about a tenth of a CPU decode step), once the first batch agreed bit for bit.
Nothing is copied per step but the keys/values of scattered sessions; crop and free only edit
block tables (and reference counts).

Prefix sharing: sessions whose tokens begin alike (a common system prompt, a document several
requests ask about) hold the identical full blocks of that prefix once, and a new session adopts
them (`share_prefix`) instead of computing them: no forward pass, no copy. A handle knows the token
ids its KV stands for (forward_batch appends them; import_kv when given `token_ids`) and the prefix
hash of each full block (`kvcache.prefix_hash`, a chain: a hash names the block's tokens and
everything before them). The backend indexes full blocks by prefix
hash (the first block with a hash keeps the entry) and counts each block's holders: crop and free
drop a reference, and a block goes back to the free ones (and out of the index) at zero.
Copy-on-write: a block held more than once is never written. Writes only go at positions >= a
handle's length, so the one case is a handle cut back into the middle of a shared block and then
extended: it first gets a fresh block with a copy of the slots it kept (one block more than its
new tokens alone need: `blocks_needed`). A privately held indexed block leaves the index before
its tail is overwritten. A handle whose tokens are not known (an import without `token_ids`)
shares nothing beyond the part that is known until it is cut back below it.

Why not transformers' `PagedAttentionCache` itself: it works on CPU (index-based update plus the
same kind of dense block-diagonal mask, with `attn_implementation="sdpa"`), but building one
probes device memory and sizes buffers through a resolved `ContinuousBatchingConfig`, takes its
KV head count from the config (wrong under tensor parallelism unless a device mesh is plumbed in),
and rolling a request back to an arbitrary length means editing its allocators' block tables and
free pools by hand; that code was rewritten many times across the transformers versions this
project accepts. The transformers surface used here is the model's own `cache.update(...)`
call, its acceptance of a ready 4D mask (a dummy one, so that it builds none), the attention
function registry and `logits_to_keep`.

Cost note: a batch whose attention scores (sum over items of new tokens x keys) exceed
`max_attention_elements` runs as several consecutive forward passes (groups of consecutive
items); a single item always runs whole.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from specdec_core.engine import cpu_kernels
from specdec_core.engine.cpu_linear import linear_kernel, num_parameters
from specdec_core.engine.kvcache import logits_per_item, prefix_hash
from specdec_core.engine.lean_pass import LeanPass
from specdec_core.errors import ResourceExhausted

log = logging.getLogger(__name__)

_ATTENTION = "specdec_paged"
GROWTH_TOKENS = 256  # room to grow in place; each session's unused room may stay resident
_SUPPORTED_ATTENTION = ("sdpa", "eager", cpu_kernels.NAME, _ATTENTION)


class PagedSequence:
    """A handle: one session's block table and the number of tokens whose KV it holds; for prefix
    sharing, the token ids of the first `len(tokens)` of them (all of them unless an import did
    not name its tokens) and the prefix hashes of its full blocks among those."""

    __slots__ = ("owner", "blocks", "length", "tokens", "hashes")

    def __init__(self, owner: BatchedBackend):
        self.owner = owner
        self.blocks: list[int] = []
        self.length = 0
        self.tokens: list[int] = []  # a prefix of the held tokens (len <= length)
        self.hashes: list[bytes] = []  # prefix hash of each full block of `tokens`

    def __repr__(self) -> str:
        return f"PagedSequence(length={self.length}, blocks={len(self.blocks)})"


class _Item:
    """One sequence's part of a batch: its rows in the flattened query, the pool slots of its keys
    0..end (None for a fresh prefill, whose keys are exactly the new ones) and its causal mask
    (None when one query row sees every key)."""

    __slots__ = ("q0", "q1", "read", "mask", "is_causal")

    def __init__(self, q0: int, q1: int, read: torch.Tensor | slice | None, mask: torch.Tensor | None, is_causal: bool):
        self.q0, self.q1, self.read, self.mask, self.is_causal = q0, q1, read, mask, is_causal


class _BatchView:
    """What the model sees as its cache during one forward pass: `update` writes the new keys and
    values of every layer into the pool; `attend` (called by the model's attention, through
    `_paged_attention`) runs each sequence's queries against that sequence's keys only."""

    is_compileable = False

    def __init__(self, backend: BatchedBackend, write_index: torch.Tensor, items: list[_Item],
                 kernel: cpu_kernels.Batch | None = None):
        self.backend = backend
        self.write_index = write_index  # [T] slots of the new tokens, in batch order
        self.items = items
        self.kernel = kernel  # every item in one call of the CPU kernel, else SDPA item by item

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Any = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states / value_states: [1, kv_heads, T, head_dim]
        k_pool, v_pool = self.backend._pools(layer_idx, key_states)
        k_pool.index_copy_(1, self.write_index, key_states[0])
        v_pool.index_copy_(1, self.write_index, value_states[0])
        return key_states, value_states  # the new ones; `attend` reads the rest from the pool

    def write_qkv(self, layer_idx: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                  kv_heads: int) -> torch.Tensor:
        """The CPU kernels' `update` for a fused q/k/v [T, heads + 2 kv_heads, d]: the rotary
        embedding of q and k (cos, sin [T, d], sin's first half negated) in place and the new keys and
        values written to the pool, in one call; the queries [1, heads, T, d]."""
        like = qkv[:, heads:heads + kv_heads].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, T, d]
        k_pool, v_pool = self.backend._pools(layer_idx, like)
        cpu_kernels.rope_write(qkv, cos, sin, heads, kv_heads, k_pool, v_pool, self.write_index)
        return qkv[:, :heads].transpose(0, 1).unsqueeze(0)

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """query [1, heads, T, d], key/value the new [1, kv_heads, T, d] -> [1, T, heads, d]."""
        k_pool, v_pool = self.backend._k_pools[layer_idx], self.backend._v_pools[layer_idx]
        if self.kernel is not None:
            return self.kernel(query, k_pool, v_pool, scaling)
        outs = []
        for it in self.items:
            q = query[:, :, it.q0:it.q1]
            if it.read is None:
                k, v = key[:, :, it.q0:it.q1], value[:, :, it.q0:it.q1]
            elif isinstance(it.read, slice):  # its slots are one run: a view, nothing copied
                k, v = k_pool[:, it.read].unsqueeze(0), v_pool[:, it.read].unsqueeze(0)
            else:  # this sequence's keys only: [kv_heads, S_i, d] -> [1, kv_heads, S_i, d]
                k = k_pool.index_select(1, it.read).unsqueeze(0)
                v = v_pool.index_select(1, it.read).unsqueeze(0)
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=it.mask, is_causal=it.is_causal, scale=scaling,
                enable_gqa=q.shape[1] != k.shape[1]))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.transpose(1, 2).contiguous()


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function a BatchedBackend's model runs with: per sequence of the batch when
    called by the backend (`specdec_batch` passed through the model's kwargs), otherwise the
    implementation the model had before (so the same model object still works elsewhere)."""
    view = kwargs.pop("specdec_batch", None)
    if view is None:
        inner = module.config._specdec_inner_attention
        fn = ALL_ATTENTION_FUNCTIONS[inner] if inner != "eager" else eager_attention_forward
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return view.attend(module.layer_idx, query, key, value, scaling), None


class BatchedBackend:
    """`CacheBackend` over one paged KV pool, plus `forward_batch` for many sessions at once.

    `max_tokens`: KV capacity in tokens over all sessions (rounded up to whole blocks); the pool
    of each layer is created on the first forward pass with the model's dtype and device (and its
    local number of KV heads, so a tensor-parallel shard holds only its heads).
    `lean`: run Llama-family layers through `lean_pass` (their operations without transformers'
    module machinery) once the first batch showed its logits bit for bit equal to the model's own.
    """

    name = "transformers-paged"

    def __init__(self, model, max_tokens: int = 65536, block_size: int = 16,
                 max_attention_elements: int = 1 << 22, lean: bool = True):
        if max_tokens <= 0 or block_size <= 0:
            raise ValueError(f"max_tokens and block_size must be positive, got {max_tokens}, {block_size}")
        config = model.config
        impl = getattr(config, "_attn_implementation", None) or "eager"
        if impl not in _SUPPORTED_ATTENTION:
            raise ValueError(
                f"BatchedBackend drives attention with a 4D mask and needs attn_implementation in "
                f"{_SUPPORTED_ATTENTION}, the model uses {impl!r}"
            )
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or (
            not layer_types and getattr(config, "use_sliding_window", False)
        ):
            raise ValueError("BatchedBackend supports full-attention models only (no sliding window layers)")

        if impl != _ATTENTION:
            AttentionInterface.register(_ATTENTION, _paged_attention)
            # masks for calls from outside a batch: an additive float mask suits sdpa and eager alike
            AttentionMaskInterface.register(_ATTENTION, eager_mask)
            config._specdec_inner_attention = impl
            model.set_attn_implementation(_ATTENTION)
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.torch_dtype = param.dtype
        self.dtype = str(param.dtype).removeprefix("torch.")
        self.vocab_size = int(config.vocab_size)
        self.num_parameters = num_parameters(model)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.block_size = int(block_size)
        self.num_blocks = -(-int(max_tokens) // self.block_size)
        self.max_tokens = self.num_blocks * self.block_size
        self.max_attention_elements = int(max_attention_elements)
        # room left after a session's blocks for it to grow in place (a reply, the next turn)
        self.growth_blocks = max(1, GROWTH_TOKENS // self.block_size)
        self._is_free = np.ones(self.num_blocks, dtype=bool)
        self._num_free = self.num_blocks
        self._refs = [0] * self.num_blocks  # holders per block (0: free)
        self._index: dict[bytes, int] = {}  # prefix hash -> a full block holding exactly that
        self._indexed: dict[int, bytes] = {}  # the reverse of _index
        self._k_pools: dict[int, torch.Tensor] = {}
        self._v_pools: dict[int, torch.Tensor] = {}
        # guards the free list, reference counts, the index, block tables and pool creation
        self._lock = threading.Lock()
        self._no_mask = torch.zeros(1, 1, 1, 1, dtype=self.torch_dtype, device=self.device)
        # the model's layers without transformers' module machinery, once checked to agree (_model_pass)
        self._lean = LeanPass.of(model) if lean else None
        # the model's own attention is the CPU kernel (cpu_kernels.enable): batches use it too
        self._kernel = config._specdec_inner_attention == cpu_kernels.NAME
        self._lean_checked = False
        # layer ids whose inputs each pass records (an EAGLE-3 head's features, target_service/head.py):
        # forward_batch appends one [tokens, len(capture) * hidden] tensor per item, in order; the
        # caller empties the list
        self.capture: tuple[int, ...] = ()
        self.captured: list[torch.Tensor] = []

    # ------------------------------------------------------------------------------------------
    # CacheBackend

    @property
    def capacity(self) -> int:
        """Room in blocks: a session holds whole blocks."""
        return self.num_blocks

    def units_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def allocate(self) -> PagedSequence:
        return PagedSequence(self)

    def crop(self, handle: PagedSequence, length: int) -> None:
        """Forget every token after the first `length` (a no-op when the handle holds fewer)."""
        self._check_handle(handle)
        if length < 0:
            raise ValueError(f"cannot crop to a negative length ({length})")
        with self._lock:
            if length < handle.length:
                handle.length = length
                self._trim_blocks(handle)

    def free(self, handle: PagedSequence) -> None:
        """Return all of the handle's blocks to the pool; the handle stays usable (empty)."""
        self._check_handle(handle)
        with self._lock:
            handle.length = 0
            self._trim_blocks(handle)

    def forward(self, handle: PagedSequence, token_ids: list[int], start: int,
                num_logits: int | None = None) -> torch.Tensor:
        return self.forward_batch([(handle, token_ids, start)], None if num_logits is None else [num_logits])[0]

    # ------------------------------------------------------------------------------------------
    # Batching

    def forward_batch(self, items: list[tuple[PagedSequence, list[int], int]],
                      num_logits: list[int] | None = None) -> list[torch.Tensor]:
        """Append each item's token_ids to its handle (which holds exactly `start` tokens) and
        return, per item, the next-token logits of its last `num_logits[i]` tokens (default: all)
        [num_logits[i], V] (float32): the LM head runs only on those rows, which is most of a long
        prefill's cost otherwise.
        All items run in one forward pass (unless the batch exceeds max_attention_elements).
        All or nothing: on any error every handle is left as it was."""
        seen: set[int] = set()
        for handle, token_ids, start in items:
            self._check_handle(handle)
            if id(handle) in seen:
                raise ValueError("the same handle appears twice in one batch")
            seen.add(id(handle))
            if handle.length != start:
                raise ValueError(f"handle holds {handle.length} tokens, the request says start={start}")
        with self._lock:
            self._reserve_blocks(items)
        try:
            results: list[torch.Tensor | None] = [None] * len(items)
            keep = logits_per_item(items, num_logits)
            for group in self._groups(items):
                for i, logits in zip(group, self._run([items[i] for i in group], [keep[i] for i in group])):
                    results[i] = logits
            with self._lock:
                for handle, token_ids, start in items:
                    self._appended(handle, start, token_ids)
        except BaseException:
            with self._lock:
                for handle, _, start in items:
                    handle.length = start
                    self._trim_blocks(handle)
            raise
        empty = torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return [empty if r is None else r for r in results]

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def free_block_ids(self) -> list[int]:
        with self._lock:
            return np.flatnonzero(self._is_free).tolist()

    # ------------------------------------------------------------------------------------------
    # Prefix sharing

    def share_prefix(self, handle: PagedSequence, token_ids: list[int], limit: int) -> int:
        """Adopt the indexed full blocks that continue the handle's tokens along token_ids, up to
        `limit` tokens (whole blocks only): the handle holds a prefix of token_ids (its `length`
        tokens). A partial last block is dropped first, and only when at least one block follows
        it. Returns the handle's new length. No forward pass, no copy; nothing to undo."""
        self._check_handle(handle)
        bs = self.block_size
        with self._lock:
            length = handle.length
            first, last = length // bs, min(limit, len(token_ids)) // bs
            if last <= first or len(handle.tokens) < length:  # nothing to gain, or tokens not known
                return length
            if handle.tokens != list(token_ids[:length]):
                raise ValueError("share_prefix: the handle's tokens are not a prefix of token_ids")
            prev = handle.hashes[-1] if handle.hashes else b""
            found: list[tuple[bytes, int]] = []
            for b in range(first, last):
                prev = prefix_hash(prev, token_ids[b * bs:(b + 1) * bs])
                block = self._index.get(prev)
                if block is None:
                    break
                found.append((prev, block))
            if not found:
                return length
            for _, block in found:  # before the release below, which may drop the same block
                self._refs[block] += 1
            dropped = handle.blocks[first:]  # the partial last block, if any
            del handle.blocks[first:]
            for block in dropped:
                self._release(block)
            handle.blocks.extend(block for _, block in found)
            handle.hashes.extend(h for h, _ in found)
            handle.length = (first + len(found)) * bs
            handle.tokens[first * bs:] = map(int, token_ids[first * bs:handle.length])
            return handle.length

    def blocks_needed(self, handle: PagedSequence, length: int) -> int:
        """Blocks the pool must hand out for the handle to grow to `length` tokens: its new blocks,
        plus one when its next write falls inside a shared block (copy-on-write)."""
        self._check_handle(handle)
        with self._lock:
            return self._needs(handle, handle.length, max(0, length - handle.length))

    @property
    def shared_blocks(self) -> int:
        """Blocks held by more than one handle."""
        with self._lock:
            return sum(1 for r in self._refs if r > 1)

    # ------------------------------------------------------------------------------------------
    # KV export and import (the Redis KV tier, `specdec_core.serving.kvstore`)

    def kv_layout(self) -> str:
        """The byte layout of exported KV: blobs are interchangeable between backends that give
        the same string. Creates the pools (one scratch token) on a backend that ran nothing yet.
        It names the linear layers' kernel too: another kernel rounds the keys and values in other
        last bits, and a session continued from them could differ from the target alone at a tie."""
        self._ensure_pools()
        k = self._k_pools[0]
        return (f"paged-kv-v1 dtype={self.dtype} layers={len(self._k_pools)} "
                f"kv_heads={k.shape[0]} head_dim={k.shape[2]} linears={linear_kernel(self.model)}")

    @torch.inference_mode()
    def export_kv(self, handle: PagedSequence, ranges: list[tuple[int, int]]) -> list[bytes]:
        """The keys and values of positions [start, end) of the handle, one blob per range:
        per layer, keys then values, [tokens, kv_heads, head_dim] in the pool's dtype."""
        self._check_handle(handle)
        blobs = []
        for start, end in ranges:
            if not 0 <= start <= end <= handle.length:
                raise ValueError(f"range [{start}, {end}) is not inside the {handle.length} cached tokens")
            slots = self._slots(handle, start, end)
            parts = []
            for layer in range(len(self._k_pools)):
                parts.append(self._k_pools[layer].index_select(1, slots).transpose(0, 1))
                parts.append(self._v_pools[layer].index_select(1, slots).transpose(0, 1))
            blobs.append(_tensor_bytes(torch.stack(parts)))
        return blobs

    @torch.inference_mode()
    def import_kv(self, handle: PagedSequence, start: int, blobs: list[bytes],
                  token_ids: list[int] | None = None) -> int:
        """Append the tokens of consecutive blobs (as export_kv made them) after the `start` tokens
        the handle holds; its new length. `token_ids`: the tokens the blobs hold, if known (then
        their full blocks can be shared; without them nothing past `start` is). All or nothing: a
        blob that is not a whole number of tokens (or token_ids of another length) raises
        ValueError, no room raises ResourceExhausted, and the handle keeps `start`."""
        self._check_handle(handle)
        if handle.length != start:
            raise ValueError(f"handle holds {handle.length} tokens, the import says start={start}")
        self._ensure_pools()
        k = self._k_pools[0]
        layers, per_token = len(self._k_pools), k.shape[0] * k.shape[2]
        token_bytes = 2 * layers * per_token * k.element_size()
        if any(len(b) == 0 or len(b) % token_bytes for b in blobs):
            raise ValueError(f"a KV blob is not a whole number of tokens of {token_bytes} bytes")
        total = sum(len(b) // token_bytes for b in blobs)
        if token_ids is not None and len(token_ids) != total:
            raise ValueError(f"{len(token_ids)} token_ids for {total} imported tokens")
        with self._lock:
            self._reserve_blocks([(handle, range(total), start)])
        try:
            pos = start
            for blob in blobs:
                n = len(blob) // token_bytes
                data = torch.frombuffer(bytearray(blob), dtype=k.dtype).view(2 * layers, n, k.shape[0], k.shape[2])
                slots = self._slots(handle, pos, pos + n)
                data = data.to(self.device).transpose(1, 2)  # [2 * layers, kv_heads, n, head_dim]
                for layer in range(layers):
                    self._k_pools[layer].index_copy_(1, slots, data[2 * layer])
                    self._v_pools[layer].index_copy_(1, slots, data[2 * layer + 1])
                pos += n
            with self._lock:
                if token_ids is None:
                    handle.length = pos  # tokens past `start` unknown: handle.tokens stops short
                else:
                    self._appended(handle, start, token_ids)
        except BaseException:
            with self._lock:
                handle.length = start
                self._trim_blocks(handle)
            raise
        return handle.length

    def _slots(self, handle: PagedSequence, start: int, end: int) -> torch.Tensor:
        """Pool slots of the handle's positions start..end-1 (position p: block p // B, offset p % B)."""
        pos = torch.arange(start, end)
        bs = self.block_size
        return (torch.tensor(handle.blocks, dtype=torch.long)[pos // bs] * bs + pos % bs).to(self.device)

    def _run_of(self, handle: PagedSequence, end: int) -> slice | None:
        """The pool slots of the handle's positions 0..end-1 as one slice when its blocks are
        consecutive (then attention reads a view of the pool instead of a gathered copy)."""
        blocks = handle.blocks[:self.units_for(end)]
        b0 = blocks[0]
        if blocks != list(range(b0, b0 + len(blocks))):
            return None
        return slice(b0 * self.block_size, b0 * self.block_size + end)

    def _ensure_pools(self) -> None:
        """The pools exist once a forward pass has run; run one scratch token if none has."""
        if not self._k_pools:
            scratch = self.allocate()
            try:
                self.forward(scratch, [0], 0, num_logits=0)
            finally:
                self.free(scratch)

    # ------------------------------------------------------------------------------------------
    # Internals

    def _check_handle(self, handle: Any) -> None:
        if not isinstance(handle, PagedSequence) or handle.owner is not self:
            raise ValueError(f"{handle!r} is not a handle of this backend")

    def _trim_blocks(self, handle: PagedSequence) -> None:
        """Release the blocks beyond what handle.length needs and forget the tokens and hashes
        past it (caller holds the lock)."""
        length, bs = handle.length, self.block_size
        keep = self.units_for(length)
        if len(handle.blocks) > keep:
            released = handle.blocks[keep:]
            del handle.blocks[keep:]
            for block in released:
                self._release(block)
        del handle.tokens[length:]
        del handle.hashes[length // bs:]
        if length % bs and self._refs[handle.blocks[-1]] == 1:
            self._unindex(handle.blocks[-1])  # its own block, partial now: its tail will be overwritten

    def _needs(self, handle: PagedSequence, start: int, n: int) -> int:
        """Free blocks that appending n tokens at `start` (= handle.length) takes (lock held)."""
        if n == 0:
            return 0
        need = self.units_for(start + n) - len(handle.blocks)
        if start % self.block_size and self._refs[handle.blocks[start // self.block_size]] > 1:
            need += 1  # copy-on-write of the shared block the first new token lands in
        return need

    def _reserve_blocks(self, items) -> None:
        """Give every handle the blocks its new tokens need, copying a shared block its first new
        token would land in, or do nothing at all (lock held)."""
        needs = [self._needs(h, start, len(ids)) for h, ids, start in items]
        total = sum(needs)
        if total > self._num_free:
            raise ResourceExhausted(
                f"KV cache full: this batch needs {total} more blocks of {self.block_size} tokens, "
                f"{self._num_free} of {self.num_blocks} are free (capacity {self.max_tokens} tokens)"
            )
        bs = self.block_size
        for handle, ids, start in items:
            if not len(ids):
                continue
            b, kept = divmod(start, bs)
            if kept:  # the first new token lands in the handle's partial last block
                old = handle.blocks[b]
                if self._refs[old] > 1:  # shared: never written; continue in a private copy
                    new = self._take_block(handle.blocks[b - 1] if b else None, 1)
                    self._copy_slots(old, new, kept)
                    handle.blocks[b] = new
                    self._release(old)
                else:
                    self._unindex(old)
            for left in range(self.units_for(start + len(ids)) - len(handle.blocks), 0, -1):
                handle.blocks.append(self._take_block(handle.blocks[-1] if handle.blocks else None, left))

    def _appended(self, handle: PagedSequence, start: int, token_ids) -> None:
        """Bookkeeping after token_ids were written at `start` (lock held): the new length, and
        the tokens and indexed full blocks when the handle's tokens up to `start` are known."""
        handle.length = start + len(token_ids)
        if len(handle.tokens) != start:
            return  # tokens before `start` unknown: the new ones cannot be hashed either
        handle.tokens.extend(map(int, token_ids))
        bs = self.block_size
        prev = handle.hashes[-1] if handle.hashes else b""
        for b in range(len(handle.hashes), handle.length // bs):
            prev = prefix_hash(prev, handle.tokens[b * bs:(b + 1) * bs])
            handle.hashes.append(prev)
            block = handle.blocks[b]
            if prev not in self._index and block not in self._indexed and self._refs[block] == 1:
                self._index[prev] = block
                self._indexed[block] = prev

    def _take_block(self, after: int | None, run: int) -> int:
        """A free block for a handle whose last block is `after` and that needs `run` more: the
        block right after `after` when it is free, so that a session's blocks stay one run
        (attention then reads a view of the pool), else the start of a new run (lock held)."""
        if after is not None and after + 1 < self.num_blocks and self._is_free[after + 1]:
            block = after + 1
        else:
            block = self._new_run_start(run)
        self._is_free[block] = False
        self._num_free -= 1
        self._refs[block] = 1
        return block

    def _new_run_start(self, run: int) -> int:
        """Where a new run of `run` blocks starts (lock held; at least one block is free): in the
        first stretch of free blocks with room for it and `growth_blocks` to grow into on both
        sides (none before it at the start of the pool), past the room it leaves the run before
        it. First fit keeps sessions in the low blocks, whose pages are already resident: the pool
        is allocated lazily, and placing runs anywhere would commit all of it over time. With no
        such room: the longest stretch, halfway in when it holds two runs, else its start."""
        edges = np.flatnonzero(np.diff(self._is_free, prepend=False, append=False))
        starts, ends = edges[0::2], edges[1::2]
        room = self.growth_blocks
        for start, end in zip(starts.tolist(), ends.tolist()):
            lead = room if start else 0
            if end - start >= lead + run + room:
                return start + lead
        i = int(np.argmax(ends - starts))
        start, end = int(starts[i]), int(ends[i])
        return start if start == 0 or end - start < 2 * run else start + (end - start) // 2

    def _release(self, block: int) -> None:
        """Drop one reference; the last one returns the block to the free list (lock held)."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._unindex(block)
            self._is_free[block] = True
            self._num_free += 1

    def _unindex(self, block: int) -> None:
        h = self._indexed.pop(block, None)
        if h is not None:
            del self._index[h]

    @torch.inference_mode()
    def _copy_slots(self, src: int, dst: int, n: int) -> None:
        """Copy the first n slots of block src to block dst, keys and values of every layer."""
        bs = self.block_size
        for pools in (self._k_pools, self._v_pools):
            for pool in pools.values():
                pool[:, dst * bs:dst * bs + n] = pool[:, src * bs:src * bs + n]

    def _groups(self, items) -> list[list[int]]:
        """Consecutive runs of non-empty items whose attention scores (new tokens x keys, summed
        over the items) fit the budget."""
        groups: list[list[int]] = []
        current: list[int] = []
        total = 0
        for i, (_, token_ids, start) in enumerate(items):
            n = len(token_ids)
            if n == 0:
                continue
            cost = n * (start + n)  # this item's attention scores
            if current and total + cost > self.max_attention_elements:
                groups.append(current)
                current, total = [], 0
            current.append(i)
            total += cost
        if current:
            groups.append(current)
        return groups

    def _pools(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self._k_pools.get(layer_idx)
        if pool is None:
            with self._lock:
                if layer_idx not in self._k_pools:
                    shape = (like.shape[1], self.num_blocks * self.block_size, like.shape[3])
                    # torch.empty: on CPU the pages are only committed as they are written
                    self._k_pools[layer_idx] = torch.empty(shape, dtype=like.dtype, device=like.device)
                    self._v_pools[layer_idx] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return self._k_pools[layer_idx], self._v_pools[layer_idx]

    @torch.inference_mode()
    def _run(self, items, keep: list[int]) -> list[torch.Tensor]:
        dev = self.device
        input_ids: list[int] = []
        positions, write, batch = [], [], []
        kernel_items: list | None = [] if self._kernel else None  # (first row, rows, start, key slots)
        for handle, token_ids, start in items:
            n = len(token_ids)
            end = start + n
            input_ids.extend(token_ids)
            positions.append(torch.arange(start, end))
            write.append(self._slots(handle, start, end))
            read = mask = None
            if start:  # keys 0..end: a view of the pool when they are one run, else their slots
                read = self._run_of(handle, end) or self._slots(handle, 0, end)
                if n > 1 and kernel_items is None:  # query j (position start + j) sees keys 0..start + j
                    pos = torch.arange(end)
                    mask = (pos[None, :] <= pos[start:, None]).to(dev)
            q0 = len(input_ids) - n
            batch.append(_Item(q0, q0 + n, read, mask, is_causal=not start and n > 1))
            if kernel_items is not None:
                keys = write[-1] if read is None else (
                    torch.arange(read.start, read.stop) if isinstance(read, slice) else read)
                kernel_items.append((q0, n, start, keys))
        kernel = cpu_kernels.Batch(kernel_items) if kernel_items else None
        view = _BatchView(self, torch.cat(write), batch, kernel)
        ids = torch.tensor([input_ids], dtype=torch.long, device=dev)
        position_ids = torch.cat(positions).to(dev).unsqueeze(0)
        rows = _kept_rows(items, keep).to(dev)
        captured: list[torch.Tensor] = []
        if self._lean is not None and self._lean_checked:
            logits = self._lean(ids, position_ids, view, rows, self.capture, captured)  # [sum(keep), V]
        else:
            logits = self._model_pass(ids, position_ids, view, rows, captured)
        if self.capture:
            aux = torch.cat(captured, dim=-1)  # [T, len(capture) * hidden]
            self.captured.extend(aux.split([len(token_ids) for _, token_ids, _ in items]))
        logits = logits if logits.dtype == torch.float64 else logits.float()  # float32 at least
        return list(logits.split(keep))

    def _model_pass(self, ids: torch.Tensor, position_ids: torch.Tensor, view: _BatchView,
                    rows: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        """The model's own forward over the batch; at the first batch, also the lean pass, which
        is used from then on only if its logits are bit for bit the same (it runs first: the
        model's own pass then writes the pool's keys and values last)."""
        lean, lean_captured = None, []
        if self._lean is not None:
            try:
                lean = self._lean(ids, position_ids, view, rows, self.capture, lean_captured)
            except Exception:  # noqa: BLE001 - a layer the structural check let through; the model's own pass serves
                log.warning("the lean forward pass failed on this model: this backend keeps the model's", exc_info=True)
                self._lean = None
        out = self.model(
            input_ids=ids,
            position_ids=position_ids,
            attention_mask=self._no_mask,  # 4D: transformers passes it through without building one
            cache=view,
            use_cache=True,
            logits_to_keep=rows,
            specdec_batch=view,
            output_hidden_states=bool(self.capture),
        )
        if self.capture:  # hidden_states[i]: the input of layer i (i = num_layers: after the final norm)
            captured.extend(out.hidden_states[i][0] for i in self.capture)
        logits = out.logits[0]
        if lean is not None:
            self._lean_checked = torch.equal(lean, logits)
            if self._lean_checked and self.capture:
                captured[:] = lean_captured
            if self._lean_checked:
                self._lean.share()
            else:
                log.warning("the lean forward pass differs from the model's own (max |diff| %.1e): "
                            "this backend keeps the model's", (lean - logits).abs().max().item())
                self._lean = None
        return logits


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def _kept_rows(items, keep: list[int]) -> torch.Tensor:
    """Indices, in the flattened batch, of the rows whose logits are kept."""
    rows, offset = [], 0
    for (_, ids, _), k in zip(items, keep):
        offset += len(ids)
        rows.extend(range(offset - k, offset))
    return torch.tensor(rows, dtype=torch.long)
