"""TokenChooser: the host side of a runner's token choice (ModelRunner, agent/runner.py, holds one).

It turns a graph call's logits into each sequence's token: on the device where it can (argmax,
top-k candidates), on the host where a sequence needs the whole row (logprobs, logit bias,
min_tokens), verifying proposals (speculative decoding) and applying token masks (structured
output). Each sequence's state of choice is its SlotSampler (agent/sampling.py), built from its
request's SamplingParams (agent/contract/sampling.py). One sequence's failed choice is its own
error (its sampler's fault); the others of the step go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TypeVar

import numpy as np
from mindspore import Tensor

from agent.contract.sampling import NO_TOKEN, SamplingParams, SequenceFault
from agent.contract.step import StepChunk
from agent.graphs.interface import ModelGraphs, bucket
from agent.sampling import SamplingFault, SlotSampler
from agent.slots import RunnerError, SlotState

log = logging.getLogger(__name__)

Choice = TypeVar("Choice")


def guarded(sampler: SlotSampler, choose: Callable[[], Choice], failed: Choice) -> Choice:
    """One sequence's choice, or `failed` with the sampler's fault set: a failed choice is that
    sequence's error, the others of the step go on."""
    try:
        return choose()
    except SamplingFault as exc:
        sampler.fault = exc.fault()
    except Exception as exc:  # a bug in one row's choice: that sequence's error, logged
        log.exception("sampling one sequence's token failed")
        sampler.fault = SequenceFault("internal", f"sampling failed: {type(exc).__name__}: {exc}")
    return failed


class TokenChooser:
    """The token choice of one graph set's calls, over its vocabulary and EOS ids."""

    def __init__(self, graphs: ModelGraphs):
        self.graphs = graphs
        self.vocab_size, self.eos_ids = graphs.spec.vocab_size, graphs.spec.eos_ids

    def verify(
        self,
        logits: Tensor,
        greedy: Tensor,
        samplers: list[SlotSampler],
        plain: int,
        scored: list[StepChunk],
        by_slot: Mapping[int, SlotSampler | None],
    ) -> tuple[list[int], dict[int, list[int]]]:
        """A step with scored rows (after the `plain` decode rows): the plain decode rows' and the
        sampling chunks' tokens (`samplers`, chosen as sample() chooses them, from those rows alone)
        and each scored slot's verified tokens. A plain greedy sampler keeps a proposal where the
        graph's argmax is it; the others verify on the host."""
        ids = greedy.asnumpy()
        all_greedy = all(s.plain_greedy for s in samplers)
        # the logits leave the device only for a row that is not plain greedy
        scored_greedy = all((s := by_slot[c.slot]) is not None and s.plain_greedy for c in scored)
        host = logits.asnumpy() if not (all_greedy and scored_greedy) else None
        sizes = [len(c.tokens) for c in scored]
        after = plain + sum(sizes)  # the sampling chunks' rows follow the scored ones
        normal = [*range(plain), *range(after, after + len(samplers) - plain)]
        if all_greedy:
            tokens = [int(t) for t in ids[normal]]  # as sample() chooses for plain greedy rows
        else:
            assert host is not None
            tokens = self.sample(Tensor(host[normal]), samplers, Tensor(ids[normal]))
        verified: dict[int, list[int]] = {}
        row = plain
        for chunk, size in zip(scored, sizes):
            sampler = by_slot[chunk.slot]
            assert sampler is not None  # checked: a decode slot has finished its prompt
            proposed = list(chunk.tokens[1:])
            if sampler.plain_greedy:
                kept = []
                for j in range(size):
                    kept.append(int(ids[row + j]))
                    sampler.observe(kept[-1])
                    if j == len(proposed) or kept[-1] != proposed[j]:
                        break
            else:
                assert host is not None  # fetched for every row that is not plain greedy
                kept = guarded(sampler, partial(sampler.verify, host[row : row + size], proposed), [NO_TOKEN])
            verified[chunk.slot] = kept
            row += size
        return tokens, verified

    def check_masks(self, masks: Mapping[int, np.ndarray], sampling: Sequence[int]) -> None:
        """Token masks of slots this call samples for: int32 words (at most the vocabulary's; the
        tokens past the last word are not allowed), with at least one token allowed."""
        words = (self.vocab_size + 31) // 32
        for slot, mask in masks.items():
            if slot not in sampling:
                raise RunnerError(f"a token mask for slot {slot}, which samples nothing in this call")
            if mask.dtype != np.int32 or mask.ndim != 1 or not 1 <= len(mask) <= words:
                raise RunnerError(
                    f"a token mask is 1..{words} int32 words (the vocabulary's bits), "
                    f"got {mask.dtype} {mask.shape}"
                )
            if not np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab_size].any():
                raise RunnerError(f"the token mask of slot {slot} allows no token of the vocabulary")

    def constrain(
        self, masks: Mapping[int, np.ndarray], samplers: Mapping[int, SlotState | SlotSampler]
    ) -> None:
        self.check_masks(masks, list(samplers))
        for slot, mask in masks.items():
            holder = samplers[slot]
            sampler = holder.sampler if isinstance(holder, SlotState) else holder
            assert sampler is not None  # checked: a decode slot has finished its prompt
            sampler.constrain(mask)

    def sampler(self, params: SamplingParams, prompt: Sequence[int]) -> SlotSampler:
        try:
            return SlotSampler(params, list(prompt), self.vocab_size, self.eos_ids)
        except ValueError as e:
            raise RunnerError(str(e)) from e

    def sample(self, logits: Tensor, samplers: list[SlotSampler], greedy: Tensor | None = None) -> list[int]:
        """Post-process on the device: argmax when every row is plain greedy (`greedy`: the decode
        graph's own, else the argmax graph), else top-k candidates for the host-side samplers. Only
        token ids (and k candidates) leave the device, except the logits of a row whose candidates
        would be the whole vocabulary, or that needs them whole (logprobs, logit bias, min_tokens):
        that row samples from them on the host, so the batch never runs the whole-vocabulary top-k
        (agent/sampling.py)."""
        if all(s.plain_greedy for s in samplers):
            ids = (self.graphs.argmax(logits) if greedy is None else greedy).asnumpy()
            return [int(t) for t in ids[: len(samplers)]]

        def choice(sampler: SlotSampler, choose: Callable[[], int]) -> int:
            return guarded(sampler, choose, NO_TOKEN)

        vocab = self.vocab_size
        whole = {
            i
            for i, s in enumerate(samplers)
            if s.needs_logits or bucket(self.graphs.topk_buckets, s.candidates_needed()) >= vocab
        }
        tokens = {}
        if whole:  # the rows come to the host: the plain greedy ones need no graph either
            whole |= {i for i, s in enumerate(samplers) if s.plain_greedy}
            rows = logits.asnumpy()
            tokens = {i: choice(samplers[i], partial(samplers[i].choose_from_logits, rows[i])) for i in whole}
        rest = [i for i in range(len(samplers)) if i not in tokens]
        if rest:
            k = bucket(self.graphs.topk_buckets, max(samplers[i].candidates_needed() for i in rest))
            values, ids = (t.asnumpy() for t in self.graphs.topk(k, logits))
            for i in rest:
                s = samplers[i]
                tokens[i] = (
                    int(ids[i, 0]) if s.plain_greedy else choice(s, partial(s.choose, values[i], ids[i]))
                )
        return [tokens[i] for i in range(len(samplers))]
