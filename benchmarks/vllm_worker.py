"""Runs one job on vLLM's offline engine, inside vLLM's own virtualenv (``benchmarks.vllm_peer``).

Usage (by ``benchmarks.vllm_peer.run_worker``): ``python vllm_worker.py JOB.json OUT.json``. Imports
nothing of tierserve (its venv does not have it): the job is ``benchmarks.vllm_peer.VllmJob`` as JSON.

Answer: ``{"version", "startup_s", "sets": [{"label", "wall_s", "requests": [{"tokens",
"ttft_s", "e2e_s", "cached_tokens"}]}]}``. ``startup_s``: building ``LLM`` (weights, KV cache,
compilation, warm-up); ``wall_s``: the set alone. ``ttft_s``/``e2e_s`` (stepped mode): from the
request's arrival to its first / last token. vLLM's engine is created under ``__main__`` (its
engine process starts with spawn).

LoRA: the job's ``adapters`` (``{"name", "id", "path"}``) become vLLM's ``LoRARequest``s, and a
request whose ``adapter`` is an index runs under that one (``lora_request`` of ``LLM.generate``,
of ``add_request`` when stepped); a job without adapters calls vLLM exactly as before.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _params(sp_cls: Any, max_tokens: int) -> Any:
    return sp_cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _lora_of(loras: list[Any], req: dict[str, Any]) -> Any:
    """The ``LoRARequest`` a request names (its ``adapter`` index), None for the base model."""
    index = req.get("adapter")
    return None if index is None else loras[index]


def _generate(llm: Any, sp_cls: Any, reqs: list[dict[str, Any]],
              loras: list[Any] | None = None) -> dict[str, Any]:
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [_params(sp_cls, r["max_tokens"]) for r in reqs]
    extra: dict[str, Any] = {}
    if any(r.get("adapter") is not None for r in reqs):
        extra["lora_request"] = [_lora_of(loras or [], r) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, **extra)
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "requests": [
            {
                "tokens": list(o.outputs[0].token_ids),
                "cached_tokens": getattr(o, "num_cached_tokens", None),
            }
            for o in outs
        ],
    }


def _stepped(llm: Any, sp_cls: Any, reqs: list[dict[str, Any]],
             loras: list[Any] | None = None) -> dict[str, Any]:
    """Requests added at their arrival times, the engine stepped by hand; each request's first
    and last token timed when the step that made it returns."""
    engine = llm.llm_engine
    order = sorted(range(len(reqs)), key=lambda i: reqs[i]["at"])
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    cached: dict[int, Any] = {}
    arrived: dict[int, float] = {}
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(order) and reqs[order[nxt]]["at"] <= now:
            i = order[nxt]
            arrived[i] = t0 + reqs[i]["at"]
            lora = _lora_of(loras or [], reqs[i])
            engine.add_request(str(i), {"prompt_token_ids": reqs[i]["prompt_token_ids"]},
                               _params(sp_cls, reqs[i]["max_tokens"]),
                               **({} if lora is None else {"lora_request": lora}))
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, reqs[order[nxt]]["at"] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            i = int(o.request_id)
            ids = list(o.outputs[0].token_ids) if o.outputs else []
            if ids and i not in first:
                first[i] = t
            if ids:
                tokens[i] = ids
            if o.finished:
                last[i] = t
                cached[i] = getattr(o, "num_cached_tokens", None)
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "requests": [
            {
                "tokens": tokens.get(i, []),
                "ttft_s": first[i] - arrived[i] if i in first else None,
                "e2e_s": last[i] - arrived[i] if i in last else None,
                "cached_tokens": cached.get(i),
            }
            for i in range(len(reqs))
        ],
    }


def _loras(job: dict[str, Any]) -> list[Any]:
    """vLLM's ``LoRARequest`` of each of the job's adapters, in order (none: nothing imported)."""
    if not job.get("adapters"):
        return []
    from vllm.lora.request import LoRARequest

    return [LoRARequest(a["name"], a["id"], a["path"]) for a in job["adapters"]]


def main() -> int:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype="float32", seed=0, **job["engine"])
    loras = _loras(job)
    if job["warmup"]:
        _generate(llm, SamplingParams, job["warmup"], loras)
    startup = time.perf_counter() - t0
    run = _stepped if job["mode"] == "stepped" else _generate
    sets = []
    for label, reqs in job["sets"]:
        if job["reset_prefix_cache"]:
            llm.reset_prefix_cache()
        sets.append({"label": label, **run(llm, SamplingParams, reqs, loras)})
    out = {"version": vllm.__version__, "startup_s": startup, "sets": sets}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
