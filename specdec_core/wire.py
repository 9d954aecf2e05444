"""Protobuf <-> shared domain types, used by every service's servicer (domain code never sees
protobuf)."""

from __future__ import annotations

from specdec.v1 import common_pb2
from specdec_core.sampling import SamplingConfig


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingConfig:
    return SamplingConfig(
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
    )


def sampling_to_proto(cfg: SamplingConfig, seed: int | None = None) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    if seed is not None:
        msg.seed = seed
    return msg


def model_info_to_proto(backend, name: str, tensor_parallel_size: int = 1) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        name=name,
        backend=backend.name,
        vocab_size=backend.vocab_size,
        max_context=backend.max_context,
        dtype=backend.dtype,
        device=str(backend.device),
        tensor_parallel_size=tensor_parallel_size,
    )
