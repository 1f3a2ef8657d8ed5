"""Real Megatron-Core on CPU: a gloo process group of one rank, and two GPU assumptions patched.

Megatron-Core's ``TopKRouter`` runs on CPU once two things are worked around, only for the
duration of each test (``helpers.cpu_patches`` restores them):

- ``Router.gating`` moves CPU-initialized gate weights to ``torch.cuda.current_device()``
  on first use (there is no GPU here): ``torch.cuda.current_device`` answers ``"cpu"``, so
  the move is a no-op.
- ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None``, a name
  ``moe_utils`` binds only when Transformer Engine imports: it is set to None, which
  selects Megatron's own ``torch.mm`` path.

Megatron's ``CheckpointFunction`` (full and selective ``"moe"`` recompute) saves and restores
the CUDA RNG state: ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` keep no CUDA state
(the CPU state is saved as well). Its schedules make one token counter with
``device="cuda"``: ``helpers.cpu_schedule()`` makes it on the CPU, around the schedule call.

Larger layouts (TP, CP, PP ranks) are simulated rank by rank in this one process: every
simulated rank gets the routers (and layer numbers) Megatron would build for it and the
tokens Megatron would give it, through Megatron's own split functions where they run
without a real group (``scatter_to_sequence_parallel_region``, ``get_batch_on_this_cp_rank``
take a group whose ``size()`` and ``rank()`` name the simulated rank: ``helpers.FakeGroup``).
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'routeplay[megatron]')"
)

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed" x5
    warnings.simplefilter("ignore")
    from helpers import cpu_patches
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def megatron_world() -> Iterator[None]:
    """``torch.distributed`` (gloo, world size 1) and Megatron's model-parallel state."""
    if not torch.distributed.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture
def megatron_cpu(megatron_world: None) -> Iterator[None]:
    """Per test: the CPU patches, one thread, and a clean global replay registry."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    RouterReplay.clear_global_router_replay_instances()
    try:
        with cpu_patches():
            yield
    finally:
        RouterReplay.clear_global_router_replay_instances()
        torch.set_num_threads(threads)
