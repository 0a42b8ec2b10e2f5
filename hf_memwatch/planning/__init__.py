"""Planning: which configuration of a run fits its memory limit, fastest, changing nothing else."""
