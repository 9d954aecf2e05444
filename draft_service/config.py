"""The draft worker's configuration: built once in main() from flags (with env defaults)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

BACKENDS = ("auto", "transformers", "llama.cpp")


@dataclass(frozen=True)
class DraftConfig:
    model: str = "smollm2"
    backend: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 50051
    max_cache_tokens: int = 65536
    max_sessions: int = 8
    context_tokens: int = 4096
    sparse_top: int = 64
    threads: int = 0
    max_workers: int = 16
    log_level: str = "info"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.sparse_top < 1:
            raise ValueError("sparse_top must be >= 1")

    @property
    def resolved_backend(self) -> str:
        """auto: llama.cpp for a .gguf model when llama-cpp-python is installed, else transformers."""
        if self.backend != "auto":
            return self.backend
        from specdec_core.models import gguf_path

        if gguf_path(self.model) is not None:
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                return "transformers"
            return "llama.cpp"
        return "transformers"

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> DraftConfig:
        env = os.environ.get
        p = argparse.ArgumentParser(prog="specdec draft", description="Run the draft worker (proposes tokens).")
        p.add_argument("--model", default=env("SPECDEC_DRAFT_MODEL", cls.model),
                       help="hub id, local folder, .gguf file, or 'smollm2' (embedded default)")
        p.add_argument("--backend", choices=BACKENDS, default=env("SPECDEC_DRAFT_BACKEND", cls.backend))
        p.add_argument("--dtype", default=env("SPECDEC_DRAFT_DTYPE", cls.dtype), help="transformers backend only")
        p.add_argument("--device", default=env("SPECDEC_DRAFT_DEVICE", cls.device), help="transformers backend only")
        p.add_argument("--host", default=env("SPECDEC_DRAFT_HOST", cls.host))
        p.add_argument("--port", type=int, default=int(env("SPECDEC_DRAFT_PORT", cls.port)))
        p.add_argument("--max-cache-tokens", type=int,
                       default=int(env("SPECDEC_DRAFT_MAX_CACHE_TOKENS", cls.max_cache_tokens)),
                       help="KV-cache budget in tokens over all sessions (LRU eviction beyond it)")
        p.add_argument("--max-sessions", type=int, default=cls.max_sessions,
                       help="llama.cpp: sequence slots in the shared context")
        p.add_argument("--context-tokens", type=int, default=cls.context_tokens,
                       help="llama.cpp: context length per session")
        p.add_argument("--sparse-top", type=int, default=cls.sparse_top,
                       help="when sampling, draw from and send the top-N tokens of the draft distribution")
        p.add_argument("--threads", type=int, default=cls.threads, help="llama.cpp threads (0: all cores)")
        p.add_argument("--max-workers", type=int, default=cls.max_workers, help="gRPC handler threads")
        p.add_argument("--log-level", default=env("SPECDEC_LOG_LEVEL", cls.log_level))
        a = p.parse_args(argv)
        return cls(a.model, a.backend, a.dtype, a.device, a.host, a.port, a.max_cache_tokens, a.max_sessions,
                   a.context_tokens, a.sparse_top, a.threads, a.max_workers, a.log_level)
