"""draft_service.config: which backend `auto` stands for, and the flags that decide it."""

from __future__ import annotations

import pytest

from draft_service.config import DraftConfig, resolve_backend
from specdec_core import cpu_quantized


def test_auto_runs_a_gguf_on_our_engine_with_8_bit_inputs_where_the_cpu_has_the_kernel(monkeypatch):
    monkeypatch.setattr(cpu_quantized, "int8_available", lambda: True)
    assert resolve_backend("auto", "smollm2") == "transformers"
    cfg = DraftConfig.from_args([])
    assert cfg.quantize_inputs and cfg.resolved_backend == "transformers"


def test_auto_falls_back_to_llama_cpp_without_the_kernel_or_with_float32_inputs(monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.setattr(cpu_quantized, "int8_available", lambda: False)
    assert resolve_backend("auto", "smollm2") == "llama.cpp"
    monkeypatch.setattr(cpu_quantized, "int8_available", lambda: True)
    cfg = DraftConfig.from_args(["--no-quantize-inputs"])
    assert not cfg.quantize_inputs and cfg.resolved_backend == "llama.cpp"
    assert resolve_backend("auto", "smollm2", device="cuda") == "llama.cpp"


def test_a_named_backend_and_a_non_gguf_model_are_taken_as_they_are(monkeypatch):
    monkeypatch.setattr(cpu_quantized, "int8_available", lambda: True)
    assert resolve_backend("llama.cpp", "smollm2") == "llama.cpp"
    assert DraftConfig.from_args(["--backend", "llama.cpp"]).resolved_backend == "llama.cpp"
    assert resolve_backend("auto", "HuggingFaceTB/SmolLM2-135M-Instruct") == "transformers"


def test_the_environment_turns_8_bit_inputs_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_DRAFT_QUANTIZE_INPUTS", "0")
    assert not DraftConfig.from_args([]).quantize_inputs
