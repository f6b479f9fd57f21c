"""The checks before anything starts: ``cluster.environment`` (our top-level modules are ours
alone in the installed environment; ``make install`` runs it, and the launcher does too) and the
launcher's (``python -m cluster.launch``, what ``make serve`` runs): a missing config file, a
clashing environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster import environment, launch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the launcher started Ray after a failed check")

    monkeypatch.setattr(launch.ray, "init", refuse)


def test_this_environment_has_no_clash() -> None:
    """A guard on the environment the suite runs in (the project's .venv under `make test`): a
    package installed into it later that ships one of our module names fails here, by name."""
    clashes = environment.package_clashes()
    assert not clashes, environment.clash_message(clashes)


def test_our_packages_are_what_pyproject_installs() -> None:
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(p.rstrip("*") for p in include) == sorted(environment.OUR_PACKAGES)


def test_clashes_name_the_other_distributions() -> None:
    owners = {
        "kernels": ["tierserve", "kernels", "tierserve"],
        "router": ["Tierserve"],
        "cluster": ["b-dist", "a-dist"],
        "numpy": ["numpy"],
    }
    assert environment.package_clashes(owners) == {
        "kernels": ["kernels"], "cluster": ["a-dist", "b-dist"]
    }
    assert environment.package_clashes({"kernels": ["tierserve"]}) == {}
    assert environment.package_clashes({}) == {}


def test_clash_message_says_what_to_do() -> None:
    msg = environment.clash_message({"kernels": ["kernels"], "cluster": ["a-dist", "b-dist"]})
    assert "top-level module `kernels`: kernels" in msg
    assert "top-level module `cluster`: a-dist, b-dist" in msg
    assert "make clean install" in msg
    assert f"{sys.executable} -m pip uninstall a-dist b-dist kernels" in msg
    assert f"{sys.executable} -m pip install 'transformers<5.25'" in msg


def test_the_check_as_a_command(monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "cluster.environment"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""
    monkeypatch.setattr(environment, "package_clashes", lambda: {"kernels": ["kernels"]})
    assert environment.main() == 1
    assert "top-level module `kernels`" in capsys.readouterr().err


def test_launch_refuses_a_clashing_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_ray: None,
    tmp_path: Path,
) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text("applications: []\n")
    monkeypatch.setattr(launch, "package_clashes", lambda: {"kernels": ["kernels"]})
    assert launch.main([str(config), "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "top-level module `kernels`" in err and "make clean install" in err


def test_launch_refuses_a_missing_config(
    capsys: pytest.CaptureFixture[str], no_ray: None, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-file.yaml"
    assert launch.main([str(missing)]) == 2
    assert f"no config file at {missing}" in capsys.readouterr().err
