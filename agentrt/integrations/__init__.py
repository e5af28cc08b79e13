"""Integrations of agentrt with other agent harnesses.

* `agentrt.integrations.rlm`: agentrt's sandboxed REPL and tool speculation as an environment of
  the RLM library (``pip install 'agentrt[rlm]'``, then ``RLM(environment="agentrt")``).

Each integration imports its harness only when it is itself imported.
"""
