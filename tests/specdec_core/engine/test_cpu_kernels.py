"""specdec_core.engine.cpu_kernels: the CPU attention kernel is right (against float64 math), gives a
position the same bits however it is computed (decoded alone, verified in a block, prefilled,
batched with other sessions, on any number of threads), and a model that uses it gives the same
logits through its own forward (transformers' generate) as through BatchedBackend's batches; the
RMS norm kernel is right and row by row; the rotary embedding with the pool writes gives PyTorch's bits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_core.engine import cpu_kernels
from specdec_core.engine.batched_backend import BatchedBackend
from specdec_core.engine.cpu_linear import pack_linears
from tiny_models import ENGINE

pytestmark = pytest.mark.skipif(cpu_kernels.load(ENGINE) is None, reason="no C compiler for the kernels")

HEADS, KV_HEADS, D = 6, 2, 64


def reference(q, k, v, first_pos, scale):
    """float64 causal attention: q [T, heads, d], k/v [S, kv_heads, d] -> [T, heads, d]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        length = first_pos + t + 1
        scores = torch.einsum("hd,shd->hs", q[t].double(), k[:length]) * scale
        out[t] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[:length])
    return out


def pools(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(KV_HEADS, length, D, generator=g)
    v = torch.randn(KV_HEADS, length, D, generator=g)
    return k, v


def run(q, k_pool, v_pool, items):
    """q [T, heads, d] -> [T, heads, d] through the kernel; items (first row, rows, first_pos, slots)."""
    return cpu_kernels.Batch(items)(q.transpose(0, 1).unsqueeze(0), k_pool, v_pool, D ** -0.5)[0]


@pytest.mark.parametrize("length", [1, 7, 8, 9, 300])
def test_kernel_matches_float64_attention(length):
    k, v = pools(length, seed=length)
    rows = min(length, 5)
    q = torch.randn(rows, HEADS, D, generator=torch.Generator().manual_seed(1))
    got = run(q, k, v, [(0, rows, length - rows, torch.arange(length))])
    want = reference(q, k.transpose(0, 1), v.transpose(0, 1), length - rows, D ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.lossless
def test_a_position_gets_the_same_bits_however_it_is_computed():
    """Decoded alone, verified in a block of 6, prefilled whole, batched with another session whose
    keys are scattered over the pool, and on one thread: the same output, bit for bit."""
    length = 120
    k, v = pools(length, seed=0)
    q = torch.randn(length, HEADS, D, generator=torch.Generator().manual_seed(2))
    slots = torch.arange(length)
    prefill = run(q, k, v, [(0, length, 0, slots)])
    block = run(q[-6:], k, v, [(0, 6, length - 6, slots)])
    alone = torch.stack([run(q[t:t + 1], k, v, [(0, 1, t, slots[:t + 1])])[0] for t in range(length - 6, length)])
    # another session first in the batch, its keys in reversed slots of the same pool
    other = run(torch.cat([q[:3], q[-6:]]), k, v, [(0, 3, 40, slots.flip(0)[:43]), (3, 6, length - 6, slots)])[3:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = run(q[-6:], k, v, [(0, 6, length - 6, slots)])
    finally:
        torch.set_num_threads(threads)
    for got in (block, alone, other, one_thread):
        assert torch.equal(got, prefill[-6:])


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    pack_linears(model)
    assert cpu_kernels.enable(model)
    assert model.config._attn_implementation == cpu_kernels.NAME
    return model


@pytest.mark.lossless
def test_the_models_own_forward_and_generate_agree_bit_for_bit_with_batches():
    model = tiny_model()
    bb = BatchedBackend(model, block_size=4)
    assert bb._kernel
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (11, 30, 5)]
    handles = [bb.allocate() for _ in prompts]
    batched = bb.forward_batch([(h, p, 0) for h, p in zip(handles, prompts)])
    with torch.inference_mode():
        for p, got in zip(prompts, batched):
            assert torch.equal(model(torch.tensor([p])).logits[0], got)
        want = model.generate(torch.tensor([prompts[1]]), max_new_tokens=12, do_sample=False)[0, 30:].tolist()
    h, ids = handles[1], []
    logits = batched[1][-1:]
    for _ in range(12):  # greedy decode, each step batched with the other sessions' verify blocks
        ids.append(int(logits[-1].argmax()))
        out = bb.forward_batch([(h, ids[-1:], h.length), (handles[0], [1, 2, 3], handles[0].length)], [1, 3])
        bb.crop(handles[0], handles[0].length - 3)
        logits = out[0]
    assert ids == want


def test_padding_falls_back_to_sdpa(caplog):
    model = tiny_model()
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.inference_mode():
        padded = model(ids, attention_mask=mask).logits
        alone = model(ids[1:]).logits
    assert "runs on SDPA" in caplog.text
    torch.testing.assert_close(padded[1], alone[0], atol=1e-5, rtol=0)


def test_without_a_compiler_models_keep_sdpa(tmp_path):
    code = ("import pathlib, sys; from transformers import LlamaConfig, LlamaForCausalLM;"
            "from specdec_core.engine import cpu_kernels; from specdec_core.engine.options import EngineOptions;"
            "m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,"
            " num_attention_heads=2, num_key_value_heads=1));"
            "lib = cpu_kernels.load(EngineOptions(pathlib.Path(sys.argv[1])));"
            "print(lib is None, cpu_kernels.enable(m), m.config._attn_implementation)")
    env = {**os.environ, "CC": "/bin/false"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.stdout.split() == ["True", "False", "sdpa"], done.stderr


def test_rms_norm_is_right_and_a_row_does_not_depend_on_the_others():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(9, 576, generator=g), torch.randn(576, generator=g)
    norm = type("LlamaRMSNorm", (torch.nn.Module,), {})()
    norm.weight, norm.variance_epsilon = w, 1e-5
    forward = cpu_kernels._rms_norm_forward(lambda self, h: None)
    got = forward(norm, x)
    want = w.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(forward(norm, x[i:i + 1])[0], got[i]) for i in range(9))


def test_rope_write_gives_pytorchs_bits_and_fills_the_pools():
    """The rotary embedding in the kernel rounds each product and the sum as PyTorch does (x * cos +
    rotate_half(x) * sin), and writes each token's key and value at its slot."""
    tokens, heads, kv, d = 5, 4, 2, 64
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(tokens, heads + 2 * kv, d, generator=g)
    angles = torch.rand(tokens, d // 2, generator=g) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = d // 2
    rotated = torch.cat((-qkv[..., half:], qkv[..., :half]), dim=-1)
    want = qkv[:, :heads + kv] * cos[:, None] + rotated[:, :heads + kv] * sin[:, None]
    k_pool, v_pool = torch.zeros(kv, 16, d), torch.zeros(kv, 16, d)
    slots = torch.tensor([3, 9, 0, 15, 4])
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).contiguous()
    got = qkv.clone()
    cpu_kernels.rope_write(got, cos, signed, heads, kv, k_pool, v_pool, slots)
    assert torch.equal(got[:, :heads + kv], want)
    assert torch.equal(got[:, heads + kv:], qkv[:, heads + kv:])  # values untouched
    assert torch.equal(k_pool[:, slots], want[:, heads:].transpose(0, 1))
    assert torch.equal(v_pool[:, slots], qkv[:, heads + kv:].transpose(0, 1))
    assert not k_pool[:, [1, 2]].any()  # nothing else written


def test_enable_swaps_the_norms_forward_for_the_kernel():
    model = tiny_model()
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(1, 3, 128)
    own = type(norm).forward(norm, x)
    with torch.inference_mode():
        got = norm(x)
    torch.testing.assert_close(got, own, atol=1e-5, rtol=0)
    assert norm.forward.__func__ is not type(norm).forward
