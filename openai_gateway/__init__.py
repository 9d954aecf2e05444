"""An OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) in front
of the coordinator's public gRPC API. It holds no state and no model: it translates, streams
server-sent events, and maps gRPC statuses to OpenAI's error shape."""
