"""Batch inference on the rollout engines: generate, score, and turn scored samples into training data
(rejection sampling, conditional SFT, iterative DPO). `rlhfkit batch-inference` is the command."""
