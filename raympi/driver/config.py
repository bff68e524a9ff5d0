"""The options of :func:`raympi.fit`, validated before any actor starts.

Frozen pydantic models with ``extra="forbid"``: a misspelled option or a bad
value is a :class:`~raympi.exceptions.ConfigError` that names the field.  Every
deadline is a field here, and the error that a deadline raises quotes it.
"""

from __future__ import annotations

import os

from typing import Any, Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raympi.core.optim import GradientTransformation
from raympi.exceptions import ConfigError

__all__ = ["FitConfig", "MPIConfig", "UNSET", "parse_config"]


class _Unset:
    """The type of :data:`UNSET` (one instance)."""

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"  # unpickled as this module's one instance


#: The default of an option of :func:`raympi.fit` whose default :class:`FitConfig` computes when ``fit`` runs (a
#: fresh dict or list, an environment variable): ``fit`` leaves it out of :func:`parse_config`, so the computed
#: default applies. Typed ``Any`` so that it may stand as the default of a parameter of any type.
UNSET: Any = _Unset()


class MPIConfig(BaseModel):
    """How the MPI library talks between ranks; the same on every rank of a group.

    ``netmod="auto"`` picks MPICH's OFI network module with its ``tcp`` provider
    when the group may span hosts (UCX, MPICH's own default, hung on ``Connect``
    between hosts) and UCX when every rank is sure to share one host (about 3x
    faster there; with ``UCX_RNDV_SCHEME=am``, under which a rank outlives a
    peer that died mid-transfer).  "May span" counts the ranks' nodes and every live node that
    could host a replacement later, because replacements inherit the group's
    choice (see :func:`raympi.driver.group.spans_hosts`).  An autoscaling cluster that
    starts with one node should set ``netmod="ofi"``.  ``interface`` names the
    NIC (``FI_TCP_IFACE`` of libfabric's tcp provider, ``UCX_NET_DEVICES`` for
    UCX); ``env`` adds any other ``MPIR_CVAR_*`` / ``FI_*`` / ``UCX_*`` variable.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    netmod: Literal["auto", "ofi", "ucx"] = Field(
        default="auto",
        description="MPICH ch4 network module (MPIR_CVAR_CH4_NETMOD); 'auto': ucx when the cluster is one host, "
        "ofi when ranks may span hosts",
    )
    provider: Optional[str] = Field(default="tcp", description="libfabric provider with netmod='ofi' (FI_PROVIDER)")
    interface: Optional[str] = Field(
        default=None, description="network interface MPI should use, e.g. 'eth0' (FI_TCP_IFACE / UCX_NET_DEVICES)"
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables for the MPI library")

    def environment(self, multi_host: bool) -> dict[str, str]:
        """The environment variables every rank of a group starts with."""
        netmod = self.netmod if self.netmod != "auto" else ("ofi" if multi_host else "ucx")
        env: dict[str, str] = {"MPIR_CVAR_CH4_NETMOD": netmod}
        if netmod == "ofi" and self.provider:
            env["FI_PROVIDER"] = self.provider
        if netmod == "ucx":
            # Rendezvous by active messages, not by reading the peer's memory (CMA): a rank whose peer
            # died mid-transfer then lives on (CMA's failed read aborts it), and large messages are faster.
            env["UCX_RNDV_SCHEME"] = "am"
        if self.interface:
            env["FI_TCP_IFACE" if netmod == "ofi" else "UCX_NET_DEVICES"] = self.interface
        return {**env, **self.env}


class FitConfig(BaseModel):
    """Every option of :func:`raympi.fit`, each a parameter of it (keyword-only after ``workers``); the options
    page of the guide groups them by purpose."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    workers: int = Field(1, ge=1, description="number of ranks (one Ray actor each)")
    epochs: int = Field(1, ge=1)
    max_steps: Optional[int] = Field(
        None, ge=1, description="stop after this many steps in all (a run can be resumed later)"
    )
    batch_size: int = Field(64, ge=1, description="global batch size, split across the workers")
    optimizer: Any = Field(None, description="a raympi.optim transform; default raympi.optim.adam(1e-3)")
    loss_fn: Optional[Callable[..., Any]] = Field(
        None,
        description="loss_fn(outputs, targets) -> mean over samples; default: the model's own loss (outputs.loss, "
        "as Hugging Face models return with labels among the inputs), else cross-entropy",
    )
    columns: Optional[tuple[str, str]] = Field(
        None, description="(input, target) columns of a ray.data.Dataset; default its two columns"
    )
    eval_dataset: Any = None
    eval_every: int = Field(
        0, ge=0, description="steps between evaluations (0: at the end of each epoch when eval_dataset is given)"
    )
    eval_with_ema: bool = Field(
        False, description="evaluate the EMA of the parameters kept by raympi.optim.ema (when the optimizer has one)"
    )
    seed: int = 0
    use_gpu: Optional[bool] = Field(None, description="one GPU per worker; default: when the cluster has GPUs")
    resources_per_worker: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    placement_strategy: Literal["SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"] = "SPREAD"
    checkpoint_dir: Optional[str] = Field(None, description="local path or fsspec URI; default ./runs/raympi-<time>")
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints (0: only at the end)")
    keep_checkpoints: int = Field(
        3, ge=1, description="checkpoints kept: the newest, or with checkpoint_metric the best by it and the newest"
    )
    checkpoint_metric: Optional[str] = Field(
        None,
        min_length=1,
        description="a key of the step records ('eval_loss', 'eval_accuracy', 'loss', ...): keep_checkpoints keeps "
        "the best by it, and the newest (resume continues from the newest); a checkpoint whose record has no value "
        "for it (a step without evaluation; NaN) ranks below every one that has",
    )
    checkpoint_mode: Optional[Literal["min", "max"]] = Field(
        None,
        description="with checkpoint_metric: 'min' (lower is better, a loss; the default) or 'max' (higher is "
        "better, an accuracy)",
    )
    direct_checkpoint_bytes: Optional[int] = Field(
        2**30,
        ge=0,
        description="a state of at least this many bytes is written by rank 0 straight to checkpoint_dir (copied, "
        "then written in the background), never through the driver; None: the driver writes every checkpoint. With "
        "workers on other nodes than the driver, checkpoint_dir must be shared storage or an fsspec URL",
    )
    resume: bool = False
    progress: Optional[bool] = Field(None, description="progress bar; default: when stderr is a terminal")
    address: Optional[str] = Field(
        None, description="Ray cluster to join ('auto'); default RAY_ADDRESS or a new local instance"
    )
    min_workers: Optional[int] = Field(
        None, ge=1, description="fewest workers to continue with after a failure; default: workers"
    )
    spares: Optional[int] = Field(
        None,
        ge=0,
        description="hot spare workers kept ready outside the communicator; default 1 when the cluster has room beyond "
        "workers, else 0",
    )
    keep_workers: bool = Field(
        default_factory=lambda: os.environ.get("RAYMPI_KEEP_WORKERS", "") == "1",
        description="keep the worker processes when the run ends well, for the next fit of the same shape in this "
        "driver (no new processes, torch not imported again); any other fit releases them. Default: the environment "
        "variable RAYMPI_KEEP_WORKERS=1",
    )
    max_restarts: int = Field(
        3, ge=0, description="infrastructure failures (lost worker or node, hung rank) survived before giving up"
    )
    restart_timeout_s: float = Field(
        60.0, gt=0, description="how long a restart waits for capacity of at least min_workers"
    )
    straggler_factor: Optional[float] = Field(
        3.0,
        gt=1,
        description="a rank whose own compute per step is this many times its peers' median, straggler_chunks chunks "
        "in a row, is swapped for a hot spare on another node (warm, no step lost, not counted in max_restarts); "
        "None turns it off",
    )
    straggler_chunks: int = Field(4, ge=1, description="chunks in a row a rank must be slow to be a straggler")
    startup_timeout_s: float = Field(
        120.0,
        gt=0,
        description="placing the workers, starting them and forming MPI; a worker still starting 4x as long as the "
        "others took, and a quarter of this, is taken for hung",
    )
    step_timeout_s: float = Field(
        10.0,
        gt=0,
        description="the longest the ranks the driver waits on may go without finishing a step "
        "(or an evaluation batch): a collective hung with every rank alive is noticed after this; "
        "a stopped or cut-off rank much sooner, by the heartbeat",
    )
    bucket_bytes: int = Field(16 * 2**20, ge=1024, description="bytes per MPI_Allreduce bucket")
    compression: Optional[Literal["bf16", "fp16"]] = Field(
        None,
        description="send float32 gradients as 16-bit floats (half the bytes; the optimizer stays float32); "
        "see the README's performance notes",
    )
    overlap: Optional[bool] = Field(
        None,
        description="sum gradient buckets over the ranks while backward still runs, as DDP does; default: "
        "on with GPUs, off on CPUs, where it did not pay (benchmarks/RESULTS.md); not with compression",
    )
    shard_optimizer: bool = Field(
        False,
        description="keep each rank's slice of the optimizer state and of the summed gradients only (ZeRO-2): "
        "a reduce-scatter, the optimizer on the slice, an all-gather of the parameters; optimizer memory 1/N per "
        "rank (2/N with shard_buddy). Not with compression or overlap",
    )
    shard_buddy: bool = Field(
        True,
        description="shard_optimizer: keep a copy of each rank's slice on one other rank (on another node where "
        "the ranks are spread evenly), updated every step: a lost rank (or node) then restarts warm with no step "
        "lost, at 2/N of the optimizer state per rank instead of 1/N. False: 1/N, and a failure restarts from "
        "the newest checkpoint",
    )
    grad_transport: Literal["auto", "mpi", "nccl", "gloo"] = Field(
        "auto",
        description="how gradients are summed: 'mpi' (the communicator; GPU gradients staged through host memory), "
        "'nccl' (a NCCL process group built from the MPI communicator; one GPU per worker), "
        "'gloo' (the same path on CPU); 'auto': nccl for workers with a whole GPU each, mpi otherwise (faster than "
        "gloo on CPU, docs/benchmarks.md)",
    )
    fp32_reduce: bool = Field(
        False, description="nccl/gloo: sum 16-bit gradients in float32 (twice the bytes); mpi always does"
    )
    loader_workers: Optional[int] = Field(
        None,
        ge=0,
        description="processes per worker reading a map-style Dataset ahead of the step (0: in the step's thread); "
        "default: the worker's CPUs minus one, at most 4",
    )
    torch_threads: Optional[int] = Field(None, ge=1, description="torch threads per worker; default the worker's CPUs")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="mixed precision: forward and loss under autocast, float32 master weights; "
        "fp16 adds dynamic loss scaling",
    )
    accumulate: int = Field(
        1, ge=1, description="micro-batches per step on each rank (gradient accumulation): less memory, the same update"
    )
    metrics: dict[str, Callable[..., Any]] = Field(
        default_factory=dict,
        description="name -> fn(outputs, targets) -> mean over the samples, for training and evaluation",
    )
    on_nonfinite: Literal["raise", "skip"] = Field(
        "raise", description="a NaN/inf loss: raise NonFiniteLossError, or skip that step's update"
    )
    callbacks: list[Any] = Field(
        default_factory=list,
        description="objects with on_step / on_eval / on_checkpoint / on_restart methods (raympi.callbacks)",
    )
    # (a lambda: given the class itself, mypy can pick neither of Field's default_factory overloads)
    mpi: MPIConfig = Field(default_factory=lambda: MPIConfig())

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, GradientTransformation):
            what = value.__name__ if isinstance(value, type) else repr(value)
            raise ValueError(
                f"optimizer={what} is not a raympi optimizer: pass a raympi.optim transform such as "
                "raympi.optim.adam(1e-3), or wrap a torch optimizer: raympi.optim.from_torch(torch.optim.Adam, lr=1e-3)"
            )
        return value

    @property
    def min_ranks(self) -> int:
        """The fewest ranks a run goes on with (``min_workers`` as validated, ``workers`` where it was unset)."""
        return self.workers if self.min_workers is None else self.min_workers

    @model_validator(mode="after")
    def _check(self) -> "FitConfig":
        min_workers = self.workers if self.min_workers is None else self.min_workers
        object.__setattr__(self, "min_workers", min_workers)
        if min_workers > self.workers:
            raise ValueError(f"min_workers={min_workers} is larger than workers={self.workers}")
        if self.overlap and self.compression:
            raise ValueError(
                f"overlap=True does not combine with compression={self.compression!r}: "
                "set overlap=False or compression=None"
            )
        if self.shard_optimizer and (self.compression or self.overlap):
            raise ValueError(
                f"shard_optimizer=True does not combine with "
                f"{'compression=' + repr(self.compression) if self.compression else 'overlap=True'} yet (the "
                "gradients are reduce-scattered in float32, after backward): set "
                f"{'compression=None' if self.compression else 'overlap=False'} or shard_optimizer=False"
            )
        if self.compression and self.grad_transport in ("nccl", "gloo"):
            raise ValueError(
                f"compression={self.compression!r} applies to the MPI transport only, not grad_transport="
                f"{self.grad_transport!r}: set compression=None or grad_transport='mpi'"
            )
        if self.grad_transport == "nccl" and self.use_gpu is False:
            raise ValueError(
                "grad_transport='nccl' needs GPU workers, but use_gpu=False: use grad_transport='gloo' or 'mpi' on CPUs"
            )
        if self.grad_transport == "nccl" and 0 < self.resources_per_worker.get("GPU", 1) < 1:
            raise ValueError(
                f"grad_transport='nccl' needs a whole GPU per worker (NCCL refuses two ranks on one device), "
                f"but resources_per_worker gives each {self.resources_per_worker['GPU']:g}: "
                "use grad_transport='mpi' or 'gloo' for workers that share a GPU"
            )
        if self.checkpoint_mode is not None and self.checkpoint_metric is None:
            raise ValueError(
                f"checkpoint_mode={self.checkpoint_mode!r} orders the checkpoints by checkpoint_metric, which is not "
                "set: name the metric (checkpoint_metric='eval_loss') or leave checkpoint_mode out"
            )
        if self.batch_size < self.workers:
            raise ValueError(
                f"batch_size={self.batch_size} is smaller than workers={self.workers}: "
                "every worker needs at least one sample per step"
            )
        return self


def parse_config(**options: Any) -> FitConfig:
    """Build a :class:`FitConfig`, turning pydantic's report into one readable :class:`ConfigError`."""
    try:
        return FitConfig(**options)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "options"
            if err["type"] == "extra_forbidden":
                known = ", ".join(sorted(FitConfig.model_fields))
                lines.append(f"unknown option {field!r} (known options: {known})")
            elif err["type"] == "value_error":
                lines.append(err["msg"].removeprefix("Value error, "))
            else:
                lines.append(f"{field}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("invalid raympi.fit options: " + "; ".join(lines)) from None
