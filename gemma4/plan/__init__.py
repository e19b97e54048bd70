"""How to run on this machine: hardware probe, policy, checks, CPU tuning, mesh rules, memory pre-flight."""
