"""A service's outside: gRPC server bootstrap, admission, security, Redis, protobuf conversion and
the KV tier in Redis."""
