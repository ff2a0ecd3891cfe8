"""Ray is an optional extra: the server and the CLI never import it, and `--ray` without it
says how to install it. Fast, in `make test`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minivllm.cli import main


def test_cli_and_server_do_not_import_ray() -> None:
    """`make run` and plain `minivllm serve` must work on an install without Ray."""
    code = ("import sys, minivllm.cli, minivllm.server.serve, minivllm.server.app; "
            "sys.exit('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_serve_ray_without_ray_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails, as when missing
    monkeypatch.delitem(sys.modules, "minivllm.scale.ray_serve", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--ray", "--num-replicas", "2", "--model", "unused"])
    assert "pip install 'minivllm[ray]'" in str(exc.value)
