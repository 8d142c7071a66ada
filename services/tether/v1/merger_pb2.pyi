from tether.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class MergerStatus(_message.Message):
    __slots__ = ("rollouts_merged", "groups_emitted", "groups_pending", "groups_filtered", "sequences", "forks", "calls_dropped", "calls_dropped_by_reason", "groups_timed_out", "late_rollouts", "rollouts_retried", "single_sequence_rollouts", "realigns", "mismatched_calls", "truncated", "call_rewards_applied", "untrainable_by_reason", "side_sequences_excluded", "session_rewards_trained")
    class CallsDroppedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class UntrainableByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROLLOUTS_MERGED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_EMITTED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PENDING_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FILTERED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    CALLS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    CALLS_DROPPED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    GROUPS_TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    LATE_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_RETRIED_FIELD_NUMBER: _ClassVar[int]
    SINGLE_SEQUENCE_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    REALIGNS_FIELD_NUMBER: _ClassVar[int]
    MISMATCHED_CALLS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    CALL_REWARDS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    UNTRAINABLE_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    SIDE_SEQUENCES_EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    SESSION_REWARDS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    rollouts_merged: int
    groups_emitted: int
    groups_pending: int
    groups_filtered: int
    sequences: int
    forks: int
    calls_dropped: int
    calls_dropped_by_reason: _containers.ScalarMap[str, int]
    groups_timed_out: int
    late_rollouts: int
    rollouts_retried: int
    single_sequence_rollouts: int
    realigns: int
    mismatched_calls: int
    truncated: int
    call_rewards_applied: int
    untrainable_by_reason: _containers.ScalarMap[str, int]
    side_sequences_excluded: int
    session_rewards_trained: int
    def __init__(self, rollouts_merged: _Optional[int] = ..., groups_emitted: _Optional[int] = ..., groups_pending: _Optional[int] = ..., groups_filtered: _Optional[int] = ..., sequences: _Optional[int] = ..., forks: _Optional[int] = ..., calls_dropped: _Optional[int] = ..., calls_dropped_by_reason: _Optional[_Mapping[str, int]] = ..., groups_timed_out: _Optional[int] = ..., late_rollouts: _Optional[int] = ..., rollouts_retried: _Optional[int] = ..., single_sequence_rollouts: _Optional[int] = ..., realigns: _Optional[int] = ..., mismatched_calls: _Optional[int] = ..., truncated: _Optional[int] = ..., call_rewards_applied: _Optional[int] = ..., untrainable_by_reason: _Optional[_Mapping[str, int]] = ..., side_sequences_excluded: _Optional[int] = ..., session_rewards_trained: _Optional[int] = ...) -> None: ...
