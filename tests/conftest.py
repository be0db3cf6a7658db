"""Test set-up: 8 emulated CPU devices for jax, one XLA compilation cache a session, and hypothesis profiles.

XLA_FLAGS and the cache must be set before jax is first imported anywhere, so they are set
here, at collection time.  The ``ci`` profile (the default; HYPOTHESIS_PROFILE=dev for more, random examples) bounds the
examples and switches deadlines off, since some tests compile with XLA.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Generator
from pathlib import Path

# LLVM -O0 for XLA's CPU code: compiling dominates the slow tests, and -O0 compiles them in about 60%
# of the time. The HLO passes (partitioning, collectives) are the same, so every check of the compiled
# HLO's collectives reads the same text; only float rounding differs, within every bound.
# The code generator's other settings below cut the tests' compile CPU by about a third more (measured
# on the zig-zag and ring-attention verifies: 45 s -> 29 s of CPU): the fusions emitted by XLA's older
# LLVM IR emitter rather than its MLIR fusion emitters, LLVM's expensive passes skipped, and each
# module's code generated in one piece rather than split over threads (the xdist workers already fill
# the cores).  The older emitter does change buffer assignment (a scatter runs as a while loop with
# buffers of its own), so the memory check compiles with the fusion emitters on whatever these flags
# say (shardc.verification.memory_check.XLA_OPTIONS), as `shardc verify` and benchmarks/ compile it.
os.environ.setdefault("XLA_FLAGS", " ".join((
    "--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false", "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_parallel_codegen_split_count=1")))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU intra-op pool with room for the collectives each device can wait at, as `shardc verify` asks
# (shardc.cli.lower_cmd): a DualPipe tick's collectives on 8 devices could otherwise wedge its 8 workers.
from shardc.cli.lower_cmd import emulate_devices  # noqa: E402

emulate_devices(8)
# One compilation cache for the session, which the xdist workers and the shardc processes tests start
# inherit: tests that lower the same module (an example verified by several files, a plan verified
# again beside a wrong one) compile it once.  It starts empty and is removed at the end, so no run
# reads another's; the process that made it (pytest itself, not a worker) removes it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="shardc-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import shardc  # noqa: E402
from shardc.ir.plan import Plan  # noqa: E402

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# Bounded and derandomized unless asked otherwise: random planner specs can reach layouts whose
# exact search takes seconds (a known gap), and the suite must stay under 8 minutes on 2 cores.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# A test that compiles with XLA must be marked slow, so that `-m "not slow"` stays fast: every
# XLA compilation (jax's backend-compile event, or a hit in the cache above, which another test's
# compilation filled) during an unmarked test's set-up or call fails it.
# jax is imported here only for a test asking for the count (xla_compiles); the listeners are added
# once some test has imported it.
_XLA_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_compiles = [0]
_listening = [False]


def _count_compile(event: str, _duration: float, **_: object) -> None:
    if event == _XLA_COMPILE:
        _compiles[0] += 1


def _count_cache_hit(event: str, **_: object) -> None:
    if event == _CACHE_HIT:
        _compiles[0] += 1


def _listen() -> None:
    if not _listening[0] and "jax" in sys.modules:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_count_compile)
        jax.monitoring.register_event_listener(_count_cache_hit)
        _listening[0] = True


def _unmarked_compiles(item: pytest.Item) -> Generator[None, object, object]:
    _listen()
    before = _compiles[0]
    result = yield
    if _compiles[0] > before and item.get_closest_marker("slow") is None:
        raise AssertionError(f"{item.nodeid} compiled with XLA {_compiles[0] - before} time(s): mark it slow")
    return result


ROOT = Path(__file__).resolve().parent.parent


_PLANS: dict[tuple[str, str, bool], Plan] = {}  # a Plan is frozen, so no test can change what another reads
_PLAN = shardc.plan  # the planner itself, which a test may stand the shared plans in for (test_fidelity)


def _shared_plan(path: str, recompute: str, explain: bool = False) -> Plan:
    # a plan made with --explain is the same plan with its choices kept: it serves where none are asked for
    if not explain and (path, recompute, True) in _PLANS:
        return _PLANS[path, recompute, True]
    if (path, recompute, explain) not in _PLANS:
        spec = shardc.parse((ROOT / path).read_text(encoding="utf-8"), filename=path)
        _PLANS[path, recompute, explain] = _PLAN(spec, recompute=recompute, explain=explain)
    return _PLANS[path, recompute, explain]


@pytest.fixture(scope="session")
def shared_plan() -> Callable[..., Plan]:
    """``shared_plan(path, recompute, explain=False)``: the spec at ``path`` (from the repository's root) planned
    so, once a process: the big examples take seconds of CPU to plan, and several files plan them alike (the
    fidelity benchmark's runs, the real models' tests)."""
    return _shared_plan


@pytest.fixture(scope="session")
def deepseek_v3_plan(shared_plan: Callable[..., Plan]) -> Plan:
    """benchmarks/runs/deepseek_v3.shard planned at its report's recompute policy (`selective`), once a process:
    several files read this plan (seconds of CPU to make), and a Plan is frozen, so none can change it."""
    return shared_plan("benchmarks/runs/deepseek_v3.shard", "selective")


@pytest.fixture
def xla_compiles() -> Callable[[], int]:
    """The XLA compilations this process has made so far, counted as the guard above counts them
    (compilation-cache hits too: a program the session compiled before is still one asked for)."""
    import jax.monitoring  # noqa: F401  # a test asking for the count compiles: the listeners need jax

    _listen()
    return lambda: _compiles[0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _unmarked_compiles(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _unmarked_compiles(item))


# The long tests first in each worker's share.  pytest-xdist's worksteal (pyproject's addopts) hands
# each worker a contiguous share of the collection, in order, and a worker that runs out takes the
# end of another's share: the tests left for last decide how long one worker waits for the other, so
# they should be short ones.  The slow marker is the measure of long: in each share the modules that
# hold the most slow tests run first, each module kept whole (its module-scoped fixtures made once)
# and in its own order.  Without workers (-n 0) the order is the collection's.
@pytest.hookimpl(trylast=True)  # after -m and -k have deselected, so the shares are xdist's
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        return
    ordered, start = [], 0
    for share in range(workers):  # the shares worksteal makes: what is left, over the workers left
        end = start + (len(items) - start) // (workers - share)
        ordered += _slowest_modules_first(items[start:end])
        start = end
    items[:] = ordered


def _slowest_modules_first(share: list[pytest.Item]) -> list[pytest.Item]:
    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    slow = Counter(module(item) for item in share if item.get_closest_marker("slow") is not None)
    return sorted(share, key=lambda item: -slow[module(item)])  # stable: each module whole, in its order
