"""tierserve: an LLM serving cluster on Ray Serve.

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
  the Serve application and the launcher (``tierserve serve CONFIG``).
- ``tierserve.bench`` (``bench/``): load generators and benchmarks (tools, not the runtime).
"""

__version__ = "0.1.0"
