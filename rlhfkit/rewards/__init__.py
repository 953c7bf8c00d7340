"""Reward sources for online RL: reward models, ``reward_func`` files, built-in verifiers, remote HTTP servers.

Modules: ``base`` (the :class:`RewardOutput` contract), ``reward_func``, ``verifiers``, ``reward_model``,
``remote`` (client), ``server`` (``rlhfkit serve-rm``), ``sources`` (``build_reward_source``, ``combine``).
See docs/rewards.md.
"""
