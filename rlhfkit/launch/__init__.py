"""Starting a Ray command (`ppo`, `batch-inference`): the checks made before anything starts (`preflight`) and
starting or joining the Ray cluster (`ray_cluster`). Below `rl` and `inference`, which both use it; it imports
neither of them (tests/test_layering.py)."""
