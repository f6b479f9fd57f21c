"""Multi-LoRA benchmark: offline throughput with adapters mixed in every step against the base
model alone, on the same requests, in one engine.

Run: ``python -m benchmarks.lora`` (the default model, SmolLM2-135M-Instruct, fp32 on CPU);
``--model`` another; ``--adapters N`` (4), ``--rank R`` (16), ``--requests N`` (32),
``--prompt-len`` (128), ``--max-tokens`` (32); ``--quick`` a seconds-long smoke run;
``--json PATH``. Nothing here asserts on time: the target is printed as met or not.

The adapters are random, written in PEFT's format from the model's own shapes (``A`` and ``B``
drawn from a fixed seed, rank ``R`` on every attention and MLP projection of every layer: the
most work an adapter can add). The requests (fixed seed, random token ids, greedy, EOS ignored)
run twice on one engine with ``enable_lora`` and ``max_loras`` = N: every request on the base
model, then request ``i`` on adapter ``i mod N`` (so every step mixes all N). Reported: generated
tokens/s of each run, their ratio (target: mixed at least 0.8x the base on CPU) and the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tierserve import LLM, LoRARequest, SamplingParams
from tierserve.cluster.measure import machine
from tierserve.replica.lora import ModelShapes
from tierserve.replica.models.catalog import DEFAULT_MODEL

TARGET_RATIO = 0.8
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(shapes: ModelShapes, path: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of ``rank`` on every projection of every layer of a model of
    ``shapes``, under ``path``."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(shapes.layers):
        for proj in PROJECTIONS:
            if proj not in layer:
                continue
            s = layer[proj]
            group = "self_attn" if s.module.startswith("self_attn") else "mlp"
            stem = f"base_model.model.model.layers.{i}.{group}.{proj}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, s.in_features, generator=gen) * 0.02
            tensors[f"{stem}.lora_B.weight"] = torch.randn(s.out_features, rank, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": list(PROJECTIONS), "base_model_name_or_path": None}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams,
        loras: list[LoRARequest | None]) -> dict[str, float]:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": round(seconds, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_len, args.max_tokens = 4, 8, 4
    llm = LLM(args.model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              max_cpu_loras=args.adapters, max_num_seqs=max(args.requests, 1))
    assert llm.engine.lora is not None
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    low = min(200, vocab // 2)
    prompts = [[rng.randrange(low, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1,
                                str(write_adapter(llm.engine.lora.shapes, Path(tmp) / f"a{i}",
                                                  args.rank, seed=i)))
                    for i in range(args.adapters)]
        for a in adapters:
            llm.engine.load_lora(a)
        run(llm, prompts[:2], params, [None, adapters[0]])  # warm-up: first-call costs
        base = run(llm, prompts, params, [None] * len(prompts))
        mixed = run(llm, prompts, params, [adapters[i % len(adapters)]
                                           for i in range(len(prompts))])
    ratio = mixed["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
    record: dict[str, Any] = {
        "machine": machine(),
        "model": args.model,
        "adapters": args.adapters,
        "rank": args.rank,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "base": base,
        "mixed": mixed,
        "ratio": round(ratio, 3),
    }
    print(f"machine: {record['machine']}")
    print(f"base model alone:      {base['tokens_per_s']:8.1f} tokens/s ({base['seconds']} s)")
    print(f"{args.adapters} adapters mixed:     {mixed['tokens_per_s']:8.1f} tokens/s "
          f"({mixed['seconds']} s)")
    met = "met" if ratio >= TARGET_RATIO else "NOT met"
    print(f"ratio mixed/base: {ratio:.3f} (target >= {TARGET_RATIO}: {met})")
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
