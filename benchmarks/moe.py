"""Offline generation throughput of a mixture-of-experts model on CPU: tierserve's engine on a
small random MoE checkpoint, beside a dense checkpoint with the same active parameters per token,
and beside ``transformers`` on the same MoE checkpoint.

Run: ``python -m benchmarks.moe`` (a few minutes on 2 quiet cores); ``--quick`` a smoke run
(tiny shapes, a few requests: seconds); ``--requests N``, ``--new-tokens N``,
``--prompt-len N``; ``--experts E --top-k K`` the MoE's routing; ``--arch mixtral|qwen3-moe``;
``--rounds N``; ``--json PATH`` the figures. Nothing here asserts on time.

One run, one machine, one mix of requests for every system:

- The checkpoints (fp32, written by ``transformers``' own classes with a seeded random init and
  ``save_pretrained``, the embedded byte tokenizer beside them): the MoE (Mixtral or Qwen3-MoE
  shaped: ``--experts`` experts of ``--expert-size``, ``--top-k`` per token, every layer sparse)
  and a dense Llama of the same attention and an MLP of ``top_k x expert-size``: the same
  multiply-adds per token in the MLP, so the MoE's extra cost is the routing, the grouping and
  the smaller per-expert products.
- The mix: ``--requests`` prompts of ``--prompt-len`` random token ids (seeded), greedy, EOS
  ignored, ``--new-tokens`` each. tokens/s = requested tokens / wall seconds of the whole mix.
- The systems: ``tierserve`` (``LLM.generate``, all requests at once, the native CPU kernels
  where built: the experts run grouped by expert on them) on the MoE and on the dense model;
  ``hf`` (``transformers`` ``generate`` on one left-padded batch of the whole mix) on the MoE.
- Rounds: each system once per round in a fixed order; medians over rounds. The machine (CPU,
  cores, versions, torch threads) and the load average before and after are recorded: the
  machine may be shared, so compare figures of one run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tierserve.cluster.measure import load_avg_1m, machine

THREADS = 2


@dataclass(frozen=True)
class Shape:
    """The benchmark models' sizes."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    experts: int
    top_k: int
    expert_size: int


@dataclass
class Figure:
    system: str
    model: str
    tokens_per_s: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)


def write_checkpoints(shape: Shape, arch: str, root: Path) -> tuple[Path, Path]:
    """The MoE and the dense checkpoint (same attention, dense MLP of top_k x expert size)."""
    import transformers

    from tierserve.replica.models.embedded import build_tokenizer

    common: dict[str, Any] = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, tie_word_embeddings=False,
    )
    if arch == "mixtral":
        moe_cfg: Any = transformers.MixtralConfig(
            **common, intermediate_size=shape.expert_size, num_local_experts=shape.experts,
            num_experts_per_tok=shape.top_k, sliding_window=None,
        )
        moe_cls: Any = transformers.MixtralForCausalLM
    else:
        moe_cfg = transformers.Qwen3MoeConfig(
            **common, intermediate_size=shape.top_k * shape.expert_size,
            moe_intermediate_size=shape.expert_size, num_experts=shape.experts,
            num_experts_per_tok=shape.top_k, norm_topk_prob=True,
        )
        moe_cls = transformers.Qwen3MoeForCausalLM
    dense_cfg = transformers.LlamaConfig(**common, intermediate_size=shape.top_k * shape.expert_size)
    paths = []
    for name, cls, cfg in (("moe", moe_cls, moe_cfg), ("dense", transformers.LlamaForCausalLM,
                                                        dense_cfg)):
        torch.manual_seed(0)
        model = cls(cfg).eval()
        path = root / name
        model.save_pretrained(str(path))
        build_tokenizer().save_pretrained(str(path))
        paths.append(path)
    return paths[0], paths[1]


def make_mix(requests: int, prompt_len: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(requests)]


def run_tierserve(path: Path, prompts: list[list[int]], new_tokens: int) -> float:
    from tierserve.replica.llm import LLM
    from tierserve.replica.sampler import SamplingParams

    longest = max(map(len, prompts)) + new_tokens
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=len(prompts),
              max_model_len=longest + 16)
    torch.set_num_threads(THREADS)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != new_tokens * len(prompts):
        raise RuntimeError(f"tierserve made {produced} tokens, {new_tokens * len(prompts)} asked")
    return produced / wall


def run_hf(path: Path, prompts: list[list[int]], new_tokens: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    torch.set_num_threads(THREADS)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw: dict[str, Any] = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(input_ids=ids[:1, :8], attention_mask=mask[:1, :8], max_new_tokens=2, **kw)
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, **kw)
        wall = time.perf_counter() - t0
    return new_tokens * len(prompts) / wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny shapes, few requests")
    ap.add_argument("--arch", choices=("mixtral", "qwen3-moe"), default="qwen3-moe")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-size", type=int, default=None, help="each expert's intermediate size")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--systems", default="tierserve,hf", help="comma list of tierserve, hf")
    ap.add_argument("--json", default=None, help="write the figures to this path")
    args = ap.parse_args(argv)
    if not 1 <= args.top_k <= args.experts:
        ap.error(f"--top-k must be within 1 .. --experts ({args.experts}), got {args.top_k}")
    systems = args.systems.split(",")
    if not set(systems) <= {"tierserve", "hf"} or not systems:
        ap.error(f"--systems takes a comma list of tierserve, hf; got {args.systems!r}")
    quick = args.quick
    shape = Shape(
        vocab=512 if quick else 4096, hidden=64 if quick else 512, layers=2 if quick else 8,
        heads=4 if quick else 8, kv_heads=2 if quick else 4, experts=args.experts,
        top_k=args.top_k, expert_size=args.expert_size or (32 if quick else 512),
    )
    requests = args.requests or (4 if quick else 32)
    prompt_len = args.prompt_len or (16 if quick else 128)
    new_tokens = args.new_tokens or (8 if quick else 64)
    rounds = args.rounds or (1 if quick else 3)
    torch.set_num_threads(THREADS)
    info = machine(shape=asdict(shape), arch=args.arch, requests=requests, prompt_len=prompt_len,
                   new_tokens=new_tokens, rounds=rounds)
    from tierserve.kernels import cpu_native

    info["native_kernels"] = cpu_native.available()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    prompts = make_mix(requests, prompt_len, shape.vocab)
    figures: dict[tuple[str, str], Figure] = {}
    with tempfile.TemporaryDirectory(prefix="tierserve-moe-bench-") as tmp:
        moe_path, dense_path = write_checkpoints(shape, args.arch, Path(tmp))
        cases = [("tierserve", "moe", moe_path), ("tierserve", "dense", dense_path),
                 ("hf", "moe", moe_path)]
        for _ in range(rounds):
            for system, model, path in cases:
                if system not in systems:
                    continue
                run = run_tierserve if system == "tierserve" else run_hf
                tps = run(path, prompts, new_tokens)
                figures.setdefault((system, model), Figure(system, model, [])).tokens_per_s.append(
                    tps)
                print(f"  {system:9s} {model:5s} {tps:9.1f} tok/s", flush=True)
    info["load_avg_1m_after"] = load_avg_1m()
    print(f"\n{'system':9s} {'model':5s} {'tok/s (median)':>15s}")
    for f in figures.values():
        print(f"{f.system:9s} {f.model:5s} {f.median:15.1f}")
    moe = figures.get(("tierserve", "moe"))
    dense = figures.get(("tierserve", "dense"))
    hf = figures.get(("hf", "moe"))
    if moe and dense:
        print(f"tierserve MoE / dense (same active parameters): {moe.median / dense.median:.2f}x")
    if moe and hf:
        print(f"tierserve / transformers on the MoE: {moe.median / hf.median:.2f}x")
    print(f"load average (1 min) before {info['load_avg_1m_before']:.2f}, "
          f"after {info['load_avg_1m_after']:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": info, "figures": [asdict(f) for f in figures.values()]}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
