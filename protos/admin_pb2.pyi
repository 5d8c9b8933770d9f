from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepTimings(_message.Message):
    __slots__ = ("wall_seconds", "reduce_seconds", "update_seconds", "send_seconds", "pass_seconds", "pass_median_ms", "pass_p90_ms", "pass_max_ms", "buckets", "tail_seconds")
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REDUCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASS_MEDIAN_MS_FIELD_NUMBER: _ClassVar[int]
    PASS_P90_MS_FIELD_NUMBER: _ClassVar[int]
    PASS_MAX_MS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TAIL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    wall_seconds: float
    reduce_seconds: float
    update_seconds: float
    send_seconds: float
    pass_seconds: float
    pass_median_ms: float
    pass_p90_ms: float
    pass_max_ms: float
    buckets: int
    tail_seconds: float
    def __init__(self, wall_seconds: _Optional[float] = ..., reduce_seconds: _Optional[float] = ..., update_seconds: _Optional[float] = ..., send_seconds: _Optional[float] = ..., pass_seconds: _Optional[float] = ..., pass_median_ms: _Optional[float] = ..., pass_p90_ms: _Optional[float] = ..., pass_max_ms: _Optional[float] = ..., buckets: _Optional[int] = ..., tail_seconds: _Optional[float] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("rank", "last_seen_unix")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    rank: int
    last_seen_unix: float
    def __init__(self, rank: _Optional[int] = ..., last_seen_unix: _Optional[float] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("node_id", "version", "uptime_seconds", "registered", "step", "buckets_owned", "bytes_owned", "bytes_in_ram", "bytes_on_disk", "world_size", "workers", "last_step", "paused", "pause_reason", "data_address", "non_finite", "job_state", "drain_step", "overrides", "jobs_let_go", "morphs", "last_morph_step", "last_morph_from", "last_morph_pause_seconds", "update_path", "state_at_risk", "moments")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_OWNED_FIELD_NUMBER: _ClassVar[int]
    BYTES_OWNED_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_RAM_FIELD_NUMBER: _ClassVar[int]
    BYTES_ON_DISK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    PAUSE_REASON_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_STEP_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    JOBS_LET_GO_FIELD_NUMBER: _ClassVar[int]
    MORPHS_FIELD_NUMBER: _ClassVar[int]
    LAST_MORPH_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_MORPH_FROM_FIELD_NUMBER: _ClassVar[int]
    LAST_MORPH_PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_PATH_FIELD_NUMBER: _ClassVar[int]
    STATE_AT_RISK_FIELD_NUMBER: _ClassVar[int]
    MOMENTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    uptime_seconds: float
    registered: bool
    step: int
    buckets_owned: int
    bytes_owned: int
    bytes_in_ram: int
    bytes_on_disk: int
    world_size: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    last_step: StepTimings
    paused: bool
    pause_reason: str
    data_address: str
    non_finite: NonFiniteStatus
    job_state: str
    drain_step: int
    overrides: _containers.RepeatedCompositeFieldContainer[Override]
    jobs_let_go: int
    morphs: int
    last_morph_step: int
    last_morph_from: int
    last_morph_pause_seconds: float
    update_path: str
    state_at_risk: str
    moments: str
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., registered: _Optional[bool] = ..., step: _Optional[int] = ..., buckets_owned: _Optional[int] = ..., bytes_owned: _Optional[int] = ..., bytes_in_ram: _Optional[int] = ..., bytes_on_disk: _Optional[int] = ..., world_size: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., last_step: _Optional[_Union[StepTimings, _Mapping]] = ..., paused: _Optional[bool] = ..., pause_reason: _Optional[str] = ..., data_address: _Optional[str] = ..., non_finite: _Optional[_Union[NonFiniteStatus, _Mapping]] = ..., job_state: _Optional[str] = ..., drain_step: _Optional[int] = ..., overrides: _Optional[_Iterable[_Union[Override, _Mapping]]] = ..., jobs_let_go: _Optional[int] = ..., morphs: _Optional[int] = ..., last_morph_step: _Optional[int] = ..., last_morph_from: _Optional[int] = ..., last_morph_pause_seconds: _Optional[float] = ..., update_path: _Optional[str] = ..., state_at_risk: _Optional[str] = ..., moments: _Optional[str] = ...) -> None: ...

class Override(_message.Message):
    __slots__ = ("name", "value", "origin")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    origin: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., origin: _Optional[str] = ...) -> None: ...

class NonFiniteEvent(_message.Message):
    __slots__ = ("action", "step", "rank", "bucket", "values", "unix_time")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    action: str
    step: int
    rank: int
    bucket: int
    values: int
    unix_time: float
    def __init__(self, action: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., bucket: _Optional[int] = ..., values: _Optional[int] = ..., unix_time: _Optional[float] = ...) -> None: ...

class NonFiniteStatus(_message.Message):
    __slots__ = ("policy", "refused_pushes", "skipped_steps", "last")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REFUSED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    policy: str
    refused_pushes: int
    skipped_steps: int
    last: NonFiniteEvent
    def __init__(self, policy: _Optional[str] = ..., refused_pushes: _Optional[int] = ..., skipped_steps: _Optional[int] = ..., last: _Optional[_Union[NonFiniteEvent, _Mapping]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("world_size", "workers")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, world_size: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class Hyperparameters(_message.Message):
    __slots__ = ("lr", "lr_scale", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm")
    LR_FIELD_NUMBER: _ClassVar[int]
    LR_SCALE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    lr: float
    lr_scale: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    max_grad_norm: float
    def __init__(self, lr: _Optional[float] = ..., lr_scale: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ...) -> None: ...

class GetHyperparametersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetHyperparametersResponse(_message.Message):
    __slots__ = ("overrides", "last_applied", "origins")
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_FIELD_NUMBER: _ClassVar[int]
    ORIGINS_FIELD_NUMBER: _ClassVar[int]
    overrides: Hyperparameters
    last_applied: _containers.RepeatedCompositeFieldContainer[AppliedHyperparameters]
    origins: _containers.RepeatedCompositeFieldContainer[Override]
    def __init__(self, overrides: _Optional[_Union[Hyperparameters, _Mapping]] = ..., last_applied: _Optional[_Iterable[_Union[AppliedHyperparameters, _Mapping]]] = ..., origins: _Optional[_Iterable[_Union[Override, _Mapping]]] = ...) -> None: ...

class AppliedHyperparameters(_message.Message):
    __slots__ = ("group", "lr", "beta1", "beta2", "eps", "weight_decay")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    group: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    def __init__(self, group: _Optional[int] = ..., lr: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ...) -> None: ...

class SetHyperparametersRequest(_message.Message):
    __slots__ = ("overrides", "clear")
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    overrides: Hyperparameters
    clear: bool
    def __init__(self, overrides: _Optional[_Union[Hyperparameters, _Mapping]] = ..., clear: _Optional[bool] = ...) -> None: ...

class SetHyperparametersResponse(_message.Message):
    __slots__ = ("overrides",)
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    overrides: Hyperparameters
    def __init__(self, overrides: _Optional[_Union[Hyperparameters, _Mapping]] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("step", "buckets_applied")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    step: int
    buckets_applied: int
    def __init__(self, step: _Optional[int] = ..., buckets_applied: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("timeout_seconds",)
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    def __init__(self, timeout_seconds: _Optional[float] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("step", "path", "manifest_json")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    manifest_json: str
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., manifest_json: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_seconds",)
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    def __init__(self, timeout_seconds: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("step", "path", "manifest_json")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    manifest_json: str
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., manifest_json: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStepsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepEvent(_message.Message):
    __slots__ = ("step", "unix_time", "timings")
    STEP_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    step: int
    unix_time: float
    timings: StepTimings
    def __init__(self, step: _Optional[int] = ..., unix_time: _Optional[float] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("confirm_node_id",)
    CONFIRM_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    confirm_node_id: str
    def __init__(self, confirm_node_id: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("job", "step", "archived")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ARCHIVED_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    archived: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., archived: _Optional[str] = ...) -> None: ...

class MorphRequest(_message.Message):
    __slots__ = ("leave", "reason")
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    leave: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, leave: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class MorphResponse(_message.Message):
    __slots__ = ("told", "world_size")
    TOLD_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    told: _containers.RepeatedScalarFieldContainer[int]
    world_size: int
    def __init__(self, told: _Optional[_Iterable[int]] = ..., world_size: _Optional[int] = ...) -> None: ...
