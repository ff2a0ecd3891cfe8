"""Ray is an optional extra: the server and the CLI never import it, and `--ray` without it
says how to install it. Fast, in `make test`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minivllm.cli import main


def test_cli_and_server_do_not_import_ray() -> None:
    """`make run` and plain `minivllm serve` must work on an install without Ray."""
    code = (
        "import sys, minivllm.cli, minivllm.server.serve, minivllm.server.app; "
        "sys.exit('ray' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_serve_ray_without_ray_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails, as when missing
    monkeypatch.delitem(sys.modules, "minivllm.scale.ray_serve", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--ray", "--num-replicas", "2", "--model", "unused"])
    assert "pip install 'minivllm[ray]'" in str(exc.value)


def test_app_builder_parses_engine_options_and_refuses_unknown_ones() -> None:
    """`serve run minivllm.scale.ray_serve:app_builder key=value ...`: strings become the
    engine options' types and the replica's CPU share; a misspelt option is named."""
    pytest.importorskip("ray")
    from minivllm.scale.ray_serve import app_builder

    app = app_builder(
        {
            "model": "m",
            "num_replicas": "2",
            "replica_cpus": "1.5",
            "max_model_len": "512",
            "enforce_eager": "true",
        }
    )
    deployment = app._bound_deployment  # Serve's Application keeps the bound deployment here
    assert deployment.num_replicas == 2
    assert deployment.ray_actor_options["num_cpus"] == 1.5
    options = deployment.init_args[0]
    assert options.engine_options == {"model": "m", "max_model_len": 512, "enforce_eager": True}
    assert options.num_cpus == 1.5
    with pytest.raises(ValueError, match="max_model_length"):
        app_builder({"model": "m", "max_model_length": "512"})
