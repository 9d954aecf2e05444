"""draft_service.config: which backend `auto` stands for, and the flags that decide it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from draft_service.config import DraftConfig, resolve_backend
from specdec_core.engine import cpu_quantized
from tiny_models import ENGINE


def test_auto_runs_a_gguf_on_our_engine_with_8_bit_inputs_where_the_cpu_has_the_kernel(monkeypatch):
    monkeypatch.setattr(cpu_quantized, "int8_available", lambda: True)
    assert resolve_backend("auto", "smollm2", ENGINE) == "transformers"
    cfg = DraftConfig.from_args([])
    assert cfg.quantize_inputs and cfg.resolved_backend == "transformers"


def test_auto_falls_back_to_llama_cpp_without_the_kernel_or_with_float32_inputs(monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.setattr(cpu_quantized, "int8_available", lambda: False)
    assert resolve_backend("auto", "smollm2", ENGINE) == "llama.cpp"
    monkeypatch.setattr(cpu_quantized, "int8_available", lambda: True)
    cfg = DraftConfig.from_args(["--no-quantize-inputs"])
    assert not cfg.quantize_inputs and cfg.resolved_backend == "llama.cpp"
    assert resolve_backend("auto", "smollm2", ENGINE, device="cuda") == "llama.cpp"


def test_a_named_backend_and_a_non_gguf_model_are_taken_as_they_are(monkeypatch):
    monkeypatch.setattr(cpu_quantized, "int8_available", lambda: True)
    assert resolve_backend("llama.cpp", "smollm2", ENGINE) == "llama.cpp"
    assert DraftConfig.from_args(["--backend", "llama.cpp"]).resolved_backend == "llama.cpp"
    assert resolve_backend("auto", "HuggingFaceTB/SmolLM2-135M-Instruct", ENGINE) == "transformers"


def test_the_environment_turns_8_bit_inputs_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_DRAFT_QUANTIZE_INPUTS", "0")
    assert not DraftConfig.from_args([]).quantize_inputs


def test_the_engine_flags_take_their_defaults_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECDEC_QUANTIZED_LINEARS", "0")
    engine = DraftConfig.from_args([]).engine
    assert engine.cache_dir == tmp_path and not engine.quantized_linears and engine.packed_linears
    assert DraftConfig.from_args(["--quantized-linears", "--no-cpu-attention"]).engine.quantized_linears
    assert not DraftConfig.from_args(["--no-cpu-attention"]).engine.cpu_attention


def test_without_the_quantized_linears_auto_does_not_count_on_the_int8_kernel(monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.setattr(cpu_quantized, "int8_available", lambda: True)
    assert resolve_backend("auto", "smollm2", replace(ENGINE, quantized_linears=False)) == "llama.cpp"
