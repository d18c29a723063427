"""What a training job imports: `collective_einsum` (one decomposed einsum inside `jax.jit`) and
the client that asks the service for winners (with its in-process and disk caches and snapshots).
Imports no database, web-framework or Optuna code: the winners come over HTTP or from a file."""
