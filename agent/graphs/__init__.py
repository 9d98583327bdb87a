"""The model as MindSpore graphs: its layers and weights (decoder.py), the graphs of each step kind
built over them (step_graphs.py), the interface the runner calls any graph set through
(interface.py), and graphs loaded from MindIR exports (mindir.py)."""
