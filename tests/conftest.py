"""Shared fixtures (a private local Ray instance, ready actors), the test tiers and the groups of parallel runs.

Tiers, by module (``pytest -m unit``, ``-m integration``, ``-m system``; the README's command runs all):

- ``unit``: no Ray at all (in-process torch, MPI over ``COMM_SELF``, the driver against fakes,
  subprocesses); checked: a unit test that leaves Ray running fails.
- ``integration``: one local Ray instance (``ray_session``) and real MPI ranks.
- ``system``: clusters of nodes, network-namespace hosts, ``ray up``, the chaos test, driver
  processes killed, the benchmark smoke runs and the tools (tools/: the GPU carry, the GPU check, the sampler).
"""

from __future__ import annotations

import os
import sys

import procs  # noqa: F401  (tags every Ray process of this run: tests/procs.py)
import pytest
import time_limits

TIERS = {
    "unit": {
        "test_accumulate",
        "test_checkpoint",
        "test_cluster_yaml",
        "test_config",
        "test_controller",
        "test_docs",
        "test_heartbeat",
        "test_layers",
        "test_lint",
        "test_mpi",
        "test_optim",
        "test_optim_state",
        "test_pipeline",
        "test_policy",
        "test_precision",
        "test_shard",
        "test_state",
        "test_step",
        "test_summary",
        "test_time_limits",
    },
    "system": {
        "test_benchmarks",
        "test_chaos",
        "test_driver_loss",
        "test_elastic",
        "test_gpu_carry",
        "test_multihost",
        "test_ray_up",
        "test_tools",
    },
}  # every other module: integration


# Parallel runs (pytest-xdist, ``-n 2`` in pyproject.toml): the tests of one group run in one test process, one
# after the other.  A module is a group (its module-scoped fixtures are set up once), but for the modules whose
# tests stand alone (each test is a group of its own) and test_elastic, whose two halves each build their own
# cluster.  The longest groups go first, and the short ones fill in at the end.
ALONE = {"test_benchmarks", "test_driver_loss", "test_gpu_carry", "test_tools"}
ELASTIC_FIRST_HALF = ("test_killed_or_hung_worker_is_recovered", "test_node_loss_continues_on_fewer_workers")


def module_of(request: pytest.FixtureRequest) -> str:
    """The test module's name (``test_x``) in a module-scoped fixture."""
    return request.node.name.rsplit("/", 1)[-1].removesuffix(".py")


def tier_of(module: str) -> str:
    return next((tier for tier, modules in TIERS.items() if module in modules), "integration")


def group_of(nodeid: str) -> str:
    """The parallel group of a test, from its id (``tests/test_x.py::test_name[params]``)."""
    path, _, name = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1].removesuffix(".py")
    if module in ALONE:
        return nodeid
    if module == "test_elastic":
        return module + ("-1" if name.startswith(ELASTIC_FIRST_HALF) else "-2")
    return module


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(tier_of(item.module.__name__.rsplit(".", 1)[-1]))
    on_shared_ray = {item.module for item in items if "ray_session" in item.fixturenames}

    def order(item: pytest.Item) -> tuple[int, bool]:
        """Longest first (stable): the system tier's module-wide groups, then its tests that stand alone; the
        integration modules with a Ray of their own; then the modules on the shared Ray one after the other (between
        two of them any other module stops it, and the next starts Ray and its workers again: in file order each of
        the 9 modules on it came after one that stopped it); the unit tier last, filling in."""
        tier = tier_of(item.module.__name__.rsplit(".", 1)[-1])
        rank = {"system": 0, "integration": 2 if item.module in on_shared_ray else 1, "unit": 3}[tier]
        return rank, group_of(item.nodeid) == item.nodeid

    items.sort(key=order)


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist hands out whole groups (:func:`group_of`).  Its own ``--dist loadgroup`` reads groups from the
    ids it rewrites, which pytest 9.2 no longer lets it do."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    # In the order of pytest_collection_modifyitems: xdist's default (--loadscope-reorder) sorts the groups by their
    # number of tests, which sent the modules on the shared Ray apart and every test that stands alone (the benchmark
    # smokes, a minute each for some) to the end of the run.
    config.option.loadscopereorder = False
    return ByGroup(config, log)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_ray(request):
    yield
    if request.node.get_closest_marker("unit") and "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()
        pytest.fail("a unit test left Ray running: move its module to another tier (tests/conftest.py TIERS)")


# Time limits: each test's (its @pytest.mark.timeout, else `timeout` in pyproject.toml) is what it needs on 2 quiet
# cores, and pytest-timeout gets it stretched by the machine's load, the load over the cores, between x1 and x4:
# taken when the test starts and again whenever the limit runs out (tests/time_limits.py).  A run beside other jobs
# gets time in proportion to its share of the cores (a chaos run of ~100 s alone was stopped at 300 s beside another
# job); a hang, which never ends, still fails, within 4 x its declared limit.
@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    return time_limits.set_timer(item, settings)


def pytest_report_header(config):
    return f"time limits: the declared ones {time_limits.describe()} now (tests/time_limits.py)"


os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray lowers its workers to nice 15 (RAY_worker_niceness): beside any job at normal priority they get a few percent
# of a core (two busy processes on the 2 cores held a PBT trial's `import torch` for 2 minutes), so on a loaded
# machine every deadline in the suite would run out.  The suite's Ray workers run at its own priority instead:
# every Ray started from here inherits it (ray.init, clusters, benchmark runs, tests/netns.py's hosts), all but
# the hosts that `ray up` starts over ssh, as it would a user's.
os.environ.setdefault("RAY_worker_niceness", "0")
# MPICH's OFI/tcp publishes the address of the first interface it finds, and beside test_multihost or test_ray_up
# (the other test process) that is their namespace hosts' bridge (checked: an `Open_port` name held 10.213.x.1
# while a bridge was up), which their teardown deletes: a formation over OFI in this namespace then hung until its
# 120 s deadline (a compression benchmark, once in a full run).  On this one host every OFI rank of the suite
# uses the loopback; the namespace hosts' own Ray processes leave this out (tests/netns.py).
os.environ.setdefault("FI_TCP_IFACE", "lo")


_RAY: dict[str, bool] = {"shared": False}  # whether the Ray running now is ray_session's, kept across modules


def _uses_ray_session(module: pytest.Module) -> bool:
    return any("ray_session" in item.fixturenames for item in module.session.items if item.module is module.obj)


@pytest.fixture(scope="module", autouse=True)
def _processes_name_their_module(request):
    """Every process a module starts inherits its name in ``RAYMPI_TEST_MODULE``: ``tools/suite_cpu.py --by
    RAYMPI_TEST_MODULE`` tells where the suite's CPU goes, Ray's workers included (they inherit their raylet's)."""
    os.environ["RAYMPI_TEST_MODULE"] = module_of(request)
    yield
    os.environ.pop("RAYMPI_TEST_MODULE", None)


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_only_where_asked(request):
    """A module that does not ask for ``ray_session`` starts with no shared Ray running (it may start
    its own: a cluster, a Ray of 2 CPUs, a driver subprocess)."""
    if _RAY["shared"] and not _uses_ray_session(request.node):
        import ray

        ray.shutdown()
        _RAY["shared"] = False
    yield


@pytest.fixture(scope="module", autouse=True)
def _integration_fits_reuse_their_workers(request):
    """In the integration tier a ``fit`` takes the worker processes the previous one kept (``keep_workers``,
    README) and starts no hot spare unless it asks for one (``spares=``): a test pays for its model and data, not
    for starting processes and importing torch again.  Nothing in this tier fails a worker, and a spare was one
    more process for every new shape (the tier side by side, with the new order too: 578 -> 524 CPU-s, 305 -> 275
    s; benchmarks/RESULTS.md).  Starting afresh and the default spare stay covered: the first fit of a shape, every
    other tier (the elastic, chaos and benchmark runs start theirs), and the tests that set ``keep_workers=False``."""
    if tier_of(module_of(request)) != "integration":
        yield
        return
    import raympi

    fit = raympi.fit

    def fit_without_a_default_spare(*args, **kwargs):
        kwargs.setdefault("spares", 0)
        return fit(*args, **kwargs)

    os.environ["RAYMPI_KEEP_WORKERS"] = "1"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(raympi, "fit", fit_without_a_default_spare)
        yield
    del os.environ["RAYMPI_KEEP_WORKERS"]


@pytest.fixture(scope="module")
def ray_session():
    """A private local Ray instance (never a stale cluster recorded on the machine), started once and
    shared by the modules that ask for it one after the other (a start costs seconds)."""
    import ray

    if not (_RAY["shared"] and ray.is_initialized()):
        os.environ["RAYMPI_TEST_MODULE"], module = "ray_session", os.environ.get("RAYMPI_TEST_MODULE", "")
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            logging_level="ERROR",
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        )
        os.environ["RAYMPI_TEST_MODULE"] = module
        _RAY["shared"] = True
    yield ray


def pytest_sessionfinish(session, exitstatus):
    if _RAY["shared"]:
        import ray

        ray.shutdown()


@pytest.fixture(scope="module")
def spawn(ray_session):
    """``spawn(actor_class, n)``: ``n`` ready actors, killed when the module's tests are done."""
    made = []

    def start(actor_class, n: int) -> list:
        actors = [actor_class.remote() for _ in range(n)]
        ray_session.get([a.__ray_ready__.remote() for a in actors])
        made.extend(actors)
        return actors

    yield start
    for actor in made:
        ray_session.kill(actor)
