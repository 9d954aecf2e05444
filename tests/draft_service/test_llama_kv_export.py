"""LlamaCppBackend KV export/import of token ranges on the real SmolLM2 GGUF: chunks exported from
one backend and imported into a fresh one continue the sequence with bit-identical logits."""

from __future__ import annotations

import llama_cpp
import pytest
import torch

from draft_service.llama_backend import LlamaCppBackend
from specdec_core.engine.models import embedded_gguf_path

pytestmark = pytest.mark.slow

TEXT = ("<|im_start|>user\nTell me, in a few sentences, why the sky looks blue at noon and red at sunset, "
        "and what that has to do with the size of the molecules in the air.<|im_end|>\n<|im_start|>assistant\n"
        "Sunlight is a mix of colours. As it passes through the atmosphere, the short blue wavelengths are "
        "scattered by nitrogen and oxygen molecules far more strongly than the long red ones, so blue light "
        "reaches your eyes from every direction of the sky. At sunset the light crosses much more air, the "
        "blue is scattered away before it arrives, and the reds and oranges are what is left. The same "
        "effect, called Rayleigh scattering, makes distant mountains look bluish and hazy on a clear "
        "summer day, and it is why the sky of Mars, with its fine red dust, looks butterscotch.")
N_BATCH = 16  # divides 64 and 128: the reference and the imported sequence see the same decode chunks


def make_backend() -> LlamaCppBackend:
    return LlamaCppBackend(str(embedded_gguf_path()), n_ctx=256, max_sequences=3, n_batch=N_BATCH)


@pytest.fixture(scope="module")
def backends():
    a, b = make_backend(), make_backend()
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def exported(backends):
    """150 tokens prefilled into a sequence of backend a; its blobs of [0, 64) and [64, 128); and the
    reference logits of tokens 128..150 fed onto its first 128 tokens (cropped back to them)."""
    a, _ = backends
    ids = a.tokenize(TEXT)[:150]
    assert len(ids) == 150
    handle = a.allocate()
    try:
        a.forward(handle, ids, 0, num_logits=0)
        blobs = a.export_kv(handle, [(0, 64), (64, 128)])
        a.crop(handle, 128)
        reference = a.forward(handle, ids[128:], 128)
    finally:
        a.free(handle)
    return ids, blobs, reference


def test_round_trip_into_a_fresh_backend_is_bit_exact(backends, exported):
    """The blobs hold the very bytes of a's cells and b decodes tokens 128..150 in the same chunks
    on top of them, so b's logits must equal a's exactly, not approximately."""
    _, b = backends
    ids, blobs, reference = exported
    handle = b.allocate()
    try:
        assert b.import_kv(handle, 0, blobs) == 128 and b.num_cached(handle) == 128
        width = b.kv_bytes_per_token
        assert b.export_kv(handle, [(0, 128), (10, 20)]) == [blobs[0] + blobs[1],
                                                             blobs[0][10 * width : 20 * width]]
        assert torch.equal(b.forward(handle, ids[128:], 128), reference)
    finally:
        b.free(handle)


def test_import_on_top_of_a_locally_computed_prefix(backends, exported):
    _, b = backends
    ids, blobs, reference = exported
    handle = b.allocate()
    try:
        b.forward(handle, ids[:64], 0, num_logits=0)
        assert b.export_kv(handle, [(0, 64)]) == blobs[:1]  # same chunks, same bytes as a computed
        assert b.import_kv(handle, 64, blobs[1:]) == 128
        assert torch.equal(b.forward(handle, ids[128:], 128), reference)
    finally:
        b.free(handle)


def test_bad_blobs_raise_and_leave_the_sequence_holding_its_prefix(backends, exported, monkeypatch):
    _, b = backends
    ids, blobs, reference = exported
    handle = b.allocate()
    try:
        b.forward(handle, ids[:64], 0, num_logits=0)
        for bad in ([blobs[1][:-1]], [blobs[1], b"\0" * 7], [blobs[1][: len(blobs[1]) // 2 + 1]]):
            with pytest.raises(ValueError, match="multiple of"):
                b.import_kv(handle, 64, bad)
            assert b.num_cached(handle) == 64
        with pytest.raises(ValueError, match="holds 64 tokens"):
            b.import_kv(handle, 63, blobs[1:])

        real = llama_cpp.llama_state_seq_set_data
        refusals = []

        def refuse_once(ctx, src, size, seq_id):  # as llama.cpp does on a bad state: empty it, return 0
            if refusals:
                return real(ctx, src, size, seq_id)
            refusals.append(seq_id)
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq_id, -1, -1)
            return 0

        monkeypatch.setattr(llama_cpp, "llama_state_seq_set_data", refuse_once)
        with pytest.raises(ValueError, match="refused .* now holds 64 tokens"):
            b.import_kv(handle, 64, blobs[1:])
        monkeypatch.undo()
        assert refusals == [handle] and b.num_cached(handle) == 64
        assert b.export_kv(handle, [(0, 64)]) == blobs[:1]

        assert b.import_kv(handle, 64, blobs[1:]) == 128  # still usable, and exact
        assert torch.equal(b.forward(handle, ids[128:], 128), reference)
    finally:
        b.free(handle)


def make_fresh_layout() -> str:
    fresh = make_backend()
    try:
        return fresh.kv_layout()  # before any session exists
    finally:
        fresh.close()


def test_layout_and_blob_sizes(backends, exported):
    a, b = backends
    _, blobs, _ = exported
    assert a.kv_layout() == b.kv_layout() == make_fresh_layout()
    assert a.kv_bytes_per_token == 30 * 2 * 384  # 30 layers of f16 K and V rows, 3 KV heads x 64
    assert "v_trans=0" in a.kv_layout() and "layers=30" in a.kv_layout()
    assert [len(blob) for blob in blobs] == [64 * a.kv_bytes_per_token] * 2
    handle = a.allocate()
    try:
        a.forward(handle, [1, 2, 3, 4, 5], 0, num_logits=0)
        sizes = [len(x) for x in a.export_kv(handle, [(0, 5), (2, 2), (4, 5)])]
        assert sizes == [5 * a.kv_bytes_per_token, 0, a.kv_bytes_per_token]
        with pytest.raises(ValueError):
            a.export_kv(handle, [(3, 6)])  # past what the sequence holds
    finally:
        a.free(handle)


def test_transposed_v_without_flash_attention_round_trips(exported, monkeypatch):
    """With flash attention off llama.cpp stores V transposed (v_trans=1); the blobs stay
    token-major and the round trip is still exact."""
    ids, _, _ = exported
    default_params = llama_cpp.llama_context_default_params

    def no_flash_attention():
        params = default_params()
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        return params

    monkeypatch.setattr(llama_cpp, "llama_context_default_params", no_flash_attention)
    backend = make_backend()
    try:
        assert "v_trans=1" in backend.kv_layout()
        src, dst = backend.allocate(), backend.allocate()
        backend.forward(src, ids, 0, num_logits=0)
        blobs = backend.export_kv(src, [(0, 64), (64, 128)])
        backend.crop(src, 128)
        reference = backend.forward(src, ids[128:], 128)
        backend.forward(dst, ids[:64], 0, num_logits=0)
        assert backend.export_kv(dst, [(0, 64)]) == blobs[:1]
        assert backend.import_kv(dst, 64, blobs[1:]) == 128
        assert backend.export_kv(dst, [(0, 128)]) == [blobs[0] + blobs[1]]
        assert torch.equal(backend.forward(dst, ids[128:], 128), reference)
    finally:
        backend.close()
