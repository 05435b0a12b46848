"""The job runtime's leaves: the config, the memory plan, disk checkpoint names, fault plans, and the
agent↔rank contract. No Lightning here: the agent process imports these."""
