"""tierserve: an LLM serving cluster on Ray Serve.

The offline API sits at the top, as vLLM users write it::

    from tierserve import LLM, SamplingParams

    llm = LLM()  # the default model; options: EngineConfig's fields
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]
    print(out.outputs[0].text)
    print(llm.chat([{"role": "user", "content": "Hi!"}])[0].outputs[0].text)

``generate`` and ``chat`` answer with ``RequestOutput``s (``.prompt``, ``.prompt_token_ids``,
``.outputs[i]``: ``CompletionOutput``s with ``.text``, ``.token_ids``, ``.logprobs`` as
``Logprob``s, ``.finish_reason``), as vLLM's do. These are the offline answer's records
(``tierserve.replica.llm``); the engine's own deltas are ``tierserve.records.RequestOutput``.
Those names load on first use (importing ``tierserve`` alone, as the ingress and the router
do, loads neither torch nor the engine).

Everything installs under this one name. The repository keeps each part in a folder of its own
at the top level, and ``tierserve/`` links them into the namespace (see docs/architecture.md,
"The layers"): lower layers never import higher ones.

- ``tierserve.records``: the records every process shares (requests, outputs, errors, the
  replicas' reports); imports nothing of ours.
- ``tierserve.kernels`` (``kernels/``): paged attention and the fused GPU kernels, the native CPU
  path.
- ``tierserve.replica`` (``replica/``): one replica: scheduler, KV pool, model runner, engine,
  its Serve deployment.
- ``tierserve.router`` (``router/``): the Serve request router.
- ``tierserve.cluster`` (``cluster/``): the config, the OpenAI-compatible ingress, flow control,
  the Serve application, the launcher (``tierserve serve CONFIG``) and the load generator
  (``tierserve-load``, ``tierserve.cluster.load``).

The benchmarks are not part of the package: they sit in the repository's ``benchmarks/`` (run
from its root as ``python -m benchmarks.NAME``), import tierserve as any client does, and
nothing here imports them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierserve.cluster.offline import LLM
    from tierserve.records import LoRARequest, SamplingParams
    from tierserve.replica.config import EngineConfig
    from tierserve.replica.llm import CompletionOutput, Logprob, RequestOutput

__version__ = "0.1.0"

# name -> the module that defines it
_OFFLINE = {
    "LLM": "tierserve.cluster.offline",
    "CompletionOutput": "tierserve.replica.llm",
    "Logprob": "tierserve.replica.llm",
    "RequestOutput": "tierserve.replica.llm",
    "SamplingParams": "tierserve.records",
    "LoRARequest": "tierserve.records",
    "EngineConfig": "tierserve.replica.config",
}

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LoRARequest", "Logprob", "RequestOutput",
           "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    module = _OFFLINE.get(name)
    if module is None:
        raise AttributeError(f"module 'tierserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_OFFLINE))
