"""The GPT recipe: decoder-only language model pretraining on Megatron-Core datasets (`recipe.py`;
schemas in `config.py`; `python -m recipes.gpt.preprocess` makes indexed datasets)."""
