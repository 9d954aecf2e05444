"""specdec_core.engine.cpu_quantized: float32 weights that are exactly GGUF Q4_1 or Q8_0 values run from their
codes with exactly those weights (a storage format, not a quantization), every output row the same
whatever else shares the call, and the models made of them give the lean pass's bits and a batch's.

The weights are made as the embedded default model's are: quantized by GGUF's own code (gguf-py) and
dequantized to float32. The kernel needs AVX-512; on a CPU without it the layers stay on oneDNN
(the last test checks that fallback on any CPU). The int8-input variant (a draft's, llama.cpp's
arithmetic) is checked against its own reference and for the same row independence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import GGMLQuantizationType, dequantize, quantize
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_core.engine import cpu_kernels, cpu_linear, cpu_quantized
from specdec_core.engine.batched_backend import BatchedBackend
from specdec_core.engine.cpu_quantized import QuantizedWeight
from tiny_models import ENGINE

cpu_kernels.load(ENGINE)
needs_kernel = pytest.mark.skipif(not cpu_quantized.available(), reason="the kernel needs AVX-512 (F, BW, DQ)")
needs_int8 = pytest.mark.skipif(not cpu_quantized.int8_available(),
                                reason="the int8-input kernel needs AVX-512 VNNI and VBMI")
FORMATS = {4: GGMLQuantizationType.Q4_1, 8: GGMLQuantizationType.Q8_0}


def gguf_weight(n: int, k: int, bits: int, seed: int = 0) -> torch.Tensor:
    """A float32 [n, k] weight as a GGUF file's dequantized Q4_1 / Q8_0 tensor."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return torch.from_numpy(dequantize(quantize(w, FORMATS[bits]), FORMATS[bits]).copy())


@pytest.mark.parametrize("bits", [4, 8])
def test_compress_finds_the_codes_that_give_back_every_float(bits):
    w = gguf_weight(48, 96, bits)
    q = cpu_quantized.compress(w)
    assert q is not None and q.bits == bits
    assert torch.equal(q.dequantized(), w)
    assert q.nbytes() * 8 / w.numel() <= (5 if bits == 4 else 8.5)  # bits per weight (GGUF's own), against float32's 32
    # weights that are not on such a grid, or of a shape the kernel does not take, stay as they are
    assert cpu_quantized.compress(w + 1e-4 * torch.randn_like(w)) is None
    assert cpu_quantized.compress(w[:40]) is None  # n not a multiple of 16
    assert cpu_quantized.compress(w[:, :80]) is None  # k not a multiple of 32


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_computes_with_exactly_those_weights(bits):
    """Against float64 products of the same float32 weights: float32 rounding, nothing more."""
    w = gguf_weight(96, 1536, bits, seed=1)
    q = cpu_quantized.compress(w)
    x = torch.randn(24, 1536, generator=torch.Generator().manual_seed(2))
    want = x.double() @ w.double().T
    got = q(x)
    assert (got.double() - want).abs().max() / want.abs().max() < 1e-5


@needs_kernel
@pytest.mark.parametrize("int8_inputs", [False, pytest.param(True, marks=needs_int8)])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_result_depends_on_that_row_alone(bits, int8_inputs):
    """Batch invariance across every path of the kernel (a few rows dequantize in registers, 9-15 in
    two tiles, 16 or more through a dequantized panel; with int8 inputs, tiles of 8 rows and a
    ragged last one), thread counts, bias and residual: each row bit for bit what it gives alone,
    and `add` bit for bit the product plus the residual (a seeded sampled draft must not depend on
    its batch either)."""
    w = gguf_weight(80, 192, bits, seed=3)  # 5 groups of 16 columns: an odd one at the end
    q = cpu_quantized.compress(w)
    q.int8_inputs = int8_inputs
    bias = torch.randn(80)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, 192, generator=gen)
    residual = torch.randn(40, 80, generator=gen)
    alone = torch.cat([q(x[r:r + 1], bias) for r in range(40)])
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for rows in (1, 3, 8, 9, 13, 16, 17, 40):
                assert torch.equal(q(x[:rows], bias), alone[:rows]), (rows, n_threads)
                assert torch.equal(q(x[:rows], bias, add=residual[:rows]), alone[:rows] + residual[:rows])
    finally:
        torch.set_num_threads(threads)
    # a strided input (a slice of a wider tensor) reads the same numbers
    wide = torch.cat((x, torch.randn(40, 8)), dim=1)
    assert torch.equal(q(wide[:5, :192], bias), alone[:5])


@needs_kernel
def test_stacked_weights_give_each_weights_own_product():
    parts = [cpu_quantized.compress(gguf_weight(n, 64, 4, seed=n)) for n in (64, 32, 32)]
    x = torch.randn(7, 64)
    assert torch.equal(QuantizedWeight.cat(parts)(x), torch.cat([p(x) for p in parts], dim=-1))


@needs_kernel
def test_fused_layers_of_different_formats_give_each_layers_own_product():
    """q in Q4_1, k in Q8_0, v not on any grid (oneDNN): fused, each layer still computes in its own kernel."""
    q, k, v = (torch.nn.Linear(64, n, bias=False) for n in (64, 32, 32))
    with torch.no_grad():
        q.weight.copy_(gguf_weight(64, 64, 4, seed=1))
        k.weight.copy_(gguf_weight(32, 64, 8, seed=2))
    model = torch.nn.ModuleList([q, k, v]).eval()
    cpu_linear.pack_linears(model)
    assert [type(m.specdec_packed_weight) is QuantizedWeight for m in (q, k, v)] == [True, True, False]
    x = torch.randn(1, 5, 64)
    with torch.inference_mode():
        alone = torch.cat([m(x) for m in (q, k, v)], dim=-1)
        qkv = cpu_linear.Fused(q, k, v)
        assert torch.equal(qkv(x), alone)
        qkv.share()  # nothing to share between formats: the layers keep their own weights
        assert torch.equal(torch.cat([m(x) for m in (q, k, v)], dim=-1), alone)


def llama_cpp_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T in float64 with x quantized as llama.cpp quantizes a row for a dot product with Q4_1 /
    Q8_0 blocks: per block of 32, d = max |x| / 127 and q = round(x * (127 / max |x|)), in float32."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)
    return (q.double() * (amax / 127).double()).reshape(x.shape) @ w.double().T


@needs_int8
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_inputs_compute_in_llama_cpps_arithmetic(bits):
    """Against float64 products of the 8-bit inputs: float32 rounding, nothing more; and the inputs
    really are quantized (the product is not the float32 one). A block of zeros gives zeros, not NaN."""
    w = gguf_weight(96, 1536, bits, seed=1)
    q = cpu_quantized.compress(w)
    q.int8_inputs = True
    x = torch.randn(24, 1536, generator=torch.Generator().manual_seed(2))
    x[3, 64:96] = 0
    want = llama_cpp_product(x, w)
    got = q(x)
    assert (got.double() - want).abs().max() / want.abs().max() < 1e-5
    exact = x.double() @ w.double().T
    assert (got.double() - exact).abs().max() / exact.abs().max() > 1e-4
    assert torch.isfinite(got).all()


def gguf_llama(tie: bool = True) -> LlamaForCausalLM:
    """A tiny Llama whose linear layers are Q4_1 values and whose (tied) embeddings Q8_0, as in the
    embedded default model's GGUF file."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for i, m in enumerate(model.modules()):
            if isinstance(m, torch.nn.Linear) and m is not model.lm_head:
                m.weight.copy_(gguf_weight(*m.weight.shape, 4, seed=i))
        model.model.embed_tokens.weight.copy_(gguf_weight(256, 64, 8, seed=99))
    return model


def assert_lean_and_batch_invariant(model) -> None:
    """The lean pass (fused q/k/v and gate/up, residuals in the output projections) gives the model's
    own bits, and a session's logits do not depend on its batch."""
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (20 + 3 * i,), generator=gen).tolist() for i in range(8)]
    own, lean = BatchedBackend(model, lean=False), BatchedBackend(model)
    solo = [own.allocate() for _ in seqs]
    batch = [lean.allocate() for _ in seqs]
    for h, s in zip(solo, seqs):
        own.forward(h, s[:-1], 0)
    lean.forward_batch([(h, s[:-1], 0) for h, s in zip(batch, seqs)])
    together = lean.forward_batch([(h, s[-1:], len(s) - 1) for h, s in zip(batch, seqs)])
    assert lean._lean is not None and lean._lean_checked
    for h, s, got in zip(solo, seqs, together):
        assert torch.equal(own.forward(h, s[-1:], len(s) - 1), got)


@needs_kernel
def test_a_gguf_models_layers_run_from_codes_with_the_models_logits_and_batch_invariance():
    model = gguf_llama()
    ids = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(ids).logits
        assert cpu_linear.pack_linears(model) == 2 * 7 + 1
        got = model(ids).logits
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(isinstance(m.specdec_packed_weight, QuantizedWeight) for m in linears)
    assert model.lm_head.specdec_packed_weight.bits == 8
    assert model.model.layers[0].mlp.up_proj.weight.numel() == 0  # the float32 copy is gone
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert_lean_and_batch_invariant(model)


@needs_int8
def test_a_draft_with_int8_inputs_is_close_to_the_model_and_batch_invariant():
    """pack_linears(int8_inputs=True): every block-quantized layer (fused ones too) in llama.cpp's
    arithmetic, named so in the KV layout; logits near the float32 model's, not its bits; a
    session's logits the same alone and in a batch."""
    model = gguf_llama()
    ids = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(ids).logits
        cpu_linear.pack_linears(model, int8_inputs=True)
        got = model(ids).logits
    assert cpu_linear.linear_kernel(model) == cpu_quantized.INT8_NAME
    assert not torch.equal(got, want)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert_lean_and_batch_invariant(model)


@needs_kernel
def test_int8_inputs_without_their_kernel_compute_in_float32(monkeypatch):
    """A CPU without VNNI: the draft's layers still run from their codes, in float32 (logged)."""
    monkeypatch.setattr(cpu_quantized, "int8_available", lambda: False)
    model = gguf_llama()
    cpu_linear.pack_linears(model, int8_inputs=True)
    assert cpu_linear.linear_kernel(model) == cpu_quantized.NAME


def test_without_the_kernel_the_layers_stay_on_onednn():
    """`EngineOptions.quantized_linears` off (or a CPU without AVX-512): the same model on oneDNN's
    packed layers."""
    if not cpu_linear.available(torch.float32):
        pytest.skip("PyTorch built without oneDNN")
    model = gguf_llama()
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(ids).logits
        cpu_linear.pack_linears(model, quantized=False)
        got = model(ids).logits
    assert not any(isinstance(m.specdec_packed_weight, QuantizedWeight)
                   for m in model.modules() if isinstance(m, torch.nn.Linear))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
