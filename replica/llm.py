"""The offline API, in vLLM's shape: ``LLM(model, **options).generate(prompts, params)`` returns
one ``RequestOutput`` per prompt, its ``outputs`` the prompt's ``n`` samples as
``CompletionOutput``s, log-probabilities as ``Logprob``s by token id.

These are the offline answer's records, not the engine's: the engine streams
``tierserve.records.RequestOutput`` deltas (one sample's new tokens each), which ``generate``
gathers here into whole answers. ``from tierserve import RequestOutput, CompletionOutput``
names these. ``LLM.chat`` sits one layer up (``tierserve.cluster.offline``), where the chat
template is rendered as the HTTP chat route renders it; ``from tierserve import LLM`` is that one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from tqdm.auto import tqdm

from tierserve.records import (
    EngineStats,
    GenerateRequest,
    LoRARequest,
    SamplingParams,
    TokenLogprob,
)
from tierserve.records import RequestOutput as EngineOutput
from tierserve.replica.config import EngineConfig
from tierserve.replica.detokenizer import bad_words_ids
from tierserve.replica.engine import Engine, sample_params
from tierserve.replica.models.catalog import DEFAULT_MODEL
from tierserve.replica.scheduler import AdmitError, QueueFull

# A prompt: its text, its token ids, or vLLM's dict forms ``{"prompt": text}`` and
# ``{"prompt_token_ids": ids}``.
Prompt = str | Sequence[int] | Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability at a position: ``rank`` its place in the model's
    distribution there (1: the most likely), ``decoded_token`` its text alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: the drawn token and the ``logprobs`` most likely ones, by token id.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: the same (None for the first token, which has no context).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a prompt's answer. ``index``: which of the prompt's ``n`` samples (0 to
    n-1). ``logprobs`` (when ``SamplingParams.logprobs`` asked for them): per generated token,
    the drawn token (always) and the ``logprobs`` most likely ones; ``cumulative_logprob``:
    the sum of the drawn tokens' log-probabilities (None without ``logprobs``).
    ``finish_reason``: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``; ``stop_reason``:
    the stop string that matched or the ``stop_token_ids`` entry drawn (None for EOS)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One prompt's answer. ``prompt``: its text (None for a prompt of token ids);
    ``prompt_token_ids``: what the model read; ``prompt_logprobs`` (when
    ``SamplingParams.prompt_logprobs`` asked): per prompt token, as ``Logprob``s by token id
    (None for the first). ``outputs``: its ``n`` samples by ``index``. ``finished``: every
    sample finished. ``num_cached_tokens``: the prompt's leading tokens the prefix cache held
    when its first sample was admitted (their KV was not computed again)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None


def logprob_entry(lp: TokenLogprob, decode: Callable[[int], str]) -> dict[int, Logprob]:
    """A position's ``Logprob``s by token id: the scored token first (with its rank), then
    the most likely tokens in order (rank 1, 2, ...; the scored token keeps its first entry)."""
    ranks = {tok: j + 1 for j, (tok, _) in enumerate(lp.top)}
    rank = lp.rank if lp.rank is not None else ranks.get(lp.token)
    out = {lp.token: Logprob(lp.logprob, rank, decode(lp.token))}
    for tok, value in lp.top:
        if tok not in out:
            out[tok] = Logprob(value, ranks[tok], decode(tok))
    return out


@dataclass(slots=True)
class _Sample:
    """One sample's deltas, gathered."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, out: EngineOutput) -> None:
        self.token_ids.extend(out.token_ids)
        self.text += out.text
        self.logprobs.extend(out.logprobs or ())
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason

    def output(self, params: SamplingParams, decode: Callable[[int], str]) -> CompletionOutput:
        asked = params.logprobs is not None
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(self.token_ids),
            cumulative_logprob=sum(lp.logprob for lp in self.logprobs) if asked else None,
            logprobs=[logprob_entry(lp, decode) for lp in self.logprobs] if asked else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)


@dataclass(slots=True)
class _Answer:
    """One prompt's samples as they come in, made into its ``RequestOutput`` at the end."""

    request_id: str
    prompt: str | None
    request: GenerateRequest
    samples: list[_Sample]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int | None = None
    left: int = 0

    def add(self, out: EngineOutput) -> bool:
        """Gather ``out`` (a delta of sample ``out.index``); True when it finished the last
        unfinished sample."""
        self.samples[out.index].add(out)
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.cached_tokens is not None and out.index == 0:  # the others share its blocks
            self.cached_tokens = out.cached_tokens
        if out.finished:
            self.left -= 1
            return self.left == 0
        return False

    def output(self, decode: Callable[[int], str]) -> RequestOutput:
        params = self.request.sampling
        prompt_lps: PromptLogprobs | None = None
        if params.prompt_logprobs is not None:
            entries = self.prompt_logprobs or [None] * len(self.request.prompt_ids)
            prompt_lps = [None if e is None else logprob_entry(e, decode) for e in entries]
        outputs = [s.output(params, decode) for s in self.samples]
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=list(self.request.prompt_ids), prompt_logprobs=prompt_lps,
            outputs=outputs, finished=all(o.finished() for o in outputs),
            num_cached_tokens=self.cached_tokens)


class LLM:
    """One engine in this process. Options: see ``EngineConfig``."""

    def __init__(self, model: str = DEFAULT_MODEL, **options: Any) -> None:
        self.engine = Engine(EngineConfig.from_options(model, **options))
        self.tokenizer = self.engine.tokenizer
        self._request_ids = itertools.count()
        self._token_text: dict[int, str] = {}

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (a Hugging Face tokenizer)."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer every prompt (a string, a list of token ids, ``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}``, or a list of them), ``sampling_params.n`` samples each;
        one ``RequestOutput`` per prompt, in the prompts' order. ``sampling_params``: one for
        all or one per prompt (None: the defaults); its ``bad_words`` are tokenized here.
        ``lora_request``: the LoRA adapter (``LoRARequest``) of every prompt, or a list of one
        per prompt (None for the base model); an engine without ``enable_lora`` refuses it.

        Raises ``ValueError`` (or an ``AdmitError``) naming the first bad prompt before any
        work is done (its parameters were checked when they were made); the engine stays
        usable.
        """
        prompt_list = self._prompt_list(prompts)
        params_list = self._per_prompt(sampling_params, len(prompt_list))
        encoded = [self._encode(i, p) for i, p in enumerate(prompt_list)]
        texts = [p if isinstance(p, str) else p.get("prompt") if isinstance(p, Mapping) else None
                 for p in prompt_list]
        loras = self._per_prompt_lora(lora_request, len(prompt_list))
        return self._run(encoded, texts, params_list, priority, use_tqdm, loras)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        single = isinstance(prompts, str | Mapping) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int)
        )
        if single:
            return [cast(Prompt, prompts)]
        if not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a string, a list of token ids or a list of "
                             f"them, got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("no prompts: give at least one")
        return list(cast(Sequence[Prompt], prompts))

    @staticmethod
    def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                    n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        out = list(params)
        if len(out) != n:
            raise ValueError(f"{len(out)} sampling params for {n} prompts")
        bad = next((i for i, p in enumerate(out) if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise ValueError(f"sampling params {bad} must be a SamplingParams, got "
                             f"{type(out[bad]).__name__}")
        return out

    @staticmethod
    def _per_prompt_lora(lora: LoRARequest | Sequence[LoRARequest | None] | None,
                         n: int) -> list[LoRARequest | None]:
        if lora is None or isinstance(lora, LoRARequest):
            return [lora] * n
        if not isinstance(lora, Sequence) or isinstance(lora, str):
            raise ValueError("lora_request must be a LoRARequest, a list of one per prompt "
                             f"(None for the base model) or None, got {type(lora).__name__}")
        out = list(lora)
        if len(out) != n:
            raise ValueError(f"{len(out)} LoRA requests for {n} prompts")
        bad = next((i for i, r in enumerate(out)
                    if r is not None and not isinstance(r, LoRARequest)), None)
        if bad is not None:
            raise ValueError(f"lora_request {bad} must be a LoRARequest or None, got "
                             f"{type(out[bad]).__name__}")
        return out

    def _run(self, prompt_ids: list[list[int]], texts: list[str | None],
             params_list: list[SamplingParams], priority: Sequence[int] | None,
             use_tqdm: bool, loras: Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Check every prompt, then run their samples to the end: each sample is an engine
        request of its own on the prompt (the prefix cache shares the prompt's blocks among
        them), sample ``i`` with ``sample_params(params, i)``'s seed."""
        n = len(prompt_ids)
        prios = list(priority) if priority is not None else [0] * n
        if len(prios) != n:
            raise ValueError(f"{len(prios)} priorities for {n} prompts")
        params_list = self._with_bad_words(params_list)
        loras = list(loras) if loras is not None else [None] * n
        requests = [GenerateRequest.of(ids, sp, priority=pr, lora=lo)
                    for ids, sp, pr, lo in zip(prompt_ids, params_list, prios, loras,
                                               strict=True)]
        # Every prompt is checked here, before any work; add_request below does not scan its
        # tokens again, and the scheduler's add applies its admission rules as it queues
        # (where a full queue is found).
        for i, request in enumerate(requests):
            try:
                self.engine.validate(request)
            except (ValueError, AdmitError) as e:
                e.args = (f"prompt {i}: {e}",)
                raise

        answers = [_Answer(str(next(self._request_ids)), text, r, [_Sample(j) for j in range(r.n)],
                           left=r.n)
                   for text, r in zip(texts, requests, strict=True)]
        jobs = [(i, j) for i, r in enumerate(requests) for j in range(r.n)]
        owner: dict[int, tuple[int, int]] = {}  # engine request id -> (prompt, sample)
        queued = 0
        done = 0
        bar = tqdm(total=n, desc="generate", disable=not use_tqdm or n < 16)
        try:
            while done < n:
                while queued < len(jobs):
                    i, j = jobs[queued]
                    request = requests[i]
                    if j:
                        request = replace(request, sampling=sample_params(request.sampling, j))
                    try:
                        rid = self.engine.add_request(request, stream_text=False, index=j,
                                                      validated=True)
                    except QueueFull:
                        if not self.engine.has_unfinished():
                            raise
                        break  # room comes as the queued requests finish
                    owner[rid] = (i, j)
                    queued += 1
                for out in self.engine.step():
                    if answers[owner[out.request_id][0]].add(out):
                        done += 1
                        bar.update(1)
        except BaseException:
            for rid, (i, j) in owner.items():
                if answers[i].samples[j].finish_reason is None:
                    self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [a.output(self._decode) for a in answers]

    def _with_bad_words(self, params_list: list[SamplingParams]) -> list[SamplingParams]:
        """Each parameters' ``bad_words`` tokenized into its ``bad_words_ids`` (once per
        distinct record), as the engine takes them."""
        done: dict[int, SamplingParams] = {}
        out = []
        for sp in params_list:
            if sp.bad_words:
                if id(sp) not in done:
                    ids = [*(sp.bad_words_ids or ()), *bad_words_ids(self.tokenizer, sp.bad_words)]
                    done[id(sp)] = replace(sp, bad_words=None, bad_words_ids=ids)
                sp = done[id(sp)]
            out.append(sp)
        return out

    def _decode(self, token_id: int) -> str:
        """A token's text alone (``Logprob.decoded_token``), remembered per id."""
        text = self._token_text.get(token_id)
        if text is None:
            text = str(self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._token_text[token_id] = text
        return text

    def _encode(self, i: int, p: Prompt) -> list[int]:
        if isinstance(p, Mapping):
            keys = set(p)
            if keys == {"prompt"} and isinstance(p["prompt"], str):
                return self.engine.encode(p["prompt"])
            if keys == {"prompt_token_ids"}:
                return self._ids(i, p["prompt_token_ids"])
            raise ValueError(f"prompt {i}: a prompt dict is {{'prompt': text}} or "
                             f"{{'prompt_token_ids': ids}}, got the keys {sorted(keys)}")
        if isinstance(p, str):
            return self.engine.encode(p)
        return self._ids(i, p)

    @staticmethod
    def _ids(i: int, p: Any) -> list[int]:
        if isinstance(p, Sequence) and not isinstance(p, str) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p):
            return [int(t) for t in p]
        raise ValueError(
            f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}"
        )

    def stats(self) -> EngineStats:
        """The engine's blocks, requests, preemptions and steps (``tierserve.records.EngineStats``)."""
        return self.engine.stats()
