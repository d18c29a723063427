"""Example models to extract sharded einsums from (see `autotuner extract`)."""
