"""The target worker's configuration: built once in main() from flags (with env defaults)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TargetConfig:
    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 50052
    max_cache_tokens: int = 65536
    max_workers: int = 16
    tensor_parallel_size: int = 1
    dist_timeout_s: float = 60.0
    log_level: str = "info"

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_cache_tokens < 1:
            raise ValueError("max_cache_tokens must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype}")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> TargetConfig:
        env = os.environ.get
        p = argparse.ArgumentParser(
            prog="specdec target", description="Run the target worker (verifies draft tokens)."
        )
        p.add_argument("--model", default=env("SPECDEC_TARGET_MODEL", cls.model),
                       help="hub id, local folder, .gguf file, or 'smollm2' (embedded default)")
        p.add_argument("--dtype", default=env("SPECDEC_TARGET_DTYPE", cls.dtype))
        p.add_argument("--device", default=env("SPECDEC_TARGET_DEVICE", cls.device))
        p.add_argument("--host", default=env("SPECDEC_TARGET_HOST", cls.host))
        p.add_argument("--port", type=int, default=int(env("SPECDEC_TARGET_PORT", cls.port)))
        p.add_argument("--max-cache-tokens", type=int,
                       default=int(env("SPECDEC_TARGET_MAX_CACHE_TOKENS", cls.max_cache_tokens)),
                       help="KV-cache budget in tokens over all sessions (LRU eviction beyond it)")
        p.add_argument("--max-workers", type=int, default=cls.max_workers, help="gRPC handler threads")
        p.add_argument("--tensor-parallel-size", "--tp", type=int,
                       default=int(env("SPECDEC_TENSOR_PARALLEL_SIZE", cls.tensor_parallel_size)),
                       help="shard the model over N ranks (started under torchrun automatically)")
        p.add_argument("--dist-timeout", type=float, default=cls.dist_timeout_s,
                       help="seconds before a collective with a dead rank fails (then the service exits)")
        p.add_argument("--log-level", default=env("SPECDEC_LOG_LEVEL", cls.log_level))
        a = p.parse_args(argv)
        return cls(a.model, a.dtype, a.device, a.host, a.port, a.max_cache_tokens, a.max_workers,
                   a.tensor_parallel_size, a.dist_timeout, a.log_level)
