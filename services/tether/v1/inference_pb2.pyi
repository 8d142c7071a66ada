from tether.v1 import types_pb2 as _types_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter", "adapter_dir")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIR_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    adapter_dir: str
    def __init__(self, adapter: _Optional[str] = ..., adapter_dir: _Optional[str] = ...) -> None: ...

class WeightVersion(_message.Message):
    __slots__ = ("version", "checkpoint_dir")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    version: int
    checkpoint_dir: str
    def __init__(self, version: _Optional[int] = ..., checkpoint_dir: _Optional[str] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("checkpoint_dir", "version")
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    checkpoint_dir: str
    version: int
    def __init__(self, checkpoint_dir: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...
