"""Linear layers on the CPU through oneDNN with weights packed once, at load time.

`torch.nn.functional.linear` on the CPU calls a BLAS sgemm that re-packs the weight on every call;
for the few rows of a decode or verify step that costs as much as the product itself. oneDNN's
linear with a weight reordered ahead of time into its blocked layout (what inductor's
freezing pass does for compiled models) skips that. Measured on this project's 2-core machine,
SmolLM2-135M's 576 x 1536 linears, one thread: 1 row 13.8 -> 6.8 ms, 8 rows 23.3 -> 10.0 ms,
16 rows 32.1 -> 12.8 ms per 60 of them.

It also makes a row's result independent of how many rows share the call (BLAS's is not for 1-3
rows against 8 or more), so a session's logits no longer depend on what it was batched with. Except
for one row: for some shapes (here, layers reading 1536 or more inputs, such as SmolLM2's down
projection) oneDNN's one-row kernel sums in another order, and a plain decode alone differed from
the same step batched by 5e-5 in the logits. So fewer than MIN_ROWS rows run padded to MIN_ROWS
(which is also faster here). The results differ from BLAS's in the last bits (3e-6 on these
layers), as any two kernels do: the reference a worker's output is compared with must run the same
kernels, which it does when it is loaded by `models.load_causal_lm` too.

`pack_linears(model)` swaps the forward of every `nn.Linear` of a CPU model in float32 (or
bfloat16 where oneDNN has it) for the packed one; a float32 layer whose weights are exactly
block-quantized values (a model dequantized from a GGUF file) runs from its codes instead
(`cpu_quantized`: the same float32 weights read from 5 or 8.5 bits each, 1.5x faster at 8 rows and
2.4x at one here, and no slower at any row count). A layer whose weight is also another module's
(tied input embeddings and LM head) keeps its weight and gains the packed copy; any other layer's
weight is replaced by the packed copy, so the model's memory does not grow (tied weights aside).
"""

from __future__ import annotations

import logging
import types

import torch

from specdec_core.engine import cpu_quantized
from specdec_core.engine.cpu_quantized import QuantizedWeight

log = logging.getLogger(__name__)

PACKED = "onednn-packed"  # what kv layouts and logs call this kernel
# Fewer rows than this run padded to it. oneDNN's kernels for 2 or more rows give a row the same
# result whatever the row count (its one-row kernel does not, for some shapes), and on this
# project's 2-core machine 4 rows cost less than 1, 2 or 3 (SmolLM2's layers, fused: 20.6 ms for
# 1 row, 22.0 for 2, 17.5 for 3, 16.8 for 4, 19.7 for 8).
MIN_ROWS = 4


def available(dtype: torch.dtype) -> bool:
    """oneDNN can run packed linears of this dtype on this CPU."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _padded(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [..., M, K] with M < MIN_ROWS padded to MIN_ROWS rows (zeros), and M; (x, 0) when not padded."""
    x = x.contiguous()
    rows = x.numel() // x.shape[-1] if x.dim() >= 2 else 0
    if not 0 < rows < MIN_ROWS:
        return x, 0
    flat = x.reshape(rows, x.shape[-1])
    return torch.cat((flat, flat.new_zeros(MIN_ROWS - rows, x.shape[-1]))), rows


def _unpadded(y: torch.Tensor, x: torch.Tensor, rows: int) -> torch.Tensor:
    return y[:rows].reshape(*x.shape[:-1], y.shape[-1]) if rows else y


def _quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.specdec_packed_weight(x, self.bias)


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    padded, rows = _padded(x)
    return _unpadded(torch.ops.mkldnn._linear_pointwise(padded, self.specdec_packed_weight, self.bias, "none", [], ""),
                     x, rows)


@torch.no_grad()
def pack_linears(model: torch.nn.Module, int8_inputs: bool = False, quantized: bool = True) -> int:
    """Pack every linear layer of a CPU model (see the module docstring); the number packed.
    A no-op (0) for a model on another device, of another dtype, or already packed.
    quantized: layers whose weights are block-quantized values run from their codes, where the
    loaded kernels can (`cpu_quantized.available`); else all run on oneDNN.
    int8_inputs: block-quantized layers quantize their inputs too (llama.cpp's arithmetic, for a
    draft: `cpu_quantized`), where this CPU has the kernel for it."""
    linears = [m for m in model.modules()
               if isinstance(m, torch.nn.Linear) and not hasattr(m, "specdec_packed_weight")]
    if not linears or linears[0].weight.device.type != "cpu" or not available(linears[0].weight.dtype):
        return 0
    shared = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear)
              for p in m.parameters(recurse=False)}
    codes = quantized and linears[0].weight.dtype == torch.float32 and cpu_quantized.available()
    if int8_inputs and not (codes and cpu_quantized.int8_available()):
        log.warning("this CPU has no kernel for int8 inputs (AVX-512 VNNI and VBMI): the linears compute in float32")
        int8_inputs = False
    from_codes = 0
    for m in linears:
        w = m.weight
        q = cpu_quantized.compress(w) if codes else None
        if q is not None:
            q.int8_inputs = int8_inputs
            m.specdec_packed_weight, m.forward = q, types.MethodType(_quantized_forward, m)
            from_codes += 1
        else:
            m.specdec_packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach())
            m.forward = types.MethodType(_packed_forward, m)
        if id(w) not in shared:
            m.weight = torch.nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
    # transformers maps the weight files into memory; the tensors left (embeddings, norms) would keep
    # the whole mapping, and the pages the packing read, resident. Copies of them let it go.
    for p in model.parameters():
        p.data = p.data.clone()
    log.info("%d linear layers run from block-quantized codes (%s), %d on oneDNN with packed weights", from_codes,
             cpu_quantized.INT8_NAME if int8_inputs else cpu_quantized.NAME, len(linears) - from_codes)
    return len(linears)


def is_packed(model: torch.nn.Module) -> bool:
    return any(hasattr(m, "specdec_packed_weight") for m in model.modules())


def linear_kernel(model: torch.nn.Module) -> str:
    """Which kernels the model's linear layers run on (each rounds its sums in its own order)."""
    kinds = {w.name if isinstance(w, QuantizedWeight) else PACKED
             for m in model.modules() if (w := getattr(m, "specdec_packed_weight", None)) is not None}
    return "+".join(sorted(kinds)) or "torch"


class Fused:
    """Several packed linear layers that read the same input, as one: `x -> [x W_1^T | x W_2^T | ...]`
    in one oneDNN call (one read of the input, one call's overhead instead of several; SmolLM2's q/k/v
    and gate/up projections: 1 row 23.6 -> 21.0 ms, 8 rows 23.8 -> 20.3 ms for 30 layers here).
    A column's sum runs over the same inputs in the same kernel, so the fused product is bit for bit
    the layers' own (the lean pass checks its logits against the model's at the first batch anyway).
    `add(x, other)`: the product plus `other` (a residual) in the same call, also bit for bit.

    `share()` hands the layers' weights over: each layer then computes its output as its slice of the
    fused product and the separate packed weights are dropped, so fusing costs no memory once the
    fused product has been seen to agree."""

    def __init__(self, *linears: torch.nn.Linear):
        if not all(hasattr(m, "specdec_packed_weight") for m in linears):
            raise ValueError("Fused takes packed linear layers (pack_linears)")
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        weights = [m.specdec_packed_weight for m in linears]
        biases = [m.bias for m in linears]
        if any(b is not None for b in biases):
            biases = [b if b is not None else torch.zeros(n) for b, n in zip(biases, self.sizes)]
            self.bias = torch.cat(biases) if len(linears) > 1 else biases[0]
        else:
            self.bias = None
        self.parts = None  # layers of different formats: each its own call
        if len(linears) == 1:  # one layer: its own weight, for `add`
            self.weight = weights[0]
        elif (all(isinstance(w, QuantizedWeight) for w in weights)
              and len({(w.bits, w.int8_inputs) for w in weights}) == 1):
            self.weight = QuantizedWeight.cat(weights)
        elif not any(isinstance(w, QuantizedWeight) for w in weights):
            self.weight = torch.ops.mkldnn._reorder_linear_weight(torch.cat([w.to_dense() for w in weights]))
            if self.bias is not None:
                self.bias = self.bias.to(self.weight.dtype)
        else:
            self.weight, self.parts = None, linears

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is not None:
            return torch.cat([m(x) for m in self.parts], dim=-1)
        if isinstance(self.weight, QuantizedWeight):
            return self.weight(x, self.bias)
        padded, rows = _padded(x)
        return _unpadded(torch.ops.mkldnn._linear_pointwise(padded, self.weight, self.bias, "none", [], ""), x, rows)

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            return self.weight(x, self.bias, add=other)
        if self.parts is not None:
            return self(x) + other
        padded, rows = _padded(x)
        other = _padded(other)[0] if rows else other.contiguous()
        y = torch.ops.mkldnn._linear_pointwise.binary(padded, other, self.weight, self.bias, "add")
        return _unpadded(y, x, rows)

    def share(self) -> None:
        if len(self.linears) == 1 or self.parts is not None:
            return
        start = 0
        for m, n in zip(self.linears, self.sizes):
            m.forward = types.MethodType(_slice_forward(self, start, start + n), m)
            m.specdec_packed_weight = self.weight
            start += n


def _slice_forward(fused: Fused, start: int, end: int):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused(x)[..., start:end]
    return forward


def num_parameters(model: torch.nn.Module) -> int:
    """The model's parameters, counting a packed linear's weight (its parameter is left empty; a weight
    tied to another parameter, such as an LM head to the embedding, stays and is counted once)."""
    packed = sum(m.in_features * m.out_features for m in model.modules()
                 if hasattr(m, "specdec_packed_weight") and m.weight.numel() == 0)
    return sum(p.numel() for p in model.parameters()) + packed
