"""Linear layers whose float32 weights are exactly block-quantized values, run from their codes.

A model dequantized from a GGUF file (the embedded default, SmolLM2-135M-Instruct Q4_1) has float32
weights that are each exactly `d * q + m` (Q4_1: 4-bit q, a scale d and a minimum m per block of 32)
or `d * q` (Q8_0: 8-bit q). A decode step reads every weight once, and on a CPU memory bandwidth is
what bounds it: 32 bits a weight where 5 or 8.5 carry the same numbers. `compress(w)` finds the
codes of such a weight (and checks them: the codes must give back every float of the weight, bit
for bit), and `QuantizedWeight` multiplies with them in the C kernel (`csrc/kernels.c`,
`specdec_quantized_linear`), which turns each block back into the same float32 weights in registers
and sums in float32. So the layer computes with exactly the model's weights: this is a storage
format, not a quantization of the model.

Every output element is summed in one fixed order (see the kernel), so a row's result depends on
that row alone: not on the other rows of the call, their number, or the threads. The order is not
oneDNN's, so results differ from the packed layers' in the last bits; every path of a worker (and
the reference `models.load_causal_lm` loads) runs the same layers.

Needs AVX-512 (F, BW, DQ) and the loaded kernels (`cpu_kernels.load`); elsewhere, or with
`EngineOptions.quantized_linears` off, layers stay on oneDNN.

`int8_inputs=True` is llama.cpp's arithmetic instead, for a draft model: each row's inputs are
quantized to 8 bits per block of 32 too and a block's products summed in integers (AVX-512 VNNI,
`specdec_quantized_linear_int8`). That is a quantization of the model (its logits move by ~1e-2), so
a target never runs it; a draft may propose from any distribution (the target's verdicts keep the
output exact), and its proposals agree with the float32 model's greedy choice about as often as
llama.cpp's. Rows stay independent of each other, the threads and the row count (seeded sampled
drafts are reproducible).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_core.engine import cpu_kernels

BLOCK = 32
NAME = "block-quantized"  # what logs and KV layouts call this kernel
INT8_NAME = "block-quantized-int8-inputs"


def available() -> bool:
    """The kernels this process loaded (`cpu_kernels.load`) run block-quantized linears on this CPU."""
    lib = cpu_kernels.library()
    return lib is not None and bool(lib.specdec_quantized_available())


def int8_available() -> bool:
    """This CPU runs the int8-input kernel (AVX-512 VNNI and VBMI)."""
    return available() and bool(cpu_kernels.library().specdec_int8_available())


@dataclass
class QuantizedWeight:
    """A weight [n, k] (n a multiple of 16, k of 32) as codes in the kernel's layout (see
    `specdec_quantized_linear` in csrc/kernels.c): `bits` 4 (Q4_1) or 8 (Q8_0); d and m (float16, as
    GGUF stores them) per block of 32 inputs and output column (m empty for Q8_0). `int8_inputs`:
    multiply in llama.cpp's arithmetic (see the module docstring)."""

    bits: int
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    shape: tuple[int, int]
    int8_inputs: bool = False

    @staticmethod
    def pack(bits: int, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> QuantizedWeight:
        """From q [n, k] (0..15 or -128..127) and d, m [n, k / 32]."""
        n, k = q.shape
        groups, blocks = n // 16, k // BLOCK
        if bits == 4:
            q = q.to(torch.uint8).reshape(groups, 16, blocks, 16, 2).permute(0, 2, 3, 1, 4)
            codes = q[..., 0] | (q[..., 1] << 4)
        else:
            codes = q.to(torch.int8).reshape(groups, 16, blocks, BLOCK).permute(0, 2, 3, 1)
        def by_group(t):  # fp16 values (checked by compress), stored as fp16: exact
            return t.reshape(groups, 16, blocks).permute(0, 2, 1).to(torch.float16).contiguous()
        return QuantizedWeight(bits, codes.contiguous(), by_group(d),
                               by_group(m) if m is not None else torch.zeros(0, dtype=torch.float16), (n, k))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., k] float32 -> x W^T (+ bias) (+ add) [..., n]."""
        n, k = self.shape
        lead = x.shape[:-1]
        flat = x.reshape(-1, k).contiguous()
        rows = flat.shape[0]
        y = torch.empty(rows, n, dtype=torch.float32)
        if add is not None:
            add = add.reshape(rows, n).contiguous()
        lib = cpu_kernels.library()
        kernel = lib.specdec_quantized_linear_int8 if self.int8_inputs else lib.specdec_quantized_linear
        failed = kernel(
            self.bits, flat.data_ptr(), k, rows, k, self.codes.data_ptr(), self.d.data_ptr(), self.m.data_ptr(), n,
            bias.data_ptr() if bias is not None else None, add.data_ptr() if add is not None else None,
            y.data_ptr(), torch.get_num_threads())
        if failed:
            raise RuntimeError("the block-quantized linear kernel failed")
        return y.reshape(*lead, n)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [n, k] the codes stand for (`pack` undone)."""
        n, k = self.shape
        groups, blocks = n // 16, k // BLOCK
        if self.bits == 4:
            q = torch.stack((self.codes & 15, self.codes >> 4), dim=-1)  # [G, B, i, c, 2]
            q = q.permute(0, 3, 1, 2, 4).reshape(n, blocks, BLOCK)
        else:
            q = self.codes.permute(0, 3, 1, 2).reshape(n, blocks, BLOCK)
        def by_column(t):
            return t.float().permute(0, 2, 1).reshape(n, blocks, 1)
        w = q.float() * by_column(self.d)
        if self.bits == 4:
            w = w + by_column(self.m)
        return w.reshape(n, k)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Weights that read the same input, as one ([W_1; W_2; ...], rows stacked: groups of 16
        columns are whole, so the codes stack as they are)."""
        first = parts[0]
        if any((p.bits, p.shape[1], p.int8_inputs) != (first.bits, first.shape[1], first.int8_inputs) for p in parts):
            raise ValueError("only weights of the same format, arithmetic and input size stack")
        return QuantizedWeight(first.bits, torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]),
                               torch.cat([p.m for p in parts]), (sum(p.shape[0] for p in parts), first.shape[1]),
                               first.int8_inputs)

    @property
    def name(self) -> str:
        return INT8_NAME if self.int8_inputs else NAME

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m))


def compress(w: torch.Tensor) -> QuantizedWeight | None:
    """The codes of a float32 weight [n, k] whose every block of 32 along k is exactly Q8_0 or Q4_1
    (fp16 d and m, as GGUF stores them), or None. Checked: the codes give back every float bit for bit."""
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[0] % 16 or w.shape[1] % BLOCK or not w.numel():
        return None
    n, k = w.shape
    blocks = w.detach().reshape(-1, BLOCK)
    found = _fit(blocks, None, blocks.abs().amax(dim=1) / 127, -128, 127)
    if found is not None:
        return QuantizedWeight.pack(8, found[0].reshape(n, k), found[1].reshape(n, -1), None)
    low = blocks.amin(dim=1)  # Q4_1: the block's minimum is m itself (its q is 0), an fp16 value
    if not torch.equal(low.half().float(), low):
        return None
    found = _fit(blocks, low, (blocks.amax(dim=1) - low) / 15, 0, 15)
    if found is not None:
        return QuantizedWeight.pack(4, found[0].reshape(n, k), found[1].reshape(n, -1), low.reshape(n, -1))
    return None


def _fit(blocks: torch.Tensor, m: torch.Tensor | None, d_guess: torch.Tensor, lo: int, hi: int
         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q, d) with every block [32] bit for bit fl(d * q (+ m)), q in lo..hi and d an fp16 value
    (the guess rounded to fp16, or one of its neighbours: rounding may have moved it), or None."""
    q_all = torch.zeros_like(blocks, dtype=torch.int16)
    scale = torch.zeros_like(d_guess)
    found = torch.zeros_like(d_guess, dtype=torch.bool)
    shifted = blocks if m is None else blocks - m[:, None]
    h = d_guess.clamp(max=65504.0).half().view(torch.int16)
    for bits in (h, h + 1, h - 1):
        d = bits.view(torch.float16).float()
        q = torch.round(shifted / torch.where(d > 0, d, torch.ones_like(d))[:, None]).clamp(lo, hi)
        back = q * d[:, None] if m is None else q * d[:, None] + m[:, None]  # d q is exact: one rounding, as an FMA
        ok = ~found & (d >= 0) & (back.view(torch.int32) == blocks.view(torch.int32)).all(dim=1)
        scale = torch.where(ok, d, scale)
        q_all[ok] = q[ok].to(torch.int16)
        found |= ok
        if found.all():
            return q_all, scale
    return None
