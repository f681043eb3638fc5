"""Optimization: momentum SGD in one kernel per variable, LARS, RMSprop warm-up, learning-rate schedules,
weight-decay exclusions."""
