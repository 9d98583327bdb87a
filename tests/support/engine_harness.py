"""A model's engine and its answer streams, built side by side as the model repository builds them,
for tests that drive the engine without the HTTP server."""

from __future__ import annotations

from agent.contract.sampling import SamplingParams
from agent.model.tokenizer import TextTokenizer
from config.schema import ServingConfig
from scheduler.engine import Engine
from server.admission import AnswerRequest, generate_answer
from server.engine_client import EngineClient
from server.output import AnswerStream, OutputProcessor


class EngineAndStreams:
    def __init__(self, config: ServingConfig, tokenizer: TextTokenizer):
        self.outputs = OutputProcessor(tokenizer)
        self.engine = Engine(config, tokenizer.vocab_size, tokenizer.eos_ids, self.outputs.process)
        self.client = EngineClient(self.engine, self.outputs)

    def generate_answer(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
    ) -> AnswerStream:
        request = AnswerRequest(
            prompt=prompt,
            samplings=[sampling],
            max_new_tokens=max_new_tokens,
            stop=stop,
            ignore_eos=ignore_eos,
        )
        return generate_answer(self.client, request, sampling, request_id)
