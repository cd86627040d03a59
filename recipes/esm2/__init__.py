"""ESM-2: a protein masked language model (recipes/esm2/recipe.py)."""
