"""What both workers (and the coordinator's server shell) need, in two folders and four common modules.

- `engine/`: running a model: loading it (`models`, with `options.EngineOptions`), the batched
  paged-KV backend and its lean pass, our CPU kernels (`cpu_kernels`, `cpu_linear`,
  `cpu_quantized`, C in `csrc/`), KV-cache bookkeeping (`kvcache`), the engine thread's batching
  queue (`batching`), and the logit processing and keyed randomness that draft and target must
  apply identically (`sampling`).
- `serving/`: a service's outside: the gRPC server bootstrap (`server`), admission, TLS and bearer
  tokens (`security`), the Redis client, protobuf <-> domain conversion (`wire`) and the KV tier
  in Redis (`kvstore`).
- top level: small facts every layer uses: `errors` (domain errors and their status codes),
  `limits` (input limits and checks), `logs` (log format, a session's name in logs), `metrics`
  (the Prometheus metrics).

Imports run one way (tests/specdec_core/test_layout.py checks it): the top-level modules import
only each other; `engine` imports the top level and never `serving` (nor the generated protos);
`serving` imports the top level, and `engine` only where it carries engine data out of the
process (`wire`: sampling types <-> protobuf; `kvstore`: KV chunks <-> Redis). This package imports
no service.
"""
