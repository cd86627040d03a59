"""The tiny example recipe (docs/points.md): a small network learns a noisy linear function of 3-d points.
It is what docs/architecture.md walks when it adds a recipe: the smallest contract, nothing else."""
