"""The MNIST recipe: autoencoder pretraining, classifier fine-tuning and prediction (`recipe.py`;
schemas in `config.py`)."""
