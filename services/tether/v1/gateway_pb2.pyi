from tether.v1 import types_pb2 as _types_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PauseAdmissionRequest(_message.Message):
    __slots__ = ("drain_timeout_s",)
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    drain_timeout_s: float
    def __init__(self, drain_timeout_s: _Optional[float] = ...) -> None: ...

class ResumeAdmissionRequest(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...

class AdmissionStatus(_message.Message):
    __slots__ = ("paused", "in_flight", "weight_version")
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    in_flight: int
    weight_version: int
    def __init__(self, paused: _Optional[bool] = ..., in_flight: _Optional[int] = ..., weight_version: _Optional[int] = ...) -> None: ...
