from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "committed_ids", "num_tokens", "sampling", "seed", "min_confidence")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    sampling: _common_pb2.SamplingParams
    seed: int
    min_confidence: float
    def __init__(self, session_id: _Optional[str] = ..., committed_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., min_confidence: _Optional[float] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("token_ids", "distributions", "prefill_tokens", "compute_ms", "batch_size", "batch_prefill_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    prefill_tokens: int
    compute_ms: float
    batch_size: int
    batch_prefill_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., prefill_tokens: _Optional[int] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., batch_prefill_tokens: _Optional[int] = ...) -> None: ...

class ReleaseDraftCacheRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseDraftCacheResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GetDraftModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDraftModelResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ...) -> None: ...
