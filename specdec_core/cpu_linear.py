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
the same step batched by 5e-5 in the logits. Packing asks oneDNN once per weight shape whether a
row alone comes out as it does among others; where it does not, a one-row input runs as two (the
row twice). Only there: the two-row product costs 20% more than the one-row kernel over all layers. The
results differ from BLAS's in the last bits (3e-6 on these layers), as any two kernels do: the
reference a worker's output is compared with must run the same kernels, which it does when it is
loaded by `models.load_causal_lm` too.

`pack_linears(model)` swaps the forward of every `nn.Linear` of a CPU model in float32 (or
bfloat16 where oneDNN has it) for the packed one. A layer whose weight is also another module's
(tied input embeddings and LM head) keeps its weight and gains the packed copy; any other layer's
weight is replaced by the packed copy, so the model's memory does not grow (tied weights aside).
"""

from __future__ import annotations

import logging
import types

import torch

log = logging.getLogger(__name__)

PACKED = "onednn-packed"  # what kv layouts and logs call this kernel


def available(dtype: torch.dtype) -> bool:
    """oneDNN can run packed linears of this dtype on this CPU."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    if self.specdec_one_row_differs and x.dim() >= 2 and x.numel() == x.shape[-1]:  # one row: run two
        two = torch.ops.mkldnn._linear_pointwise(x.expand(*x.shape[:-2], 2, x.shape[-1]).contiguous(),
                                                 self.specdec_packed_weight, self.bias, "none", [], "")
        return two[..., :1, :]
    return torch.ops.mkldnn._linear_pointwise(x, self.specdec_packed_weight, self.bias, "none", [], "")


def _one_row_differs(m: torch.nn.Linear, seen: dict) -> bool:
    """Whether oneDNN gives a row alone another result than the same row among others, for this
    layer's shape (asked once per shape, on random rows, at the current thread count: asking at
    other thread counts at load time, torch.set_num_threads back and forth, left the target worker's
    passes 1.6x slower in the benchmark run)."""
    packed, bias = m.specdec_packed_weight, m.bias
    key = (m.in_features, m.out_features, packed.dtype, bias is not None)
    if key not in seen:
        x = torch.randn(4, m.in_features, generator=torch.Generator().manual_seed(0)).to(packed.dtype)
        many = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        seen[key] = any(not torch.equal(torch.ops.mkldnn._linear_pointwise(x[i:i + 1], packed, bias, "none", [], ""),
                                        many[i:i + 1]) for i in range(4))
    return seen[key]


@torch.no_grad()
def pack_linears(model: torch.nn.Module) -> int:
    """Pack every linear layer of a CPU model (see the module docstring); the number packed.
    A no-op (0) for a model on another device, of another dtype, or already packed."""
    linears = [m for m in model.modules()
               if isinstance(m, torch.nn.Linear) and not hasattr(m, "specdec_packed_weight")]
    if not linears or linears[0].weight.device.type != "cpu" or not available(linears[0].weight.dtype):
        return 0
    shared = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear)
              for p in m.parameters(recurse=False)}
    seen: dict = {}
    for m in linears:
        w = m.weight
        m.specdec_packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        m.specdec_one_row_differs = _one_row_differs(m, seen)
        m.forward = types.MethodType(_packed_forward, m)
        if id(w) not in shared:
            m.weight = torch.nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
    # transformers maps the weight files into memory; the tensors left (embeddings, norms) would keep
    # the whole mapping, and the pages the packing read, resident. Copies of them let it go.
    for p in model.parameters():
        p.data = p.data.clone()
    log.info("%d linear layers run on oneDNN with packed weights", len(linears))
    return len(linears)


def is_packed(model: torch.nn.Module) -> bool:
    return any(hasattr(m, "specdec_packed_weight") for m in model.modules())
