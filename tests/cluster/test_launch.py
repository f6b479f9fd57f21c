"""The launcher's checks before it starts anything (``python -m cluster.launch``, what ``make
serve`` runs): a missing config file, and an environment where another installed package ships
one of our top-level module names (``transformers`` >= 5.25 pulls in the PyPI ``kernels``)."""

from __future__ import annotations

import pytest

from cluster import launch


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the launcher started Ray after a failed check")

    monkeypatch.setattr(launch.ray, "init", refuse)


def test_this_environment_has_no_clash() -> None:
    assert launch.package_clashes() == {}, launch.clash_message(launch.package_clashes())


def test_clashes_name_the_other_distributions() -> None:
    owners = {
        "kernels": ["tierserve", "kernels", "tierserve"],
        "router": ["Tierserve"],
        "cluster": ["b-dist", "a-dist"],
        "numpy": ["numpy"],
    }
    assert launch.package_clashes(owners) == {"kernels": ["kernels"], "cluster": ["a-dist", "b-dist"]}
    assert launch.package_clashes({"kernels": ["tierserve"]}) == {}
    assert launch.package_clashes({}) == {}


def test_clash_message_says_what_to_do() -> None:
    msg = launch.clash_message({"kernels": ["kernels"]})
    assert "top-level module `kernels`: kernels" in msg
    assert "pip uninstall kernels" in msg
    assert "transformers<5.25" in msg


def test_launch_refuses_a_clashing_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_ray: None
) -> None:
    monkeypatch.setattr(launch, "package_clashes", lambda: {"kernels": ["kernels"]})
    assert launch.main(["configs/cluster.yaml", "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "top-level module `kernels`" in err and "pip uninstall kernels" in err


def test_launch_refuses_a_missing_config(capsys: pytest.CaptureFixture[str], no_ray: None) -> None:
    assert launch.main(["configs/no-such-file.yaml"]) == 2
    assert "no config file at configs/no-such-file.yaml" in capsys.readouterr().err
