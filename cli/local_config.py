"""What ``shoal local`` runs: its settings (``LocalConfig``), validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shoal.errors import InvalidArgument
from shoal.observe.alerts import AlertConfig
from shoal.settings.config import JobConfig


@dataclass(frozen=True)
class LocalConfig:
    script: str
    script_args: tuple[str, ...] = ()
    num_ps: int = 2
    num_workers: int = 2
    job: JobConfig = field(default_factory=JobConfig)
    compression: str = "none"
    pull_codec: str = "none"
    transport: str = "tcp"
    summary: str = ""
    run_dir: str = ""
    startup_timeout_s: float = 60.0
    restart: bool = True
    restart_backoff_s: float = 1.0
    max_restarts: int = 10
    checkpoint_dir: str = ""          # passed to the chief with the two settings below
    checkpoint_interval: str = ""
    keep_checkpoints: int = 3
    drain_s: float = 60.0              # after our workers end: how long workers that joined from outside may take
    tensorboard: str = ""              # TensorBoard runs go to <this or <run-dir>/tb>/<mode>-<time>/<role>
    metrics_port: int | None = None    # None: no /metrics; 0: every role a free port; N: chief N, then N+1, ...
    alerts: AlertConfig = field(default_factory=AlertConfig)
    run_name: str = ""                 # the TensorBoard run folder ("": <mode>-<UTC time>)
    secure: bool = False               # a job token in the run dir (unless one is given) for every role
    config: str = ""                   # the job file, passed to the chief (its autoscaling policy)
    autoscale: bool = False            # start and stop workers to follow the chief's desired count
    allow_checkpoint_failures: bool = False   # failed checkpoints do not make the run exit 73 (shoal.errors)
    # Where each role runs (hidden --hosts, for tests and bench/nemesis.py --netns): role name ->
    # (argv prefix, e.g. ``ip netns exec NS``, and the address it binds); a role not named runs here on loopback
    hosts: tuple[tuple[str, tuple[str, ...], str], ...] = ()

    def __post_init__(self) -> None:
        if self.num_ps < 1:
            raise InvalidArgument(f"--ps must be >= 1, got {self.num_ps}")
        if self.num_workers < 1:
            raise InvalidArgument(f"--workers must be >= 1, got {self.num_workers}")
        if not Path(self.script).is_file():
            raise InvalidArgument(f"training script {self.script!r} does not exist")
        if self.drain_s < 0:
            raise InvalidArgument(f"--drain-seconds must be >= 0, got {self.drain_s}")
        if self.restart_backoff_s < 0:
            raise InvalidArgument(f"--restart-backoff must be >= 0, got {self.restart_backoff_s}")
        if self.job.backup_workers >= self.num_workers and self.job.backup_workers:
            raise InvalidArgument(f"--backup-workers {self.job.backup_workers} must be less than "
                                  f"--workers {self.num_workers}")
