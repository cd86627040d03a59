"""The training loop's building blocks: config schemas, distributed setup, layers, data-parallel
backends, optimizer, data sampling, precision and metrics."""
