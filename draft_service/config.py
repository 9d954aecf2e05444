"""The draft worker's configuration: built once in main() from flags (with env defaults)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from specdec_core.engine.options import EngineOptions
from specdec_core.serving.kvstore import KVStoreOptions
from specdec_core.serving.server import ServerOptions

BACKENDS = ("auto", "transformers", "llama.cpp")


@dataclass(frozen=True)
class DraftConfig:
    server: ServerOptions
    engine: EngineOptions
    model: str = "smollm2"
    backend: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"
    quantize_inputs: bool = True
    max_cache_tokens: int = 65536
    max_sessions: int = 16
    context_tokens: int = 2048
    sparse_top: int = 64
    max_queue: int = 64
    threads: int = 0
    prefill_chunk: int = 32
    kv_store: KVStoreOptions = KVStoreOptions()

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.sparse_top < 1:
            raise ValueError("sparse_top must be >= 1")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {self.prefill_chunk}")
        if min(self.max_queue, self.max_sessions, self.context_tokens, self.max_cache_tokens) < 1:
            raise ValueError("max_queue, max_sessions, context_tokens and max_cache_tokens must be >= 1")

    @property
    def resolved_backend(self) -> str:
        return resolve_backend(self.backend, self.model, self.engine, self.device, self.quantize_inputs)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> DraftConfig:
        env = os.environ.get
        p = argparse.ArgumentParser(prog="specdec draft", description="Run the draft worker (proposes tokens).")
        p.add_argument("--model", default=env("SPECDEC_DRAFT_MODEL", cls.model),
                       help="hub id, local folder, .gguf file, or 'smollm2' (embedded default)")
        p.add_argument("--backend", choices=BACKENDS, default=env("SPECDEC_DRAFT_BACKEND", cls.backend))
        p.add_argument("--dtype", default=env("SPECDEC_DRAFT_DTYPE", cls.dtype), help="transformers backend only")
        p.add_argument("--device", default=env("SPECDEC_DRAFT_DEVICE", cls.device), help="transformers backend only")
        p.add_argument("--quantize-inputs", action=argparse.BooleanOptionalAction,
                       default=env("SPECDEC_DRAFT_QUANTIZE_INPUTS", "1") != "0",
                       help="transformers backend, CPU: linear layers whose weights are block-quantized (a GGUF "
                            "model) quantize their inputs to 8 bits as well and sum in integers, llama.cpp's "
                            "arithmetic (AVX-512 VNNI): a cheaper draft step whose proposals agree with the "
                            "float32 model nearly always; the target's verdicts keep the output exact")
        p.add_argument("--max-cache-tokens", type=int,
                       default=int(env("SPECDEC_DRAFT_MAX_CACHE_TOKENS", cls.max_cache_tokens)),
                       help="transformers backend: KV-cache size in tokens over all sessions (idle sessions "
                            "are evicted least recently used first to make room)")
        p.add_argument("--max-sessions", type=int, default=int(env("SPECDEC_DRAFT_MAX_SESSIONS", cls.max_sessions)),
                       help="llama.cpp: sequence slots in the shared context (idle sessions are evicted "
                            "least recently used first to make room)")
        p.add_argument("--context-tokens", type=int, default=int(env("SPECDEC_DRAFT_CONTEXT_TOKENS", cls.context_tokens)),
                       help="llama.cpp: context length per session; longer sessions decode without a draft")
        p.add_argument("--sparse-top", type=int, default=cls.sparse_top,
                       help="when sampling, draw from and send the top-N tokens of the draft distribution")
        p.add_argument("--max-queue", type=int, default=int(env("SPECDEC_DRAFT_MAX_QUEUE", cls.max_queue)),
                       help="Propose calls admitted at once (queued or running); more get RESOURCE_EXHAUSTED at once")
        p.add_argument("--threads", type=int, default=cls.threads, help="compute threads, llama.cpp or torch (0: all cores)")
        p.add_argument("--prefill-chunk", type=int,
                       default=int(env("SPECDEC_DRAFT_PREFILL_CHUNK", cls.prefill_chunk)),
                       help="a context the draft has not seen is prefilled at most this many tokens per batch, "
                            "beside the other sessions' proposals (0: whole contexts in one batch)")
        EngineOptions.add_flags(p)
        KVStoreOptions.add_flags(p, "SPECDEC_DRAFT")
        ServerOptions.add_flags(p, "SPECDEC_DRAFT", port=50051)
        a = p.parse_args(argv)
        return cls(server=ServerOptions.from_args(a), engine=EngineOptions.from_args(a), model=a.model,
                   backend=a.backend, dtype=a.dtype, device=a.device, quantize_inputs=a.quantize_inputs,
                   max_cache_tokens=a.max_cache_tokens, max_sessions=a.max_sessions,
                   context_tokens=a.context_tokens, sparse_top=a.sparse_top, max_queue=a.max_queue,
                   threads=a.threads, prefill_chunk=a.prefill_chunk, kv_store=KVStoreOptions.from_args(a))


def resolve_backend(backend: str, model: str, engine: EngineOptions, device: str = "cpu",
                    quantize_inputs: bool = True) -> str:
    """The backend `auto` stands for: for a .gguf model on a CPU with the int8-input kernel (AVX-512
    VNNI), transformers with --quantize-inputs (this project's engine in llama.cpp's arithmetic: on the
    embedded default, one thread, a draft step of one session 9.4 ms against llama.cpp's 11.1 and of 8
    sessions 20.5 against 61.2, benchmarks/results/int8_draft.md); else llama.cpp for a .gguf when
    llama-cpp-python is installed; else transformers. The int8-input kernel counts only where
    `engine` lets the quantized linears run."""
    if backend != "auto":
        return backend
    from specdec_core.engine import cpu_kernels, cpu_quantized
    from specdec_core.engine.models import gguf_path

    if gguf_path(model) is None:
        return "transformers"
    if device == "cpu" and quantize_inputs and engine.cpu_attention and engine.quantized_linears:
        cpu_kernels.load(engine)
        if cpu_quantized.int8_available():
            return "transformers"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "transformers"
    return "llama.cpp"
