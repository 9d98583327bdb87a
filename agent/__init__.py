"""Agent side, in three parts:

- agent.contract: what the processes exchange (the agent wire protocol and transport, sampling
  parameters, the native HTTP request body); no MindSpore, no side effects: every process imports it;
- agent.model: the model's files (spec, checkpoint formats, quantized blocks, tokenizer,
  detokenizer); numpy only, read by the agents, the server and the tools;
- the agent runtime (the other modules: graphs, runner, kernels, the agent process and launcher),
  which needs MindSpore and is imported only by agent processes and the tools that run the model.
"""
