"""Planning a run before paying for it: what a recipe costs and reaches on a topology (imagenet-tpu-plan)."""
