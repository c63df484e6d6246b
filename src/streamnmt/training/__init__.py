"""The training run: the trainer's loop, the step, EMA, stopping, checkpointer, evaluator,
recipe, monitors, logs and plots."""
