"""Running a model: loading, the batched backend, CPU kernels, KV-cache bookkeeping, batching and
sampling. Imports `specdec_core`'s top-level modules, never `specdec_core.serving`."""
