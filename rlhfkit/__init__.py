"""rlhfkit: post-training language models with human feedback and verifiable rewards."""

__version__ = "0.1.0"
