"""``routeplay bench --address`` on a cluster without a node per role is a usage error
that names the missing roles (nothing is measured, nothing is started)."""

from __future__ import annotations

import pytest
import ray

from routeplay.bench.measure import node_roles
from routeplay.cli.main import main
from routeplay.errors import MisuseError

pytestmark = pytest.mark.usefixtures("ray_local")


def test_a_cluster_without_the_roles_is_refused_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(MisuseError, match="one node per role") as refused:
        node_roles()
    assert "engine" in str(refused.value.found)
    address = ray.get_runtime_context().gcs_address
    assert main(["bench", "--smoke", "--address", address, "--no-plot"]) == 1
    assert "no node for" in capsys.readouterr().err
    assert ray.is_initialized()  # the test's own connection is kept


def test_a_connection_the_bench_made_is_closed_when_it_refuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    address = ray.get_runtime_context().gcs_address
    namespace = ray.get_runtime_context().namespace
    ray.shutdown()
    try:
        assert main(["bench", "--smoke", "--address", address, "--no-plot"]) == 1
        assert "no node for" in capsys.readouterr().err
        assert not ray.is_initialized()
    finally:  # the module's job goes on (its fixture ends it)
        ray.init(address=address, namespace=namespace, log_to_driver=False)
