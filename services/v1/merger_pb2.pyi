from tether.v1 import types_pb2 as _types_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class MergerStatus(_message.Message):
    __slots__ = ("rollouts_merged", "groups_emitted", "groups_pending", "groups_filtered", "sequences", "forks", "calls_dropped")
    ROLLOUTS_MERGED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_EMITTED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PENDING_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FILTERED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    CALLS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    rollouts_merged: int
    groups_emitted: int
    groups_pending: int
    groups_filtered: int
    sequences: int
    forks: int
    calls_dropped: int
    def __init__(self, rollouts_merged: _Optional[int] = ..., groups_emitted: _Optional[int] = ..., groups_pending: _Optional[int] = ..., groups_filtered: _Optional[int] = ..., sequences: _Optional[int] = ..., forks: _Optional[int] = ..., calls_dropped: _Optional[int] = ...) -> None: ...
