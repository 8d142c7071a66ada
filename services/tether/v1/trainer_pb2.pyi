from tether.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitGroupRequest(_message.Message):
    __slots__ = ("group_id", "samples", "rollouts", "run_id")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    samples: _containers.RepeatedCompositeFieldContainer[_types_pb2.Sample]
    rollouts: int
    run_id: str
    def __init__(self, group_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[_types_pb2.Sample, _Mapping]]] = ..., rollouts: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class SubmitGroupResponse(_message.Message):
    __slots__ = ("buffered_groups", "duplicate")
    BUFFERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    buffered_groups: int
    duplicate: bool
    def __init__(self, buffered_groups: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("step", "min_groups", "max_groups", "group_ids", "drop_group_ids", "run_id", "intended_groups")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MIN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    DROP_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    INTENDED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    min_groups: int
    max_groups: int
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    drop_group_ids: _containers.RepeatedScalarFieldContainer[str]
    run_id: str
    intended_groups: int
    def __init__(self, step: _Optional[int] = ..., min_groups: _Optional[int] = ..., max_groups: _Optional[int] = ..., group_ids: _Optional[_Iterable[str]] = ..., drop_group_ids: _Optional[_Iterable[str]] = ..., run_id: _Optional[str] = ..., intended_groups: _Optional[int] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("step", "weight_version", "checkpoint_dir", "metrics", "replayed", "adapter_dir")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIR_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    checkpoint_dir: str
    metrics: _containers.ScalarMap[str, float]
    replayed: bool
    adapter_dir: str
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ..., checkpoint_dir: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., replayed: _Optional[bool] = ..., adapter_dir: _Optional[str] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("buffered_groups", "buffered_samples", "weight_version", "steps_done", "last_step", "checkpoint_dir", "run_id", "adapter", "adapter_dir", "last_step_time", "steps_per_minute", "settings")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BUFFERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIR_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_TIME_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    buffered_groups: int
    buffered_samples: int
    weight_version: int
    steps_done: int
    last_step: int
    checkpoint_dir: str
    run_id: str
    adapter: str
    adapter_dir: str
    last_step_time: float
    steps_per_minute: float
    settings: _containers.ScalarMap[str, str]
    def __init__(self, buffered_groups: _Optional[int] = ..., buffered_samples: _Optional[int] = ..., weight_version: _Optional[int] = ..., steps_done: _Optional[int] = ..., last_step: _Optional[int] = ..., checkpoint_dir: _Optional[str] = ..., run_id: _Optional[str] = ..., adapter: _Optional[str] = ..., adapter_dir: _Optional[str] = ..., last_step_time: _Optional[float] = ..., steps_per_minute: _Optional[float] = ..., settings: _Optional[_Mapping[str, str]] = ...) -> None: ...

class OpenRunRequest(_message.Message):
    __slots__ = ("run_id", "adapter", "settings")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    adapter: str
    settings: _containers.ScalarMap[str, str]
    def __init__(self, run_id: _Optional[str] = ..., adapter: _Optional[str] = ..., settings: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CloseRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class CloseRunResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class RunStatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("version", "run_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    run_id: str
    def __init__(self, version: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("version", "buckets", "tensors", "bytes", "seconds", "adapter_dir")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIR_FIELD_NUMBER: _ClassVar[int]
    version: int
    buckets: int
    tensors: int
    bytes: int
    seconds: float
    adapter_dir: str
    def __init__(self, version: _Optional[int] = ..., buckets: _Optional[int] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., adapter_dir: _Optional[str] = ...) -> None: ...
