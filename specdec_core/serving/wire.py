"""Protobuf <-> shared domain types, used by every service's servicer (domain code never sees
protobuf)."""

from __future__ import annotations

from specdec.v1 import common_pb2
import json

from specdec_core.engine.grammar import Constraint
from specdec_core.engine.sampling import SamplingConfig, TokenLogprob


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingConfig:
    return SamplingConfig(
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        output_start=msg.output_start,
        constraint=constraint_from_proto(msg.constraint) if msg.HasField("constraint") else None,
    )


def constraint_from_proto(msg: common_pb2.Constraint) -> Constraint | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        spec = ""
    elif kind == "choice":
        spec = json.dumps(list(msg.choice.choices))
    else:
        spec = getattr(msg, kind)
    return Constraint(kind, spec, tuple(msg.end_token_ids))


def constraint_to_proto(c: Constraint) -> common_pb2.Constraint:
    msg = common_pb2.Constraint(end_token_ids=list(c.end_ids))
    if c.kind == "json_object":
        msg.json_object = True
    elif c.kind == "choice":
        msg.choice.choices.extend(c.choices)
    else:
        setattr(msg, c.kind, c.spec)
    return msg


def sampling_to_proto(cfg: SamplingConfig, seed: int | None = None) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
        presence_penalty=cfg.presence_penalty, frequency_penalty=cfg.frequency_penalty,
        repetition_penalty=cfg.repetition_penalty, logit_bias=dict(cfg.logit_bias),
        output_start=cfg.output_start,
    )
    if cfg.logprobs is not None:
        msg.logprobs = cfg.logprobs
    if cfg.constraint is not None:
        msg.constraint.CopyFrom(constraint_to_proto(cfg.constraint))
    if seed is not None:
        msg.seed = seed
    return msg


def logprobs_to_proto(logprobs: list[TokenLogprob], text=None) -> list[common_pb2.TokenLogprobs]:
    """text: token id -> its text (the coordinator's tokenizer); None between workers."""
    def one(token_id: int, logprob: float) -> common_pb2.Logprob:
        return common_pb2.Logprob(token_id=token_id, logprob=logprob, token=text(token_id) if text else "")

    return [common_pb2.TokenLogprobs(chosen=one(lp.token_id, lp.logprob), top=[one(t, v) for t, v in lp.top])
            for lp in logprobs]


def logprobs_from_proto(msgs) -> list[TokenLogprob]:
    return [TokenLogprob(m.chosen.token_id, m.chosen.logprob, [(t.token_id, t.logprob) for t in m.top]) for m in msgs]


def model_info_to_proto(backend, name: str, tensor_parallel_size: int = 1) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        name=name,
        backend=backend.name,
        vocab_size=backend.vocab_size,
        max_context=backend.max_context,
        dtype=backend.dtype,
        device=str(backend.device),
        tensor_parallel_size=tensor_parallel_size,
        num_parameters=backend.num_parameters,
    )
