"""The per-sample records a step copies and unpickles by the thousand, each next to the
way it was made before, alternating in one process:

    PYTHONPATH=src .venv/bin/python benchmarks/record_copies.py [--rounds 7]

Why: every lease hand-off of a step copies each sample's ``SampleRouting`` (the buffer
taking a group, the batch taking its samples), the driver unpickles every finished
sample from its rollout workers, and each trainer rank unpickles its share of the plan,
a handle and a ``PackedSample`` per sample: on the step's critical path, 1,024 samples
a rank at 4,096 a step. The shape is the RL step's: a GRPO member's handle has two
segments (the group's prompt rows, then its own), Qwen3-30B-A3B.

Each figure is the median over ``--rounds`` of the time for 1,024 objects, in ms:

- ``SampleRouting`` copy with a new lease: ``replaced`` (a generated copier) against
  ``dataclasses.replace``, and against the loop over the slots it used before;
- a pickled segment rebuilt: ``_segment`` (slot setters, the range check) against the
  dataclass's keyword ``__init__`` (what it called before);
- a ``PackedSample`` state set: its generated ``__setstate__`` against the loop over
  its slots (what ``fast_state`` set before).

Example:
    .venv/bin/python benchmarks/record_copies.py --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
import statistics
import time
from collections.abc import Callable
from typing import Any

from routeplay.core import Handle, Segment, StoreRef
from routeplay.core.handle import _segment
from routeplay.core.presets import preset
from routeplay.core.records import replaced
from routeplay.rollout import SampleRouting
from routeplay.train.packing import PackedSample

SAMPLES = 1024


def _ms(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return (time.perf_counter() - start) * 1e3


def _slot_loop_copier(cls: type) -> Callable[[Any, dict[str, Any]], Any]:
    """The copy ``replaced`` made before: every field read at once, then written through
    its slot in a Python loop."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    slots = {name: vars(cls)[name] for name in names}
    values_of = operator.attrgetter(*names)

    def copy(obj: Any, changes: dict[str, Any]) -> Any:
        new: Any = object.__new__(cls)
        for slot, value in zip(slots.values(), values_of(obj), strict=True):
            slot.__set__(new, value)
        for name, value in changes.items():
            slots[name].__set__(new, value)
        return new

    return copy


def _slot_loop_setstate(cls: type) -> Callable[[Any, tuple[Any, ...]], None]:
    """The ``__setstate__`` ``fast_state`` gave before: a loop over the slots."""
    slots = tuple(vars(cls)[f.name] for f in dataclasses.fields(cls))

    def setstate(obj: Any, state: tuple[Any, ...]) -> None:
        for slot, value in zip(slots, state, strict=True):
            slot.__set__(obj, value)

    return setstate


def _ways() -> dict[str, dict[str, Callable[[], Any]]]:
    spec = preset("qwen3-30b-a3b")
    routings: list[SampleRouting] = []
    segments: list[tuple[Any, ...]] = []
    states: list[tuple[Any, ...]] = []
    for at in range(SAMPLES):
        group, member = divmod(at, 8)
        source = StoreRef(payload_id=f"run/{group}", run="run", rows=512 + 8 * 511)
        parts = ((source, 0, 512), (source, 512 + member * 511, 512 + (member + 1) * 511))
        segments.extend((*part, spec, 1) for part in parts)
        handle = Handle(spec, [Segment(source=s, start=a, stop=b, spec=spec) for s, a, b in parts])
        routings.append(SampleRouting(sample_id=f"{group}.{member}", handle=handle))
        states.append((f"{group}.{member}", handle, 1024, (at % 8) * 1023, None))
    loop_copy = _slot_loop_copier(SampleRouting)
    loop_setstate = _slot_loop_setstate(PackedSample)
    new = object.__new__
    generated_setstate = vars(PackedSample)["__setstate__"]
    return {
        "SampleRouting copy": {
            "replaced": lambda: [replaced(r, lease=None, unreleased=()) for r in routings],
            "dataclasses.replace": lambda: [
                dataclasses.replace(r, lease=None, unreleased=()) for r in routings
            ],
            "slot loop (before)": lambda: [
                loop_copy(r, {"lease": None, "unreleased": ()}) for r in routings
            ],
        },
        "segment rebuilt (x2 a sample)": {
            "_segment": lambda: [_segment(*args) for args in segments],
            "keyword __init__ (before)": lambda: [
                Segment(source=s, start=a, stop=b, spec=p, weight_version=v)
                for s, a, b, p, v in segments
            ],
        },
        "PackedSample state set": {
            "generated __setstate__": lambda: [
                generated_setstate(new(PackedSample), state) for state in states
            ],
            "slot loop (before)": lambda: [
                loop_setstate(new(PackedSample), state) for state in states
            ],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    for what, ways in _ways().items():
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):  # the ways alternate: the host's drift hits each alike
            for name, work in ways.items():
                times[name].append(_ms(work))
        medians = {name: statistics.median(ms) for name, ms in times.items()}
        first = next(iter(medians.values()))
        shown = ", ".join(f"{name} {ms:.2f} ms (x{ms / first:.2f})" for name, ms in medians.items())
        print(f"{what}, {SAMPLES:,} objects: {shown}")


if __name__ == "__main__":
    main()
