"""The engine's one configuration: every option of one replica, its default and its validation.

The same model serves the YAML's ``args.engine`` (``tierserve.cluster.config.ClusterConfig.engine``),
``LLM(model, **options)`` and the Serve replica; the scheduler reads its caps from it. Names are
vLLM's where vLLM has the option (``max_num_seqs``, ``max_num_batched_tokens``,
``scheduling_policy``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization``,
``max_model_len``, ``block_size``, ``dtype``, ``trust_remote_code``). Torch-free and Ray-free:
the scheduler and the ingress import it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tierserve.records import DEFAULT_BLOCK_SIZE
from tierserve.replica.models.catalog import DEFAULT_MODEL

SchedulingPolicy = Literal["fcfs", "priority"]
BlockSize = Literal[8, 16, 32, 64, 128]
DType = Literal["auto", "float32", "bfloat16", "float16"]
Backend = Literal["auto", "torch", "triton"]
CONTEXT_CAP = 8192  # max_model_len's default: the model's, at most this


class EngineConfig(BaseModel):
    """One replica's engine. Every field, its default and its meaning (docs/config.md's
    table lists exactly these):

    - ``model``: a packaged model, a ``.gguf`` file (or a folder holding one), a checkpoint
      directory, a hub id, or ``tierserve-tiny``.
    - ``block_size``: positions per KV block.
    - ``num_kv_blocks``: exactly this many KV blocks (overrides the two below).
    - ``kv_cache_memory_bytes``: the KV pool's budget on CPU.
    - ``gpu_memory_utilization``: on GPU, the fraction of memory the replica may use; the pool
      gets what the weights and activations leave.
    - ``max_num_seqs``: running sequences at most.
    - ``max_num_batched_tokens``: tokens per step at most (a decode costs 1, a prefill chunk its
      length).
    - ``max_model_len``: the context (prompt plus generated); None: the model's, at most 8192.
    - ``max_waiting``: waiting requests at most; beyond, 429 (``QueueFull``).
    - ``scheduling_policy``: ``priority`` (higher first, with aging) or ``fcfs``.
    - ``aging_steps``: steps per level of aging; 0: strict priority.
    - ``slo_scheduling``: SLO-aware steps (docs/scheduler.md §8): while requests with a time
      per output token target are unfinished, each step is sized by a cost model learned from
      the engine's own step times to take at most ``slo_headroom`` of the strictest target; off
      (or without targets) the scheduler is exactly §1 to §7.
    - ``slo_headroom``: the share of the strictest TPOT target a step may be predicted to take.
    - ``slo_prefill_headroom``: a step that prefills prompts of the strictest target may take
      longer, as long as every unfinished request of that target with a first token keeps its
      time per output token so far within this share of its target if its next token comes at
      the step's end (its TPOT is a mean: steps shorter than the limit leave a budget), and
      never longer than the next laxer target's limit; while none of them has a first token,
      such a prompt takes its whole chunk within that. None: those prompts are timed against
      the limit like the rest.
    - ``slo_prefill_headroom_late``: the share of the target that budget may use instead while a
      prompt of the strictest target would miss its first-token target at the rate the reserve
      gives its tier (``Request.ttft_left_s``: its tier's ``ttft_target_s`` less what it
      waited before the replica); a burst then spends more of the running requests' margin
      on first tokens. Used only where above ``slo_prefill_headroom`` (and never without it);
      None: off.
    - ``prefill_chunk_tokens``: a prompt's chunk per step at most (chunked prefill; vLLM's
      ``long_prefill_token_threshold``); None: whole prompts.
    - ``enable_prefix_caching``: share the KV blocks of common prompt prefixes between requests
      and keep them after use until their room is needed (``replica/prefix_cache.py``).
    - ``dtype``: ``auto`` (fp32 on CPU, bf16 on GPU) or a dtype name.
    - ``device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    - ``deterministic``: bit-exact batch and chunk invariance (CPU, fp32; docs/determinism.md).
    - ``attention_backend``: ``triton`` (GPU), ``torch`` (CPU), ``auto`` by device.
    - ``trust_remote_code``: let ``transformers`` run code shipped with a checkpoint.
    - ``num_threads``: torch CPU threads; None: the replica's CPU share.
    - ``enforce_eager``: never run decode steps as CUDA graphs (GPU); by default a pure-decode
      step on CUDA with the triton backend replays the graph captured at start-up for its
      bucketed batch size (up to ``max_num_seqs``). The CPU never uses graphs.
    - ``fused_kernels``: on the triton backend, each RMSNorm with its residual add and the
      rotary embedding with the KV store run as one Triton kernel each; False keeps the torch
      ops (the eager fallback). The CPU path has its own native fusions either way.
    - ``grammar_cache_bytes``: the compiled structured-output grammars a replica keeps, in
      bytes (least recently used dropped first); also the most one compiled grammar may take
      (a larger one is refused, 400 ``grammar_too_complex``).
    - ``grammar_compile_timeout_s``: one grammar compile's budget; past it the compile worker
      is killed and the request refused (400 ``grammar_too_complex``).
    - ``grammar_compiles_per_tenant``: grammar compiles a tenant may have queued or running in
      a replica; one more is refused (429 ``too_many_compiles``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = DEFAULT_MODEL
    block_size: BlockSize = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = Field(default=None, gt=0)
    kv_cache_memory_bytes: int | None = Field(default=256 * 2**20, gt=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    max_num_seqs: int = Field(default=64, gt=0)
    max_num_batched_tokens: int = Field(default=2048, gt=0)
    max_model_len: int | None = Field(default=None, ge=2)
    max_waiting: int = Field(default=256, gt=0)
    scheduling_policy: SchedulingPolicy = "priority"
    aging_steps: int = Field(default=100, ge=0)
    slo_scheduling: bool = True
    slo_headroom: float = Field(default=0.7, gt=0.0, le=1.0)
    slo_prefill_headroom: float | None = Field(default=0.85, gt=0.0, le=1.0)
    slo_prefill_headroom_late: float | None = Field(default=None, gt=0.0, le=1.0)
    prefill_chunk_tokens: int | None = Field(default=256, gt=0)
    enable_prefix_caching: bool = True
    dtype: DType = "auto"
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    deterministic: bool = False
    attention_backend: Backend = "auto"
    trust_remote_code: bool = False
    num_threads: int | None = Field(default=None, gt=0)
    enforce_eager: bool = False
    fused_kernels: bool = True
    grammar_cache_bytes: int = Field(default=64 * 2**20, gt=0)
    grammar_compile_timeout_s: float = Field(default=10.0, gt=0.0)
    grammar_compiles_per_tenant: int = Field(default=4, gt=0)

    @classmethod
    def from_options(cls, model: str, **options: Any) -> EngineConfig:
        """``LLM(model, **options)``'s config: an unknown option is a ``TypeError`` that lists
        the known ones, a bad value a ``ValueError`` naming the field."""
        known = set(cls.model_fields)
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {unknown}; known: {sorted(known - {'model'})}"
            )
        try:
            return cls(model=model, **options)
        except ValidationError as e:
            raise ValueError(describe(e)) from None

    def prefix_root(self) -> int:
        """The root of this engine's prefix-cache hash chains: blocks of another model, dtype or
        block size never share a name. The ingress computes the same for the router."""
        from tierserve.replica.prefix_cache import model_key

        return model_key(self.model, self.dtype, self.block_size)


def describe(e: ValidationError) -> str:
    """A pydantic error as one line per field: ``engine.max_num_seqs: ...``."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '(config)'}: {err['msg']}" for err in e.errors()
    )


def context_length(cfg: EngineConfig, max_position_embeddings: int) -> int:
    """The context (prompt plus generated) a replica of ``cfg`` serves: ``max_model_len``, else
    the model's ``max_position_embeddings``, at most ``CONTEXT_CAP``."""
    return int(cfg.max_model_len or min(max_position_embeddings, CONTEXT_CAP))
