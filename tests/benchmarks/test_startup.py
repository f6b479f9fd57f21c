"""``benchmarks.startup``'s own logic (the launches run by hand: ``python -m benchmarks.startup``): the floor
config keeps the default config's layout and nothing of tierserve, the medians, and bad
arguments refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from benchmarks import startup

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "cluster.yaml"


def test_the_floor_keeps_the_layout_and_drops_tierserve() -> None:
    config = yaml.safe_load(DEFAULT.read_text())
    floor = startup.floor_config(config)
    ServeDeploySchema.model_validate(floor)  # a config `serve run` takes
    assert floor["http_options"] == config["http_options"]
    assert floor["proxy_location"] == config["proxy_location"]
    (app,) = floor["applications"]
    assert app["import_path"] == startup.FLOOR_IMPORT_PATH and "args" not in app
    mine = {d["name"]: d for d in config["applications"][0]["deployments"]}
    for d in app["deployments"]:
        assert set(d) == {"name", "num_replicas", "ray_actor_options"}  # no tierserve router
        assert d["num_replicas"] == mine[d["name"]]["num_replicas"]
        assert d["ray_actor_options"] == mine[d["name"]]["ray_actor_options"]
    assert {d["name"] for d in app["deployments"]} == set(mine)
    with pytest.raises(ValueError, match="no applications"):
        startup.floor_config({"http_options": {}})


def test_the_floor_app_binds_the_two_deployments_by_name() -> None:
    app = startup.floor_app()
    assert app._bound_deployment.name == "Ingress"
    (inner,) = app._bound_deployment.init_args
    assert inner._bound_deployment.name == "LLMServer"


def test_summary_takes_medians_and_the_time_above_the_floor() -> None:
    starts = [startup.Start("tierserve", 0, 12.0, 14.0), startup.Start("tierserve", 1, 11.0, 13.0),
              startup.Start("tierserve", 2, 13.0, 16.0), startup.Start("floor", 0, 9.0, 9.5),
              startup.Start("floor", 1, 10.0, 10.5), startup.Start("floor", 2, 8.0, 8.5)]
    s = startup.summarize(starts)
    assert s["tierserve"] == {"http_s": 12.0, "ready_s": 14.0}
    assert s["floor"] == {"http_s": 9.0, "ready_s": 9.5}
    assert s["above_floor_s"] == pytest.approx(4.5)
    assert "above_floor_s" not in startup.summarize(starts[:3])


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--config", "configs/no-such.yaml"], "--config configs/no-such.yaml: no such file"),
])
def test_bad_arguments_are_refused_before_anything_starts(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(startup, "measure", lambda *a: pytest.fail("started"))
    with pytest.raises(SystemExit) as exc:
        startup.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_config_without_applications_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("http_options: {port: 8000}\n")
    monkeypatch.setattr(startup, "measure", lambda *a: pytest.fail("started"))
    with pytest.raises(SystemExit) as exc:
        startup.main(["--config", str(bad)])
    assert exc.value.code == 2 and "not a Serve deploy config" in capsys.readouterr().err
