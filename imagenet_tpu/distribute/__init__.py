"""Distribution: which strategy, where TPU replicas sit on the torus, grouped and 2-D all-reduces (the one place
of TPU collective ops), and local worker clusters."""
