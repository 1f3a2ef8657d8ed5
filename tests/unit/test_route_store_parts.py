"""``RouteStore`` is one class over small parts, not a chain of mixins: its public names
are pinned, none of its bases is a store class, each part's module imports alone (none
loads the client), each forwarded method is its part's (name, docstring, signature,
awaitable or not), the parts work without the client, and a copy of the client (what
pickling makes) leaves this process's state behind but moves leases together with the
original."""

from __future__ import annotations

import asyncio
import copy
import inspect
import subprocess
import sys
from typing import Any

import numpy as np

from routeplay.core import Routes, RouteSpec, canonicalize
from routeplay.store import Lease, RouteStore, StoreConfig
from routeplay.store.client.accounting import Accounting
from routeplay.store.client.core import StoreCore
from routeplay.store.client.keys import KeyAdoption
from routeplay.store.client.leases import Leases
from routeplay.store.client.read_path import ReadPath
from routeplay.store.client.write_path import WritePath
from routeplay.store.remote.backend import LocalBackend

SPEC = RouteSpec(num_layers=2, top_k=2, num_experts=8)

PUBLIC = (
    "aacquire", "aacquire_many", "aadopt_key", "aadopt_keys", "aadopt_keys_each", "aclone_lease",
    "aclone_leases", "acquire", "acquire_many", "acquire_many_flow", "adopt_key", "adopt_keys",
    "adopt_keys_each", "adrive", "aflush", "afree_engine_keys", "afree_key", "aleaks", "aput",
    "aput_leased", "aput_leased_many", "aput_many", "aput_staged", "aput_staged_many",
    "arelease_lease", "arelease_leases", "arelease_many", "arevoke", "arevoke_holder", "astats",
    "atransfer_lease", "atransfer_leases", "backend", "block_rows_for", "clone_lease",
    "clone_leases", "compact", "discard_written", "drive", "flush", "free_engine_keys", "free_key",
    "hold_blocks", "identity", "layout_blocks", "leaks", "leased_handles", "local", "pull", "put",
    "put_leased", "put_leased_many", "put_many", "put_staged", "put_staged_flow", "put_staged_many",
    "put_staged_many_flow", "read", "read_many", "release_lease", "release_leases", "release_many",
    "repin_blocks", "resolve", "revoke", "revoke_holder", "run", "scoped", "shutdown",
    "staged_adoption", "staged_leased_adoption", "start", "stats", "transfer_lease",
    "transfer_leases", "unpin_blocks", "written_handles",
)  # fmt: skip
"""RouteStore's public names when it was a mixin chain (recorded with ``dir()``), and those
added since on purpose (``hold_blocks``: issue 39's read-ahead windows;
``staged_leased_adoption``, ``leased_handles`` and ``acquire_many_flow``: issue 39's group
writes that lease their members in the same call)."""

PARTS = {
    "routeplay.store.client.core": StoreCore,
    "routeplay.store.client.leases": Leases,
    "routeplay.store.client.write_path": WritePath,
    "routeplay.store.client.read_path": ReadPath,
    "routeplay.store.client.keys": KeyAdoption,
    "routeplay.store.client.accounting": Accounting,
}


def routing(rows: int, seed: int) -> Routes:
    keys = np.random.default_rng(seed).random((rows, SPEC.num_layers, SPEC.num_experts))
    return canonicalize(np.argsort(keys, axis=-1)[..., : SPEC.top_k].astype(np.uint8), SPEC)


def test_the_public_names_are_unchanged() -> None:
    assert sorted(n for n in dir(RouteStore) if not n.startswith("_")) == sorted(PUBLIC)


def test_no_base_class_is_a_store_class() -> None:
    assert RouteStore.__mro__ == (RouteStore, object)


def test_each_part_imports_alone_without_the_client() -> None:
    probe = (
        "import importlib, sys; importlib.import_module(sys.argv[1]); "
        "sys.exit('routeplay.store.client.route_store' in sys.modules)"
    )
    runs = {
        name: subprocess.Popen([sys.executable, "-c", probe, name], stderr=subprocess.PIPE)
        for name in [*PARTS, "routeplay.store.client.forwarding", "routeplay.store.client.pins"]
    }
    failed = {name: run.communicate()[1].decode()[-500:] for name, run in runs.items()}
    assert {name: err for name, err in failed.items() if runs[name].returncode} == {}


def test_each_forwarded_method_is_its_parts() -> None:
    forwarded = 0
    for part in PARTS.values():
        for name, method in vars(part).items():
            if name.startswith("_") or name not in PUBLIC or not callable(method):
                continue
            mine = getattr(RouteStore, name)
            assert mine.__name__ == name
            assert mine.__doc__ == method.__doc__, name
            assert inspect.signature(mine) == inspect.signature(method), name
            assert inspect.iscoroutinefunction(mine) == inspect.iscoroutinefunction(method)
            twin = name.startswith("a") and name[1:] in PUBLIC  # aput_many, adrive, ...
            assert inspect.iscoroutinefunction(mine) == twin, name
            forwarded += 1
    # 66 when the parts were made, then hold_blocks, then the leased group writes'
    # staged_leased_adoption, leased_handles and acquire_many_flow
    assert forwarded == 70


def test_the_parts_write_lease_read_and_count_without_the_client() -> None:
    core = StoreCore(StoreConfig(run="parts", shards=2), LocalBackend("parts", shards=2, ttl_s=600))
    reads = ReadPath(core)

    class Owner:  # what a Lease calls back into, made of the parts alone
        identity = core.identity
        read = reads.read

        def __getattr__(self, name: str) -> Any:
            return getattr(leases, name)

    leases = Leases(core, owner=Owner())
    writes, accounts = WritePath(core, leases), Accounting(core)
    rows = routing(9, seed=1)
    _, lease = writes.put_leased(rows, "parts/a")
    np.testing.assert_array_equal(lease.read(2, 5), rows.array[2:5])
    assert len(core.pins) == 1  # the grant's blocks: the read made no shard call
    assert accounts.stats().leases == 1
    lease.release()
    assert (accounts.stats().leases, len(core.pins)) == (0, 0)
    assert accounts.leaks() == []


def test_a_copy_leaves_local_state_behind_and_leases_move_together() -> None:
    store = RouteStore.local(StoreConfig(run="copied", shards=1))
    first, second = store.put_many([routing(4, seed=2), routing(4, seed=3)])
    mine = store.acquire(first, "a")
    twin = copy.copy(store)  # through __reduce__: (config, backend), as pickling does
    assert type(twin) is RouteStore
    assert twin.identity == store.identity
    assert (len(store._core.pins), len(twin._core.pins)) == (1, 0)
    theirs = twin.acquire(second, "b")
    assert Lease.one_shard([mine, theirs])  # one store, whichever copy granted them
    moved = Lease.transfer_all([mine, theirs], "c")
    assert [lease.holder for lease in moved] == ["c", "c"]
    assert mine.released
    asyncio.run(moved[0].arelease())
    assert Lease.release_each([moved[1]]) == [None]
    assert store.stats().leases == 0
