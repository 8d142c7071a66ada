from tether.v1 import types_pb2 as _types_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(_message.Message):
    __slots__ = ("status", "step", "total_steps", "weight_version", "reward_mean", "run_dir")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    status: str
    step: int
    total_steps: int
    weight_version: int
    reward_mean: float
    run_dir: str
    def __init__(self, status: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., weight_version: _Optional[int] = ..., reward_mean: _Optional[float] = ..., run_dir: _Optional[str] = ...) -> None: ...
