"""What generate.py runs for any recipe that opts in to generation (recipes/base.py: GENERATION): the decoding
loop with a KV cache and sampling (`decoding.py`), the prompts (`prompts.py`) and the output file it appends to and
continues (`generations_file.py`). The recipe gives the tokenizer and runs its model on token ids."""
