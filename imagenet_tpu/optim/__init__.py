"""Optimization: LARS, RMSprop warm-up, learning-rate schedules, weight-decay exclusions."""
