"""The model as MindSpore graphs: the shared layer math (layers.py), a decoder layer with its weights
and KV cache (decoder.py), the whole model (model.py), the graphs of each step kind
built over them (step_graphs.py), the interface the runner calls any graph set through
(interface.py), and graphs loaded from MindIR exports (mindir.py)."""
