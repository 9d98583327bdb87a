"""The launcher: starts each model's agent processes, waits for their readiness, supervises and
restarts them (model_agents.py), the models it holds and their loads and unloads (models.py), the
server's control channel (control.py), the memory budget they share (memory_budget.py), and the
`start_agent.py` entry (start.py)."""
