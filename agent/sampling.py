"""Per-sequence token choice from the top-k post-process graph's candidates.

The device returns the K best (logit, id) pairs of each row, best first; each sequence then applies
its own repetition penalty, temperature and truncation with its own random draws. Truncation runs
in llama.cpp's sampler-chain order: top-k, typical_p (locally typical sampling, transformers'
TypicalLogitsWarper: the tokens whose surprisal is nearest the entropy of the top-k's distribution,
until their mass reaches typical_p), top-p over what is left, then min_p (the tokens of at least
min_p times the most likely remaining one's probability; vLLM v0's place too, where v1 applies it
before top-k/top-p: the two differ only where top-p and min_p are both set). All of them act on
the distribution after the temperature, as vLLM's do and this sampler's top-p always has (llama.cpp
scales last). Each row's truncation is its own arithmetic on its own candidates, so a row's token
never depends on the other rows of its batch. A sequence's draw for its n-th token is a function of
its key (from its seed, else random) and n alone, never of a generator's state: a seeded request
gives the same text whatever else shares its batch and however its steps were made (one token, or
proposals verified, as speculative decoding makes them by load).

Penalties: `repetition_penalty` (CTRL-style, over prompt and output tokens) and OpenAI's
`presence_penalty` / `frequency_penalty` (subtracted from the logits of output tokens, once and per
occurrence). Exactness: penalties only lower the logits of tokens already seen (so OpenAI's negative
values are refused), hence the true top-k after them lies within the top (k + number of seen tokens)
before them; `candidates_needed` asks for that many, and the whole vocabulary when no top-k applies.

A row that needs the whole vocabulary does not run a top-k over it on the device (13-23 ms for a
batch of 32 with a 49152-token vocabulary, paid by every row of the batch): `choose_from_logits`
takes its logits row and draws from the same distribution on the host, sorting only the tokens the
draw can reach (none without truncation, the nucleus with top-p or min_p; typical_p needs the order
of every token of the top-k, the whole vocabulary without one).

The whole row is also taken by a sequence that asks for logprobs (their normaliser is the whole
vocabulary's), has a logit bias (it may raise any token), has stop ids to suppress (`min_tokens`) or
a token mask (structured output: the server's grammar sends one with each step that samples for it).
Logprobs are those of the distribution the token is drawn from: the logits after penalties, logit
bias and suppression, divided by the temperature (1 for greedy rows), before truncation (top-k,
typical_p, top-p, min_p); only the chosen token's and the `logprobs` best tokens' values leave the
agent, never the logits.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence

import numpy as np

from agent.contract.sampling import SamplingParams, SequenceFault, TokenLogprob


class SamplingFault(ValueError):
    """This sequence's choice cannot be made (SequenceFault's kinds): its error, not the step's."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind

    def fault(self) -> SequenceFault:
        return SequenceFault(self.kind, str(self))


class SlotSampler:
    """Chooses the tokens of one sequence: its parameters, its key (its draws) and the tokens it has seen."""

    def __init__(
        self, params: SamplingParams, prompt: list[int], vocab_size: int, eos_ids: Iterable[int] = ()
    ):
        if params.largest_token_id() >= vocab_size:
            raise ValueError(
                f"token id {params.largest_token_id()} (logit_bias, stop_token_ids or pool) is outside the "
                f"vocabulary 0..{vocab_size - 1}"
            )
        self.params = params
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.bias_ids = np.array([t for t, _ in params.logit_bias], np.int64)
        self.bias_values = np.array([b for _, b in params.logit_bias], np.float64)
        self.suppressed = np.array(sorted(set(self.eos_ids) | set(params.stop_token_ids)), np.int64)
        self.generated = 0  # tokens chosen so far (min_tokens)
        self.last: TokenLogprob | None = None  # the logprobs of the last choice, when asked for
        self.fault: SequenceFault | None = None  # why its last choice failed: it samples no more
        self.recent: list[TokenLogprob] = []  # the logprobs of the choices of the last verify()
        self.allowed: np.ndarray | None = None  # the next choice's token mask (structured output)
        self.key = secrets.randbits(64) if params.seed is None else _mix64(params.seed + GOLDEN_GAMMA)
        self.repetition = params.repetition_penalty != 1.0
        self.counted = params.presence_penalty > 0 or params.frequency_penalty > 0
        self.penalised = self.repetition or self.counted
        self.seen: set[int] = set(prompt) if self.repetition else set()
        self.counts: dict[int, int] = {}  # output tokens, for presence/frequency penalties

    @property
    def plain_greedy(self) -> bool:
        """Greedy without a penalty: the argmax graph's answer is final."""
        return self.params.greedy and not self.penalised and not self.needs_logits

    @property
    def needs_logits(self) -> bool:
        """Its next choice needs the whole logits row (choose_from_logits), whatever its top-k."""
        p = self.params
        return (
            p.logprobs is not None
            or bool(p.logit_bias)
            or self.generated < p.min_tokens
            or self.allowed is not None
        )

    def constrain(self, bitmask: np.ndarray) -> None:
        """The next choice only among the tokens whose bit is set (bit j of word i: token 32i + j),
        as the server's grammar allows them; the mask holds for one choice."""
        bits = np.unpackbits(bitmask.astype("<i4").view(np.uint8), bitorder="little")[: self.vocab_size]
        self.allowed = np.zeros(self.vocab_size, bool)  # tokens past the mask's words: not allowed
        self.allowed[: len(bits)] = bits

    def candidates_needed(self) -> int:
        p = self.params
        if p.greedy:
            k = 1
        elif p.top_k > 0:
            k = p.top_k
        else:
            return self.vocab_size
        return min(self.vocab_size, k + len(self.seen) + len(self.counts))

    def choose(self, values: np.ndarray, ids: np.ndarray) -> int:
        """values/ids: this row's candidates, best first (at least candidates_needed() of them)."""
        p = self.params
        logits = values.astype(np.float64)
        if self.penalised:
            if self.seen:
                seen = np.fromiter(self.seen, dtype=np.int64, count=len(self.seen))
                hit = np.isin(ids, seen)
                penalised = np.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
                logits = np.where(hit, penalised, logits)
            if self.counts:
                penalty = np.zeros(self.vocab_size)
                tokens = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
                occurrences = np.fromiter(self.counts.values(), dtype=np.float64, count=len(self.counts))
                penalty[tokens] = p.presence_penalty + p.frequency_penalty * occurrences
                logits = logits - penalty[ids]
            order = np.argsort(-logits, kind="stable")
            logits, ids = logits[order], ids[order]
        if p.greedy:
            token = int(ids[0])
        else:
            order = np.lexsort((ids, -logits))  # best first, ties by id: as _nucleus orders them
            logits, ids = logits[order], ids[order]
            if p.top_k > 0:
                logits, ids = logits[: p.top_k], ids[: p.top_k]
            ids, cumulative = _truncated(np.exp((logits - logits[0]) / p.temperature), ids, p)
            index = int(np.searchsorted(cumulative, self.uniform(), side="right"))
            token = int(ids[min(index, len(cumulative) - 1)])
        self.observe(token)
        return token

    def choose_from_logits(self, row: np.ndarray) -> int:
        """The choice choose() makes, from the row's logits for every token (indexed by id), with
        the logit bias and suppressed stop ids applied; its logprobs in `last` when asked for."""
        p = self.params
        logits = self._adjusted(self._penalised(row.astype(np.float64)))
        if not np.isfinite(logits).any():
            raise SamplingFault("request", self._why_nothing_is_allowed())
        if p.greedy:
            token = int(np.argmax(logits))
        else:
            token = self._draw(np.exp((logits - logits.max()) / p.temperature))
        if p.logprobs is not None:
            self.last = self._logprob(logits / (1.0 if p.greedy else p.temperature), token, p.logprobs)
            self.recent.append(self.last)
        self.observe(token)
        return token

    def verify(self, rows: np.ndarray, proposed: Sequence[int]) -> list[int]:
        """Speculative decoding: rows[j] are the logits after the j-th proposed token (row 0: after
        the pending token), one more row than proposals. Each position's token is chosen as a
        one-token step chooses it (its own draw), and a proposal is kept where it is that token:
        for proposals that were certain (n-gram, a greedy draft) that is rejection sampling (kept
        with its probability, else a token of the other tokens' distribution), and the tokens are
        exactly those of the same sequence decoded without proposals. The tokens chosen: the
        proposals kept and one more (the first rejected one's replacement, or the token after all)."""
        tokens: list[int] = []
        self.recent = []
        for j, row in enumerate(rows):
            tokens.append(self.choose_from_logits(row))
            if j == len(proposed) or tokens[-1] != proposed[j]:
                break
        return tokens

    def uniform(self) -> float:
        """The draw in [0, 1) of the token this sequence chooses next (its `generated`-th): the
        SplitMix64 stream of its key at that index, so it never depends on what was drawn before."""
        return (_mix64(self.key + (self.generated + 1) * GOLDEN_GAMMA) >> 11) * 2.0**-53

    def _why_nothing_is_allowed(self) -> str:
        forbidden = self.generated < self.params.min_tokens and self.suppressed.size
        if self.allowed is not None and forbidden:
            return (
                "no token can follow: the grammar allows only tokens that min_tokens keeps out "
                f"before token {self.params.min_tokens} (EOS and stop_token_ids)"
            )
        return "no token can follow: every token of the vocabulary is excluded"

    def _adjusted(self, logits: np.ndarray) -> np.ndarray:
        if self.allowed is not None:
            logits[~self.allowed] = -np.inf
        if self.bias_ids.size:
            np.add.at(logits, self.bias_ids, self.bias_values)
        if self.generated < self.params.min_tokens and self.suppressed.size:
            logits[self.suppressed] = -np.inf
        return logits

    @staticmethod
    def _logprob(scaled: np.ndarray, token: int, best: int) -> TokenLogprob:
        """log-softmax of the scaled logits at `token`, and the `best` most likely (id, logprob),
        in float64 on logits shifted by their peak: finite for every logit the bounds admit (a
        temperature of 1e-5 scales them 1e5 times). One that is not anyway is this sequence's fault."""
        peak = float(scaled.max())
        shifted = scaled - peak
        normaliser = float(np.log(np.exp(shifted).sum()))
        top: tuple[tuple[int, float], ...] = ()
        if best:
            ids = _best_ids(shifted, 0.0, best)
            top = tuple((int(t), float(shifted[t]) - normaliser) for t in ids if np.isfinite(shifted[t]))
        entry = TokenLogprob(float(shifted[token]) - normaliser, top)
        if not all(np.isfinite(v) for v in (entry.logprob, *(v for _, v in top))):
            raise SamplingFault("internal", f"the logprob of token {token} is not finite ({entry.logprob})")
        return entry

    def _penalised(self, logits: np.ndarray) -> np.ndarray:
        p = self.params
        if self.seen:
            seen = np.fromiter(self.seen, dtype=np.int64, count=len(self.seen))
            hit = logits[seen]
            logits[seen] = np.where(hit > 0, hit / p.repetition_penalty, hit * p.repetition_penalty)
        if self.counts:
            tokens = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            occurrences = np.fromiter(self.counts.values(), dtype=np.float64, count=len(self.counts))
            logits[tokens] -= p.presence_penalty + p.frequency_penalty * occurrences
        return logits

    def _draw(self, probs: np.ndarray) -> int:
        """The position's draw (as in choose()) from unnormalised probabilities by token id."""
        p = self.params
        if p.top_k == 0 and p.top_p >= 1.0 and p.min_p == 0.0 and p.typical_p >= 1.0:
            # no truncation: the id order serves as well as any
            cumulative = np.cumsum(probs)
            index = int(np.searchsorted(cumulative, self.uniform() * cumulative[-1], side="right"))
            return min(index, len(probs) - 1)
        if p.typical_p < 1.0:
            # the entropy is the whole top-k's: every one of them sorted, as choose() has them
            top_k = min(p.top_k or len(probs), len(probs))
            kept = np.argpartition(-probs, top_k - 1)[:top_k] if top_k < len(probs) else np.arange(len(probs))
            best = kept[np.lexsort((kept, -probs[kept]))]
            ids, cumulative = _truncated(probs[best], best, p)
        else:
            ids, cumulative = _nucleus(probs, p.top_k or len(probs), p.top_p, p.min_p)
        index = int(np.searchsorted(cumulative, self.uniform(), side="right"))
        return int(ids[min(index, len(ids) - 1)])

    def state(self) -> dict:
        """All a decode agent needs to go on choosing this sequence's tokens exactly as this one
        would (PD disaggregation), in msgpack's types: its draws follow from its key and `generated`."""
        return {
            "params": self.params.model_dump(),
            "generated": self.generated,
            "seen": sorted(self.seen),
            "counts": [[token, n] for token, n in self.counts.items()],
            "key": self.key,
        }

    @classmethod
    def from_state(cls, state: dict, vocab_size: int, eos_ids: Iterable[int] = ()) -> SlotSampler:
        """The inverse of state(). It comes from another agent: every token id is checked against
        the vocabulary and every count's range, so that a malformed or hostile state is refused here
        (ValueError saying what is wrong) instead of failing a later step of every sequence in the
        batch, or penalising tokens it does not name (a negative id indexes from the end)."""
        try:
            sampler = cls(SamplingParams.model_validate(state["params"]), [], vocab_size, eos_ids)
            generated, seen, counts = state["generated"], state["seen"], state["counts"]
            if not _is_int(generated) or generated < 0:
                raise ValueError(f"generated must be a count (>= 0), got {generated!r:.50}")
            sampler.generated = generated
            sampler.seen = set(_token_ids(seen, vocab_size, "seen"))
            if sampler.seen and not sampler.repetition:
                raise ValueError("seen tokens without a repetition penalty")
            if not isinstance(counts, list) or not all(isinstance(c, list) and len(c) == 2 for c in counts):
                raise ValueError("counts must be [token id, occurrences] pairs")
            tokens = _token_ids([token for token, _ in counts], vocab_size, "counts")
            occurrences = [n for _, n in counts]
            if not all(_is_int(n) and 1 <= n <= generated for n in occurrences):
                raise ValueError(f"counts' occurrences must be 1..generated ({generated})")
            if counts and not sampler.counted:
                raise ValueError("counts without a presence or frequency penalty")
            sampler.counts = dict(zip(tokens, occurrences))
            key = state["key"]
            if not _is_int(key) or not 0 <= key <= MASK64:
                raise ValueError(f"key must be a 64-bit unsigned integer, got {key!r:.50}")
            sampler.key = key
        except (
            KeyError,
            TypeError,
            ValueError,
            OverflowError,
            RecursionError,
        ) as exc:  # pydantic's are ValueErrors
            raise ValueError(f"not a sampler state: {type(exc).__name__}: {exc}") from exc
        return sampler

    def observe(self, token: int) -> None:
        self.generated += 1
        self.allowed = None
        if self.repetition:
            self.seen.add(token)
        if self.counted:
            self.counts[token] = self.counts.get(token, 0) + 1


MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment


def _mix64(x: int) -> int:
    """SplitMix64's output function: nearby inputs (a stream's indices) give unrelated 64-bit words."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _is_int(value) -> bool:
    return type(value) is int  # not a bool, nor a float msgpack carried


def _token_ids(values, vocab_size: int, what: str) -> list[int]:
    """`values` as token ids of a vocabulary of `vocab_size` (ValueError naming the first that is not)."""
    if not isinstance(values, list) or len(values) > vocab_size:
        raise ValueError(f"{what} must be a list of at most {vocab_size} token ids")
    for token in values:
        if not _is_int(token) or not 0 <= token < vocab_size:
            raise ValueError(f"{what}: token id {token!r:.50} is outside the vocabulary 0..{vocab_size - 1}")
    return values


FIRST_NUCLEUS_GUESS = 64


def _best_ids(values: np.ndarray, peak: float, best: int) -> np.ndarray:
    """The ids of the `best` largest values, best first (ties by id). A selection over the tokens
    near the peak (a comparison, 0.04 ms over 49152 tokens) instead of the whole row (0.35 ms):
    exact, since every token left out is below all those kept."""
    for margin in (8.0, 32.0):
        ids = np.flatnonzero(values >= peak - margin)
        if len(ids) >= best:
            break
    else:
        ids = np.arange(len(values))
    if len(ids) > best:
        ids = ids[np.argpartition(values[ids], -best)[-best:]]
    return ids[np.lexsort((ids, -values[ids]))]


def _nucleus(
    probs: np.ndarray, top_k: int, top_p: float, min_p: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """The ids a top-k, top-p then min_p draw can reach, best first, with their cumulative share
    (ending at 1). Sorts a growing prefix of the best tokens until it holds the nucleus (or every
    token min_p keeps), not the vocabulary."""
    top_k = min(top_k, len(probs))  # a top_k past the vocabulary keeps it all
    kept = np.argpartition(-probs, top_k - 1)[:top_k] if top_k < len(probs) else np.arange(len(probs))
    total = probs[kept].sum()
    threshold = min_p * probs[kept].max()
    size = min(top_k, FIRST_NUCLEUS_GUESS)
    while True:
        best = kept if size == top_k else kept[np.argpartition(-probs[kept], size - 1)[:size]]
        ids = best[np.lexsort((best, -probs[best]))]  # best first, ties by id
        running = np.cumsum(probs[ids])
        if (
            size == top_k
            or (top_p < 1.0 and running[-1] / total >= top_p)
            or probs[ids[-1]] < threshold  # every token min_p keeps is in
        ):
            break
        size = min(top_k, size * 8)
    keep = len(ids)
    if top_p < 1.0:
        keep = min(int(np.searchsorted(running / total, top_p)) + 1, len(ids))
    if min_p > 0.0:  # as _truncated cuts it
        keep = min(keep, int(np.count_nonzero(probs[ids] >= min_p * probs[ids[0]])))
    # normalised as choose() normalises its candidates': the same draw picks the same token
    return ids[:keep], running[:keep] / running[keep - 1]


def _truncated(probs: np.ndarray, ids: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """typical_p, top-p then min_p over the top-k's probabilities (unnormalised, best first, ties
    by id): the ids a draw can reach, in that order, with their cumulative share (ending at 1)."""
    if params.typical_p < 1.0:
        typical = _typical(probs, params.typical_p)
        probs, ids = probs[typical], ids[typical]
    running = np.cumsum(probs)
    keep = len(running)
    if params.top_p < 1.0:
        keep = int(np.searchsorted(running / running[-1], params.top_p)) + 1
    if params.min_p > 0.0:
        # relative to the most likely token left: llama.cpp's, after typical_p (which may drop the
        # most likely one); a prefix of the best-first order
        keep = min(keep, int(np.count_nonzero(probs >= params.min_p * probs[0])))
    return ids[:keep], running[:keep] / running[keep - 1]


def _typical(probs: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical sampling's tokens as a mask (Meister et al. 2022, as transformers'
    TypicalLogitsWarper keeps them): by distance of their surprisal from the entropy, nearest
    first, until their probability reaches `mass`, with every token as near as the last one (so
    ties never depend on an order). `probs`: unnormalised, best first."""
    share = probs / probs.sum()
    with np.errstate(divide="ignore"):
        surprisal = -np.log(share)  # infinite where a probability underflowed to 0: never typical
    finite = share > 0
    entropy = float(np.sum(share[finite] * surprisal[finite]))
    distance = np.abs(surprisal - entropy)
    order = np.argsort(distance, kind="stable")
    running = np.cumsum(share[order])
    last = min(int(np.count_nonzero(running < mass)), len(order) - 1)
    return distance <= distance[order[last]]
