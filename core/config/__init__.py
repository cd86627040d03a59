"""Config schemas (`schema.py`: every default and its meaning) and their strict validation (`validation.py`)."""
