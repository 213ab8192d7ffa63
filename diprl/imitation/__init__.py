"""Imitation: teacher data from rule-bot games, the `python -m diprl.imitation` command, agreement.

It trains through the learner (`diprl.learn.learner.Learner.train_records(records, "bc")`) and
imports game, bots, policy, inference and learn; nothing imports it but entry points and benchmarks.
Modules: `teacher` (one decision, tokenized as the policy writes it), `strata` (which decisions to
keep), `data` (games in worker processes, the held-out split), `shards` (on disk, cached),
`train` (batches of whole game states), `decode` and `agreement` (greedy constrained decode, scored
against the teacher), `config` and `run` (the command).
"""
