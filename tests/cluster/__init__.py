"""Real cluster components for the launch tests: Slurm daemons, network-namespace hosts."""
