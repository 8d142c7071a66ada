"""Calculator tool-use agent: the smallest task where RL visibly teaches a policy to use a tool."""
