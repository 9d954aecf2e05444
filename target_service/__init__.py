"""The target worker: the big model, per-session KV caches, single-pass verification."""
