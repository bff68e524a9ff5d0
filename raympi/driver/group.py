"""The worker group: placing worker actors and hot spares, joining them into one communicator,
re-forming it around survivors (warm restarts), tearing it down; every wait has a deadline.

The spares and replacements it holds are kept by :class:`~raympi.driver.spares.Spares`."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from typing import Any, Callable, Sequence

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raympi import comm
from raympi.deadline import Deadline, Expired, each_done
from raympi.driver.capacity import cluster_capacity, spans_hosts, worker_bundle
from raympi.driver.config import FitConfig
from raympi.driver.heartbeat import BEAT_S, SILENT_S, Heartbeat, start_hung
from raympi.driver.policy import Failed, Failure, FailureKind
from raympi.driver import pool, tune
from raympi.driver.spares import Joining, Spares, Standby, Starting, succeeded
from raympi.exceptions import CapacityError, FormationError, RaympiError, TrainingError, where
from raympi.worker import Worker, WorkerSpec
from raympi.worker.results import Rejoined, Where

REFORM_MIN_S = 5.0  # the shortest deadline for re-forming a group (the first formation's x4 if longer)
# a suspected rank that does not answer a ping within this while others do is hung
SUSPECT_PING_S = 1.5
# A silent rank is replaced at once; its call then gets this long (from when it was found silent) for Ray's word
# that its process died (late on a loaded machine), which labels the failure (lost, not hung) after the fact.
DEATH_NOTICE_S = 1.0
PARK_S = 2.0  # how long workers may take to drop a finished run before they are killed rather than kept
# an idle hot spare that does not answer a ping within this is left out of a derivation
SPARE_PING_S = 0.5
# glibc settings of CPU workers: freed gradient-sized blocks stay in the heap (else each step's fresh
# gradients page-fault tens of MB back in: up to 28 ms a step on a 5.8M MLP), in one arena (the step's
# Ray thread got one that glibc shrinks on free: benchmarks/RESULTS.md).
CPU_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(64 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
    "MALLOC_ARENA_MAX": "1",
}
# NCCL errors as raympi's abort expects them (read by torch's ProcessGroupNCCL as it is built): after a peer's death
# or ProcessGroupSum.abort, NCCL's watchdog aborts the communicators and leaves the process alive (2, "CleanUpOnly";
# torch's default 3 ends the process), so the step's wait ends in an error or the abort flag, which raympi raises as
# CollectiveAborted; and no heartbeat monitor that ends the process when the watchdog is stuck in an abort: a
# survivor stays for the re-formed group, and raympi's own deadlines end a rank that hangs.  MPIConfig.env overrides.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}

__all__ = ["LOST", "NCCL_ENV", "WorkerGroup"]

log = logging.getLogger("raympi")

#: What :meth:`WorkerGroup.outcomes` gives for a rank whose actor died.
LOST = "lost"


@dataclasses.dataclass
class Silent:
    """A rank found silent (its call unanswered, pings too) and replaced before Ray said whether its process
    died: :meth:`WorkerGroup.label_silent` labels it and only then kills it."""

    rank: int
    actor: Any
    call: Any
    since: float


class WorkerGroup:
    """``world`` :class:`~raympi.worker.Worker` actors joined into one MPI communicator.

    Args:
        cfg: the run's options.
        world: how many ranks.
        spec: what every worker is built from (a :class:`~raympi.worker.WorkerSpec`).
        state: the state to start from (a checkpoint's), or ``None`` for the model's own.
        ray_dataset: a ``ray.data.Dataset`` and its columns, split over the ranks; else ``None``.
        place_timeout_s: a shorter deadline for placing the workers (restarts count capacity again sooner).
        announce: says what the start is doing, a line at a time.
        spares: hot spares to keep: workers started ahead of need (torch imported, model and data
            loaded) outside the communicator, on resources the workers do not use.

    Building one starts nothing; :meth:`start` does.
    """

    def __init__(
        self,
        cfg: FitConfig,
        world: int,
        spec: WorkerSpec,
        state: Any,
        ray_dataset: tuple[Any, tuple[str, str]] | None = None,
        place_timeout_s: float | None = None,
        announce: Callable[[str], None] = lambda text: None,
        spares: int = 0,
    ) -> None:
        self.cfg, self.world, self.spec, self.state, self.ray_dataset = cfg, world, spec, state, ray_dataset
        self.place_timeout_s, self.announce = place_timeout_s, announce
        self.actors: list[Any] = []
        self.hosts: list[str] = []
        self.nodes: list[str] = []
        self.bundles: list[int | None] = []  # each rank's bundle of the placement group (None: a spare from outside)
        self.pids: list[int] = []
        self.pg: Any = None
        self.owns_pg = True  # False for a Tune trial's placement group: the trial removes it
        self.spares = Spares(target=spares)
        # The standby communicator (see raympi.comm.formation): its actors in rank order, the dead included
        # until the next derivation, and the spares inside it.
        self.standby: list[Any] = []
        self.lost: list[Any] = []  # actors killed since the last reform (still in the standby communicator)
        self.standby_broken = False  # a join was cut short: the members may disagree on the standby communicator
        self.reformed_by = ""  # how the last reform made its communicator: "derived" or "connected"
        self.fresh = True  # no step run yet by a set of processes that all just started (a warm group is not)
        self.form_s = 0.0  # how long the first formation took
        self.bundle = worker_bundle(cfg, spec.device == "cuda")
        # What parked workers must share with this group to be taken (pool.py): MPI's environment is read once.
        self.key = (
            world,
            sorted(self.bundle.items()),
            cfg.placement_strategy,
            spec.device,
            spec.torch_threads,
            cfg.mpi,
        )
        self._spec_ref: Any = None
        self._watch: Heartbeat | None = None
        self.silent_found: list[Silent] = []  # ranks the last failure found silent, not yet replaced
        self.unlabelled: list[Silent] = []  # ranks replaced while silent, their label (died or hung) not yet known
        self.labelled: list[tuple[int, bool]] = []  # labels known, not yet asked for (label_silent)
        self.draining: frozenset[str] = frozenset()  # nodes being drained: no rank, spare or bundle of ours goes there

    def start(self) -> WorkerGroup:
        """Place the workers (or take those parked by the last fit), start them, join them into one
        communicator, give them the state, and start the hot spares; returns the group.

        Raises:
            CapacityError: the workers could not be placed or started within ``startup_timeout_s``.
            Failed: a worker died or failed while starting (a :class:`~raympi.driver.policy.Failure`).
        """
        cfg, world, spec, announce = self.cfg, self.world, self.spec, self.announce
        deadline = Deadline(cfg.startup_timeout_s, "startup_timeout_s")
        parked = pool.take(self.key) if cfg.keep_workers and tune.current() is None else None
        if parked is None:
            pool.release()  # parked workers never hold what this group needs
        elif not _answer(parked.actors + parked.spares):  # one died while parked: start afresh
            pool.end(parked)
            parked = None
        self.spares.parked = parked.spares if parked else []
        try:
            if parked:
                self.pg, self.bundles, self.actors = parked.pg, list(range(world)), parked.actors
            else:
                announce(f"placing {world} worker(s) of {self.bundle}")
                self.bundles = list(self._place(deadline.sooner(self.place_timeout_s or cfg.startup_timeout_s)))
            node_of_bundle = placement_group_table(self.pg)["bundles_to_node_id"]
            self.nodes = [node_of_bundle[i] for i in self.bundles]
            env = {**NCCL_ENV, **cfg.mpi.environment(multi_host=spans_hosts(self.bundle, self.nodes))}
            env["OMP_NUM_THREADS"] = str(spec.torch_threads)
            if spec.device == "cpu":
                env = {**CPU_MALLOC_ENV, **env}
            # Applied by each worker as it starts (Worker.__init__), not as a Ray runtime_env: a worker with a
            # runtime_env is started through Ray's setup process (measured: 2 actors ready in 2.2-3.2 s against
            # 1.8 s) and cannot be one of the worker processes Ray started ahead.
            self._spec_ref = ray.put(dataclasses.replace(spec, env=env))
            if parked:
                announce(f"reusing {world} worker(s) kept from the last fit (each unpickles the model and data)")
                ready = [a.reuse.remote(self._spec_ref, r) for r, a in enumerate(self.actors)]
            else:
                announce(f"starting {world} worker(s) (each imports torch and unpickles the model and data)")
                self.actors = [self._spawn(i, i) for i in range(world)]
                ready = [a.__ray_ready__.remote() for a in self.actors]
            self.gather(ready, deadline, "starting the workers", startup=True, first_call=True)
            announce("joining MPI")
            started = time.monotonic()
            members = comm.form(
                self.actors,
                timeout_s=max(1.0, deadline.remaining()),
                bucket_bytes=cfg.bucket_bytes,
                compression=cfg.compression,
            )
            self.hosts = [host for _, _, host in members]
            self.standby = list(self.actors)
            self.form_s = time.monotonic() - started
            state = self.state
            state_ref = state if state is None or isinstance(state, ray.ObjectRef) else ray.put(state)
            self.state = None  # (the group keeps no copy of it)
            shards = self.ray_dataset[0].streaming_split(world, equal=True) if self.ray_dataset else [None] * world
            columns = self.ray_dataset[1] if self.ray_dataset else None
            self.pids = self.gather(
                [a.setup.remote(state_ref, cfg.seed, shards[r], columns) for r, a in enumerate(self.actors)],
                deadline,
                "setting up the workers",
                startup=True,
            )
            for _ in range(self.spares.target):
                self._start_spare(None)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _spawn(self, bundle_index: int | None, rank: int) -> Any:
        """A worker actor in bundle ``bundle_index`` of the placement group, or outside it (``None``: a spare)."""
        bundle = self.bundle
        strategy = (
            PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle_index)
            if bundle_index is not None
            else "DEFAULT"
        )
        return (
            ray.remote(concurrency_groups={"health": 1})(Worker)  # type: ignore[call-overload]
            .options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=strategy,
                max_restarts=0,
            )
            .remote(self._spec_ref, rank)
        )

    def _start_spare(self, bundle_index: int | None) -> None:
        """A hot spare in a freed bundle of the group, or outside the group where the cluster has room now."""
        if bundle_index is None and self.spares.parked:  # a spare of the last fit: it holds its resources already
            actor = self.spares.parked.pop()
            self.spares.outside.append(Starting(actor, None, actor.reuse.remote(self._spec_ref, -1)))
            return
        if bundle_index is None and (
            self._rescheduling() or any(ray.available_resources().get(k, 0) < v for k, v in self.bundle.items())
        ):
            return  # no room beyond the workers': a spare must never hold what they need
        actor = self._spawn(bundle_index, rank=-1)
        self.spares.outside.append(Starting(actor, bundle_index, actor.__ray_ready__.remote()))

    def _rescheduling(self) -> bool:
        """Whether Ray is placing a bundle of ours again, lost with its node.  A spare outside the group must
        not take the room it waits for: Ray's GCS retries such a placement group with no pause, a core busy
        (and its health checks starved) until the bundle fits, measured here for minutes after a node loss."""
        return self.pg is not None and placement_group_table(self.pg).get("state") == "RESCHEDULING"

    def replace(self, failed: list[int], avoid: frozenset[str] = frozenset()) -> None:
        """Kill the ``failed`` ranks (one found silent and replaced by a spare, once labelled: :meth:`label_silent`);
        hot spares take their places at once, replacements start in the background for the rest where live
        nodes have room, and new spares start in the freed bundles.  ``avoid``: nodes whose spares take no
        rank (a slow or draining node); a rank with no spare elsewhere gets a replacement, as with none at all
        (outside the group's bundles when its own is on a draining node).

        The spares and replacements wait (``spares.incoming``, ``spares.replacements``) until :meth:`reform`
        takes them in.
        """
        avoid |= self.draining
        silent = {s.rank: s for s in self.silent_found if s.actor is self.actors[s.rank]}
        self.silent_found = []
        for r in failed:
            if r not in silent:
                ray.kill(self.actors[r], no_restart=True)
            self.lost.append(self.actors[r])
        self._settle_join(wait_s=0.2)
        self._drop_dead_spares()  # a spare taken in must be alive: one on a lost node may not be known dead yet
        spares = self.spares
        alive, spares.outside = spares.sorted_outside(), []  # ready spares first
        if avoid:  # those on the avoided nodes wait for another turn
            on = self._nodes_of([s.actor for s in alive + spares.inside])
            usable = [s for s in alive if on.get(id(s.actor)) not in avoid]
            spares.outside, alive = [s for s in alive if s not in usable], usable
            inside = [s for s in spares.inside if on.get(id(s.actor)) not in avoid]
            held, spares.inside = [s for s in spares.inside if s not in inside], inside
        taken = self.world - len(failed) + len(spares.replacements) + len(spares.incoming)
        room = max(0, cluster_capacity(self.bundle) - taken)
        for r in failed:
            freed, spare = self.bundles[r], bool(spares.inside or alive)
            if self.nodes[r] in self.draining:  # its bundle goes with the node: nothing of ours starts there
                freed = None
            if r in silent and spare:  # killed once labelled (label_silent): Ray may yet say that it died
                self.unlabelled.append(silent[r])
            elif r in silent:  # a replacement started in its bundle needs that room now: labelled and killed first
                self.unlabelled.append(silent[r])
                self.labelled += self._label(silent[r], wait=True)
            if spare:  # a spare takes the rank; a new spare takes the freed bundle
                if spares.inside:  # one inside the standby communicator: it joins with no new connection
                    spares.incoming.append(spares.inside.pop(0))
                else:  # one outside MPI (ready, or nearly)
                    spares.replacements.append(alive.pop(0))
                spares.used += 1
                spares.refill.append(freed)
            elif room > 0:  # a lost node's bundle has nowhere to go until capacity returns
                room -= 1
                actor = self._spawn(freed, rank=-1)
                spares.replacements.append(Starting(actor, freed, actor.__ray_ready__.remote()))
        spares.outside.extend(alive)
        if avoid:
            spares.inside += held

    def drop_spares_on(self, nodes: frozenset[str]) -> None:
        """Kill the hot spares on ``nodes`` (being drained): they would go with the node, and new ones may start
        elsewhere meanwhile (one inside the standby communicator stays in it until the next derivation)."""
        spares = self.spares
        actors = [s.actor for s in spares.inside] + [s.actor for s in spares.outside]
        doomed = {key for key, node in self._nodes_of(actors).items() if node in nodes}
        for actor in actors:
            if id(actor) in doomed:
                ray.kill(actor, no_restart=True)
        self.lost += [s.actor for s in spares.inside if id(s.actor) in doomed]
        spares.inside = [s for s in spares.inside if id(s.actor) not in doomed]
        spares.outside = [s for s in spares.outside if id(s.actor) not in doomed]

    def spare_off(self, nodes: set[str]) -> bool:
        """Whether a hot spare, ready and on none of ``nodes``, could take a rank now."""
        candidates = [s.actor for s in self.spares.inside] + [s.actor for s in self.spares.outside if s.usable()]
        return any(node not in nodes for node in self._nodes_of(candidates).values())

    def _nodes_of(self, actors: list[Any], timeout_s: float = SPARE_PING_S) -> dict[int, str]:
        """The node of each of ``actors`` that answers within ``timeout_s`` (keyed by ``id(actor)``)."""
        return _answers({id(a): a.node.remote() for a in actors}, timeout_s)

    def replacement_ready(self) -> bool:
        """Whether a replacement started by :meth:`replace` is ready to be taken in (a grow)."""
        return self.spares.replacement_ready()

    def join_spares(self) -> None:
        """Connect one ready hot spare into the standby communicator, if there is one and none is joining.

        Called between two chunks: the members' part of the join is queued behind the chunks in flight,
        so training never waits for a spare to start, only for one connect round (see
        :meth:`raympi.comm.Member.mpi_join_standby`).
        """
        self._settle_join()
        self._top_up_spares()
        spares = self.spares
        if spares.joining is not None or self.standby_broken or not self.standby:
            return
        spare = next((s for s in spares.outside if s.usable()), None)
        if spare is None:
            return
        spares.outside.remove(spare)
        try:
            port = ray.get(spare.actor.mpi_open_port.remote(), timeout=SUSPECT_PING_S)
        except (ray.exceptions.RayError, TimeoutError):
            ray.kill(spare.actor, no_restart=True)
            return
        members = [a.mpi_join_standby.remote(port, False) for a in self.standby]
        spares.joining = Joining(spare, [spare.actor.mpi_join_standby.remote(port, True), *members])
        log.info("raympi: a hot spare joins the standby communicator of %d", len(self.standby))

    def _top_up_spares(self) -> None:
        """Start a hot spare when fewer than asked for are kept and the cluster has room again (say, once a
        dead worker's resources are released: a restart found none); at most one try a second."""
        spares = self.spares
        if spares.held() >= spares.target or spares.replacements or time.monotonic() < spares.next_top_up:
            return
        if self.world < self.cfg.workers:  # the group grows back first: a spare must not take its room
            return
        spares.next_top_up = time.monotonic() + 1.0
        taken = {*self.bundles, *spares.bundles()}
        table = placement_group_table(self.pg)
        free = [
            i
            for i in range(len(table["bundles"]))
            if i not in taken and table["bundles_to_node_id"].get(i) not in self.draining
        ]
        self._start_spare(free[0] if free else None)

    def _settle_join(self, wait_s: float = 0.0) -> None:
        """Account for a spare's join once it is over (``wait_s``: at a failure, wait that long, then give up on it).

        A join over, every call answered with a rank: the spare is inside.  Cut short by a failure: the
        members that had not started it skip it (their communicator was abandoned) and keep the old standby
        communicator; if one went through, the members disagree on it and the next reform connects anew.
        """
        settled = self.spares.settle_join(wait_s)
        if isinstance(settled, Standby):
            self.standby.append(settled.actor)
        elif settled is True:
            self.standby_broken = True

    def reform(self, keep: list[int], root: int, deadline: Deadline) -> None:
        """A new communicator of the old ranks ``keep`` (in order), the hot spares taking failed ranks'
        places, and the replacements ready by now.

        With no replacement to take in, it is derived from the standby communicator (no new connection);
        otherwise every member connects anew.  Waits for replacements only while fewer than ``min_workers``
        ranks would be left; the others stay pending and join later (another :meth:`reform`).  Every rank
        then takes the state of old rank ``root`` by broadcast.  Any failure here leaves the caller to do
        a cold restart.
        """
        spares, ready = self.spares, list[Starting]()
        while True:
            ready += spares.take_ready_replacements()
            kept = len(keep) + len(spares.incoming) + len(ready)
            if kept >= self.cfg.min_ranks or not spares.replacements or deadline.expired():
                break
            ray.wait([s.ready for s in spares.replacements], num_returns=1, timeout=deadline.remaining())
        if kept < self.cfg.min_ranks:
            raise CapacityError(
                f"only {kept} worker(s) could be kept or started, fewer than min_workers={self.cfg.min_workers}"
            )
        self._settle_join(wait_s=max(0.2, min(2.0, deadline.remaining())))
        taken: list[Standby | Starting] = [*spares.incoming, *ready]
        actors = [self.actors[r] for r in keep] + [s.actor for s in taken]
        self.bundles = [self.bundles[r] for r in keep] + [s.bundle for s in taken]
        self.actors, self.world, spares.incoming = actors, len(actors), []
        # Re-forming by connecting hangs now and then after a peer died mid-collective (MPICH over UCX, 1 in
        # 10-30): a short deadline.
        timeout_s = max(1.0, min(deadline.remaining(), max(REFORM_MIN_S, 4 * self.form_s)))
        options = {"timeout_s": timeout_s, "bucket_bytes": self.cfg.bucket_bytes, "compression": self.cfg.compression}
        if not ready and not self.standby_broken:
            self._drop_dead_spares()
            alive = [i for i, a in enumerate(self.standby) if not any(a is d for d in self.lost)]
            standby = [self.standby[i] for i in alive]
            members = [next(i for i, s in enumerate(standby) if s is a) for a in actors]
            formed = comm.derive(self.standby, alive, members, **options)  # type: ignore[arg-type]
            self.standby, self.reformed_by = standby, "derived"
        else:
            formed = comm.form(actors, **options)  # type: ignore[arg-type]
            self.standby, self.standby_broken, self.reformed_by = list(actors), False, "connected"
            # The spares inside the old standby communicator join the new one as they did the old.
            spares.outside += [Starting(s.actor, s.bundle, s.actor.__ray_ready__.remote()) for s in spares.inside]
            spares.inside = []
        self.lost = []
        self.hosts = [host for _, _, host in formed]
        node_of_bundle = placement_group_table(self.pg)["bundles_to_node_id"]
        outside = self._nodes_of([a for a, b in zip(self.actors, self.bundles) if b is None])  # spares taken in
        self.nodes = [
            node_of_bundle.get(b, "?") if b is not None else outside.get(id(a), "?")
            for a, b in zip(self.actors, self.bundles)
        ]
        answers: list[Rejoined] = self.gather(
            [a.rejoin.remote(keep.index(root)) for a in self.actors], deadline, "re-forming the group"
        )
        unusable = next((a.unusable for a in answers if a.unusable), None)
        if unusable is not None:  # the survivors' slices of a sharded state do not make one state
            raise FormationError(unusable)
        self.fresh = False
        # New spares start only now (one importing torch took the cores re-forming needs: +0.3 s on
        # 2 cores), and only where live nodes have room (never waiting on a lost node's bundle).
        for bundle_index in spares.refill:
            if cluster_capacity(self.bundle) > self.world + len(spares.outside) + len(spares.inside):
                self._start_spare(bundle_index)
        spares.refill = []

    def _drop_dead_spares(self) -> None:
        """Ping the hot spares inside the standby communicator; one that died idle (its node lost, say) is
        killed and left out: it stays in the standby communicator only until the next derivation."""
        inside = self.spares.inside
        if not inside:
            return
        pings = [(s, s.actor.ping.remote()) for s in inside]
        answered, _ = ray.wait([p for _, p in pings], num_returns=len(pings), timeout=SPARE_PING_S)
        for spare, ping in pings:
            if ping not in answered or not succeeded(ping):
                ray.kill(spare.actor, no_restart=True)
                self.lost.append(spare.actor)
                inside.remove(spare)

    def _place(self, deadline: Deadline) -> list[int]:
        """Reserve a bundle per rank: a placement group of our own, or the Tune trial's; returns each rank's bundle."""
        slots = tune.current()
        if slots is not None:  # the trial reserved them (raympi.tune.trainable); it keeps its placement group
            self.pg, self.owns_pg = slots.pg, False
            return list(slots.bundles[: self.world])
        bundle = self.bundle
        can_host = cluster_capacity(bundle)
        if can_host < self.world:
            gpus = ray.cluster_resources().get("GPU", 0)
            hint = (
                f"the cluster has {gpus:g} GPU(s): pass use_gpu=False (or leave use_gpu unset) to train on CPUs, "
                "or add GPU nodes"
                if bundle.get("GPU") and gpus < self.world * bundle["GPU"]
                else "lower workers or resources_per_worker, or add nodes"
            )
            raise CapacityError(
                f"the Ray cluster can host {can_host} worker(s) of {bundle}, not workers={self.world}: {hint}"
            )
        self.pg = placement_group([dict(bundle) for _ in range(self.world)], strategy=self.cfg.placement_strategy)
        if not self.pg.wait(max(0.1, deadline.remaining())):
            raise CapacityError(
                f"{self.world} worker(s) of {bundle} could not be placed within "
                f"startup_timeout_s={self.cfg.startup_timeout_s:g} s (the cluster has room for {can_host} when idle: "
                "other jobs hold the rest); raise startup_timeout_s or free resources"
            )
        return list(range(self.world))

    def gather(
        self,
        refs: Sequence[Any],
        deadline: Deadline,
        what: str,
        startup: bool = False,
        first_call: bool = False,
        heartbeat: bool = False,
    ) -> list[Any]:
        """Results of one call per rank, failing fast on the first error and at ``deadline``.

        ``first_call``: the workers' first call, where dying on a live node means the spec did not unpickle,
        and a rank still starting long after its peers started is hung (:func:`~raympi.driver.heartbeat.start_hung`).
        ``heartbeat``: ping every rank while waiting (:mod:`raympi.driver.heartbeat`); a rank silent for
        ``SILENT_S`` while the others answer is hung (stopped, cut off), found without waiting for ``deadline``,
        unless Ray reports it dead within ``DEATH_NOTICE_S`` (then it is a lost worker).

        Raises:
            Failed: a rank died, raised, or made no progress in time (``startup``: a timeout is a
                :class:`CapacityError` instead: the workers could not even start).
        """
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        watch = self._heartbeat() if heartbeat and self.world > 1 else None
        began, ready_s = time.monotonic(), list[float]()  # how long each rank that answered took, for start_hung
        try:
            while pending:
                wait = deadline if watch is None else deadline.sooner(BEAT_S)
                if first_call and len(refs) > 1:
                    wait = wait.sooner(1.0)  # to judge the ranks still starting (start_hung) once a second
                try:
                    for ref in each_done(pending, wait):
                        pending.remove(ref)
                        ready_s.append(time.monotonic() - began)
                        self._check(ref, rank_of[ref], what, first_call=first_call)
                except Expired as expired:
                    if deadline.expired():
                        # The hard limit counts from the last work every waited-on rank finished: one that
                        # still finishes steps is slow (a loaded machine), not hung.
                        since = watch.last_progress([rank_of[r] for r in pending]) if watch else -math.inf
                        if since + deadline.seconds <= time.monotonic():
                            raise Expired(deadline, expired.pending) from None
                        deadline = Deadline(deadline.seconds, deadline.field, start=since)
                    # A starting rank has no thread to answer pings yet: its peers' starts judge it.
                    waited_s = time.monotonic() - began
                    if first_call and start_hung(ready_s, waited_s, self.cfg.startup_timeout_s):
                        starting = sorted(rank_of[ref] for ref in pending)
                        raise Failed(
                            self._failure(
                                FailureKind.HUNG,
                                f"{what}: rank(s) {starting} still starting after {waited_s:.0f} s, while the "
                                f"others started within {max(ready_s):.1f} s (a hung process)",
                                starting,
                            )
                        )
                    stuck = watch.silent() if watch is not None else []
                    if stuck:  # the others answered later pings: hung or dead, not merely slow
                        late = [ref for ref in pending if rank_of[ref] in stuck]
                        settled = ray.wait(late, num_returns=len(late), timeout=0)[0] if late else []
                        for ref in settled:  # raises Failed (worker lost) where Ray reports it dead already
                            pending.remove(ref)
                            self._check(ref, rank_of[ref], what, first_call=first_call)
                        if late and len(settled) == len(late):  # they finished their calls after all: slow
                            continue
                        stuck = sorted(set(stuck) - {rank_of[ref] for ref in settled})
                        # Acted on at once: whether the process died or hung is settled after the restart.
                        now = time.monotonic()
                        self.silent_found = [
                            Silent(rank_of[ref], self.actors[rank_of[ref]], ref, now)
                            for ref in late
                            if ref not in settled
                        ]
                        raise Failed(
                            self._failure(
                                FailureKind.HUNG,
                                f"{what}: rank(s) {stuck} stopped answering "
                                f"(a ping unanswered for {watch.limit() if watch else SILENT_S:.2g} s "
                                "while the others replied)",
                                stuck,
                            )
                        ) from None
        except Expired as expired:
            waiting = sorted(rank_of[r] for r in expired.pending)
            stuck = self.silent(waiting)
            message = (
                f"{what}: rank(s) {stuck} made no progress within {deadline.setting} "
                "(hung process, cut link, or too small a deadline)"
            )
            if startup:
                raise CapacityError(message) from None
            report = ""
            if stuck == waiting:  # every one answers: ask where each is, and for its stacks, before any is killed
                culprits, places, report = self._explain_hang(waiting)
                if culprits:
                    stuck = culprits
                    message = (
                        f"{what}: rank(s) {stuck} made no progress within {deadline.setting}, outside any collective "
                        f"while their peers wait in one ({places})"
                    )
                elif places:
                    message += f" ({places})"
            failure = self._failure(FailureKind.HUNG, message, stuck)
            raise Failed(dataclasses.replace(failure, report=report or None)) from None
        return ray.get(list(refs))

    def _explain_hang(self, ranks: list[int], timeout_s: float = 2.0) -> tuple[list[int], str, str]:
        """Where each rank is and every thread's stack, from the health threads: ``(culprits, places, report)``.

        The culprits are the ``ranks`` outside a collective (in the user's code, or waiting for data) while
        another rank waits in one: they keep their peers waiting.  None when no rank is in a collective (a
        link cut, say) or every one is.  ``places``: one line of each rank's step, activity and time at it;
        ``report``: that and each rank's stacks, for the run's folder.
        """
        asked = {
            (r, what): getattr(a, what).remote() for r, a in enumerate(self.actors) for what in ("where", "stacks")
        }
        answers = _answers(asked, timeout_s)
        places: dict[int, Where] = {r: v for (r, what), v in answers.items() if what == "where"}
        stacks: dict[int, str] = {r: v for (r, what), v in answers.items() if what == "stacks"}
        inside = [r for r, p in places.items() if p.activity == "collective"]
        culprits = [r for r in ranks if r in places and places[r].activity != "collective"] if inside else []
        line = "; ".join(
            f"rank {r}: {p.activity} for {p.since_s:.1f} s at step {p.step + 1}" for r, p in sorted(places.items())
        )
        report = "\n\n".join(
            f"rank {r} ({where(r, self.world, self.hosts[r] if r < len(self.hosts) else None)}): "
            + (
                f"{places[r].activity} for {places[r].since_s:.1f} s at step {places[r].step + 1}"
                if r in places
                else "no answer"
            )
            + "\n"
            + stacks.get(r, "(no stacks: the rank did not answer)")
            for r in range(len(self.actors))
        )
        return culprits, line, report

    def label_silent(self, wait: bool = False) -> list[tuple[int, bool]]:
        """``(rank, died)`` of the ranks replaced while silent whose label is now known: ``died`` when Ray
        reported the process gone within ``DEATH_NOTICE_S`` of its silence, else it was alive but hung
        (stopped, frozen).  Each is killed once labelled.  ``wait``: wait for the labels still open."""
        out, self.labelled = self.labelled, []
        for silent in list(self.unlabelled):
            out += self._label(silent, wait)
        return out

    def _label(self, silent: Silent, wait: bool) -> list[tuple[int, bool]]:
        """:meth:`label_silent` of one rank: ``[]`` while its label is open."""
        remaining = DEATH_NOTICE_S - (time.monotonic() - silent.since)
        done = bool(ray.wait([silent.call], timeout=max(0.0, remaining) if wait else 0)[0])
        if not done and remaining > 0 and not wait:
            return []
        died = False
        if done:
            try:
                ray.get(silent.call, timeout=0)
            except ray.exceptions.RayActorError:
                died = True
            except ray.exceptions.RayError:
                pass
        ray.kill(silent.actor, no_restart=True)
        self.unlabelled.remove(silent)
        return [(silent.rank, died)]

    def _heartbeat(self) -> Heartbeat:
        """The heartbeat of the current ranks: one for the group's life, new after each reform."""
        if self._watch is None or self._watch.actors != self.actors:
            self._watch = Heartbeat(self.actors)
        return self._watch

    def abort(self, ranks: Sequence[int]) -> None:
        """Ask ``ranks`` to abandon the collective in flight (answered from their health thread)."""
        for r in ranks:
            self.actors[r].abort.remote()

    def outcomes(self, calls: dict[int, Any], timeout_s: float) -> dict[int, Any] | None:
        """What each rank's call (rank -> object ref) returned once all are done: its result, or
        :data:`LOST` where its actor died; ``None`` when not all were done within ``timeout_s``.

        Raises:
            ray.exceptions.RayError: a call failed otherwise (it raised).
        """
        ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=max(0.0, timeout_s))
        if len(ready) < len(calls):
            return None
        out: dict[int, Any] = {}
        for r, ref in calls.items():
            try:
                out[r] = ray.get(ref)
            except ray.exceptions.RayActorError:  # lost as well (several ranks on one lost node)
                out[r] = LOST
        return out

    def snapshot(self, rank: int) -> Any:
        """Ask ``rank`` for its state from its health thread (it may be busy re-forming): a handle for :meth:`holds`."""
        return self.actors[rank].snapshot.remote()

    def holds(self, snapshot: Any, timeout_s: float) -> bool:
        """Whether the state asked for by :meth:`snapshot` arrived whole within ``timeout_s``."""
        return bool(ray.wait([snapshot], timeout=max(0.0, timeout_s))[0]) and succeeded(snapshot)

    def silent(self, ranks: list[int], timeout_s: float = 2.0) -> list[int]:
        """Which of ``ranks`` do not answer a ping (stopped or cut off); all of them if every one answers."""
        if not self.actors:
            return ranks
        pings = {self.actors[r].ping.remote(): r for r in ranks}
        answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=timeout_s)
        quiet = sorted(set(ranks) - {pings[ref] for ref in answered})
        return quiet or ranks

    def _check(self, ref: Any, rank: int, what: str, first_call: bool = False) -> None:
        label = where(rank, self.world, self.hosts[rank] if rank < len(self.hosts) else None)
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
            if isinstance(cause, RaympiError) and not isinstance(cause, TrainingError):
                raise cause from None
            trace = _clean(getattr(exc, "traceback_str", "") or str(exc))
            kind = type(cause) if isinstance(cause, TrainingError) else TrainingError  # NonFiniteLossError stays itself
            error = kind(
                f"{what}: {label} raised {type(cause).__name__}: {cause}\n\nTraceback on rank {rank}:\n{trace}"
            )
            raise Failed(self._failure(FailureKind.USER_ERROR, str(error).splitlines()[0], [rank], error)) from None
        except ray.exceptions.RayActorError as exc:
            created = getattr(exc, "error_msg", "") or ""
            if first_call and "creation task" in created and "Traceback" in created:  # __init__ raised: show it
                trace = _clean(created)
                hint = (
                    "\nA module the model, loss, optimizer or dataset needs is not importable on the workers: make it "
                    "importable on every node (ray.init(runtime_env={'working_dir': ...} or 'py_modules'))"
                    if "No module named" in trace
                    else ""
                )
                raise TrainingError(f"{what}: {label} failed to start:\n{trace}{hint}") from None
            if first_call and self._node_alive(rank):
                raise TrainingError(
                    f"{what}: {label} died on a live node before it could run ({str(exc).splitlines()[0]}). "
                    "Workers die like this when they cannot unpickle the model, loss or optimizer: make the modules "
                    "that define them importable on every node "
                    "(ray.init(runtime_env={'working_dir': ...} or 'py_modules'))"
                ) from None
            message = f"{what}: {label} died ({type(exc).__name__}: {str(exc).splitlines()[0]})"
            raise Failed(self._failure(FailureKind.WORKER_LOST, message, [rank])) from None

    def _failure(self, kind: FailureKind, cause: str, ranks: list[int], error: BaseException | None = None) -> Failure:
        """A :class:`Failure` naming the failed ranks and their nodes."""
        nodes = tuple(self.nodes[r] for r in ranks if r < len(self.nodes))
        return Failure(kind, cause, ranks=tuple(ranks), nodes=nodes, error=error)

    def _node_alive(self, rank: int) -> bool:
        node = self.nodes[rank] if rank < len(self.nodes) else None
        return any(n["NodeID"] == node and n.get("Alive") for n in ray.nodes())

    def _park(self) -> bool:
        """Keep the workers, their placement group and the idle hot spares outside it for the next fit of
        this shape (:mod:`raympi.driver.pool`), when the group is whole and every one of them answers."""
        held = self.spares
        whole = self.owns_pg and self.pg is not None and self.bundles == list(range(self.world))
        if not whole or held.replacements or held.incoming or held.joining or self.lost or not self.actors:
            return False
        if len(placement_group_table(self.pg)["bundles"]) != self.world:
            return False
        ready = [s.actor for s in held.outside if s.bundle is None and s.usable()]
        spares = ready + [s.actor for s in held.inside if s.bundle is None] + held.parked
        calls = [a.park.remote() for a in self.actors + spares]
        done, _ = ray.wait(calls, num_returns=len(calls), timeout=PARK_S)
        if len(done) < len(calls) or not all(succeeded(ref) for ref in calls):
            return False
        pool.park(pool.Parked(self.key, pool.job(), self.pg, self.actors, spares))
        kept = {id(a) for a in self.actors + spares}
        held.outside = [s for s in held.outside if id(s.actor) not in kept]
        held.inside = [s for s in held.inside if id(s.actor) not in kept]
        self.actors, held.parked, self.pg = [], [], None
        return True

    def shutdown(self, park: bool = False) -> None:
        """Kill every actor and release the placement group (idempotent); ``park``: keep them for the next
        fit instead, where the group allows it (``keep_workers``)."""
        if park and self._park():
            self.shutdown()  # what was not kept: spares still starting or in bundles
            return
        for actor in self.actors + self.spares.actors() + [s.actor for s in self.unlabelled]:
            ray.kill(actor, no_restart=True)
        self.actors, self.standby, self.lost, self.unlabelled = [], [], [], []
        self.spares.clear()
        if self.pg is not None and self.owns_pg:
            remove_placement_group(self.pg)
        self.pg = None


def _clean(trace: str) -> str:
    """A remote traceback without colour codes and without the ``^^^^`` marker lines."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", trace).splitlines()
    return "\n".join(line for line in lines if line.strip(" ^~"))


def _answers(calls: dict[Any, Any], timeout_s: float) -> dict[Any, Any]:
    """What each call (key -> object ref) returned, for the calls that succeeded within ``timeout_s`` together."""
    ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout_s)
    return {k: ray.get(ref) for k, ref in calls.items() if ray.wait([ref], timeout=0)[0] and succeeded(ref)}


def _answer(actors: list[Any]) -> bool:
    """Whether every one of ``actors`` answers a ping within ``SUSPECT_PING_S``."""
    pings = [a.ping.remote() for a in actors]
    done, _ = ray.wait(pings, num_returns=len(pings), timeout=SUSPECT_PING_S)
    return len(done) == len(pings) and all(succeeded(p) for p in pings)
