"""specdec_core.engine.lean_pass: a Llama-family model's layers run without transformers' module machinery
give bit for bit the model's own logits, in every kind of batch; a backend uses the lean pass only
after its first batch agreed, and models it does not fit keep their own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdec_core.engine.batched_backend import BatchedBackend
from specdec_core.engine.cpu_linear import pack_linears
from specdec_core.engine.lean_pass import LeanPass

VOCAB = 256
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def llama(packed: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    if packed:
        pack_linears(model)
    return model


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_steps(bb: BatchedBackend) -> list[torch.Tensor]:
    """Prefills, a ragged batch of decodes and verify blocks, a session whose blocks are scattered
    and a batch split into several passes: every logit row they return."""
    out = []
    handles = [bb.allocate() for _ in range(4)]
    out += bb.forward_batch([(h, tokens(5 + 9 * i, seed=i), 0) for i, h in enumerate(handles)])
    for step in range(3):  # decodes and verify blocks of different sizes, side by side
        out += bb.forward_batch([(h, tokens(1 + (i + step) % 4, seed=10 * step + i), h.length)
                                 for i, h in enumerate(handles)])
    bb.crop(handles[1], 3)  # a rollback, then growth into other blocks
    out += bb.forward_batch([(h, tokens(2, seed=50 + i), h.length) for i, h in enumerate(handles)])
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["torch-linears", "packed-linears"])
def test_lean_pass_is_bit_identical_to_the_model_in_every_kind_of_batch(packed):
    model = llama(packed)
    lean = BatchedBackend(model, block_size=4)
    own = BatchedBackend(model, block_size=4, lean=False)
    got, want = run_steps(lean), run_steps(own)
    assert lean._lean is not None and lean._lean_checked  # the lean pass ran from the second batch on
    assert own._lean is None
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_split_batches_run_the_lean_pass_too():
    model = llama()
    outs = []
    for lean in (True, False):
        bb = BatchedBackend(model, max_attention_elements=40, lean=lean)  # one pass per item
        handles = [bb.allocate() for _ in range(3)]
        for h, n in zip(handles, (12, 5, 9)):
            bb.forward(h, tokens(n, seed=n), 0)
        outs.append(bb.forward_batch([(h, tokens(3, seed=7 + i), h.length) for i, h in enumerate(handles)]))
        assert len(bb._groups([(h, [0, 1, 2], h.length) for h in handles])) == 3
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_a_lean_pass_that_disagrees_is_dropped_and_the_models_logits_are_used(caplog):
    model = llama()
    bb = BatchedBackend(model)
    real = bb._lean

    def off_by_a_bit(*args):
        return real(*args) + 1e-6

    bb._lean = off_by_a_bit
    handle = bb.allocate()
    first = bb.forward(handle, tokens(6, seed=1), 0)
    assert bb._lean is None and not bb._lean_checked
    assert "lean forward pass differs" in caplog.text
    reference = BatchedBackend(model, lean=False)
    assert torch.equal(first, reference.forward(reference.allocate(), tokens(6, seed=1), 0))
    second = bb.forward(handle, [3], 6)  # the model's own pass from now on
    other = reference.allocate()
    reference.forward(other, tokens(6, seed=1), 0)
    assert torch.equal(second, reference.forward(other, [3], 6))


def test_a_lean_pass_that_fails_is_dropped_and_the_batch_still_served(caplog):
    model = llama()
    bb = BatchedBackend(model)

    def broken(*args):
        raise RuntimeError("a layer it does not know")

    bb._lean = broken
    got = bb.forward(bb.allocate(), tokens(6, seed=2), 0)
    assert bb._lean is None and "lean forward pass failed" in caplog.text
    reference = BatchedBackend(model, lean=False)
    assert torch.equal(got, reference.forward(reference.allocate(), tokens(6, seed=2), 0))


def test_qwen2_layers_qualify_and_agree():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE)).eval()  # q/k/v with bias
    assert LeanPass.of(model) is not None
    got = run_steps(BatchedBackend(model, block_size=4))
    want = run_steps(BatchedBackend(model, block_size=4, lean=False))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_models_it_does_not_fit_keep_their_own_forward():
    hooked = llama()
    hooked.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: o)  # as tensor parallelism does
    assert LeanPass.of(hooked) is None
    extra = llama()
    extra.model.layers[1].self_attn.q_norm = torch.nn.LayerNorm(16)  # a layer of another shape (Qwen3's q/k norms)
    assert LeanPass.of(extra) is None
    assert BatchedBackend(extra)._lean is None
