"""Tuning: the Optuna search over a problem's strategies (`search`), storing sessions and winners
in the database (`store`), and the worker that takes tuning jobs from the service (`service_worker`).
The one part of `autotuner` that imports the database layer (`db`) and Optuna."""
