"""What both workers (and the coordinator's server shell) need: model loading, KV-cache
bookkeeping, logit processing, keyed randomness, errors and the gRPC server bootstrap.

This package imports no service.
"""
