from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    WORKER: _ClassVar[Role]
    PS: _ClassVar[Role]

class ViewScope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FULL: _ClassVar[ViewScope]
    ROUTING: _ClassVar[ViewScope]
ROLE_UNSPECIFIED: Role
WORKER: Role
PS: Role
FULL: ViewScope
ROUTING: ViewScope

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class ModelLayout(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class JobConfig(_message.Message):
    __slots__ = ("mode", "backup_workers", "staleness", "num_shards", "lease_seconds", "replicas", "recovery", "nonfinite", "guard")
    MODE_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    GUARD_FIELD_NUMBER: _ClassVar[int]
    mode: str
    backup_workers: int
    staleness: int
    num_shards: int
    lease_seconds: float
    replicas: int
    recovery: str
    nonfinite: str
    guard: UpdateGuard
    def __init__(self, mode: _Optional[str] = ..., backup_workers: _Optional[int] = ..., staleness: _Optional[int] = ..., num_shards: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., replicas: _Optional[int] = ..., recovery: _Optional[str] = ..., nonfinite: _Optional[str] = ..., guard: _Optional[_Union[UpdateGuard, _Mapping]] = ...) -> None: ...

class UpdateGuard(_message.Message):
    __slots__ = ("lr_factor", "grad_norm_factor", "grad_norm_policy", "grad_norm_warmup", "expel_after", "require_batch")
    LR_FACTOR_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FACTOR_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_POLICY_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_WARMUP_FIELD_NUMBER: _ClassVar[int]
    EXPEL_AFTER_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_BATCH_FIELD_NUMBER: _ClassVar[int]
    lr_factor: float
    grad_norm_factor: float
    grad_norm_policy: str
    grad_norm_warmup: int
    expel_after: int
    require_batch: bool
    def __init__(self, lr_factor: _Optional[float] = ..., grad_norm_factor: _Optional[float] = ..., grad_norm_policy: _Optional[str] = ..., grad_norm_warmup: _Optional[int] = ..., expel_after: _Optional[int] = ..., require_batch: _Optional[bool] = ...) -> None: ...

class Counters(_message.Message):
    __slots__ = ("steps", "samples", "bytes_pushed", "bytes_pulled")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PUSHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    steps: int
    samples: int
    bytes_pushed: int
    bytes_pulled: int
    def __init__(self, steps: _Optional[int] = ..., samples: _Optional[int] = ..., bytes_pushed: _Optional[int] = ..., bytes_pulled: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("role", "address", "layout", "host", "member_id", "view_scope", "job_id", "generation")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    VIEW_SCOPE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    role: Role
    address: str
    layout: ModelLayout
    host: str
    member_id: str
    view_scope: ViewScope
    job_id: str
    generation: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., layout: _Optional[_Union[ModelLayout, _Mapping]] = ..., host: _Optional[str] = ..., member_id: _Optional[str] = ..., view_scope: _Optional[_Union[ViewScope, str]] = ..., job_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class MemberInfo(_message.Message):
    __slots__ = ("member_id", "role", "address", "host", "state", "counters", "step_seconds", "straggler", "excluded")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    role: Role
    address: str
    host: str
    state: str
    counters: Counters
    step_seconds: float
    straggler: bool
    excluded: bool
    def __init__(self, member_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., host: _Optional[str] = ..., state: _Optional[str] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., step_seconds: _Optional[float] = ..., straggler: _Optional[bool] = ..., excluded: _Optional[bool] = ...) -> None: ...

class ShardRoute(_message.Message):
    __slots__ = ("shard", "primary_id", "primary_address", "backup_id", "backup_address", "backup_complete")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_ID_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_ID_FIELD_NUMBER: _ClassVar[int]
    BACKUP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    shard: int
    primary_id: str
    primary_address: str
    backup_id: str
    backup_address: str
    backup_complete: bool
    def __init__(self, shard: _Optional[int] = ..., primary_id: _Optional[str] = ..., primary_address: _Optional[str] = ..., backup_id: _Optional[str] = ..., backup_address: _Optional[str] = ..., backup_complete: _Optional[bool] = ...) -> None: ...

class ClusterView(_message.Message):
    __slots__ = ("epoch", "members", "shards", "ready", "job", "layout_fingerprint", "completed_epochs", "routing_only", "num_workers", "worker_rank", "unchanged", "job_id", "generation", "job_phase", "job_result", "job_exit_code")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_ONLY_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_RANK_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    JOB_PHASE_FIELD_NUMBER: _ClassVar[int]
    JOB_RESULT_FIELD_NUMBER: _ClassVar[int]
    JOB_EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    members: _containers.RepeatedCompositeFieldContainer[MemberInfo]
    shards: _containers.RepeatedCompositeFieldContainer[ShardRoute]
    ready: bool
    job: JobConfig
    layout_fingerprint: str
    completed_epochs: int
    routing_only: bool
    num_workers: int
    worker_rank: int
    unchanged: bool
    job_id: str
    generation: int
    job_phase: str
    job_result: str
    job_exit_code: int
    def __init__(self, epoch: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberInfo, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[ShardRoute, _Mapping]]] = ..., ready: _Optional[bool] = ..., job: _Optional[_Union[JobConfig, _Mapping]] = ..., layout_fingerprint: _Optional[str] = ..., completed_epochs: _Optional[int] = ..., routing_only: _Optional[bool] = ..., num_workers: _Optional[int] = ..., worker_rank: _Optional[int] = ..., unchanged: _Optional[bool] = ..., job_id: _Optional[str] = ..., generation: _Optional[int] = ..., job_phase: _Optional[str] = ..., job_result: _Optional[str] = ..., job_exit_code: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("member_id", "lease_seconds", "view", "shard", "restore_checkpoint", "credential", "verify_key")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    RESTORE_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_KEY_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    lease_seconds: float
    view: ClusterView
    shard: int
    restore_checkpoint: str
    credential: str
    verify_key: bytes
    def __init__(self, member_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., view: _Optional[_Union[ClusterView, _Mapping]] = ..., shard: _Optional[int] = ..., restore_checkpoint: _Optional[str] = ..., credential: _Optional[str] = ..., verify_key: _Optional[bytes] = ...) -> None: ...

class TaskProgress(_message.Message):
    __slots__ = ("task_id", "next_start")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_START_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    next_start: int
    def __init__(self, task_id: _Optional[int] = ..., next_start: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("member_id", "counters", "progress", "step_seconds", "backups_complete", "round_blame", "own_step_seconds")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ROUND_BLAME_FIELD_NUMBER: _ClassVar[int]
    OWN_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    counters: Counters
    progress: _containers.RepeatedCompositeFieldContainer[TaskProgress]
    step_seconds: float
    backups_complete: _containers.RepeatedCompositeFieldContainer[ShardCopy]
    round_blame: _containers.RepeatedCompositeFieldContainer[RoundBlame]
    own_step_seconds: float
    def __init__(self, member_id: _Optional[str] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., progress: _Optional[_Iterable[_Union[TaskProgress, _Mapping]]] = ..., step_seconds: _Optional[float] = ..., backups_complete: _Optional[_Iterable[_Union[ShardCopy, _Mapping]]] = ..., round_blame: _Optional[_Iterable[_Union[RoundBlame, _Mapping]]] = ..., own_step_seconds: _Optional[float] = ...) -> None: ...

class RoundBlame(_message.Message):
    __slots__ = ("shard", "worker", "rounds", "last", "ratio", "waited_seconds")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    worker: str
    rounds: int
    last: int
    ratio: float
    waited_seconds: float
    def __init__(self, shard: _Optional[int] = ..., worker: _Optional[str] = ..., rounds: _Optional[int] = ..., last: _Optional[int] = ..., ratio: _Optional[float] = ..., waited_seconds: _Optional[float] = ...) -> None: ...

class ShardCopy(_message.Message):
    __slots__ = ("shard", "backup_id")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    BACKUP_ID_FIELD_NUMBER: _ClassVar[int]
    shard: int
    backup_id: str
    def __init__(self, shard: _Optional[int] = ..., backup_id: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("epoch", "known", "leave")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    known: bool
    leave: str
    def __init__(self, epoch: _Optional[int] = ..., known: _Optional[bool] = ..., leave: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("member_id", "counters")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    counters: Counters
    def __init__(self, member_id: _Optional[str] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ...) -> None: ...

class ViewRequest(_message.Message):
    __slots__ = ("after_epoch", "timeout_seconds", "member_id", "scope", "generation")
    AFTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    after_epoch: int
    timeout_seconds: float
    member_id: str
    scope: ViewScope
    generation: int
    def __init__(self, after_epoch: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., member_id: _Optional[str] = ..., scope: _Optional[_Union[ViewScope, str]] = ..., generation: _Optional[int] = ...) -> None: ...

class DatasetSpec(_message.Message):
    __slots__ = ("size", "batch_size", "epochs", "batches_per_task", "seed")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_TASK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    size: int
    batch_size: int
    epochs: int
    batches_per_task: int
    seed: int
    def __init__(self, size: _Optional[int] = ..., batch_size: _Optional[int] = ..., epochs: _Optional[int] = ..., batches_per_task: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "epoch", "start", "stop", "attempt", "token")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    epoch: int
    start: int
    stop: int
    attempt: int
    token: bytes
    def __init__(self, task_id: _Optional[int] = ..., epoch: _Optional[int] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ..., attempt: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class BatchRange(_message.Message):
    __slots__ = ("epoch", "start", "stop")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    start: int
    stop: int
    def __init__(self, epoch: _Optional[int] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class TaskRequest(_message.Message):
    __slots__ = ("member_id", "dataset", "max_tasks", "done_task_ids", "dropped", "held_task_ids", "reports_held")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    MAX_TASKS_FIELD_NUMBER: _ClassVar[int]
    DONE_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    HELD_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_HELD_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    dataset: DatasetSpec
    max_tasks: int
    done_task_ids: _containers.RepeatedScalarFieldContainer[int]
    dropped: _containers.RepeatedCompositeFieldContainer[BatchRange]
    held_task_ids: _containers.RepeatedScalarFieldContainer[int]
    reports_held: bool
    def __init__(self, member_id: _Optional[str] = ..., dataset: _Optional[_Union[DatasetSpec, _Mapping]] = ..., max_tasks: _Optional[int] = ..., done_task_ids: _Optional[_Iterable[int]] = ..., dropped: _Optional[_Iterable[_Union[BatchRange, _Mapping]]] = ..., held_task_ids: _Optional[_Iterable[int]] = ..., reports_held: _Optional[bool] = ...) -> None: ...

class TaskReply(_message.Message):
    __slots__ = ("tasks", "finished", "epoch", "data_epochs_open")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DATA_EPOCHS_OPEN_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    finished: bool
    epoch: int
    data_epochs_open: int
    def __init__(self, tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ..., finished: _Optional[bool] = ..., epoch: _Optional[int] = ..., data_epochs_open: _Optional[int] = ...) -> None: ...

class MetricsReport(_message.Message):
    __slots__ = ("member_id", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    values: _containers.ScalarMap[str, float]
    def __init__(self, member_id: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class JobStats(_message.Message):
    __slots__ = ("totals", "metrics", "workers_seen", "workers_live", "tasks_done", "tasks_total", "job", "queue_depth", "completed_epochs", "epochs", "batches_per_epoch", "restored_from", "restored_step", "checkpoint_step", "checkpoints_written", "lost_shards", "stopped", "checkpoints_failed", "checkpoint_failed_step", "checkpoint_error", "metric_sources", "job_id", "generation", "checkpoint_missing_steps", "last_applied_step", "job_phase", "job_result", "job_exit_code", "job_ended_seconds_ago", "job_drain_left_seconds", "autoscale_decisions")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetricSourcesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_SEEN_FIELD_NUMBER: _ClassVar[int]
    WORKERS_LIVE_FIELD_NUMBER: _ClassVar[int]
    TASKS_DONE_FIELD_NUMBER: _ClassVar[int]
    TASKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    LOST_SHARDS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FAILED_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ERROR_FIELD_NUMBER: _ClassVar[int]
    METRIC_SOURCES_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_MISSING_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_STEP_FIELD_NUMBER: _ClassVar[int]
    JOB_PHASE_FIELD_NUMBER: _ClassVar[int]
    JOB_RESULT_FIELD_NUMBER: _ClassVar[int]
    JOB_EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    JOB_ENDED_SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    JOB_DRAIN_LEFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    totals: Counters
    metrics: _containers.ScalarMap[str, float]
    workers_seen: int
    workers_live: int
    tasks_done: int
    tasks_total: int
    job: JobConfig
    queue_depth: int
    completed_epochs: int
    epochs: int
    batches_per_epoch: int
    restored_from: str
    restored_step: int
    checkpoint_step: int
    checkpoints_written: int
    lost_shards: _containers.RepeatedScalarFieldContainer[int]
    stopped: str
    checkpoints_failed: int
    checkpoint_failed_step: int
    checkpoint_error: str
    metric_sources: _containers.ScalarMap[str, str]
    job_id: str
    generation: int
    checkpoint_missing_steps: _containers.RepeatedScalarFieldContainer[int]
    last_applied_step: int
    job_phase: str
    job_result: str
    job_exit_code: int
    job_ended_seconds_ago: float
    job_drain_left_seconds: float
    autoscale_decisions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, totals: _Optional[_Union[Counters, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., workers_seen: _Optional[int] = ..., workers_live: _Optional[int] = ..., tasks_done: _Optional[int] = ..., tasks_total: _Optional[int] = ..., job: _Optional[_Union[JobConfig, _Mapping]] = ..., queue_depth: _Optional[int] = ..., completed_epochs: _Optional[int] = ..., epochs: _Optional[int] = ..., batches_per_epoch: _Optional[int] = ..., restored_from: _Optional[str] = ..., restored_step: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., checkpoints_written: _Optional[int] = ..., lost_shards: _Optional[_Iterable[int]] = ..., stopped: _Optional[str] = ..., checkpoints_failed: _Optional[int] = ..., checkpoint_failed_step: _Optional[int] = ..., checkpoint_error: _Optional[str] = ..., metric_sources: _Optional[_Mapping[str, str]] = ..., job_id: _Optional[str] = ..., generation: _Optional[int] = ..., checkpoint_missing_steps: _Optional[_Iterable[int]] = ..., last_applied_step: _Optional[int] = ..., job_phase: _Optional[str] = ..., job_result: _Optional[str] = ..., job_exit_code: _Optional[int] = ..., job_ended_seconds_ago: _Optional[float] = ..., job_drain_left_seconds: _Optional[float] = ..., autoscale_decisions: _Optional[_Iterable[str]] = ...) -> None: ...

class UnreachableReport(_message.Message):
    __slots__ = ("reporter_id", "member_id")
    REPORTER_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    reporter_id: str
    member_id: str
    def __init__(self, reporter_id: _Optional[str] = ..., member_id: _Optional[str] = ...) -> None: ...

class UnreachableReply(_message.Message):
    __slots__ = ("expired",)
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    expired: bool
    def __init__(self, expired: _Optional[bool] = ...) -> None: ...

class OptimizerConfig(_message.Message):
    __slots__ = ("name", "hparams", "spec_json")
    class HparamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    HPARAMS_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    hparams: _containers.ScalarMap[str, float]
    spec_json: str
    def __init__(self, name: _Optional[str] = ..., hparams: _Optional[_Mapping[str, float]] = ..., spec_json: _Optional[str] = ...) -> None: ...

class InitHeader(_message.Message):
    __slots__ = ("layout_fingerprint", "shard", "numel", "optimizer", "offset", "flat_start", "tables_json")
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    FLAT_START_FIELD_NUMBER: _ClassVar[int]
    TABLES_JSON_FIELD_NUMBER: _ClassVar[int]
    layout_fingerprint: str
    shard: int
    numel: int
    optimizer: OptimizerConfig
    offset: int
    flat_start: int
    tables_json: str
    def __init__(self, layout_fingerprint: _Optional[str] = ..., shard: _Optional[int] = ..., numel: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ..., offset: _Optional[int] = ..., flat_start: _Optional[int] = ..., tables_json: _Optional[str] = ...) -> None: ...

class InitReply(_message.Message):
    __slots__ = ("created", "version")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    created: bool
    version: int
    def __init__(self, created: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker_id", "shard", "layout_fingerprint", "version", "codec", "offset", "numel", "key", "view_epoch", "samples", "has_batch", "task_id", "attempt", "token", "data_epoch", "task_start", "task_stop", "batch_start", "batch_stop", "hparams", "more_batches")
    class HparamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VIEW_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    HAS_BATCH_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DATA_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TASK_START_FIELD_NUMBER: _ClassVar[int]
    TASK_STOP_FIELD_NUMBER: _ClassVar[int]
    BATCH_START_FIELD_NUMBER: _ClassVar[int]
    BATCH_STOP_FIELD_NUMBER: _ClassVar[int]
    HPARAMS_FIELD_NUMBER: _ClassVar[int]
    MORE_BATCHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    shard: int
    layout_fingerprint: str
    version: int
    codec: str
    offset: int
    numel: int
    key: str
    view_epoch: int
    samples: int
    has_batch: bool
    task_id: int
    attempt: int
    token: bytes
    data_epoch: int
    task_start: int
    task_stop: int
    batch_start: int
    batch_stop: int
    hparams: _containers.ScalarMap[str, float]
    more_batches: _containers.RepeatedCompositeFieldContainer[PushBatch]
    def __init__(self, worker_id: _Optional[str] = ..., shard: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., version: _Optional[int] = ..., codec: _Optional[str] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., key: _Optional[str] = ..., view_epoch: _Optional[int] = ..., samples: _Optional[int] = ..., has_batch: _Optional[bool] = ..., task_id: _Optional[int] = ..., attempt: _Optional[int] = ..., token: _Optional[bytes] = ..., data_epoch: _Optional[int] = ..., task_start: _Optional[int] = ..., task_stop: _Optional[int] = ..., batch_start: _Optional[int] = ..., batch_stop: _Optional[int] = ..., hparams: _Optional[_Mapping[str, float]] = ..., more_batches: _Optional[_Iterable[_Union[PushBatch, _Mapping]]] = ...) -> None: ...

class PushBatch(_message.Message):
    __slots__ = ("task", "batch_start", "batch_stop")
    TASK_FIELD_NUMBER: _ClassVar[int]
    BATCH_START_FIELD_NUMBER: _ClassVar[int]
    BATCH_STOP_FIELD_NUMBER: _ClassVar[int]
    task: Task
    batch_start: int
    batch_stop: int
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ..., batch_start: _Optional[int] = ..., batch_stop: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "version", "reason", "duplicate", "applied_before")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: int
    reason: str
    duplicate: bool
    applied_before: _containers.RepeatedCompositeFieldContainer[BatchRange]
    def __init__(self, accepted: _Optional[bool] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ..., duplicate: _Optional[bool] = ..., applied_before: _Optional[_Iterable[_Union[BatchRange, _Mapping]]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("shard", "min_version", "timeout_seconds", "codec", "layout_fingerprint", "since_version")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    shard: int
    min_version: int
    timeout_seconds: float
    codec: str
    layout_fingerprint: str
    since_version: int
    def __init__(self, shard: _Optional[int] = ..., min_version: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., codec: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., since_version: _Optional[int] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("shard", "version", "offset", "numel", "codec", "shard_numel", "delta", "changed")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHARD_NUMEL_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    shard: int
    version: int
    offset: int
    numel: int
    codec: str
    shard_numel: int
    delta: bool
    changed: int
    def __init__(self, shard: _Optional[int] = ..., version: _Optional[int] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., codec: _Optional[str] = ..., shard_numel: _Optional[int] = ..., delta: _Optional[bool] = ..., changed: _Optional[int] = ...) -> None: ...

class DataChannelOffer(_message.Message):
    __slots__ = ("port", "ticket")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class RowsHeader(_message.Message):
    __slots__ = ("shard", "table", "count", "min_version", "timeout_seconds", "layout_fingerprint", "dtype", "version", "dim")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    shard: int
    table: str
    count: int
    min_version: int
    timeout_seconds: float
    layout_fingerprint: str
    dtype: str
    version: int
    dim: int
    def __init__(self, shard: _Optional[int] = ..., table: _Optional[str] = ..., count: _Optional[int] = ..., min_version: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., layout_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., version: _Optional[int] = ..., dim: _Optional[int] = ...) -> None: ...

class TableStatus(_message.Message):
    __slots__ = ("name", "rows", "bytes", "bytes_per_row", "dim", "num_embeddings", "optimizer")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    bytes: int
    bytes_per_row: int
    dim: int
    num_embeddings: int
    optimizer: str
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ..., bytes_per_row: _Optional[int] = ..., dim: _Optional[int] = ..., num_embeddings: _Optional[int] = ..., optimizer: _Optional[str] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("shard", "initialized", "version", "numel", "mode", "pushes_applied", "pushes_dropped", "bytes_in", "bytes_out", "round_pending", "ledger", "worker_clocks", "backup", "backup_state", "promotions", "optimizer", "nonfinite_refused", "guard_refused", "rolled_back", "expelled", "tables")
    class WorkerClocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class NonfiniteRefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class GuardRefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SHARD_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    ROUND_PENDING_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    WORKER_CLOCKS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    BACKUP_STATE_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_REFUSED_FIELD_NUMBER: _ClassVar[int]
    GUARD_REFUSED_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    EXPELLED_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    shard: int
    initialized: bool
    version: int
    numel: int
    mode: str
    pushes_applied: int
    pushes_dropped: int
    bytes_in: int
    bytes_out: int
    round_pending: int
    ledger: _containers.RepeatedCompositeFieldContainer[LedgerEpoch]
    worker_clocks: _containers.ScalarMap[str, int]
    backup: str
    backup_state: str
    promotions: int
    optimizer: OptimizerConfig
    nonfinite_refused: _containers.ScalarMap[str, int]
    guard_refused: _containers.ScalarMap[str, int]
    rolled_back: int
    expelled: _containers.RepeatedScalarFieldContainer[str]
    tables: _containers.RepeatedCompositeFieldContainer[TableStatus]
    def __init__(self, shard: _Optional[int] = ..., initialized: _Optional[bool] = ..., version: _Optional[int] = ..., numel: _Optional[int] = ..., mode: _Optional[str] = ..., pushes_applied: _Optional[int] = ..., pushes_dropped: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., round_pending: _Optional[int] = ..., ledger: _Optional[_Iterable[_Union[LedgerEpoch, _Mapping]]] = ..., worker_clocks: _Optional[_Mapping[str, int]] = ..., backup: _Optional[str] = ..., backup_state: _Optional[str] = ..., promotions: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ..., nonfinite_refused: _Optional[_Mapping[str, int]] = ..., guard_refused: _Optional[_Mapping[str, int]] = ..., rolled_back: _Optional[int] = ..., expelled: _Optional[_Iterable[str]] = ..., tables: _Optional[_Iterable[_Union[TableStatus, _Mapping]]] = ...) -> None: ...

class LedgerEpoch(_message.Message):
    __slots__ = ("epoch", "applied", "max_count")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    MAX_COUNT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    applied: int
    max_count: int
    def __init__(self, epoch: _Optional[int] = ..., applied: _Optional[int] = ..., max_count: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("shard", "by_shard")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    BY_SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: int
    by_shard: bool
    def __init__(self, shard: _Optional[int] = ..., by_shard: _Optional[bool] = ...) -> None: ...

class FreezeRequest(_message.Message):
    __slots__ = ("shard", "target_version", "timeout_seconds", "hold_seconds")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    target_version: int
    timeout_seconds: float
    hold_seconds: float
    def __init__(self, shard: _Optional[int] = ..., target_version: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., hold_seconds: _Optional[float] = ...) -> None: ...

class FreezeReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class WriteShardRequest(_message.Message):
    __slots__ = ("shard", "directory", "version", "start", "stop", "layout_fingerprint", "thaw")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    THAW_FIELD_NUMBER: _ClassVar[int]
    shard: int
    directory: str
    version: int
    start: int
    stop: int
    layout_fingerprint: str
    thaw: bool
    def __init__(self, shard: _Optional[int] = ..., directory: _Optional[str] = ..., version: _Optional[int] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., thaw: _Optional[bool] = ...) -> None: ...

class WriteShardReply(_message.Message):
    __slots__ = ("shard", "start", "stop", "file", "sha256", "bytes", "version", "frozen_seconds")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FROZEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    start: int
    stop: int
    file: str
    sha256: str
    bytes: int
    version: int
    frozen_seconds: float
    def __init__(self, shard: _Optional[int] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ..., file: _Optional[str] = ..., sha256: _Optional[str] = ..., bytes: _Optional[int] = ..., version: _Optional[int] = ..., frozen_seconds: _Optional[float] = ...) -> None: ...

class ThawRequest(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: int
    def __init__(self, shard: _Optional[int] = ...) -> None: ...

class ThawReply(_message.Message):
    __slots__ = ("frozen_seconds",)
    FROZEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    frozen_seconds: float
    def __init__(self, frozen_seconds: _Optional[float] = ...) -> None: ...

class ReplicatedBatch(_message.Message):
    __slots__ = ("epoch", "start", "owner")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    start: int
    owner: str
    def __init__(self, epoch: _Optional[int] = ..., start: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class ReplicateHeader(_message.Message):
    __slots__ = ("shard", "version", "primary_id", "keys", "batches", "workers", "offset", "numel", "shard_numel", "hparams", "dtype", "entries", "nnz", "sparse", "rows_bytes", "rows_part")
    class HparamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_NUMEL_FIELD_NUMBER: _ClassVar[int]
    HPARAMS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NNZ_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    ROWS_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROWS_PART_FIELD_NUMBER: _ClassVar[int]
    shard: int
    version: int
    primary_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    batches: _containers.RepeatedCompositeFieldContainer[ReplicatedBatch]
    workers: _containers.RepeatedScalarFieldContainer[str]
    offset: int
    numel: int
    shard_numel: int
    hparams: _containers.ScalarMap[str, float]
    dtype: str
    entries: bool
    nnz: int
    sparse: bool
    rows_bytes: int
    rows_part: bool
    def __init__(self, shard: _Optional[int] = ..., version: _Optional[int] = ..., primary_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., batches: _Optional[_Iterable[_Union[ReplicatedBatch, _Mapping]]] = ..., workers: _Optional[_Iterable[str]] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., shard_numel: _Optional[int] = ..., hparams: _Optional[_Mapping[str, float]] = ..., dtype: _Optional[str] = ..., entries: _Optional[bool] = ..., nnz: _Optional[int] = ..., sparse: _Optional[bool] = ..., rows_bytes: _Optional[int] = ..., rows_part: _Optional[bool] = ...) -> None: ...

class InstallHeader(_message.Message):
    __slots__ = ("shard", "version", "primary_id", "offset", "total_bytes", "layout_fingerprint")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    shard: int
    version: int
    primary_id: str
    offset: int
    total_bytes: int
    layout_fingerprint: str
    def __init__(self, shard: _Optional[int] = ..., version: _Optional[int] = ..., primary_id: _Optional[str] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ...) -> None: ...

class ReplicateReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class DigestRequest(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: int
    def __init__(self, shard: _Optional[int] = ...) -> None: ...

class DigestReply(_message.Message):
    __slots__ = ("shard", "version", "sha256", "role")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    shard: int
    version: int
    sha256: str
    role: str
    def __init__(self, shard: _Optional[int] = ..., version: _Optional[int] = ..., sha256: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...
