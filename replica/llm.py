"""The offline API, close to vLLM's: ``LLM(model, **options).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from tqdm.auto import tqdm

from tierserve.records import EngineStats, GenerateRequest, RequestOutput, SamplingParams
from tierserve.replica.config import EngineConfig
from tierserve.replica.engine import Engine
from tierserve.replica.models.catalog import DEFAULT_MODEL
from tierserve.replica.scheduler import AdmitError, QueueFull

Prompt = str | Sequence[int]


@dataclass(slots=True)
class CompletionOutput:
    """One prompt's answer. ``cached_tokens``: the prompt's leading tokens the prefix cache
    already held when the request was admitted (their KV was not computed again)."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0


class LLM:
    """One engine in this process. Options: see ``EngineConfig``."""

    def __init__(self, model: str = DEFAULT_MODEL, **options: Any) -> None:
        self.engine = Engine(EngineConfig.from_options(model, **options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Answer every prompt; outputs in the prompts' order.

        Raises ``ValueError`` (or an ``AdmitError``) naming the first bad prompt before any work is
        done; the engine stays usable.
        """
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int)
        )
        prompt_list: list[Prompt] = (
            [cast(Prompt, prompts)] if single else list(cast(Sequence[Prompt], prompts))
        )
        n = len(prompt_list)
        if params is None:
            params_list = [SamplingParams() for _ in range(n)]
        elif isinstance(params, SamplingParams):
            params_list = [params] * n
        else:
            params_list = list(params)
        if len(params_list) != n:
            raise ValueError(f"{len(params_list)} sampling params for {n} prompts")
        prios = list(priority) if priority is not None else [0] * n
        if len(prios) != n:
            raise ValueError(f"{len(prios)} priorities for {n} prompts")
        requests = [GenerateRequest.of(self._encode(i, p), sp, priority=pr)
                    for i, (p, sp, pr) in enumerate(zip(prompt_list, params_list, prios,
                                                        strict=True))]
        # Every prompt is checked here, before any work (its parameters were checked when they
        # were made); add_request below does not scan its tokens again, and the scheduler's add
        # applies its admission rules as it queues (where a full queue is found).
        for i, request in enumerate(requests):
            try:
                self.engine.validate(request)
            except (ValueError, AdmitError) as e:
                e.args = (f"prompt {i}: {e}",)
                raise

        outputs = [CompletionOutput(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        index: dict[int, int] = {}
        pending = 0
        done = 0
        bar = tqdm(total=n, desc="generate", disable=not use_tqdm or n < 16)
        try:
            while done < n:
                while pending < n:
                    try:
                        rid = self.engine.add_request(requests[pending], stream_text=False,
                                                      validated=True)
                    except QueueFull:
                        break
                    index[rid] = pending
                    pending += 1
                for out in self.engine.step():
                    done += self._collect(outputs[index[out.request_id]], out)
                    if out.finished:
                        bar.update(1)
        except BaseException:
            for rid, i in index.items():
                if outputs[i].finish_reason is None:
                    self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return outputs

    @staticmethod
    def _collect(dst: CompletionOutput, out: RequestOutput) -> int:
        dst.token_ids.extend(out.token_ids)
        dst.text += out.text
        if out.cached_tokens is not None:
            dst.cached_tokens = out.cached_tokens
        if out.finished:
            dst.finish_reason = out.finish_reason
            return 1
        return 0

    def _encode(self, i: int, p: Prompt) -> list[int]:
        if isinstance(p, str):
            return self.engine.encode(p)
        if isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
            return [int(t) for t in p]
        raise ValueError(
            f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}"
        )

    def stats(self) -> EngineStats:
        """The engine's blocks, requests, preemptions and steps (``tierserve.records.EngineStats``)."""
        return self.engine.stats()
