"""Environments that misbehave on purpose (fault injection for the error tests); pick one with the MODE variable."""

MODE = "raise"


class AgentInstance:
    def step(self, states):
        if states["turn"] == 0:
            return {"rewards": 0.0, "done": False, "environment_feedback": " more"}
        if MODE == "raise":
            raise KeyError("no such tool")
        if MODE == "nan":
            return {"rewards": float("nan"), "done": True}
        if MODE == "no_done":
            return {"rewards": 1.0}
        return "not a dict"
