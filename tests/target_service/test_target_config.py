"""target_service.config: the engine's switches are flags, with the environment as their defaults."""

from __future__ import annotations

from pathlib import Path

from target_service.config import TargetConfig


def test_the_engine_flags_take_their_defaults_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECDEC_CPU_ATTENTION", "0")
    cfg = TargetConfig.from_args([])
    assert cfg.engine.cache_dir == tmp_path and not cfg.engine.cpu_attention and cfg.engine.packed_linears
    cfg = TargetConfig.from_args(["--cpu-attention", "--no-packed-linears", "--cache-dir", "/srv/cache"])
    assert cfg.engine.cpu_attention and not cfg.engine.packed_linears and cfg.engine.cache_dir == Path("/srv/cache")
    assert cfg.kv_store.chunk_tokens == 64 and cfg.prefill_stall == 1.6  # the fields after it are where they were
