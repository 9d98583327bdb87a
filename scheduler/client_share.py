"""ClientShares: what each client (an API key, or an address when keys are off) holds of the server,
and the fair order in which waiting requests take free slots. Pure logic, used by BatchScheduler.

Work-conserving: a client alone may fill every slot, the whole waiting queue and every token in
flight. Fair under contention:
- a free slot goes to the waiting request whose client runs the fewest sequences, then the lower
  `priority` (with scheduling_policy priority: a client orders its own requests, and breaks ties
  with others, but cannot jump another client's fair share), then the oldest: a newcomer beside a
  client that holds every slot gets the next slot that frees, within one answer's time;
- once the queue (or the tokens in flight) reaches its bound, a client holding less than its share
  of that bound (scheduler.client_share) is still admitted, up to (1 + share) times the bound, while one
  holding more is refused: 429, naming the limit. So one client's flood cannot lock others out of
  the queue. (A client alone at the bound is refused as by a full server: 503, 429 on OpenAI's API.)
- scheduler.max_running_per_client, when set, caps a client's running sequences; its other requests
  wait even while slots are free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.sequence import Sequence


@dataclass
class ClientLoad:
    waiting: int = 0
    running: int = 0
    tokens: int = 0  # prompt + answer tokens its admitted requests may reach

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.tokens)


class ClientShares:
    def __init__(self, share: float = 1.0, max_running: int | None = None, by_priority: bool = False):
        if not 0 < share <= 1:
            raise ValueError(f"client_share must lie in (0, 1], got {share}")
        self.share, self.max_running, self.by_priority = share, max_running, by_priority
        self.loads: dict[str, ClientLoad] = {}

    def load(self, client: str) -> ClientLoad:
        return self.loads.get(client) or ClientLoad()

    def refusal(
        self, seq: Sequence, queue: tuple[int, int], tokens: tuple[int, int] | None
    ) -> tuple[str, bool] | None:
        """Why `seq` may not join the queue, if it may not, and whether its client is over its
        share (else the server is full for everyone): `queue` is (waiting now, its bound), `tokens`
        (in flight now, their bound; None: no bound)."""
        load = self.load(seq.client)
        checks = [(queue, load.waiting, 1, f"the waiting queue is full ({queue[1]} requests)")]
        if tokens is not None:
            now, bound = tokens
            checks.append(
                (
                    tokens,
                    load.tokens,
                    seq.token_budget,
                    f"too many tokens in flight: this request needs up to {seq.token_budget} (prompt + "
                    f"max_new_tokens), {max(0, bound - now)} of {bound} are free",
                )
            )
        for (now, bound), mine, need, full in checks:
            if now + need <= bound:
                continue
            # Alone, a client meets the server's own bound: it is full, not unfair.
            if self.share >= 1 or all(client == seq.client for client in self.loads):
                return full, False
            if mine + need > self.share * bound:
                share = f"scheduler.client_share {self.share:g} of it: {int(self.share * bound)}"
                return (
                    f"{full}, and this client would hold {mine + need}, more than its share ({share})",
                    True,
                )
            if now + need > (1 + self.share) * bound:
                return f"{full}, even for clients under their share", False
        return None

    def next_to_admit(self, waiting: Iterable[Sequence]) -> Sequence | None:
        """The waiting sequence a free slot goes to (None: every waiting client is at its cap): the
        client running fewest first, then by priority, then a stream before a pooling request (batch
        work: a chat arriving behind an embedding job's queued inputs starts at once, not after
        them), then in arrival order."""
        candidates = [
            s for s in waiting if self.max_running is None or self.load(s.client).running < self.max_running
        ]
        return min(
            candidates,
            # min keeps the first of equal keys: the waiting queue is in arrival order
            key=lambda s: (
                self.load(s.client).running,
                s.priority if self.by_priority else 0,
                s.sampling.pool is not None,
            ),
            default=None,
        )

    def queued(self, seq: Sequence) -> None:
        load = self.loads.setdefault(seq.client, ClientLoad())
        load.waiting += 1
        load.tokens += seq.token_budget

    def admitted(self, seq: Sequence) -> None:
        load = self.loads[seq.client]
        load.waiting -= 1
        load.running += 1

    def finished(self, seq: Sequence, was_running: bool) -> None:
        load = self.loads[seq.client]
        if was_running:
            load.running -= 1
        else:
            load.waiting -= 1
        load.tokens -= seq.token_budget
        if load.idle:
            del self.loads[seq.client]
