from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sample(_message.Message):
    __slots__ = ("rollout_id", "group_id", "task_id", "sequence_index", "token_ids", "loss_mask", "rollout_logprobs", "advantages", "reward", "weight_version", "rollout_sequences", "weight_spans", "constrained_tokens")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SPANS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    group_id: str
    task_id: str
    sequence_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    rollout_logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    reward: float
    weight_version: int
    rollout_sequences: int
    weight_spans: _containers.RepeatedCompositeFieldContainer[WeightSpan]
    constrained_tokens: int
    def __init__(self, rollout_id: _Optional[str] = ..., group_id: _Optional[str] = ..., task_id: _Optional[str] = ..., sequence_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., rollout_logprobs: _Optional[_Iterable[float]] = ..., advantages: _Optional[_Iterable[float]] = ..., reward: _Optional[float] = ..., weight_version: _Optional[int] = ..., rollout_sequences: _Optional[int] = ..., weight_spans: _Optional[_Iterable[_Union[WeightSpan, _Mapping]]] = ..., constrained_tokens: _Optional[int] = ...) -> None: ...

class WeightSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: int
    start: int
    end: int
    def __init__(self, version: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
