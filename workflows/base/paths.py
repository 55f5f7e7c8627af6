"""The agent's own files in a state dir, by name: the CLI, the agent and the checks meet
there. Plain constants (the quick CLI reads them without importing the store)."""

DOORBELL = "agent.sock"  # datagram: "a new intent was written" (runners/base/doorbell.py)
CONTROL = "control.sock"  # stream: the quick CLI's requests (runners/quick/control.py)
LOCK = "agent.lock"  # flock held by the running agent; holds its pid
AGENT_ID = "agent-id"  # the box's name, written once
AGENT_LOG = "agent.log"  # where `vigil agent start` sends the detached agent's log
HALTED = "agent.halted"  # the agent's one line when it stopped acting, for status and check
CLAIMS = "claims"  # a job run's exec claims, one per generation uuid (SpawnSpec.exec_claim)
