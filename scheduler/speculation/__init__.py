"""Speculative decoding, the scheduler's side: tokens proposed for a decoding sequence are verified
together in one step, the target's answers staying exactly its own.

- speculator.py: Speculator, what each sequence proposes (n-gram prompt lookup, or a count for the
  agents' draft model, agent/drafter.py) and when it rests after proposals that failed;
- ngram.py: the prompt lookup and each sequence's SpeculationState;
- proposal_length.py: how many proposals pay for themselves, from the acceptance and the costs;
- verify_costs.py: each group's learned cost of verifying proposals;
- drafts.py: Drafts, a plan's proposals and their counts for the metrics.
"""
