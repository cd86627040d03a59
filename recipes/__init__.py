"""Recipes: a model, its data and its task, plugged into the loop through `base.Recipe`.
`registry.py` maps `recipe: <name>` to the class and registers the config schemas."""
