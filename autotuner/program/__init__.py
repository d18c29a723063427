"""A user's whole program, for the commands that run one (`plan`, `extract`, `bench-model`,
`tune-model`): `load` (the --mesh/--kwargs/--target/--memory options, the program loaded on
in-process CPU devices or moved onto an aot target), `factory` (importing MODULE:FACTORY, its
meshes, the plain and overlapped programs as a `Bench`, the numerics check, the lab's handler),
`on_target` (the program opened and planned on a target: this process or every process of a lab),
`winners` (the tuned winners from --db/--service/--snapshot), `bench_store` (a bench-model run as a
row of the results database) and `console` (the stderr console, `say`, `fail`, the --db database).

A library, not a command group: `autotuner.cli` wires these to options; nothing here imports
`autotuner.cli`.
"""
