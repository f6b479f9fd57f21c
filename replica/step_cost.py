"""What an engine step costs, learned online from the engine's own step times (docs/scheduler.md §8).

A step's wall time is modelled as linear in its shape::

    t = c0 + c_tok * tokens + c_seq * sequences + c_att * attention

``tokens``: positions computed (decodes plus prefill chunks); ``sequences``: requests in the step
(each samples a row of logits, each is a separate attention problem); ``attention``: query-key
pairs the step's attention visits (a decode at context n visits n, a chunk of ``k`` positions
starting at ``s`` visits ``k * (s + (k + 1) / 2)``). The coefficients are fitted by least squares
over the steps seen, older ones forgotten geometrically (``forget`` per step), with a ridge pull
toward a prior so that the first predictions are sane, and kept non-negative (a cost never falls
as work grows). Pure Python, no torch: the scheduler uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Features are scaled to comparable magnitudes before fitting (seconds per 100 tokens, per 10
# sequences, per 100k query-key pairs).
_SCALE = (1.0, 1e-2, 1e-1, 1e-5)


@dataclass(frozen=True, slots=True)
class StepShape:
    """The work of one step (see the module docstring)."""

    tokens: int = 0
    sequences: int = 0
    attention: float = 0.0

    def plus(self, tokens: int, sequences: int, attention: float) -> StepShape:
        return StepShape(self.tokens + tokens, self.sequences + sequences,
                         self.attention + attention)


def decode_attention(context: int) -> float:
    """Query-key pairs of one decode at ``context`` positions."""
    return float(context)


def chunk_attention(start: int, length: int) -> float:
    """Query-key pairs of a prefill chunk of ``length`` positions after ``start`` computed ones."""
    return length * (start + (length + 1) / 2)


@dataclass(frozen=True, slots=True)
class CostPrior:
    """Seconds per step, per token, per sequence and per query-key pair before any step is seen.

    The defaults are of a small model on one CPU core (SmolLM2-135M in fp32: about 20 ms of
    weights read a step, about 3 ms a token); a GPU's steps are far cheaper, and a few dozen
    steps replace the prior."""

    base_s: float = 0.02
    per_token_s: float = 0.003
    per_sequence_s: float = 0.0002
    per_pair_s: float = 2e-8
    # How strongly the prior pulls the fit (in steps of evidence): weak, so that data decides
    # wherever it reaches, and the prior only splits what the data cannot tell apart.
    weight: float = 0.05


class StepCostModel:
    """Predicts a step's seconds from its ``StepShape``; ``observe`` each step as it ends."""

    def __init__(self, prior: CostPrior | None = None, forget: float = 0.995,
                 refit_every: int = 8) -> None:
        if not 0.5 < forget <= 1.0:
            raise ValueError(f"forget must be in (0.5, 1], got {forget}")
        if refit_every < 1:
            raise ValueError(f"refit_every must be at least 1, got {refit_every}")
        self.prior = prior or CostPrior()
        p = self.prior
        self._prior_coef = [p.base_s, p.per_token_s / _SCALE[1], p.per_sequence_s / _SCALE[2],
                            p.per_pair_s / _SCALE[3]]
        self.forget = forget
        self.refit_every = refit_every
        self._xtx = [[0.0] * 4 for _ in range(4)]
        self._xty = [0.0] * 4
        self.observed = 0
        self._coef = list(self._prior_coef)

    @staticmethod
    def _features(shape: StepShape) -> list[float]:
        return [1.0, shape.tokens * _SCALE[1], shape.sequences * _SCALE[2],
                shape.attention * _SCALE[3]]

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """Seconds per step, per token, per sequence and per query-key pair."""
        c = self._coef
        return (c[0], c[1] * _SCALE[1], c[2] * _SCALE[2], c[3] * _SCALE[3])

    def predict(self, shape: StepShape) -> float:
        x = self._features(shape)
        return sum(c * v for c, v in zip(self._coef, x, strict=True))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Learn from one step that took ``seconds``. Once warm, a single step far slower than
        predicted (a page fault, a garbage collection, a noisy neighbour) counts as at most three
        times the prediction, so one spike does not throttle the steps after it."""
        if shape.tokens <= 0 or not seconds > 0.0:
            return
        if self.observed >= 32:
            seconds = min(seconds, 3.0 * self.predict(shape) + 0.005)
        x = self._features(shape)
        f = self.forget
        for i in range(4):
            self._xty[i] = f * self._xty[i] + x[i] * seconds
            row = self._xtx[i]
            for j in range(4):
                row[j] = f * row[j] + x[i] * x[j]
        self.observed += 1
        if self.observed % self.refit_every == 0 or self.observed <= 16:
            self._refit()

    def _refit(self) -> None:
        """Ridge toward the prior, with a non-negativity active set (at most four solves)."""
        w = self.prior.weight
        active = [True] * 4
        coef = list(self._prior_coef)
        for _ in range(4):
            idx = [i for i in range(4) if active[i]]
            a = [[self._xtx[i][j] + (w if i == j else 0.0) for j in idx] for i in idx]
            b = [self._xty[i] + w * self._prior_coef[i] for i in idx]
            sol = _solve(a, b)
            if sol is None:
                return
            coef = [0.0] * 4
            for k, i in enumerate(idx):
                coef[i] = sol[k]
            negative = [i for i in idx if coef[i] < 0.0 and i != 0]
            if not negative:
                break
            for i in negative:
                active[i] = False
        coef[0] = max(coef[0], 0.0)
        self._coef = [max(c, 0.0) for c in coef]

    def max_tokens(self, base: StepShape, limit_s: float, start: int, cap: int,
                   new_sequence: bool) -> int:
        """The most positions of one prefill chunk (after ``start`` computed ones, at most
        ``cap``) that keep a step of ``base`` plus the chunk within ``limit_s``; 0 if none."""
        seqs = 1 if new_sequence else 0
        lo, hi = 0, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            shape = base.plus(mid, seqs, chunk_attention(start, mid))
            if self.predict(shape) <= limit_s:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    n = len(b)
    m = [[*row[:], b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
