"""`vlmesh bench`: open-loop load, the write-ups' workloads, percentiles, baselines side by side."""
