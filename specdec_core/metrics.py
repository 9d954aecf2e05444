"""Prometheus metrics shared by the services (each process exports only what it touches).

Served on a separate HTTP port (`--metrics-port`, 0 = off) by `start_metrics_server`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

REQUESTS = Counter("specdec_requests_total", "gRPC requests by method and status code", ["method", "code"])
IN_FLIGHT = Gauge("specdec_requests_in_flight", "requests being served (queue depth)", ["method"])

TOKENS = Counter("specdec_generated_tokens_total", "tokens committed to sessions (output)")
ROUNDS = Counter("specdec_rounds_total", "speculative rounds (target verify passes)")
DRAFT_TOKENS = Counter("specdec_draft_tokens_total", "draft tokens proposed")
ACCEPTED_TOKENS = Counter("specdec_accepted_tokens_total", "draft tokens accepted by the target")
ACCEPTED_AT = Counter("specdec_accepted_by_position_total", "draft tokens accepted, by position in the block",
                      ["position"])
ROUND_SECONDS = Histogram("specdec_round_seconds", "round latency by phase", ["phase"], buckets=LATENCY_BUCKETS)

VERIFY_BATCH = Histogram("specdec_verify_batch_size", "sessions verified in one forward pass",
                         buckets=(1, 2, 4, 8, 16, 32, 64))
FORWARD_SECONDS = Histogram("specdec_forward_seconds", "worker forward-pass latency", ["role"],
                            buckets=LATENCY_BUCKETS)
TARGET_THREADS = Gauge("specdec_target_threads", "intra-op threads of the target's last batch (--solo-threads)")
QUEUE_DEPTH = Gauge("specdec_worker_queue_depth", "requests waiting for the next batch")
CACHE_TOKENS = Gauge("specdec_cache_tokens", "tokens held in worker KV caches", ["role"])
CACHE_SESSIONS = Gauge("specdec_cache_sessions", "sessions with a worker KV cache", ["role"])
CACHE_FREE_UNITS = Gauge("specdec_cache_free_units", "free KV capacity (paged blocks, llama.cpp slots or tokens)",
                         ["role"])
ADMISSION_REFUSED = Counter("specdec_admission_refused_total", "calls refused at once because a lane was full",
                            ["lane"])
STORE_ERRORS = Counter("specdec_session_store_errors_total",
                       "session store (Redis) calls that failed: unavailable, full (maxmemory), replicas (WAIT "
                       "short), tenant_cap", ["reason"])
CACHE_EVICTIONS = Counter("specdec_cache_evictions_total", "sessions evicted from worker KV caches", ["role"])
GRAMMAR_SECONDS = Counter("specdec_grammar_seconds_total", "time spent on structured-output constraints: "
                          "masking positions (mask: computing and applying the masks), cutting proposals (cut), "
                          "compiling (compile)", ["step"])
HEAD_SECONDS = Counter("specdec_head_seconds_total", "time the target worker's EAGLE-3 head spent: absorbing "
                       "the target's features (absorb) and drafting (propose)", ["step"])
HEAD_TOKENS = Counter("specdec_head_tokens_total", "draft tokens the target worker's head proposed")
GRAMMAR_ROWS = Counter("specdec_grammar_rows_total", "positions masked by a structured-output constraint")
SUFFIX_SHARED = Counter("specdec_suffix_shared_total", "finished requests the suffix index exchanged with the "
                        "other coordinator replicas through Redis: sent, received, dropped (queue full)",
                        ["direction"])
SUFFIX_INDEX_TOKENS = Gauge("specdec_suffix_index_tokens", "tokens held in the coordinator's suffix index")


def start_metrics_server(port: int, host: str = "0.0.0.0") -> None:
    if port:
        start_http_server(port, addr=host)
KV_CHUNKS = Counter("specdec_kv_store_chunks_total",
                    "KV-tier chunks by outcome: hit, miss (read), invalid (ignored: checksum, shape or model "
                    "mismatch), stored, dropped (write queue full or Redis down)", ["role", "outcome"])
KV_BYTES = Counter("specdec_kv_store_bytes_total", "KV-tier bytes written to Redis", ["role", "direction"])
KV_RESTORED_TOKENS = Counter("specdec_kv_store_restored_tokens_total", "tokens whose KV was restored instead of "
                             "prefilled", ["role"])
KV_RESTORE_SECONDS = Histogram("specdec_kv_store_restore_seconds", "time to fetch and import a restore", ["role"],
                               buckets=LATENCY_BUCKETS)
KV_PENDING_BYTES = Gauge("specdec_kv_store_pending_bytes", "KV chunks waiting to be written", ["role"])
KV_ERRORS = Counter("specdec_kv_store_errors_total", "KV-tier Redis calls that failed", ["role"])
KV_HOOK_SECONDS = Histogram("specdec_kv_store_round_seconds", "time the KV tier and prefix sharing add to a "
                            "lease on the engine thread (sharing, restore, handing chunks to the writer)", ["role"],
                            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5))
