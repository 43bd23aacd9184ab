"""The engine: configuration, component selection and the step loop that drives the scheduler,
the model runner and the sampler."""
