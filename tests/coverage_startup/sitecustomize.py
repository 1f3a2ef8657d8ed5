"""Keeps the coverage of Ray's worker processes (`make coverage` puts this on PYTHONPATH).

coverage.py starts in every Python process that inherits COVERAGE_PROCESS_CONFIG (its
`[run] patch = ["subprocess"]`, in pyproject.toml), Ray's workers included: they inherit the
environment of the raylet the test's driver started. But coverage saves at exit, and a Ray
worker seldom exits: the actors of a job that ends, and actors killed by `ray.kill`, leave
through Ray's C++ quick exit, and an actor stopped with its node gets a SIGTERM whose handler
Ray replaces with its own. So a Ray worker that coverage measures saves its data every half
second and before any SIGTERM handler runs; at most the last half second of a killed worker
goes unmeasured. And the methods of a threaded actor (the store's shards) run on threads
that Ray's C++ core starts, which coverage would not trace at all.
"""

import atexit
import os
import signal
import sys
import threading

import coverage

SAVE_EVERY_S = 0.5
SIGTERM_WAIT_S = 1.0  # a save takes ~10 ms; the raylet kills 3 s after its SIGTERM
RAY_WORKER_MAIN = os.path.join("ray", "_private", "workers", "default_worker.py")

# One save at a time: coverage's data file (SQLite) is not shared between threads.
_saving = threading.Lock()
_last_save_done = threading.Event()


def _save_periodically(cov: coverage.Coverage) -> None:
    while not _last_save_done.wait(SAVE_EVERY_S):
        with _saving:
            if not _last_save_done.is_set():
                cov.save()


def _leave_the_exit_save_to_coverage() -> None:
    # Registered after coverage's own exit hook, so it runs first: no periodic save
    # is under way or starts while coverage saves for the last time.
    with _saving:
        _last_save_done.set()


def _save_before_sigterm(cov: coverage.Coverage) -> None:
    set_handler = signal.signal

    def set_handler_saving_first(signum, handler):
        if signum != signal.SIGTERM or not callable(handler):
            return set_handler(signum, handler)
        inner = handler

        def save_then_handle(signum, frame):
            # This runs on the main thread, which may hold the lock itself (a SIGTERM
            # during the exit hook): wait for a periodic save, never for ourselves.
            if not _last_save_done.is_set() and _saving.acquire(timeout=SIGTERM_WAIT_S):
                try:
                    _last_save_done.set()  # a second SIGTERM goes straight to Ray's
                    cov.stop()
                    cov.save()
                finally:
                    _saving.release()
            return inner(signum, frame)

        return set_handler(signum, save_then_handle)

    signal.signal = set_handler_saving_first


def _trace_threads_ray_starts(cov: coverage.Coverage) -> None:
    """A threaded actor's methods run on threads Ray's C++ core starts, which coverage
    (it reaches new threads through `threading.settrace`) never sees: the executor Ray
    wraps each actor method in installs coverage's tracer on such a thread first."""
    from ray._private.function_manager import FunctionActorManager

    make_executor = FunctionActorManager._make_actor_method_executor
    install_tracer = cov._collector._installation_trace  # what threading.settrace gets

    def make_tracing_executor(self, method_name, method):
        executor = make_executor(self, method_name, method)

        def tracing_executor(*args, **kwargs):
            if sys.gettrace() is None:
                sys.settrace(install_tracer)
            return executor(*args, **kwargs)

        tracing_executor.name, tracing_executor.method = executor.name, executor.method
        return tracing_executor

    FunctionActorManager._make_actor_method_executor = make_tracing_executor


def _keep_ray_worker_coverage() -> None:
    cov = coverage.Coverage.current()
    if cov is None or not sys.argv or not sys.argv[0].endswith(RAY_WORKER_MAIN):
        return
    _trace_threads_ray_starts(cov)
    _save_before_sigterm(cov)
    atexit.register(_leave_the_exit_save_to_coverage)
    threading.Thread(target=_save_periodically, args=(cov,), daemon=True).start()


_keep_ray_worker_coverage()
