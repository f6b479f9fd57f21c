"""``python -m tierserve.replica.models.prepare MODEL...``: build the caches a GGUF model's start reads, once,
ahead of its first start (``make install`` runs it for the default model).

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
import sys
import time

from tierserve.replica.models import gguf_loader
from tierserve.replica.models.config import ModelLoadError
from tierserve.replica.models.meta import gguf_file


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
    parser.add_argument("models", nargs="+", metavar="MODEL",
                        help="a packaged model's name, a .gguf file or a folder holding one")
    args = parser.parse_args(argv)
    for model in args.models:
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


if __name__ == "__main__":
    sys.exit(main())
