from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "committed_ids", "draft_ids", "draft_distributions", "sampling", "seed", "draft_in_flight", "decode_steps", "stop_token_ids", "head_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    sampling: _common_pb2.SamplingParams
    seed: int
    draft_in_flight: bool
    decode_steps: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    head_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., committed_ids: _Optional[_Iterable[int]] = ..., draft_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., draft_in_flight: _Optional[bool] = ..., decode_steps: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., head_tokens: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "next_token_id", "prefill_tokens", "compute_ms", "batch_size", "logprobs", "batch_tokens", "threads", "batch_prefill_tokens", "decoded_ids", "passes", "pass_tokens", "head_ids", "head_distributions", "head_ms")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    BATCH_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODED_IDS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    PASS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEAD_IDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    HEAD_MS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token_id: int
    prefill_tokens: int
    compute_ms: float
    batch_size: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    batch_tokens: int
    threads: int
    batch_prefill_tokens: int
    decoded_ids: _containers.RepeatedScalarFieldContainer[int]
    passes: int
    pass_tokens: int
    head_ids: _containers.RepeatedScalarFieldContainer[int]
    head_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    head_ms: float
    def __init__(self, num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., batch_tokens: _Optional[int] = ..., threads: _Optional[int] = ..., batch_prefill_tokens: _Optional[int] = ..., decoded_ids: _Optional[_Iterable[int]] = ..., passes: _Optional[int] = ..., pass_tokens: _Optional[int] = ..., head_ids: _Optional[_Iterable[int]] = ..., head_distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., head_ms: _Optional[float] = ...) -> None: ...

class ReleaseTargetCacheRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseTargetCacheResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GetTargetModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTargetModelResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ...) -> None: ...
