"""Reports: the tables, statistics and plots a run writes, and the views over DVC's experiments and plots."""
