"""Rollouts: episodes (warmup, fork into a GRPO group, play to the horizon), rewards, credit assignment,
and the Ray actors that run them and deliver trajectory groups to the learner's queue."""
