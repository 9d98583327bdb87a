"""Which replica a request goes to: the one most likely to hold its prompt's prefix in its prefix
cache, else the least loaded (Ray Serve LLM's PrefixCacheAffinityRouter is the model; this one keeps
its table in the proxy's process instead of a tree actor, and hashes blocks instead of a char tree).

The proxy hashes the first blocks of the prompt text (`prefix_hashes`, each hash covering every block
before it, as the agents' prefix cache chains its blocks) and passes them as the call's keyword
`prefix`; a call may also name its replica (`replica`: the proxy's ?replica= and its sums over the
replicas), or one to avoid (`avoid`: a request that replica refused). After each routing the router
remembers the replica for every hash of the prompt.
"""

from __future__ import annotations

import asyncio
import importlib
import random
from collections import OrderedDict

from ray.serve._private.common import ReplicaID
from ray.serve._private.replica_result import ReplicaResult
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve.request_router import RequestRouter

IDLE_ROUTING_TASK_S = 0.005
# Hashes remembered (oldest forgotten first): 8 per prompt, so the last ~12 000 prompts.
REMEMBERED_HASHES = 100_000


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 8, **_unused) -> None:
        """imbalance: the replica holding a prefix is passed over when it has this many more
        requests under way than the least loaded one (its cache is not worth the wait)."""
        self.imbalance = imbalance
        self.owners: OrderedDict[str, str] = OrderedDict()  # prefix hash -> replica's unique id
        self.routed_by_prefix = 0  # requests sent to the replica holding their prefix
        if self._deployment_id is not None:  # the proxy lists the replicas through it
            # Looked up now: this class reaches the proxy by value (tools/ray_serve/prefix.py)
            shared = importlib.import_module("tools.ray_serve.prefix")
            shared.ROUTERS[self._deployment_id.name] = self

    def replica_ids(self) -> list[str]:
        return sorted(r.replica_id.unique_id for r in self._replicas.values())

    def _load(self, replica: RunningReplica) -> int:
        """Requests under way at the replica as this router knows them (its sends, and the queue
        lengths the replica reported when probed)."""
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None:
            # A routing task whose request another task took (or left behind: Ray's routing task
            # may give up its request when there are more tasks than requests): it chooses for
            # the oldest waiting request, which _fulfill_next_pending_request gives it to.
            pending_request = self._oldest_waiting()
            if pending_request is None:
                await asyncio.sleep(IDLE_ROUTING_TASK_S)  # lets the tasks placing requests run
                return [candidate_replicas]
        # Every choice below is final: when none of it takes the request, Ray backs off before
        # asking again (else its routing task spins, probing the replicas).
        pending_request.routing_context.should_backoff = True
        kwargs = pending_request.kwargs
        named = kwargs.get("replica")
        if named is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == named]]
        # A request another replica refused avoids that one (unless it is the only one).
        others = [r for r in candidate_replicas if r.replica_id.unique_id != kwargs.get("avoid")]
        candidates = self.select_available_replicas(others) or others or candidate_replicas
        if not candidates:
            return []
        by_load = sorted(candidates, key=self._load)
        by_id = {r.replica_id.unique_id: r for r in candidates}
        for digest in reversed(kwargs.get("prefix") or []):  # the longest prefix first
            owner = by_id.get(self.owners.get(digest, ""))
            if owner is not None:
                if self._load(owner) - self._load(by_load[0]) <= self.imbalance:
                    self.routed_by_prefix += 1
                    return [[owner], [r for r in by_load if r is not owner]]
                break
        # Least loaded first; among equally loaded ones at random (Ray takes the first of a rank
        # with the shortest queue), so unrelated prompts spread.
        least = self._load(by_load[0])
        first = [r for r in by_load if self._load(r) == least]
        random.shuffle(first)
        return [first, [r for r in by_load if self._load(r) > least]]

    def _oldest_waiting(self) -> PendingRequest | None:
        return next((r for r in self._pending_requests_to_fulfill if not r.future.done()), None)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """The request the replica was chosen for, else the oldest waiting one it may take (a
        request naming a replica takes no other; Ray's FIFOMixin would give it any)."""
        request = self._get_pending_request_matching_internal_request_id(request_metadata)
        if request is None:
            request = next(
                (
                    r
                    for r in self._pending_requests_to_fulfill
                    if not r.future.done()
                    and r.kwargs.get("replica") in (None, replica.replica_id.unique_id)
                    and r.kwargs.get("avoid") != replica.replica_id.unique_id
                ),
                None,
            )
        if request is not None:
            self._record_queue_wait_time(request)
            request.future.set_result(replica)
            self._remove_pending_request_from_indices(request)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        for digest in pending_request.kwargs.get("prefix") or []:
            self.owners[digest] = replica_id.unique_id
            self.owners.move_to_end(digest)
        while len(self.owners) > REMEMBERED_HASHES:
            self.owners.popitem(last=False)
