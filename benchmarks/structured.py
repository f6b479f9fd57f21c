"""Structured outputs on the default model: what a JSON schema's token mask costs, side by side.

Run: ``python -m benchmarks.structured`` (64 concurrent requests, up to 256 tokens each, 2
repeats: several minutes on 2 cores); a smoke run: ``--requests 4 --max-tokens 32 --repeats 1``.
Options: ``--requests N`` (concurrent chat requests, default 64), ``--max-tokens N`` (each
constrained request's cap, default 256), ``--repeats N`` (default 2), ``--seed S`` (request
``i`` samples from seed ``S + i``), ``--out-dir DIR`` (default ``benchmarks/out/structured``),
``--mask-iters N`` (steps of the mask timing, default 100), ``--lib-outputs N`` (outputs the
library comparison walks, default 8), ``--no-natural`` (leave out the reference run (c)).

Everything runs in one process on the default model (SmolLM2-135M-Instruct, CPU), one engine:

1. Throughput, constrained vs not. N chat requests (the tokenizer's chat template; request ``i``
   asks for a JSON record of city ``i``), all submitted at once (``Engine.add_request``, then the
   step loop), so they run concurrently up to the engine's ``max_num_seqs`` (printed: 64 by
   default). (a) ``constrained``: ``SCHEMA`` (9 required fields, enums, integer ranges, a
   boolean, strings with ``maxLength``, two arrays with ``maxItems``, one of them of objects,
   ``additionalProperties`` false), temperature 0.7, fixed seeds. (b) ``unconstrained``: the same
   prompts and seeds without the schema, ``ignore_eos``, each request's ``max_tokens`` exactly
   the tokens its constrained twin generated: both runs make the same tokens in the same batch
   shapes, so the difference is the mask's cost. (c) ``natural`` (once, for reference): no
   schema, no ``ignore_eos``, the same cap as (a). The order of (a) and (b) alternates between
   repeats (the twin of an odd repeat takes the token counts of the previous constrained run;
   the seeds make them the same, which is checked). Per run: wall time, output tokens, tokens/s,
   the mean decode step at the full batch (engine's own step times) and the ratio constrained /
   unconstrained tokens/s (target: >= 0.90), each repeat and the median. The schema's compile
   is outside the timed runs (a warm-up compiles it; figure 2 times it). The KV pool holds every
   request whole and the prefix cache is off, so that no run preempts and every run prefills
   the same tokens (preemptions are recorded). Every constrained output is checked:
   ``json.loads`` and ``jsonschema.validate``; the bench exits 1 if one that ended with
   ``stop`` does not validate (one cut by ``length`` is counted, not failed).
2. Compile time, on a fresh ``Grammars`` (the replica's cache): its TokenizerInfo and compiler
   (made on the first compile) apart, the schema's first compile, the same schema again (a
   cache hit: ``compiled`` stays 1), a matcher per request, and a regex, a choice and an EBNF
   grammar.
3. The mask at the full batch: ``rows`` (= min(N, max_num_seqs), 64 by default) live matchers,
   each advanced along a constrained output to its own position (spread over the output) and
   one token further every iteration; per iteration the fill (a bitmask for the rows, each
   matcher's row) and the apply (``xgrammar.apply_token_bitmask_inplace`` on ``[rows, vocab]``
   fp32 logits) timed apart, then ``apply_constraints`` whole; the mean as a share of the mean
   full-batch decode step of the constrained run.
4. xgrammar against llguidance on this tokenizer: tokenizer wrapping, the schema's compile, a
   matcher per request, and the mask per token of one row averaged over every token of valid
   outputs (the constrained outputs that validated; where none did, e.g. a short smoke run,
   records built by ``example_record``), and at how many positions the two masks are the
   same. Both allow any JSON whitespace, at most 16 characters in a row (xgrammar as the replica
   compiles it; llguidance through its ``whitespace_pattern``). Where the masks differ, the
   libraries do: llguidance allows only the canonical token of a property name the schema
   forces, xgrammar any token that starts it; inside strings xgrammar allows the tokenizer's
   added special tokens as text and llguidance the backslash escapes (under ``maxLength``)
   that xgrammar does not.

Output: the progress, then a markdown table of every figure; ``structured.json`` (the figures
and the machine: CPU model, cores, torch version and threads, load average before and after,
library versions) and ``structured.png`` (tokens/s constrained vs unconstrained per repeat) in
``--out-dir``. Nothing but the validation fails a run: the machine may be shared, so compare
figures of one run only.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tierserve.cluster.measure import load_avg_1m, machine, percentile, pyplot
from tierserve.records import GenerateRequest, SamplingParams, StructuredOutput

TARGET_RATIO = 0.90  # constrained tokens/s over unconstrained, at least
TEMPERATURE = 0.7
PROMPT_BOUND = 192  # tokens a chat prompt takes at most (sizes the KV pool; checked)

SUBJECTS = (
    "Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Sydney", "Toronto", "Mumbai", "Berlin",
    "Nairobi", "Santiago", "Hanoi", "Madrid", "Seoul", "Istanbul", "Bogota", "Vienna", "Dakar",
    "Jakarta", "Chicago", "Prague", "Auckland", "Lisbon", "Havana", "Kyoto", "Accra", "Dublin",
    "Manila", "Quito", "Warsaw", "Tunis", "Montreal", "Athens", "Bangkok", "Reykjavik", "Cusco",
    "Marrakesh", "Helsinki", "Shanghai", "Melbourne", "Amsterdam", "Karachi", "Budapest",
    "Casablanca", "Vancouver", "Rome", "Kathmandu", "Zanzibar", "Edinburgh", "Singapore",
    "Buenos Aires", "Stockholm", "Beirut", "Hobart", "Florence", "Addis Ababa", "Montevideo",
    "Copenhagen", "Osaka", "Kraków", "Seville", "Valparaiso", "Tbilisi",
)

CONTINENTS = ("Africa", "Asia", "Europe", "North America", "Oceania", "South America")
CLIMATES = ("tropical", "dry", "temperate", "continental", "polar")
LANDMARK_KINDS = ("museum", "monument", "park", "building", "other")
FIELDS = ("name", "country", "continent", "population", "founded", "is_capital", "climate",
          "landmarks", "languages")

# A record of typical size: 9 required fields, enums, integer ranges, a boolean, bounded strings,
# an array of objects and one of strings (both with maxItems), no other properties.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "continent": {"enum": list(CONTINENTS)},
        "population": {"type": "integer", "minimum": 0, "maximum": 40_000_000},
        "founded": {"type": "integer", "minimum": -3000, "maximum": 2025},
        "is_capital": {"type": "boolean"},
        "climate": {"enum": list(CLIMATES)},
        "landmarks": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "kind": {"enum": list(LANDMARK_KINDS)},
                },
                "required": ["name", "kind"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "languages": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": list(FIELDS),
    "additionalProperties": False,
}

# The other kinds figure 2 compiles.
REGEX = r"[A-Z][a-z]{1,15}, [A-Z]{2} [0-9]{5}(-[0-9]{4})?"
CHOICES = ["tropical", "dry", "temperate", "continental", "polar", "mediterranean"]
EBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+ ("." [0-9]+)?"""


def json_spec() -> StructuredOutput:
    """``SCHEMA`` as a request asks for it (any whitespace, the replica's default)."""
    return StructuredOutput("json", json.dumps(SCHEMA))


def other_specs() -> dict[str, StructuredOutput]:
    return {
        "regex": StructuredOutput("regex", REGEX),
        "choice": StructuredOutput("choice", json.dumps(CHOICES)),
        "grammar": StructuredOutput("grammar", EBNF),
    }


# ------------------------------------------------------------------------------ pure helpers


def subject(i: int) -> str:
    """Request ``i``'s city (the list cycles past its end)."""
    return SUBJECTS[i % len(SUBJECTS)]


def user_message(city: str) -> str:
    return (f"Describe the city of {city} as JSON with the keys {', '.join(FIELDS)}. "
            "landmarks: up to 3 objects with a name and a kind; languages: up to 3. "
            "Answer with the JSON object only.")


def example_record(city: str) -> dict[str, Any]:
    """A record that matches ``SCHEMA`` (the library comparison walks such records when no
    generated output is complete); its values are placeholders, not facts."""
    seed = sum(ord(c) for c in city)
    return {
        "name": city[:40],
        "country": "Country of " + city[:20],
        "continent": CONTINENTS[seed % len(CONTINENTS)],
        "population": 10_000 + seed * 997,
        "founded": 500 + seed % 1500,
        "is_capital": seed % 2 == 0,
        "climate": CLIMATES[seed % len(CLIMATES)],
        "landmarks": [{"name": f"{city[:30]} Museum", "kind": "museum"},
                      {"name": f"Old Town of {city[:25]}", "kind": "other"}],
        "languages": ["English", "Local"][: 1 + seed % 2],
    }


@dataclass
class Validation:
    """What the constrained outputs of one run were: how many parsed as JSON, how many matched
    the schema, their finish reasons, and the indices of those that ended with ``stop`` yet do
    not match (the failures)."""

    total: int = 0
    parsed: int = 0
    valid: int = 0
    finish: dict[str, int] = field(default_factory=dict)
    failures: list[int] = field(default_factory=list)
    first_error: str = ""
    valid_ids: list[int] = field(default_factory=list)


def validate_outputs(texts: Sequence[str], reasons: Sequence[str | None],
                     schema: dict[str, Any]) -> Validation:
    """Check every output against ``schema`` (``json.loads``, then ``jsonschema.validate``)."""
    import jsonschema

    v = Validation(total=len(texts), finish=dict(Counter(str(r) for r in reasons)))
    for i, (text, reason) in enumerate(zip(texts, reasons, strict=True)):
        error = ""
        try:
            value = json.loads(text)
        except ValueError as e:
            error = f"output {i} is not JSON: {e}"
        else:
            v.parsed += 1
            try:
                jsonschema.validate(value, schema)
            except jsonschema.ValidationError as e:
                error = f"output {i} does not match the schema: {e.message}"
            else:
                v.valid += 1
                v.valid_ids.append(i)
        if error and reason == "stop":
            v.failures.append(i)
            v.first_error = v.first_error or error
    return v


def twin_params(counts: Sequence[int], seed: int, temperature: float = TEMPERATURE
                ) -> list[SamplingParams]:
    """The unconstrained twins of constrained requests that generated ``counts`` tokens: the
    same seeds, EOS ignored, exactly that many tokens each."""
    return [SamplingParams(max_tokens=max(c, 1), temperature=temperature, seed=seed + i,
                           ignore_eos=True) for i, c in enumerate(counts)]


def kv_blocks(requests: int, max_tokens: int, block_size: int,
              prompt_bound: int = PROMPT_BOUND) -> int:
    """KV blocks that hold every request whole at once (prompt, generated tokens and the one
    position past them), plus one spare block per request."""
    per = -(-(prompt_bound + max_tokens + 1) // block_size)
    return requests * (per + 1)


def median(values: Sequence[float]) -> float:
    xs = [v for v in values if not math.isnan(v)]
    return statistics.median(xs) if xs else math.nan


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def markdown_table(rows: Sequence[tuple[str, str, str]]) -> str:
    """``rows`` of (section, figure, value) as a markdown table."""
    head = ["| section | figure | value |", "|---|---|---|"]
    return "\n".join(head + [f"| {s} | {f} | {v} |" for s, f, v in rows])


def fmt(x: float, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if isinstance(x, float) and math.isnan(x) else f"{x:{spec}}{unit}"


# ------------------------------------------------------------------------ 1. the throughput


class StepLog:
    """The engine's observer for one run: every step's own time and scheduled tokens."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int]] = []

    def step_done(self, duration_s: float, tokens: int, preempted: int) -> None:
        self.steps.append((duration_s, tokens))

    def request_done(self, times: Any) -> None:
        pass

    def rejected(self, reason: str, tier: str) -> None:
        pass

    def grammar_compiled(self, kind: str, seconds: float) -> None:
        pass

    def grammar_lookup(self, hit: bool) -> None:
        pass


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


@dataclass
class Run:
    """One timed run of N requests."""

    label: str  # constrained, unconstrained (the twin), natural
    repeat: int
    order: int  # 0: first of its repeat
    requests: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    steps: int
    full_batch_rows: int
    full_batch_steps: int  # decode-only steps with every row of the full batch
    full_batch_step_ms: float  # their mean step time (the engine's own)
    forward_share: float  # of the run's step time, the model forward
    preemptions: int
    finish: dict[str, int]


def run_batch(engine: Any, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
              label: str, repeat: int, order: int, full_rows: int
              ) -> tuple[Run, list[Completion]]:
    """Submit every request at once and step the engine until all are done."""
    for ids, sp in zip(prompts, params, strict=True):  # compiles the grammar (a hit): untimed
        engine.validate(GenerateRequest.of(ids, sp))
    steps = StepLog()
    engine.observer = steps
    pre = engine.stats().preemptions
    fwd0, tot0 = engine.times.forward_s, engine.times.total_s
    outs = [Completion() for _ in prompts]
    index: dict[int, int] = {}
    samples: list[int] = []  # rows sampled per step
    done = 0
    try:
        t0 = time.perf_counter()
        for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
            index[engine.add_request(GenerateRequest.of(ids, sp), stream_text=False,
                                     validated=True)] = i
        while done < len(prompts):
            deltas = engine.step()
            if not deltas and not engine.has_unfinished():
                raise RuntimeError(f"{label}: the engine stopped with {len(prompts) - done} "
                                   "requests unanswered")
            samples.append(len(deltas))
            for d in deltas:
                o = outs[index[d.request_id]]
                o.token_ids.extend(d.token_ids)
                o.text += d.text
                if d.finished:
                    o.finish_reason = d.finish_reason
                    done += 1
        wall = time.perf_counter() - t0
    finally:
        engine.observer = None
    # A decode-only step samples one row per scheduled token (a prefill chunk schedules more).
    full = [s for (s, tokens), rows in zip(steps.steps, samples, strict=True)
            if tokens == rows == full_rows]
    total = engine.times.total_s - tot0
    tokens = sum(len(o.token_ids) for o in outs)
    run = Run(
        label=label, repeat=repeat, order=order, requests=len(prompts), wall_s=wall,
        output_tokens=tokens, tokens_per_s=tokens / wall, steps=len(steps.steps),
        full_batch_rows=full_rows, full_batch_steps=len(full),
        full_batch_step_ms=mean(full) * 1e3,
        forward_share=ratio(engine.times.forward_s - fwd0, total),
        preemptions=engine.stats().preemptions - pre,
        finish=dict(Counter(str(o.finish_reason) for o in outs)),
    )
    return run, outs


def print_run(r: Run, log: Callable[[str], None]) -> None:
    log(f"  repeat {r.repeat} {r.label:>13}: {r.wall_s:7.2f} s, {r.output_tokens:6d} tokens, "
        f"{r.tokens_per_s:7.1f} tok/s, {r.steps} steps, decode step at {r.full_batch_rows} rows "
        f"{fmt(r.full_batch_step_ms)} ms ({r.full_batch_steps} steps), forward "
        f"{fmt(r.forward_share * 100, '.0f')}%, preemptions {r.preemptions}, finish {r.finish}")


# ---------------------------------------------------------------------------- 2. compile time


def measure_compile(engine: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """Compile times on a fresh ``Grammars`` (a replica's cache), in seconds."""
    t0 = time.perf_counter()
    import xgrammar  # noqa: F401  (its import, apart from the figures below)

    import_s = time.perf_counter() - t0
    from tierserve.replica.structured import Grammars

    g = Grammars(engine.tokenizer, engine.vocab_size, sorted(engine.eos_ids))
    try:
        clock = time.perf_counter
        t0 = clock()
        g._compiler_of()  # the TokenizerInfo and the compiler, made on the first compile
        tokenizer_info_s = clock() - t0
        spec = json_spec()
        t0 = clock()
        g.compile(spec)
        first_s = clock() - t0
        t0 = clock()
        g.compile(spec)
        hit_s = clock() - t0
        hit_compiled = g.compiled
        matcher_s = []
        for _ in range(20):
            t0 = clock()
            g.constraint(spec)
            matcher_s.append(clock() - t0)
        others: dict[str, float] = {}
        for kind, other in other_specs().items():
            t0 = clock()
            g.compile(other)
            others[kind] = clock() - t0
    finally:
        g.shutdown()
    result = {
        "xgrammar_import_s": import_s,
        "tokenizer_info_s": tokenizer_info_s,
        "json_first_s": first_s,
        "json_hit_s": hit_s,
        "compiled_after_hit": hit_compiled,
        "matcher_per_request_s": median(matcher_s),
        **{f"{kind}_s": s for kind, s in others.items()},
    }
    log(f"  import xgrammar {import_s * 1e3:.0f} ms; TokenizerInfo + compiler {tokenizer_info_s * 1e3:.1f} ms; schema first compile "
        f"{first_s * 1e3:.1f} ms, again {hit_s * 1e6:.0f} us (compiled = {hit_compiled}); "
        f"matcher {median(matcher_s) * 1e6:.0f} us; "
        + ", ".join(f"{k} {s * 1e3:.1f} ms" for k, s in others.items()))
    return result


# ------------------------------------------------------------------------ 3. the mask per step


def measure_mask(engine: Any, sequences: Sequence[list[int]], rows: int, iters: int,
                 log: Callable[[str], None]) -> dict[str, Any]:
    """The mask of ``rows`` live matchers per step: fill and apply apart, then
    ``apply_constraints`` whole, in seconds (means over ``iters`` steps)."""
    import torch
    import xgrammar as xgr

    from tierserve.replica.constraint import apply_constraints

    spec = json_spec()
    vocab = engine.vocab_size
    constraints = [engine.grammars.constraint(spec) for _ in range(rows)]
    seqs = [list(s) for s in sequences if s]
    if not seqs:
        raise ValueError("the mask timing needs at least one accepted token sequence")
    # Row r walks sequence r mod len(seqs), starting at its own position (spread over it).
    walk: list[tuple[list[int], int]] = []
    for r, c in enumerate(constraints):
        seq = seqs[r % len(seqs)]
        start = (r * 7919) % len(seq)
        for tok in seq[:start]:
            if not c.accept(tok):
                raise RuntimeError(f"row {r}: the grammar refused a token of its own output")
        walk.append((seq, start))
    row_ids = list(range(rows))
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(rows, vocab, generator=gen)
    fill_s: list[float] = []
    apply_s: list[float] = []
    whole_s: list[float] = []
    allowed: list[float] = []
    clock = time.perf_counter
    for it in range(iters):
        logits = base.clone()
        t0 = clock()
        bitmask = xgr.allocate_token_bitmask(rows, vocab)
        for r, c in enumerate(constraints):
            c.fill(bitmask, r)
        t1 = clock()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=row_ids)
        t2 = clock()
        again = base.clone()
        t3 = clock()
        apply_constraints(again, row_ids, constraints)
        t4 = clock()
        if it == 0 and not torch.equal(logits, again):
            raise RuntimeError("apply_constraints masked otherwise than fill + apply")
        fill_s.append(t1 - t0)
        apply_s.append(t2 - t1)
        whole_s.append(t4 - t3)
        allowed.append(float(torch.isfinite(logits).sum()) / rows)
        for r, c in enumerate(constraints):  # one token further (back to the start at its end)
            seq, pos = walk[r]
            if pos + 1 >= len(seq) or c.terminated:
                c.matcher.reset()
                walk[r] = (seq, 0)
            else:
                c.accept(seq[pos])
                walk[r] = (seq, pos + 1)
    result = {
        "rows": rows,
        "iters": iters,
        "fill_s": mean(fill_s),
        "apply_s": mean(apply_s),
        "apply_constraints_s": mean(whole_s),
        "apply_constraints_p99_s": percentile(whole_s, 99),
        "fill_per_row_s": mean(fill_s) / rows,
        "allowed_tokens_per_row": mean(allowed),
    }
    log(f"  {rows} rows: fill {result['fill_s'] * 1e3:.3f} ms "
        f"({result['fill_per_row_s'] * 1e6:.1f} us/row), apply {result['apply_s'] * 1e3:.3f} ms, "
        f"apply_constraints {result['apply_constraints_s'] * 1e3:.3f} ms "
        f"(p99 {result['apply_constraints_p99_s'] * 1e3:.3f}); "
        f"{result['allowed_tokens_per_row']:.0f} tokens allowed per row on average")
    return result


# ------------------------------------------------------------------ 4. xgrammar vs llguidance


def measure_libraries(tokenizer: Any, vocab: int, stop_ids: Sequence[int],
                      sequences: Sequence[list[int]], log: Callable[[str], None]
                      ) -> dict[str, Any]:
    """Both libraries on the same tokenizer, schema and token sequences, in seconds."""
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    import torch
    import xgrammar as xgr

    from tierserve.replica.structured import MAX_WHITESPACE

    clock = time.perf_counter
    text = json.dumps(SCHEMA)
    t0 = clock()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab,
                                              stop_token_ids=list(stop_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    x_tok_s = clock() - t0
    t0 = clock()
    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(stop_ids))
    l_tok_s = clock() - t0
    t0 = clock()
    x_grammar = xgr.Grammar.from_json_schema(text, any_whitespace=True, strict_mode=False,
                                             max_whitespace_cnt=MAX_WHITESPACE)
    compiled = compiler.compile_grammar(x_grammar)
    x_compile_s = clock() - t0
    t0 = clock()
    # Whitespace bounded as xgrammar's (its default is unbounded): the same language.
    l_grammar = llguidance.LLMatcher.grammar_from_json_schema(
        text, overrides={"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}"})
    first = llguidance.LLMatcher(ll_tok, l_grammar)
    l_compile_s = clock() - t0
    if first.is_error():
        raise RuntimeError(f"llguidance refused the schema: {first.get_error()}")
    x_matcher_s: list[float] = []
    l_matcher_s: list[float] = []
    for _ in range(20):
        t0 = clock()
        xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids))
        t1 = clock()
        llguidance.LLMatcher(ll_tok, l_grammar)
        l_matcher_s.append(clock() - t1)
        x_matcher_s.append(t1 - t0)

    x_mask: list[float] = []
    l_mask: list[float] = []
    x_accept: list[float] = []
    l_accept: list[float] = []
    agree = 0
    refused: list[str] = []
    x_bits = xgr.allocate_token_bitmask(1, vocab)
    l_bits = llt.allocate_token_bitmask(1, vocab)
    for n, seq in enumerate(sequences):
        xm = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids))
        lm = llguidance.LLMatcher(ll_tok, l_grammar)
        for tok in seq:
            t0 = clock()
            xm.fill_next_token_bitmask(x_bits, 0)
            t1 = clock()
            llt.fill_next_token_bitmask(lm, l_bits, 0)
            t2 = clock()
            x_ok = xm.accept_token(tok)
            t3 = clock()
            l_ok = lm.consume_token(tok)
            t4 = clock()
            x_mask.append(t1 - t0)
            l_mask.append(t2 - t1)
            x_accept.append(t3 - t2)
            l_accept.append(t4 - t3)
            agree += bool(torch.equal(x_bits, l_bits))
            if not (x_ok and l_ok) or lm.is_error():
                refused.append(f"sequence {n}, token {tok}: xgrammar {'accepts' if x_ok else 'refuses'}, "
                               f"llguidance {'accepts' if l_ok else 'refuses'} "
                               f"{lm.get_error() or ''}".strip())
                break
    positions = len(x_mask)
    x: dict[str, float] = {
        "tokenizer_s": x_tok_s,
        "compile_s": x_compile_s,
        "matcher_per_request_s": median(x_matcher_s),
        "mask_per_token_s": mean(x_mask),
        "mask_p50_s": percentile(x_mask, 50),
        "mask_p99_s": percentile(x_mask, 99),
        "accept_per_token_s": mean(x_accept),
    }
    lg: dict[str, float] = {
        "tokenizer_s": l_tok_s,
        "compile_s": l_compile_s,
        "matcher_per_request_s": median(l_matcher_s),
        "mask_per_token_s": mean(l_mask),
        "mask_p50_s": percentile(l_mask, 50),
        "mask_p99_s": percentile(l_mask, 99),
        "accept_per_token_s": mean(l_accept),
    }
    result: dict[str, Any] = {
        "sequences": len(sequences),
        "positions": positions,
        "xgrammar": x,
        "llguidance": lg,
        "masks_agree": agree,
        "refused": refused,
    }
    result["mask_ratio_llguidance_over_xgrammar"] = ratio(lg["mask_per_token_s"],
                                                          x["mask_per_token_s"])
    result["compile_ratio_llguidance_over_xgrammar"] = ratio(lg["compile_s"], x["compile_s"])
    for name, r in (("xgrammar", x), ("llguidance", lg)):
        log(f"  {name:>10}: tokenizer {r['tokenizer_s'] * 1e3:.0f} ms, compile "
            f"{r['compile_s'] * 1e3:.1f} ms, matcher {r['matcher_per_request_s'] * 1e6:.0f} us, "
            f"mask {r['mask_per_token_s'] * 1e6:.1f} us/token (p50 {r['mask_p50_s'] * 1e6:.1f}, "
            f"p99 {r['mask_p99_s'] * 1e6:.1f}), accept {r['accept_per_token_s'] * 1e6:.1f} us")
    log(f"  over {positions} positions of {len(sequences)} outputs: llguidance/xgrammar mask "
        f"{result['mask_ratio_llguidance_over_xgrammar']:.2f}x, compile "
        f"{result['compile_ratio_llguidance_over_xgrammar']:.3f}x; masks identical at "
        f"{agree}/{positions} positions" + (f"; refused: {refused}" if refused else ""))
    return result


# ------------------------------------------------------------------------------ the report


def figures_table(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    m = report["machine"]
    rows.append(("machine", "cpu", f"{m['cpu']}, {m['cores_usable']}/{m['cores']} cores, "
                 f"torch {m.get('torch', '?')} ({m.get('torch_threads', '?')} threads)"))
    rows.append(("machine", "load average 1 min before / after",
                 f"{m['load_avg_1m_before']:.2f} / {m.get('load_avg_1m_after', math.nan):.2f}"))
    cfg = report["config"]
    rows.append(("config", "requests / max_tokens / max_num_seqs",
                 f"{cfg['requests']} / {cfg['max_tokens']} / {cfg['max_num_seqs']}"))
    for r in report["runs"]:
        rows.append(("1 throughput", f"repeat {r['repeat']} {r['label']}",
                     f"{r['wall_s']:.2f} s, {r['output_tokens']} tokens, "
                     f"{r['tokens_per_s']:.1f} tok/s, step at {r['full_batch_rows']} rows "
                     f"{fmt(r['full_batch_step_ms'])} ms"))
    t = report["throughput"]
    for i, q in enumerate(t["ratios"]):
        rows.append(("1 throughput", f"repeat {i} constrained / unconstrained", f"{q:.3f}"))
    rows.append(("1 throughput", "median ratio (target >= 0.90)",
                 f"{fmt(t['median_ratio'], '.3f')} ({'met' if t['target_met'] else 'NOT met'})"))
    rows.append(("1 throughput", "constrained step - unconstrained step (median)",
                 f"{fmt(t['step_delta_ms'], '.3f')} ms"))
    for i, v in enumerate(report["validation"]):
        rows.append(("1 validation", f"repeat {i}",
                     f"{v['parsed']}/{v['total']} parsed, {v['valid']}/{v['total']} valid, "
                     f"finish {v['finish']}, stop-but-invalid {len(v['failures'])}"))
    c = report["compile"]
    rows.append(("2 compile", "TokenizerInfo + compiler", f"{c['tokenizer_info_s'] * 1e3:.1f} ms"))
    rows.append(("2 compile", "schema, first", f"{c['json_first_s'] * 1e3:.1f} ms"))
    rows.append(("2 compile", "schema, again (cache hit)",
                 f"{c['json_hit_s'] * 1e6:.0f} us, compiled = {c['compiled_after_hit']}"))
    rows.append(("2 compile", "matcher per request", f"{c['matcher_per_request_s'] * 1e6:.0f} us"))
    for kind in other_specs():
        rows.append(("2 compile", kind, f"{c[f'{kind}_s'] * 1e3:.1f} ms"))
    k = report["mask"]
    rows.append(("3 mask", f"fill, {k['rows']} rows", f"{k['fill_s'] * 1e3:.3f} ms"))
    rows.append(("3 mask", f"apply, {k['rows']} rows", f"{k['apply_s'] * 1e3:.3f} ms"))
    rows.append(("3 mask", "apply_constraints", f"{k['apply_constraints_s'] * 1e3:.3f} ms"))
    rows.append(("3 mask", f"decode step at {k['rows']} rows (constrained, median)",
                 f"{fmt(k['step_ms'])} ms"))
    rows.append(("3 mask", "share of the step", fmt(k["share"] * 100, ".1f", "%")))
    lib = report["libraries"]
    for name in ("xgrammar", "llguidance"):
        r = lib[name]
        rows.append((f"4 {name}", "tokenizer / compile / matcher",
                     f"{r['tokenizer_s'] * 1e3:.0f} ms / {r['compile_s'] * 1e3:.1f} ms / "
                     f"{r['matcher_per_request_s'] * 1e6:.0f} us"))
        rows.append((f"4 {name}", "mask per token (mean, p99)",
                     f"{r['mask_per_token_s'] * 1e6:.1f} us, {r['mask_p99_s'] * 1e6:.1f} us"))
    rows.append(("4 libraries", "llguidance / xgrammar mask",
                 f"{lib['mask_ratio_llguidance_over_xgrammar']:.2f}x over {lib['positions']} "
                 f"positions ({lib['source']})"))
    rows.append(("4 libraries", "llguidance / xgrammar compile",
                 f"{lib['compile_ratio_llguidance_over_xgrammar']:.3f}x"))
    rows.append(("4 libraries", "identical masks",
                 f"{lib['masks_agree']}/{lib['positions']}"))
    return rows


def plot(runs: Sequence[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    repeats = sorted({r["repeat"] for r in runs if r["label"] != "natural"})
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    width = 0.38
    for j, (label, colour) in enumerate((("constrained", "tab:blue"),
                                         ("unconstrained", "tab:orange"))):
        values = [next((r["tokens_per_s"] for r in runs
                        if r["repeat"] == k and r["label"] == label), 0.0) for k in repeats]
        xs = [k + (j - 0.5) * width for k in range(len(repeats))]
        bars = ax.bar(xs, values, width, label=label, color=colour)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    natural = [r for r in runs if r["label"] == "natural"]
    if natural:
        ax.axhline(natural[0]["tokens_per_s"], color="grey", linestyle="--",
                   label="natural (no schema, own lengths)")
    def tick(k: int) -> str:
        c = next((r["tokens_per_s"] for r in runs
                  if r["repeat"] == k and r["label"] == "constrained"), math.nan)
        u = next((r["tokens_per_s"] for r in runs
                  if r["repeat"] == k and r["label"] == "unconstrained"), math.nan)
        return f"repeat {k}\nratio {fmt(ratio(c, u), '.3f')}"

    ax.set_xticks(range(len(repeats)), [tick(k) for k in repeats])
    ax.margins(y=0.15)
    ax.set_ylabel("output tokens/s")
    n = runs[0]["requests"] if runs else 0
    ax.set_title(f"JSON schema mask: {n} concurrent requests, SmolLM2-135M on CPU")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def versions() -> dict[str, str]:
    out = {}
    for name in ("xgrammar", "llguidance", "transformers", "jsonschema"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


# ------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> tuple[dict[str, Any], int]:
    """Every figure; the exit status (1: a constrained output that ended with ``stop`` does not
    match its schema)."""
    from tierserve.replica.config import EngineConfig
    from tierserve.replica.llm import LLM

    n, max_tokens = args.requests, args.max_tokens
    block = EngineConfig().block_size
    t0 = time.perf_counter()
    llm = LLM(num_kv_blocks=kv_blocks(n, max_tokens, block), enable_prefix_caching=False,
              max_waiting=max(256, n))
    engine = llm.engine
    load_s = time.perf_counter() - t0
    info = machine()
    info.update(versions())
    cfg = engine.config
    full_rows = min(n, cfg.max_num_seqs)
    log("Structured outputs: a JSON schema's mask on the default model")
    log(f"machine: {info['cpu']}, {info['cores_usable']} usable of {info['cores']} cores, torch "
        f"{info.get('torch')} ({info.get('torch_threads')} threads, {info.get('capability')}), "
        f"xgrammar {info['xgrammar']}, llguidance {info['llguidance']}; load average "
        f"{info['load_avg_1m_before']:.2f}")
    log(f"model {cfg.model} loaded in {load_s:.1f} s; max_num_seqs {cfg.max_num_seqs} "
        + ("(>= requests: all run at once)" if cfg.max_num_seqs >= n else
           f"(< {n} requests: the rest wait for a seat)")
        + f"; {cfg.num_kv_blocks} KV blocks of {cfg.block_size}, prefix cache off")

    def chat(city: str) -> list[int]:
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message(city)}], add_generation_prompt=True,
            tokenize=False)
        return list(engine.tokenizer.encode(text, add_special_tokens=False))

    prompts = [chat(subject(i)) for i in range(n)]
    longest = max(len(p) for p in prompts)
    if longest > PROMPT_BOUND:
        raise RuntimeError(f"a prompt of {longest} tokens: raise PROMPT_BOUND ({PROMPT_BOUND})")
    spec = json_spec()
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE,
                                  seed=args.seed + i, structured=spec) for i in range(n)]

    log("\n2. compile time (a fresh Grammars)")
    compile_figures = measure_compile(engine, log)

    # Warm-up (untimed): the engine's own compile of the schema, the kernels at small batches.
    w = min(n, 4)
    run_batch(engine, prompts[:w], [dataclasses.replace(p, max_tokens=8) for p in constrained[:w]],
              "warm-up", -1, 0, w)
    run_batch(engine, prompts[:w], twin_params([8] * w, args.seed), "warm-up", -1, 1, w)

    log(f"\n1. throughput: {n} requests at once, up to {max_tokens} tokens, temperature "
        f"{TEMPERATURE}, seeds {args.seed}..{args.seed + n - 1}")
    runs: list[Run] = []
    validations: list[Validation] = []
    counts: list[int] | None = None
    changed: list[int] = []  # repeats whose constrained outputs differ from the previous ones
    first_outputs: list[Completion] | None = None
    for rep in range(args.repeats):
        order = ("constrained", "unconstrained") if rep % 2 == 0 else ("unconstrained",
                                                                       "constrained")
        for k, label in enumerate(order):
            if label == "constrained":
                r, outs = run_batch(engine, prompts, constrained, label, rep, k, full_rows)
                new_counts = [len(o.token_ids) for o in outs]
                if counts is not None and new_counts != counts:
                    changed.append(rep)
                    log(f"  note: repeat {rep}'s constrained outputs differ from the previous "
                        f"one's ({sum(new_counts)} tokens against {sum(counts)})")
                counts = new_counts
                first_outputs = first_outputs or outs
                v = validate_outputs([o.text for o in outs], [o.finish_reason for o in outs],
                                     SCHEMA)
                validations.append(v)
                log(f"  repeat {rep} validation: {v.parsed}/{v.total} parsed, {v.valid}/{v.total} "
                    f"valid, finish {v.finish}, stop-but-invalid {len(v.failures)}"
                    + (f" ({v.first_error})" if v.first_error else ""))
            else:
                assert counts is not None  # the first repeat runs constrained first
                r, _ = run_batch(engine, prompts, twin_params(counts, args.seed), label, rep, k,
                                 full_rows)
            runs.append(r)
            print_run(r, log)
    if not args.no_natural:
        natural = [SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE,
                                  seed=args.seed + i) for i in range(n)]
        r, _ = run_batch(engine, prompts, natural, "natural", 0, 2, full_rows)
        runs.append(r)
        print_run(r, log)

    def of(label: str, rep: int) -> Run:
        return next(x for x in runs if x.label == label and x.repeat == rep)

    ratios = [ratio(of("constrained", k).tokens_per_s, of("unconstrained", k).tokens_per_s)
              for k in range(args.repeats)]
    step_c = median([of("constrained", k).full_batch_step_ms for k in range(args.repeats)])
    step_u = median([of("unconstrained", k).full_batch_step_ms for k in range(args.repeats)])
    throughput = {
        "ratios": ratios,
        "median_ratio": median(ratios),
        "target_ratio": TARGET_RATIO,
        "target_met": median(ratios) >= TARGET_RATIO,
        "constrained_step_ms": step_c,
        "unconstrained_step_ms": step_u,
        "step_delta_ms": step_c - step_u,
        "outputs_changed_in_repeats": changed,
    }
    log("  constrained / unconstrained tokens/s: "
        + ", ".join(f"{q:.3f}" for q in ratios)
        + f"; median {median(ratios):.3f} (target >= {TARGET_RATIO}: "
        + ("met" if throughput["target_met"] else "NOT met") + ")")

    assert first_outputs is not None
    # Token sequences the grammar accepted: the constrained outputs of the first repeat.
    accepted = [o.token_ids for o in first_outputs if o.token_ids]
    log(f"\n3. the mask per step at {full_rows} rows")
    mask = measure_mask(engine, accepted, full_rows, args.mask_iters, log)
    mask["step_ms"] = step_c
    mask["share"] = ratio(mask["apply_constraints_s"] * 1e3, step_c)
    log(f"  apply_constraints is {fmt(mask['share'] * 100, '.1f', '%')} of the mean decode step "
        f"at {full_rows} rows ({fmt(step_c)} ms, constrained run); measured in the runs, the "
        f"constrained step takes {fmt(step_c - step_u, '.3f')} ms more than its twin's")

    log("\n4. xgrammar against llguidance on this tokenizer")
    valid_ids = [i for i in validations[0].valid_ids if first_outputs[i].finish_reason == "stop"]
    eos = sorted(engine.eos_ids)
    if valid_ids:
        source = "generated"
        walks = [first_outputs[i].token_ids for i in valid_ids[: args.lib_outputs]]
    else:
        source = "example records"
        walks = [list(engine.tokenizer.encode(json.dumps(example_record(subject(i)), indent=2),
                                              add_special_tokens=False)) + eos[:1]
                 for i in range(args.lib_outputs)]
    log(f"  walking {len(walks)} {source} outputs")
    libraries = measure_libraries(engine.tokenizer, engine.vocab_size, eos, walks, log)
    libraries["source"] = source
    info["load_avg_1m_after"] = load_avg_1m()

    failures = sum(len(v.failures) for v in validations)
    report: dict[str, Any] = {
        "machine": info,
        "config": {
            "model": cfg.model, "requests": n, "max_tokens": max_tokens,
            "repeats": args.repeats, "seed": args.seed, "temperature": TEMPERATURE,
            "max_num_seqs": cfg.max_num_seqs, "num_kv_blocks": cfg.num_kv_blocks,
            "block_size": cfg.block_size, "prefix_caching": cfg.enable_prefix_caching,
            "longest_prompt": longest, "load_s": load_s, "schema": SCHEMA,
        },
        "runs": [asdict(r) for r in runs],
        "throughput": throughput,
        "validation": [asdict(v) for v in validations],
        "compile": compile_figures,
        "mask": mask,
        "libraries": libraries,
        "failures": failures,
        # The first constrained run's outputs, for a look at what the model wrote.
        "outputs": [{"subject": subject(i), "finish_reason": o.finish_reason,
                     "tokens": len(o.token_ids), "text": o.text}
                    for i, o in enumerate(first_outputs)],
    }
    return report, 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests (default 64)")
    ap.add_argument("--max-tokens", type=int, default=256,
                    help="each constrained request's cap (default 256)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="constrained / unconstrained pairs, in alternating order (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="request i samples from seed + i")
    ap.add_argument("--out-dir", default="benchmarks/out/structured",
                    help="where structured.json and structured.png go")
    ap.add_argument("--mask-iters", type=int, default=100,
                    help="steps the mask timing walks (default 100)")
    ap.add_argument("--lib-outputs", type=int, default=8,
                    help="outputs the library comparison walks (default 8)")
    ap.add_argument("--no-natural", action="store_true",
                    help="leave out the reference run without schema nor ignore_eos")
    args = ap.parse_args(argv)
    for name in ("requests", "max_tokens", "repeats", "mask_iters", "lib_outputs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} takes 1 or more")
    report, status = run(args)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print("\n" + markdown_table(figures_table(report)))
    with open(out_dir / "structured.json", "w") as f:
        json.dump(report, f, indent=1)
    plot(report["runs"], out_dir / "structured.png")
    print(f"\nwrote {out_dir / 'structured.json'} and {out_dir / 'structured.png'}")
    if status:
        print(f"FAILED: {report['failures']} constrained outputs ended with stop and do not "
              "match the schema", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
