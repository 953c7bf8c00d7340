"""Multi-turn agent environments (`--agent_func_path`): docs/agents.md.

OpenRLHF's agent classes are importable from here, so an OpenRLHF agent file needs only its import line changed:
`from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor` (rlhfkit.agents.base)."""

from rlhfkit.agents.base import AgentInstanceBase, MultiTurnAgentExecutor

__all__ = ["AgentInstanceBase", "MultiTurnAgentExecutor"]
