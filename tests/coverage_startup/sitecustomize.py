"""Keeps the coverage of Ray's worker processes (`make coverage` puts this on PYTHONPATH).

coverage.py starts in every Python process that inherits COVERAGE_PROCESS_CONFIG (its
`[run] patch = ["subprocess"]`, in pyproject.toml), Ray's workers included: they inherit the
environment of the raylet the test's driver started. But coverage saves at exit, and a Ray
worker seldom exits: the actors of a job that ends, and actors killed by `ray.kill`, leave
through Ray's C++ quick exit, and an actor stopped with its node gets a SIGTERM whose handler
Ray replaces with its own. So a Ray worker that coverage measures saves its data every half
second and before any SIGTERM handler runs; at most the last half second of a killed worker
goes unmeasured.
"""

import atexit
import os
import signal
import sys
import threading

import coverage

SAVE_EVERY_S = 0.5
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
            with _saving:
                _last_save_done.set()
                cov.stop()
                cov.save()
            return inner(signum, frame)

        return set_handler(signum, save_then_handle)

    signal.signal = set_handler_saving_first


def _keep_ray_worker_coverage() -> None:
    cov = coverage.Coverage.current()
    if cov is None or not sys.argv or not sys.argv[0].endswith(RAY_WORKER_MAIN):
        return
    _save_before_sigterm(cov)
    atexit.register(_leave_the_exit_save_to_coverage)
    threading.Thread(target=_save_periodically, args=(cov,), daemon=True).start()


_keep_ray_worker_coverage()
