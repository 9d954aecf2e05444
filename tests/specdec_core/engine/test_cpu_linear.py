"""specdec_core.engine.cpu_linear: linear layers on oneDNN with packed weights give the model's logits
(to float32 rounding), every row the same whatever else shares the batch, and free the weights
they replace."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_core.engine import cpu_linear
from specdec_core.engine.batched_backend import BatchedBackend

pytestmark = pytest.mark.skipif(not cpu_linear.available(torch.float32), reason="PyTorch built without oneDNN")


def tiny(tie: bool, intermediate: int = 128) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tie", [True, False])
def test_packed_model_gives_the_same_logits(tie):
    model = tiny(tie)
    ids = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(ids).logits
        assert cpu_linear.pack_linears(model) == 2 * 7 + 1
        got = model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert cpu_linear.is_packed(model) and cpu_linear.pack_linears(model) == 0  # once only
    # the replaced weights are gone; a tied LM head keeps the embeddings' weight
    assert model.model.layers[0].mlp.up_proj.weight.numel() == 0
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    assert model.lm_head.weight.numel() == (256 * 64 if tie else 0)
    assert model.model.embed_tokens.weight.numel() == 256 * 64


def test_a_sessions_logits_do_not_depend_on_its_batch():
    """Batch invariance: a session's logits are bit-identical alone and batched with others
    (PyTorch's BLAS path rounds 1-3 rows differently from 8; oneDNN rounds a single row differently
    from two or more where a layer reads 1536 or more inputs, as SmolLM2's down projection does)."""
    model = tiny(True, intermediate=1536)
    cpu_linear.pack_linears(model)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (20 + 3 * i,), generator=gen).tolist() for i in range(8)]
    solo_bb, batch_bb = BatchedBackend(model), BatchedBackend(model)
    solo, batch = [solo_bb.allocate() for _ in seqs], [batch_bb.allocate() for _ in seqs]
    for h, s in zip(solo, seqs):
        solo_bb.forward(h, s[:-1], 0)
    batch_bb.forward_batch([(h, s[:-1], 0) for h, s in zip(batch, seqs)])
    together = batch_bb.forward_batch([(h, s[-1:], len(s) - 1) for h, s in zip(batch, seqs)])
    for h, s, got in zip(solo, seqs, together):
        assert torch.equal(solo_bb.forward(h, s[-1:], len(s) - 1), got)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
def test_fused_layers_give_each_layers_own_product_and_residual_sum(rows):
    """q/k/v (with biases, as Qwen2 has) and gate/up as one call: each layer's columns bit for bit its
    own product, `add` bit for bit the product plus the residual; after `share()` the layers compute
    from the fused weight (their own packed weights dropped) and still give the same numbers."""
    torch.manual_seed(3)
    q, k, v = torch.nn.Linear(64, 64), torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    o = torch.nn.Linear(64, 64, bias=False)
    model = torch.nn.ModuleList([q, k, v, o]).eval()
    cpu_linear.pack_linears(model)
    x = torch.randn(1, rows, 64)
    residual = torch.randn(1, rows, 64)
    with torch.inference_mode():
        alone = [m(x) for m in (q, k, v)]
        qkv = cpu_linear.Fused(q, k, v)
        assert torch.equal(qkv(x), torch.cat(alone, dim=-1))
        assert torch.equal(cpu_linear.Fused(o).add(x, residual), o(x) + residual)
        qkv.share()
        assert q.specdec_packed_weight is qkv.weight
        assert all(torch.equal(m(x), want) for m, want in zip((q, k, v), alone))
