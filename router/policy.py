"""The ranking: which replica should take this request. Pure and Ray-free.

A replica's report (``RoutingStats``) is a snapshot taken at ``report_time``. Requests this router
sent it after that moment are not in the snapshot, so they are added to it ("unseen" charges);
requests sent before it are already counted by the replica (running ones in ``free_blocks`` and
``committed_blocks``, waiting ones in ``waiting_blocks``) and are not counted twice.

Prefix hits: ``ReplicaLoad.prefix_hits`` is how many of the request's leading prompt blocks the
router believes the replica has cached (``tierserve.router.prefix_index``). Those positions cost no prefill
there and their blocks are shared, so the request's charge on that replica (``need``, ``full``)
and its own prefill work (``uncached`` tokens) shrink by them.

Two rankings, by the request's kind:

- Latency (``RequestShape.latency``: the ingress marks the top tier's requests, their priority
  reaching that tier's base priority): the replica where the first token comes soonest. First
  those whose free blocks (less what was sent since the report) hold the prompt now; then the
  least prefill work before this request's first token, in tokens: the queue's (the waiting
  queue's blocks plus the unseen charges: a long prompt admitted in the same step delays
  everyone's first token, and a request that has to wait for blocks waits for decodes to finish)
  plus the request's own uncached positions, so a cached system prompt weighs against a queue;
  then the most free blocks. Where the replica's SLO-aware steps let a request of the strictest
  target pass the lower tiers' queue (``RoutingStats.slo_steps``), only the prompts of its own
  target are ahead of it: the reported ``target_prefill`` and the latency requests sent since
  (``target_work``).
- Throughput (lower priorities): the replica that can take the whole request without
  preempting anyone and has the least of this router's work. First those whose committed blocks
  (every unfinished request at its full ``max_tokens``, plus the unseen charges at theirs) leave
  room for this request at its full length; then, when prefix affinity applies, the most cached
  positions; then the fewest requests outstanding from this router; then the most room.
  Spreading requests by count and never overcommitting a pool is what keeps preemptions down.
  Prefix affinity applies when the best replica has at least ``Affinity.min_hit_fraction`` of the
  prompt cached (a few shared blocks are not worth a queue) and the replicas are balanced.

Balance: the replicas that can take the request are imbalanced when the most loaded one has more
than ``Affinity.balance_abs`` requests outstanding beyond the least loaded one and more than
``Affinity.balance_rel`` times its count. Then both rankings fall back to load alone (prefix hits
only break ties): affinity must not pile a popular prefix onto one replica while others idle.

LoRA adapters (``RequestShape.lora``: the request's adapter's key, ``LoRARequest.key``, its
name and id; None for the base model): a
replica holds an adapter when its last report lists it loaded (``RoutingStats.lora_adapters``)
or this router sent it a request of that adapter since the report (an unseen charge's
``Charge.lora``: the replica loads it on first use). Where it does not, the request would pay
the load first: ``Affinity.adapter_load_tokens`` prefill positions, added to the prefill ahead
of it in the latency ranking and, in the throughput ranking, a tie-break after the requests
outstanding (a replica holding the adapter wins between equally loaded ones). Imbalanced, both
rankings leave it to break ties after the prefix hits, as the balance rule wants: affinity must
not pile one tenant's adapter onto one replica while others idle. A replica whose report says
it serves no adapters (``RoutingStats.max_loras`` 0 and none loaded) would refuse an adapter's
request: it ranks last for one, below a failed one. A base-model request's ranking is what it
was without adapters (no load, no such replica).

A replica that has not reported yet while another has (one that autoscaling or a restart just
added) ranks after every reported one: its pool and room are not known until it reports, so a
burst is not sent to it on a guess; only a replica whose engine has failed ranks below it.
Before any replica
has reported, each is assumed to be as large as the others, minus everything this router has
sent it: this falls back to "fewest blocks outstanding from this router".
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tierserve.arith import ceil_div
from tierserve.records import DEFAULT_BLOCK_SIZE, GenerateRequest, RoutingStats

K = TypeVar("K", bound=Hashable)


# A tier's requests gather on a replica already keeping their target while it holds fewer than
# this many of them: beyond, they spread (a replica's step carries only so many within a limit).
GATHER_MAX = 4
# A latency request gathers there only while the prompts of its target ahead of it take less
# than this many seconds at the rate the replica reports for them (``target_prefill_per_s``):
# beyond, the first token comes sooner on a replica that would have to start keeping the target.
GATHER_PREFILL_S = 0.5


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` positions."""
    return ceil_div(max(tokens, 0), block_size)


def charge_blocks(prompt_tokens: int, block_size: int) -> int:
    """Blocks a request is charged when routed: its prompt and its first generated token."""
    return blocks_for(prompt_tokens + 1, block_size)


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the router knows about one request, from its ``GenerateRequest``.

    ``latency``: route it for its first token (the ingress marks the top tier's requests)."""

    prompt_tokens: int
    max_tokens: int = 0
    latency: bool = False
    # The names of the prompt's full blocks (GenerateRequest.prefix_hashes) and how many samples
    # of the prompt the request runs (each holds the prompt; cached blocks are shared).
    prefix: tuple[int, ...] = ()
    samples: int = 1
    # The time per output token its tier promises (None: none): a replica whose SLO-aware step
    # has no seat left for it ranks after those that have one.
    tpot_target_s: float | None = None
    # The LoRA adapter it runs under (its key, name and id; None: the base model): a replica
    # holding it loaded is preferred over one that would have to load it (a replica holding
    # another id of the name does not count: it loads the new one).
    lora: str | None = None

    @classmethod
    def from_request(cls, request: GenerateRequest) -> RequestShape:
        """The shape of the ingress's typed request (all its ``n`` samples)."""
        return cls(
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_new_tokens,
            latency=request.latency,
            prefix=request.prefix_hashes,
            samples=max(request.n, 1),
            tpot_target_s=request.tpot_target_s,
            lora=request.lora.key if request.lora is not None else None,
        )

    def usable_prefix(self, block_size: int) -> int:
        """Leading blocks a replica's cache can give the request: full blocks before the prompt's
        last position (that one is always computed: its logits are needed)."""
        per_sample = self.prompt_tokens // max(self.samples, 1)
        return min(len(self.prefix), max(per_sample - 1, 0) // block_size)


def full_blocks(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Blocks a request holds once it has generated all of its ``max_tokens``."""
    return blocks_for(prompt_tokens + max(max_tokens, 1), block_size)


@dataclass(frozen=True, slots=True)
class Charge:
    """A request this router sent to a replica that has not completed yet."""

    blocks: int  # at admission: prompt and first token
    routed_at: float  # time.time() on the router when it was sent
    full: int = 0  # at its full length (prompt + max_tokens); 0: unknown, taken as ``blocks``
    # A latency request's uncached prompt positions (0 for others): prefill ahead of the next
    # latency request there until the report shows it.
    prefill: int = 0
    # Its LoRA adapter (None: the base model): loaded there from then on, until the report
    # shows it.
    lora: str | None = None

    @property
    def full_blocks(self) -> int:
        return max(self.full, self.blocks)


@dataclass(frozen=True, slots=True)
class ReplicaLoad(Generic[K]):
    """One replica as this router sees it: its last report, its outstanding charges, and how many
    leading blocks of the request being ranked it probably has cached."""

    key: K
    stats: RoutingStats | None
    charges: Sequence[Charge] = ()
    prefix_hits: int = 0


@dataclass(frozen=True, slots=True)
class Affinity:
    """How prefix hits weigh against load (module docstring)."""

    # Imbalanced: max outstanding - min outstanding > balance_abs and max > balance_rel * min.
    balance_abs: int = 16
    balance_rel: float = 1.5
    # Throughput-tier affinity only when the best replica has this share of the prompt cached.
    min_hit_fraction: float = 0.25
    # What loading a request's LoRA adapter costs a replica that does not hold it, in prefill
    # positions (latency ranking; a tie-break in the throughput ranking).
    adapter_load_tokens: int = 256

    def __post_init__(self) -> None:
        if self.balance_abs < 0:
            raise ValueError(f"balance_abs must be >= 0, got {self.balance_abs}")
        if self.balance_rel < 1.0:
            raise ValueError(f"balance_rel must be >= 1, got {self.balance_rel}")
        if not 0.0 <= self.min_hit_fraction <= 1.0:
            raise ValueError(f"min_hit_fraction must be in [0, 1], got {self.min_hit_fraction}")
        if self.adapter_load_tokens < 0:
            raise ValueError(
                f"adapter_load_tokens must be >= 0, got {self.adapter_load_tokens}")

    def imbalanced(self, outstanding: Sequence[int]) -> bool:
        if len(outstanding) < 2:
            return False
        hi, lo = max(outstanding), min(outstanding)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo


@dataclass(frozen=True, slots=True)
class Ranked(Generic[K]):
    """A replica's place in the ranking for one request."""

    key: K
    est_free: int  # estimated free blocks before this request (may be negative: a backlog)
    need: int  # blocks this request would be charged there
    est_waiting: int  # reported waiting plus requests sent since the report
    saturated: bool  # cannot hold the request now and has a long queue
    never_fits: bool  # its pool is too small for prompt + max_tokens
    dead: bool = False  # its last report says its engine has failed
    pending: int = 0  # prefill work queued ahead, in blocks (waiting + sent since the report)
    room: int = 0  # blocks left once every unfinished request reaches its full length
    outstanding: int = 0  # requests this router sent there that have not completed
    full: int = 0  # blocks this request holds at its full length
    cached: int = 0  # prompt positions it would probably find cached there (all samples)
    short: bool = False  # its free blocks less what was sent since its report cannot hold it now
    # Prefill positions before this request's first token there: the queue's (where SLO-aware
    # steps let a request of the strictest target pass the lower tiers, only that target's),
    # then its own uncached ones.
    prefill_ahead: int = 0
    # This request's own uncached prompt positions if it is a latency request, else 0 (its
    # charge's ``prefill``).
    own_prefill: int = 0
    # Its last report leaves no seat within its step limit for this request (one with a TPOT
    # target), counting what was sent since the report.
    no_seat: bool = False
    # Its step does not already keep this request's own target (the strictest target present
    # there is another or none): the request would shorten every step there, where a replica
    # keeping that target loses nothing more. Requests with a target gather first where their
    # target is already kept, seats allowing.
    unconstrained: bool = False
    # It has not reported yet, while another replica has: ranked after the reported ones.
    unreported: bool = False
    # Prefill positions that loading the request's adapter would cost there (0: it holds the
    # adapter, or a base-model request).
    adapter_load: int = 0
    # Its report says it serves no LoRA adapters, and the request names one: ranked last.
    no_lora: bool = False


def charged_since_report(stats: RoutingStats | None, charges: Sequence[Charge]) -> list[Charge]:
    """The charges the report does not reflect: all of them without a report."""
    if stats is None:
        return list(charges)
    return [c for c in charges if c.routed_at >= stats.report_time]


def holds_adapter(stats: RoutingStats | None, unseen: Sequence[Charge], lora: str) -> bool:
    """Whether a replica probably holds adapter ``lora`` loaded: its report lists it, or this
    router sent it a request of that adapter since the report."""
    if stats is not None and lora in stats.lora_adapters:
        return True
    return any(c.lora == lora for c in unseen)


def serves_no_adapters(stats: RoutingStats | None) -> bool:
    """Whether a replica's report says it serves no LoRA adapters (``max_loras`` 0 and none
    loaded); a replica without a report is not known to refuse them."""
    return stats is not None and stats.max_loras == 0 and not stats.lora_adapters


def target_work(stats: RoutingStats | None, request: RequestShape,
                unseen: Sequence[Charge]) -> int | None:
    """The prefill ahead of a latency request with a TPOT target on a replica whose SLO-aware
    steps let it pass the lower tiers' queue: the reported prompt positions of its target there
    (none where the replica's strictest target is laxer or absent: it would be the strictest),
    plus the latency requests sent since the report. None where that does not apply (no such
    steps, no report, no target, not a latency request, or a stricter target there): then the
    whole queue is ahead of it."""
    if (stats is None or not stats.slo_steps or not request.latency
            or request.tpot_target_s is None):
        return None
    target_ms = round(request.tpot_target_s * 1000)
    if stats.tpot_target_ms and stats.tpot_target_ms < target_ms:
        return None
    reported = stats.target_prefill if stats.tpot_target_ms == target_ms else 0
    return reported + sum(c.prefill for c in unseen)


def seats_for(stats: RoutingStats, tpot_target_s: float) -> int:
    """The seats a replica's SLO-aware step has for a request with ``tpot_target_s``: the
    reported ``target_seats`` where that is the strictest target there and its steps let
    that target pass the lower tiers (``slo_steps``: the others' decodes give way to it),
    else ``seats`` (where it would become the strictest, a seat beyond those is one taken
    from a running request by preemption: not a free one)."""
    if (stats.slo_steps and stats.target_seats >= 0
            and stats.tpot_target_ms == round(tpot_target_s * 1000)):
        return stats.target_seats
    return stats.seats


def rank_replicas(
    loads: Sequence[ReplicaLoad[K]],
    request: RequestShape,
    rng: random.Random,
    *,
    saturation_waiting: int = 8,
    default_block_size: int = DEFAULT_BLOCK_SIZE,
    affinity: Affinity | None = None,
) -> list[Ranked[K]]:
    """Best replica first (see the module docstring for the two rankings and the balance rule).

    Before either ranking: for a request of a LoRA adapter, replicas that serve no adapters go
    last; then replicas whose engine has failed, then those whose pool can
    never hold ``prompt + max_tokens``, then saturated ones (the estimated free blocks cannot
    hold the request and the estimated queue is at least ``saturation_waiting``), then, for a
    request with a TPOT target, those whose SLO-aware step has no seat left for it
    (``seats_for``, less the requests sent since the report). Inside either ranking, while
    the replicas are balanced and after whether the request fits there now (and after prefix
    hits where affinity applies), a replica whose
    step already keeps the request's own target as its strictest goes first (a replica keeping a
    top tier's target loses nothing more by one more such request, where another would shorten
    all its steps for it: a tier's requests gather where their target is already kept, while
    fewer than ``GATHER_MAX`` of them are there and, for a latency request, less than
    ``GATHER_PREFILL_S`` of their prompts' prefill is ahead of it). Remaining ties
    at random (``rng``). A replica without a report is never saturated, never too small and never
    dead (nothing is known against it). ``affinity`` None: ``Affinity()``.
    """
    affinity = affinity or Affinity()
    reported = [load.stats for load in loads if load.stats is not None]
    assumed_total = max((s.total_blocks for s in reported), default=0)
    fallback_block_size = reported[0].block_size if reported else default_block_size
    latency = request.latency
    samples = max(request.samples, 1)

    entries: list[Ranked[K]] = []
    for load in loads:
        stats = load.stats
        block_size = stats.block_size if stats is not None else fallback_block_size
        hit_blocks = min(load.prefix_hits, request.usable_prefix(block_size))
        shared = hit_blocks * samples  # blocks the request would not take fresh
        need = max(charge_blocks(request.prompt_tokens, block_size) - shared, 1)
        whole = full_blocks(request.prompt_tokens, request.max_tokens, block_size)
        full = max(whole - shared, 1)
        unseen = charged_since_report(stats, load.charges)
        unseen_now = sum(c.blocks for c in unseen)
        unseen_full = sum(c.full_blocks for c in unseen)
        if stats is None:
            free_now, pending = assumed_total - unseen_now, unseen_now
            room = assumed_total - unseen_full
            est_waiting = len(unseen)
        else:
            free_now, pending = stats.free_blocks - unseen_now, stats.waiting_blocks + unseen_now
            room = stats.total_blocks - stats.committed_blocks - unseen_full
            est_waiting = stats.waiting + len(unseen)
        est_free = free_now - (stats.waiting_blocks if stats is not None else 0)
        own = request.prompt_tokens - hit_blocks * block_size * samples
        ahead = target_work(stats, request, unseen)
        keeps_target = (request.tpot_target_s is not None and stats is not None
                        and stats.tpot_target_ms == round(request.tpot_target_s * 1000))
        lora = request.lora
        load_cost = (affinity.adapter_load_tokens
                     if lora is not None and not holds_adapter(stats, unseen, lora) else 0)
        entries.append(Ranked(
            key=load.key,
            est_free=est_free,
            need=need,
            est_waiting=est_waiting,
            saturated=stats is not None and est_free < need and est_waiting >= saturation_waiting,
            never_fits=stats is not None and whole > stats.total_blocks,
            dead=stats is not None and not stats.alive,
            pending=pending,
            room=room,
            outstanding=len(load.charges),
            full=full,
            cached=hit_blocks * block_size * samples,
            short=free_now < need,
            prefill_ahead=(pending * block_size if ahead is None else ahead) + own,
            own_prefill=own if latency else 0,
            no_seat=stats is not None and request.tpot_target_s is not None
            and seats_for(stats, request.tpot_target_s) - len(unseen) < samples,
            unconstrained=request.tpot_target_s is not None and not (
                keeps_target and stats is not None
                and stats.target_requests + len(unseen) < GATHER_MAX
                and not (latency and ahead is not None
                         and ahead >= GATHER_PREFILL_S * stats.target_prefill_per_s)),
            unreported=stats is None and bool(reported),
            adapter_load=load_cost,
            no_lora=lora is not None and serves_no_adapters(stats),
        ))

    eligible = [r for r in entries if not (r.dead or r.never_fits or r.saturated)]
    balanced = not affinity.imbalanced([r.outstanding for r in eligible or entries])
    best_cached = max((r.cached for r in eligible or entries), default=0)
    sticky = balanced and best_cached > 0 and (
        best_cached >= affinity.min_hit_fraction * max(request.prompt_tokens, 1)
    )

    def order(r: Ranked[K]) -> tuple[Any, ...]:
        # For a base-model request no_lora and adapter_load are False and 0 everywhere: the
        # order is the one without adapters.
        head = (r.no_lora, r.dead, r.unreported, r.never_fits, r.saturated, r.no_seat)
        gather = balanced and r.unconstrained  # never past the balance rule
        if latency:
            if balanced:
                return (*head, r.short, gather, r.prefill_ahead + r.adapter_load, -r.est_free,
                        rng.random())
            return (*head, r.short, r.pending, -r.est_free, -r.cached, r.adapter_load,
                    rng.random())
        if sticky:
            return (*head, r.room < r.full, -r.cached, gather, r.outstanding, r.adapter_load,
                    -r.room, rng.random())
        if balanced:
            return (*head, r.room < r.full, gather, r.outstanding, r.adapter_load, -r.cached,
                    -r.room, rng.random())
        return (*head, r.room < r.full, gather, r.outstanding, -r.cached, r.adapter_load,
                -r.room, rng.random())

    return sorted(entries, key=order)
