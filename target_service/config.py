"""The target worker's configuration: built once in main() from flags (with env defaults)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from specdec_core.engine.options import EngineOptions
from specdec_core.serving.kvstore import KVStoreOptions
from specdec_core.serving.server import ServerOptions


@dataclass(frozen=True)
class TargetConfig:
    server: ServerOptions
    engine: EngineOptions
    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    max_cache_tokens: int = 65536
    tensor_parallel_size: int = 1
    dist_timeout_s: float = 60.0
    kv_cache: str = "paged"
    batch_window_ms: float = 1.0
    max_batch: int = 32
    max_queue: int = 64
    threads: int = 0
    solo_threads: int = 0
    prefill_chunk: int = 16
    prefill_stall: float = 1.6
    kv_store: KVStoreOptions = KVStoreOptions()
    head: str = "auto"

    def __post_init__(self):
        if self.max_cache_tokens < 1:
            raise ValueError("max_cache_tokens must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.kv_cache not in ("paged", "dynamic"):
            raise ValueError(f"kv_cache must be paged or dynamic, got {self.kv_cache!r}")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {self.prefill_chunk}")
        if self.prefill_stall != 0 and self.prefill_stall <= 1:
            raise ValueError(f"prefill_stall must be > 1 (or 0: a fixed chunk), got {self.prefill_stall}")
        if self.threads < 0 or self.solo_threads < 0:
            raise ValueError(f"threads and solo_threads must be >= 0, got {self.threads}, {self.solo_threads}")
        if self.dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise ValueError(f"dtype must be float32, float16, bfloat16 or float64 (for exactness checks), "
                             f"got {self.dtype}")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> TargetConfig:
        env = os.environ.get
        p = argparse.ArgumentParser(prog="specdec target", description="Run the target worker (verifies draft tokens).")
        p.add_argument("--model", default=env("SPECDEC_TARGET_MODEL", cls.model),
                       help="hub id, local folder, .gguf file, or 'smollm2' (embedded default)")
        p.add_argument("--dtype", default=env("SPECDEC_TARGET_DTYPE", cls.dtype))
        p.add_argument("--device", default=env("SPECDEC_TARGET_DEVICE", cls.device))
        p.add_argument("--max-cache-tokens", type=int,
                       default=int(env("SPECDEC_TARGET_MAX_CACHE_TOKENS", cls.max_cache_tokens)),
                       help="KV-cache size in tokens over all sessions (the paged pool, or the DynamicCaches' "
                            "budget); idle sessions are evicted least recently used first to make room")
        p.add_argument("--tensor-parallel-size", "--tp", type=int,
                       default=int(env("SPECDEC_TENSOR_PARALLEL_SIZE", cls.tensor_parallel_size)),
                       help="shard the model over N ranks (started under torchrun automatically)")
        p.add_argument("--dist-timeout", type=float, default=cls.dist_timeout_s,
                       help="seconds before a collective with a dead rank fails (then the service exits)")
        p.add_argument("--kv-cache", choices=["paged", "dynamic"], default=cls.kv_cache,
                       help="paged: block-pool cache, sessions verified together in one batched pass; "
                            "dynamic: one transformers DynamicCache per session, one session per pass")
        p.add_argument("--batch-window-ms", type=float, default=cls.batch_window_ms,
                       help="after the first request of a batch, wait this long for others")
        p.add_argument("--max-batch", type=int, default=cls.max_batch, help="sessions per batched pass")
        p.add_argument("--max-queue", type=int, default=int(env("SPECDEC_TARGET_MAX_QUEUE", cls.max_queue)),
                       help="Verify calls admitted at once (queued or running); more get RESOURCE_EXHAUSTED at once")
        p.add_argument("--threads", type=int, default=int(env("SPECDEC_TARGET_THREADS", cls.threads)),
                       help="torch intra-op threads on CPU (0: torch's default, one per core); on a machine "
                            "shared with the draft worker, give each its own cores")
        p.add_argument("--solo-threads", type=int, default=int(env("SPECDEC_TARGET_SOLO_THREADS", cls.solo_threads)),
                       help="with --threads: threads for batches while no draft worker drafts (the coordinators say "
                            "so in each Verify; the draft's cores are idle then; `specdec up` gives all cores); "
                            "0: always --threads")
        p.add_argument("--prefill-chunk", type=int,
                       default=int(env("SPECDEC_TARGET_PREFILL_CHUNK", cls.prefill_chunk)),
                       help="long prompts are prefilled in chunks between the other sessions' rounds, so that "
                            "they do not stall them: prompts no longer than this (or than what a pass beside them "
                            "would take) are never split, and a pass takes at least this many tokens of long "
                            "prefills (all of them together) where as many "
                            "sessions wait for their prefill as decode; a pass while none decode takes up to "
                            "256 (0: whole prompts in one pass)")
        p.add_argument("--prefill-stall", type=float,
                       default=float(env("SPECDEC_TARGET_PREFILL_STALL", cls.prefill_stall)),
                       help="a pass beside decoding sessions takes as many prompt tokens as keep it within this "
                            "many times their pass alone, by the measured cost of their pass and of a prompt "
                            "token, more in proportion where more wait than decode (this CPU: 3-6 tokens beside "
                            "4 sessions; a GPU: up to 256). Lower: steadier decoding, slower prefills; 0: always "
                            "--prefill-chunk")
        p.add_argument("--head", default=env("SPECDEC_TARGET_HEAD", cls.head),
                       help="an EAGLE-3 draft head beside the target, in the speculators format (a folder or hub "
                            "id; `specdec train-head` makes one): the coordinator's policy may then draft with it, "
                            "one Verify call a round. auto: the head shipped for the embedded model when --model is "
                            "smollm2, else none; none: no head")
        EngineOptions.add_flags(p)
        KVStoreOptions.add_flags(p, "SPECDEC_TARGET")
        ServerOptions.add_flags(p, "SPECDEC_TARGET", port=50052)
        a = p.parse_args(argv)
        return cls(ServerOptions.from_args(a), EngineOptions.from_args(a), a.model, a.dtype, a.device,
                   a.max_cache_tokens, a.tensor_parallel_size, a.dist_timeout, a.kv_cache, a.batch_window_ms, a.max_batch, a.max_queue,
                   a.threads, a.solo_threads, a.prefill_chunk, a.prefill_stall, KVStoreOptions.from_args(a), a.head)
