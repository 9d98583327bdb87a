"""python tests/cached_greedy.py MODEL RUNTIME_JSON PROMPT_JSON STEPS: build a runner with the
runtime's compile cache, warm it up with the known-answer check, print its greedy tokens as JSON.
(A file, not `python -c`: MindSpore's compile cache reads its entry script.)"""
import json, sys
from agent.model.formats import load_checkpoint
from agent.compile_cache import compile_cache_dir
from agent.known_answer import KnownAnswer
from agent.runner import ModelRunner, configure_mindspore
from agent.contract.sampling import SamplingParams
from config.schema import RuntimeSection

model, runtime, prompt, steps = sys.argv[1], RuntimeSection.model_validate_json(sys.argv[2]), \
    json.loads(sys.argv[3]), int(sys.argv[4])
checkpoint = load_checkpoint(model)
configure_mindspore(runtime, compile_cache=compile_cache_dir(checkpoint, runtime, "test"))
runner = ModelRunner(checkpoint, runtime)
runner.warm_up(lambda line: None, known=KnownAnswer.of_checkpoint(checkpoint, runtime))
tokens = [runner.prefill(0, prompt, SamplingParams())]
while len(tokens) < steps:
    tokens += runner.decode([0])
print(json.dumps(tokens))
