"""python tests/support/cached_greedy.py MODEL RUNTIME_JSON PROMPT_JSON STEPS: build a runner with the
runtime's compile cache, warm it up with the known-answer check, print its greedy tokens as JSON.
(A file, not `python -c`: MindSpore's compile cache reads its entry script.)"""

import json
import sys

import runner_calls as calls
from agent.bootstrap import Placement, build_runner, init_device
from agent.contract.sampling import SamplingParams
from config.schema import ModelSection, RuntimeSection, ServingConfig

model, runtime, prompt, steps = (
    sys.argv[1],
    RuntimeSection.model_validate_json(sys.argv[2]),
    json.loads(sys.argv[3]),
    int(sys.argv[4]),
)
config = ServingConfig(model=ModelSection(path=model), runtime=runtime)
init_device(config, Placement("test"))
runner, _ = build_runner(config, Placement("test"), lambda line: None)
tokens = [calls.prefill(runner, 0, prompt, SamplingParams())]
while len(tokens) < steps:
    tokens += calls.decode(runner, [0])
print(json.dumps(tokens))
