"""`autotuner calibrate`: calibrate the cost model on a target and store it for the device.

Registers on the `autotuner` app (`autotuner.cli.common`). Progress and the parameter table go to stderr; with
--json the parameters (and the device) go to stdout as one JSON object.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from autotuner.cli.common import DB_HELP, app, err, fail, say

HELP = """Calibrate the cost model on a target and store its parameters for the target's device.

Runs, through the ordinary harness (the same barrier and max-over-processes timing as `autotuner tune`), a matmul-rate sweep, a point-to-point transfer sweep (all-gather and reduce-scatter rings whose einsums are negligible, 1, 2 and 4 chunks, one and both directions) and four overlap sessions (all-gather and reduce-scatter, balanced and compute-heavy shapes), then fits the model (`autotuner.costmodel`). Takes a few minutes on the lab. The newest calibration of a device is the one `autotuner.costmodel.load_params` (the tuner's order, the service's `model` answers) reads.
"""


def params_table(params: Any) -> Table:
    t = Table(title="cost-model calibration")
    t.add_column("parameter")
    t.add_column("value")
    rows = [
        ("matmul", ", ".join(f"{f / 1e9:.2g} GF: {f / s / 1e9:.1f} GF/s" for f, s in params.mm)),
        ("memory floor", f"{params.mem_bw / 1e9:.2f} GB/s"),
        ("all-gather alone", f"{params.ag[0] * 1e3:.2f} ms + {params.ag[1] * 1e9:.3f} ns/B "
                             f"({8 / params.ag[1] / 1e9 if params.ag[1] else 0:.2f} Gbit/s)"),
        ("reduce-scatter alone", f"{params.rs[0] * 1e3:.2f} ms + {params.rs[1] * 1e9:.3f} ns/B"),
        ("transfer latency", f"{params.alpha * 1e6:.0f} us"),
        ("transfer, one direction", f"{8 / params.beta_uni / 1e9 if params.beta_uni else 0:.2f} Gbit/s"),
        ("transfer, per direction when both", f"{8 / params.beta_bidi / 1e9 if params.beta_bidi else 0:.2f} Gbit/s"),
        ("cpu slowdown during a transfer (kappa)", f"{params.kappa:.2f}"),
        ("transfer slowdown during compute", f"{params.kappa_x:.2f}"),
        ("rolled-loop iteration", f"{params.loop_s * 1e6:.0f} us"),
        ("copy rate (fuse=after, concatenation)", f"{params.copy_bw / 1e9:.2f} GB/s"),
    ]
    if params.info:
        rows.append(("fit", ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in params.info.items())))
    for k, v in rows:
        t.add_row(k, v)
    return t


@app.command("calibrate", help=HELP)
def calibrate_cmd(
    target: Annotated[str | None, typer.Option(help="inproc:N, lab:TOPOLOGY:N:RATE or local")] = None,
    db: Annotated[str | None, typer.Option("--db", help=DB_HELP)] = None,
    reps: Annotated[int, typer.Option(min=3, help="timed repetitions per program")] = 5,
    raw: Annotated[Path | None, typer.Option("--raw", help="also write the raw sweeps (JSON) here")] = None,
    store_raw: Annotated[bool, typer.Option("--store-raw/--no-store-raw",
                                            help="keep the raw sweeps in the database too")] = True,
    json_out: Annotated[bool, typer.Option("--json", help="the parameters as JSON on stdout")] = False,
) -> None:
    from autotuner import costmodel
    from autotuner.cli.common import db_url, open_database
    from autotuner.measure.targets import Target, TargetError, TargetSession, default_target

    try:
        tgt = Target.parse(target or default_target())
    except TargetError as e:
        fail(str(e))
    database = open_database(db_url(db))
    try:
        with TargetSession(tgt, log=say) as ts:
            err.print(f"calibrating on {tgt.text}: device {ts.device.label} ({ts.device.key[:8]})",
                      highlight=False)
            params, sweeps = costmodel.calibrate(ts, reps=reps, log=say)
            device = ts.device
    except TargetError as e:
        fail(str(e))
    except costmodel.CostModelError as e:
        fail(f"calibration failed: {e}")
    if raw is not None:
        raw.write_text(json.dumps(sweeps, indent=1))
    rec = costmodel.save_params(database, device, params, raw=sweeps if store_raw else None)
    err.print(params_table(params))
    err.print(f"stored as calibration {rec.id} of device {device.label} ({device.key[:8]})", highlight=False)
    if json_out:
        sys.stdout.write(json.dumps({"device": device.to_dict(), "device_key": device.key,
                                     "calibration_id": rec.id, "params": params.to_dict()}) + "\n")
