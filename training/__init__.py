"""What the trainer and the planner share: the assembly of a run's model, optimizers and step, and
the training step itself."""
