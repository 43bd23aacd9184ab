"""Running the model: the model runner, backend output checks, compiled decode steps and
tensor-parallel execution."""
