"""The soak's fault plan (seeded, every kind forced once) and its payload corruption."""

from __future__ import annotations

import pytest

from routeplay.cli.soak_command import soak_config
from routeplay.errors import AlreadyReleased, MisuseError, RoutesLost, SpecMismatch
from routeplay.pipeline.faults import (
    FAULT_KINDS,
    FaultConfig,
    classify,
    is_premature_release,
    tamper,
)


def _draws(config: FaultConfig, steps: int) -> list[frozenset[str]]:
    plan = config.build()
    out = []
    for step in range(steps):
        drawn = plan.draw(step)
        for kind in drawn:
            plan.count(kind)
        out.append(drawn)
    return out


def test_same_seed_same_faults_other_seed_others() -> None:
    assert _draws(FaultConfig(seed=3), 50) == _draws(FaultConfig(seed=3), 50)
    assert _draws(FaultConfig(seed=3), 50) != _draws(FaultConfig(seed=4), 50)


def test_each_kind_is_forced_once_even_at_rate_zero() -> None:
    zero = FaultConfig(**dict.fromkeys(FAULT_KINDS, 0.0))
    draws = _draws(zero, len(FAULT_KINDS) + 3)
    assert draws[: len(FAULT_KINDS)] == [frozenset({k}) for k in FAULT_KINDS]
    assert draws[len(FAULT_KINDS) :] == [frozenset()] * 3
    assert _draws(zero.replace(each_at_least_once=False), 20) == [frozenset()] * 20


def test_a_rate_outside_zero_one_is_refused() -> None:
    with pytest.raises(MisuseError, match="probability"):
        FaultConfig(worker_kill=1.5)


def test_tamper_breaks_keys_routing_lists_and_blobs() -> None:
    key = "0123456789abcdef" * 3 + "01234567"
    body, hit = tamper({"meta_info": {"routed_experts": key}, "text": "hi"})
    assert hit
    assert body["meta_info"]["routed_experts"] == "z" + key[1:]
    assert body["text"] == "hi"
    nested, hit = tamper({"r": [[[1, 2], [3, 4]]]})
    assert hit
    assert nested["r"] == [[[-1, 2], [3, 4]]]
    blob, hit = tamper({"b": "QUJD" * 20})
    assert hit
    assert len(blob["b"]) == 77
    assert tamper({"token_ids": [1, 2, 3], "finish_reason": "stop"}) == (
        {"token_ids": [1, 2, 3], "finish_reason": "stop"},
        False,
    )


def test_classify_names_our_errors_and_flags_premature_releases() -> None:
    assert classify(SpecMismatch("x")) == "SpecMismatch"
    assert classify(KeyError("x")) == "untyped:KeyError"
    assert is_premature_release(AlreadyReleased("x"))
    assert is_premature_release(RoutesLost("x"))
    assert not is_premature_release(SpecMismatch("x"))


def test_the_soak_command_s_options_set_every_rate_the_seed_and_the_wire() -> None:
    # `routeplay soak --rate R` drives every fault kind's rate; the seed seeds both the
    # fault draws and the demo (the e2e soak runs the command end to end).
    config = soak_config(
        steps=3,
        seed=7,
        rate=0.0,
        key_ttl=1.0,
        kill_between_jobs=True,
        num_cpus=None,
        engine_format="sglang",
    )
    assert all(config.faults.rate(kind) == 0.0 for kind in FAULT_KINDS)
    assert (config.steps, config.key_ttl_s, config.faults.seed, config.demo.seed) == (3, 1.0, 7, 7)
    assert config.faults.worker_kill_in_flight is False
    assert config.demo.wire == "sglang"
    # At rate 0 only the forced faults fire: stale_retry at step 0, the next kind at 1, ...
    assert _draws(config.faults, 3) == [frozenset({kind}) for kind in FAULT_KINDS[:3]]
