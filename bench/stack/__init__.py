"""Local stacks: simulated or real workers and a router on this machine, and their layouts."""
