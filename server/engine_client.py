"""EngineClient: one model's engine as the front end drives it (vLLM's AsyncLLM): `generate` queues
an EngineRequest and returns its AnswerStream, `abort` ends a request. The routes never pair the
engine and the output processor themselves, nor work out which token ids end an answer unseen.

    client = EngineClient(engine, outputs)
    stream = client.generate(request, stop=("\\n\\n",))   # AdmissionError when refused
    async for out in stream: ...                          # closing it early aborts the request
"""

from __future__ import annotations

from scheduler.engine import Engine
from scheduler.engine_io import AdmissionError, EngineRequest
from server.output import AnswerStream, OutputProcessor


class EngineClient:
    def __init__(self, engine: Engine, outputs: OutputProcessor):
        self.engine, self.outputs = engine, outputs

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end every answer of the model (its EOS ids, the agents' among them)."""
        return self.engine.stop_ids

    def generate(
        self, request: EngineRequest, stop: tuple[str, ...] = (), shown: frozenset[int] = frozenset()
    ) -> AnswerStream:
        """Queue `request` (AdmissionError if refused) and open its stream: `stop` strings end its
        text, `shown` special tokens are written as text (a tool format's markers); the ids that end
        it are the request's stop ids beside the model's, never text."""
        try:
            self.engine.add_request(request)
        except AdmissionError:
            self.outputs.metrics.requests.labels("rejected").inc()
            raise
        hidden = request.stop_ids(self.engine.stop_ids)
        return self.outputs.open(request.request_id, hidden, stop, self.abort, shown)

    def abort(self, request_id: str) -> None:
        """End the request now (its stream gets a final output), freeing its slot."""
        self.engine.abort(request_id)
