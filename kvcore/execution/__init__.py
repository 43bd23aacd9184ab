"""Running the model (layer 3): the model runner, backend output checks, compiled decode steps and
tensor-parallel execution."""
