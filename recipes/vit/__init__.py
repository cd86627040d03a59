"""The ViT recipe: image classification with a Vision Transformer (`recipe.py`; schemas in `config.py`)."""
