"""Sampling: logits processors, greedy, temperature, top-k, top-p, min-p, and a random generator
owned by each request; the log-probabilities clients ask for.

Per request, in this order: ``logit_bias`` added; the stop tokens masked until ``min_tokens``
tokens have been generated; every id outside ``allowed_token_ids`` masked, and the bad words
(``bad_words_ids``, vLLM's: a one-token word always, a longer one's last token when the output
ends with the rest of it); ``repetition_penalty`` (prompt and output tokens: a positive logit
divided by it, a negative one multiplied), ``frequency_penalty`` (times each token's count in
the output) and ``presence_penalty`` (once per token present) subtracted. (A masked logit is
-inf whatever the bias or penalties do to it, so the masks' place in the order changes
nothing.) Then greedy takes the argmax; otherwise the temperature divides, top-k, top-p and
min-p filter, and the token is drawn.

A request's token-id inputs are tensors built once, on the logits' device, at its first step:
a step applies each with one indexed op per row, so its cost does not grow with the lengths of
``stop_token_ids``, ``logit_bias`` or ``allowed_token_ids``.

Every random draw comes from the request's own ``torch.Generator`` and consumes the same amount of
randomness per token whatever else is in the batch, so a seeded request samples the same tokens
alone, in any batch, and across a preemption (the generator and the token counts stay with the
request). Every operation is per row, so a row's result does not depend on the other rows.

A structured output's grammar masks its row last (``tierserve.replica.structured``): the tokens
it does not allow next are set to -inf after the processors, before greedy or the draw, in one
bitmask for the batch's constrained rows (``tierserve.replica.constraint``); the drawn token advances the row's matcher.

Log-probabilities (``logprobs``) are those of the model's own distribution, the log-softmax of
the raw logits, before any processor or temperature (vLLM's default).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tierserve.records import MAX_LOGPROBS, SamplingParams, TokenLogprob
from tierserve.replica.constraint import TokenConstraint, apply_constraints

__all__ = [
    "MAX_LOGPROBS",
    "SamplerState",
    "SamplingParams",
    "TokenLogprob",
    "logit_bias_from_json",
    "sample",
    "token_logprobs",
]

@dataclass(slots=True)
class _Inputs:
    """A request's token-id inputs as tensors on the logits' device, built once (at its first
    processed step) so that a step applies each with one indexed op, whatever their length.

    ``bias_ids``/``bias_values``: ``logit_bias`` within the vocabulary; ``stop``: the ids
    ``min_tokens`` holds back; ``banned``: what is never drawn, a ``[vocab]`` bool mask when
    ``allowed_token_ids`` is given (every id outside it, and the single-token bad words), else
    the single-token bad words' ids. None: nothing of that kind."""

    vocab: int
    device: torch.device
    dtype: torch.dtype
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    stop: torch.Tensor | None = None
    banned: torch.Tensor | None = None


def _id_tensor(ids: Iterable[int], vocab: int, device: torch.device) -> torch.Tensor | None:
    kept = [t for t in ids if 0 <= t < vocab]
    return torch.tensor(kept, dtype=torch.int64, device=device) if kept else None


@dataclass(slots=True)
class SamplerState:
    """A request's sampling parameters, its own generator and what its processors remember:
    the tokens generated so far (counted per id for the penalties) and the prompt's ids. Kept
    across preemption, so a resumed request samples as if it had never stopped.

    The generator, the penalties' history and the token-id inputs (``logit_bias``, the
    ``min_tokens`` stop ids, ``allowed_token_ids`` and the single-token bad words) live on the
    device of the logits, created at the first step that needs them (seeded from
    ``params.seed`` or a random seed), once per request: nothing of a step crosses to the host
    but the sampled ids, and no step loops over a request's ids in Python. A multi-token bad
    word is matched on the host against the tail of the output, looked up by its output's
    last token.

    ``stop_ids``: the ids ``min_tokens`` holds back (EOS and ``stop_token_ids``).
    ``constraint``: the grammar of a structured output (None: unconstrained); ``rejected``: it
    refused a drawn token, ``rejected_token`` (cannot happen while its mask is applied; the
    engine ends such a request in an error rather than let it leave its grammar)."""

    params: SamplingParams
    prompt: Sequence[int] = ()
    stop_ids: Collection[int] = ()
    constraint: TokenConstraint | None = None
    rejected: bool = field(init=False, default=False)
    rejected_token: int | None = field(init=False, default=None)
    seed: int = field(init=False)
    generated: int = field(init=False, default=0)
    _generator: torch.Generator | None = field(init=False, default=None)
    # [vocab] per-id counts of generated tokens, and the ids of prompt and output (penalties
    # only; created at the first step, when the vocabulary and the device are known).
    counts: torch.Tensor | None = field(init=False, default=None)
    seen: torch.Tensor | None = field(init=False, default=None)
    _inputs: _Inputs | None = field(init=False, default=None)
    # Whether a processor applies at every step (penalties, bias, allowed ids, bad words).
    _always: bool = field(init=False, default=False)
    # Multi-token bad words: by the last token of their prefix, (the rest of the prefix, the
    # token banned after it); the output's last tokens, as many as the longest prefix.
    _bad_after: dict[int, list[tuple[tuple[int, ...], int]]] = field(init=False,
                                                                     default_factory=dict)
    _tail: list[int] = field(init=False, default_factory=list)
    _tail_len: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        p = self.params
        self.seed = p.seed if p.seed is not None else random.getrandbits(63)
        for word in p.bad_words_ids or ():
            if len(word) > 1:
                *prefix, banned = word
                self._bad_after.setdefault(prefix[-1], []).append((tuple(prefix[:-1]), banned))
                self._tail_len = max(self._tail_len, len(prefix))
        self._always = bool(p.penalized or p.logit_bias or p.allowed_token_ids
                            or p.bad_words_ids)

    def generator(self, device: torch.device) -> torch.Generator:
        """The request's own generator on ``device`` (the same stream whatever the batch)."""
        g = self._generator
        if g is None or g.device != device:
            if g is not None and self.generated:
                raise RuntimeError(f"a request's sampler moved from {g.device} to {device}")
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generator = g
        return g

    def record(self, token: int) -> None:
        """Account for a generated token (``sample`` calls it)."""
        self.generated += 1
        if self.constraint is not None and not self.rejected and not self.constraint.accept(token):
            self.rejected = True
            self.rejected_token = token
        if self.counts is not None and self.seen is not None:
            self.counts[token] += 1
            self.seen[token] = True
        if self._tail_len:
            self._tail.append(token)
            if len(self._tail) > 2 * self._tail_len:
                del self._tail[: -self._tail_len]

    def _history(self, vocab: int, device: torch.device | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None or self.seen is None:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = [t for t in self.prompt if 0 <= t < vocab]
            if ids:
                self.seen[torch.tensor(ids, dtype=torch.int64, device=device)] = True
        return self.counts, self.seen

    def inputs(self, logits: torch.Tensor) -> _Inputs:
        """The request's token-id inputs for ``logits`` ``[R, V]``, built at the first call
        (again only if the vocabulary, device or dtype changed)."""
        vocab, device, dtype = logits.shape[-1], logits.device, logits.dtype
        c = self._inputs
        if c is not None and c.vocab == vocab and c.device == device and c.dtype == dtype:
            return c
        p = self.params
        c = _Inputs(vocab, device, dtype)
        if p.logit_bias:
            bias = [(t, b) for t, b in p.logit_bias.items() if 0 <= t < vocab]
            if bias:
                c.bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.int64, device=device)
                c.bias_values = torch.tensor([b for _, b in bias], dtype=dtype, device=device)
        if p.min_tokens and self.stop_ids:
            c.stop = _id_tensor(self.stop_ids, vocab, device)
        single = _id_tensor((w[0] for w in p.bad_words_ids or () if len(w) == 1), vocab, device)
        if p.allowed_token_ids:
            banned = torch.ones(vocab, dtype=torch.bool, device=device)
            allowed = _id_tensor(p.allowed_token_ids, vocab, device)
            if allowed is not None:
                banned[allowed] = False
            if single is not None:
                banned[single] = True
            c.banned = banned
        else:
            c.banned = single
        self._inputs = c
        return c

    def bad_word_ends(self) -> list[int]:
        """The last tokens of the multi-token bad words whose other tokens end the output now
        (each masked at this step)."""
        tail = self._tail
        if not tail:
            return []
        found = []
        for prefix, banned in self._bad_after.get(tail[-1], ()):
            n = len(prefix)
            if n == 0 or (len(tail) > n and tail[-1 - n:-1] == list(prefix)):
                found.append(banned)
        return found

    @property
    def processed(self) -> bool:
        """Whether any logits processor applies at this step."""
        return self._always or bool(self.generated < self.params.min_tokens and self.stop_ids)


def sample(logits: torch.Tensor, states: Sequence[SamplerState]) -> list[int]:
    """One token per row of ``logits`` ``[R, V]`` (fp32, on any device; not modified); each
    state records its token."""
    if logits.shape[0] != len(states):
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(states)} sampler states")
    if not states:
        return []
    logits = logits.float()
    processed = [i for i, s in enumerate(states) if s.processed]
    constrained = [i for i, s in enumerate(states) if s.constraint is not None]
    if processed or constrained:
        logits = logits.clone()
    if processed:
        _process(logits, [states[i] for i in processed], processed)
    if constrained:
        apply_constraints(logits, constrained,
                          [c for i in constrained if (c := states[i].constraint) is not None])
    greedy = [s.params.greedy for s in states]
    if all(greedy):
        out = logits.argmax(dim=-1).tolist()
    else:
        out = logits.argmax(dim=-1).tolist() if any(greedy) else [0] * len(states)
        rows = [i for i, g in enumerate(greedy) if not g]
        picked = _draw(logits[rows] if len(rows) < len(states) else logits, [states[i] for i in rows])
        for j, i in enumerate(rows):
            out[i] = picked[j]
    for s, tok in zip(states, out, strict=True):
        s.record(tok)
    return out


def _process(logits: torch.Tensor, states: Sequence[SamplerState], rows: Sequence[int]) -> None:
    """Apply the logits processors of ``states`` to their ``rows`` of ``logits`` in place, each
    row from its request's cached inputs (``SamplerState.inputs``): the bias in one indexed
    add, the ``min_tokens`` stop ids and the banned ids (``allowed_token_ids``, single-token
    bad words) in one indexed fill each, the multi-token bad words that the output's tail
    completes, then the penalties from the request's history (all on the logits' device)."""
    vocab, device = logits.shape[1], logits.device
    ninf = float("-inf")
    for s, r in zip(states, rows, strict=True):
        p = s.params
        row = logits[r]
        c = s.inputs(logits)
        if c.bias_ids is not None and c.bias_values is not None:
            row.index_put_((c.bias_ids,), c.bias_values, accumulate=True)
        if c.stop is not None and s.generated < p.min_tokens:
            row.index_fill_(0, c.stop, ninf)
        if c.banned is not None:
            if c.banned.dtype == torch.bool:
                row.masked_fill_(c.banned, ninf)
            else:
                row.index_fill_(0, c.banned, ninf)
        if s._tail_len:
            for t in s.bad_word_ends():
                if 0 <= t < vocab:
                    row[t] = ninf
        if not p.penalized:
            continue
        counts, seen = s._history(vocab, device)
        if p.repetition_penalty != 1.0:
            rp = p.repetition_penalty
            row.copy_(torch.where(seen, torch.where(row > 0, row / rp, row * rp), row))
        if p.frequency_penalty:
            row.sub_(counts * p.frequency_penalty)
        if p.presence_penalty:
            row.sub_((counts > 0).float() * p.presence_penalty)


def _draw(x: torch.Tensor, states: Sequence[SamplerState]) -> list[int]:
    """Sample one token per row of processed logits ``x`` (non-greedy rows), on its device."""
    params = [s.params for s in states]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=x.device)
    x = x / temps.unsqueeze(1)
    x = _filter_top_k_top_p(x, params)
    probs = x.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
        floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)  # the most likely token always stays
    # Exponential race (Gumbel-max in another form): argmax(p / E) with E ~ Exp(1) draws from p.
    # Each request draws V variates from its own generator on the device, so its stream does
    # not depend on the batch.
    noise = torch.empty(probs.shape, dtype=torch.float32, device=probs.device)
    for j, s in enumerate(states):
        noise[j].exponential_(generator=s.generator(probs.device))
    picked: list[int] = (probs / noise).argmax(dim=-1).tolist()
    return picked


def _filter_top_k_top_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p sets to -inf."""
    ks = [p.top_k if p.top_k > 0 else 0 for p in params]
    ps = [p.top_p for p in params]
    if not any(ks) and all(p >= 1.0 for p in ps):
        return x
    vocab = x.shape[1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_x, dtype=torch.bool)
    if any(ks):
        k = torch.tensor([min(k, vocab) if k else vocab for k in ks], device=x.device)
        ranks = torch.arange(vocab, device=x.device).unsqueeze(0)
        keep &= ranks < k.unsqueeze(1)
    if any(p < 1.0 for p in ps):
        masked = sorted_x.masked_fill(~keep, float("-inf"))
        probs = masked.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        top_p = torch.tensor(ps, dtype=probs.dtype, device=x.device).unsqueeze(1)
        keep &= before < top_p  # the first token is always kept
    filtered = sorted_x.masked_fill(~keep, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, filtered)


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], ks: Sequence[int]
) -> list[TokenLogprob]:
    """For each row of raw ``logits`` ``[R, V]``: the log-probability of ``tokens[r]``, its rank
    (1 + the tokens more likely than it) and the ``ks[r]`` most likely tokens (the model's own
    distribution)."""
    if logits.shape[0] != len(tokens) or len(tokens) != len(ks):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(tokens)} tokens")
    if not tokens:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device).unsqueeze(1))
    rank = (logp > chosen).sum(dim=-1) + 1
    k = max(ks)
    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    chosen_l, rank_l = chosen.squeeze(1).tolist(), rank.tolist()
    top_vl, top_il = top_v.tolist(), top_i.tolist()
    return [
        TokenLogprob(tokens[r], chosen_l[r],
                     tuple(zip(top_il[r][: ks[r]], top_vl[r][: ks[r]], strict=True)),
                     rank=rank_l[r])
        for r in range(len(tokens))
    ]


def logit_bias_from_json(bias: Mapping[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) as ``SamplingParams`` takes it;
    a key that is not an integer is a ``ValueError`` naming it."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        out[tok] = float(value)
    return out
