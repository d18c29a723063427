"""The model in use: calibrations stored per device, the tuner's `order_for`, and the
service's `model_answer` (the model's pick for an untuned shape)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotuner.costmodel.params import VERSION, CostModelError, Params
from autotuner.costmodel.simulate import predict, ranker
from autotuner.device import Device
from autotuner.problem import GroupedProblem, Problem
from autotuner.strategy import Strategy


def order_for(database: Any, device: Device, problem: Problem) -> Callable[[list[Strategy]], list[Strategy]] | None:
    """The model's `order` for `problem` on `device` if the device is calibrated, else None (and
    None for a grouped problem: the model simulates one einsum's ring, not k on one ring)."""
    if isinstance(problem, GroupedProblem):
        return None
    try:
        return ranker(load_params(database, device), problem)
    except CostModelError:
        return None



def model_answer(database: Any, *, cache_s: float = 300.0, min_speedup: float = 1.1
                 ) -> Callable[[Problem, Device], tuple[Strategy, float] | None]:
    """For the service: `fn(problem, device) -> (strategy, speedup) | None` (None: the device has
    no calibration, or the model does not predict at least `min_speedup` over the baseline: a
    prediction is not a measurement, so a thin predicted gain is left to the baseline rather than
    risk a regression). Calibrations are read from `database` (`load_params`) and kept `cache_s`
    seconds; predictions (a few ms per strategy) are kept per (device, problem) until the
    device's calibration changes, at most `ANSWERS_MAX` of them."""
    import threading
    import time

    params_cache: dict[str, tuple[float, Params | None]] = {}
    answers: dict[tuple[str, str], tuple[Strategy, float] | None] = {}
    lock = threading.Lock()

    def fn(problem: Problem, device: Device) -> tuple[Strategy, float] | None:
        now = time.monotonic()
        hit = params_cache.get(device.key)
        if hit is None or now - hit[0] > cache_s:
            try:
                fresh: Params | None = load_params(database, device)
            except CostModelError:
                fresh = None
            with lock:
                if hit is not None and hit[1] != fresh:  # recalibrated: earlier answers are stale
                    for k in [k for k in answers if k[0] == device.key]:
                        del answers[k]
                hit = params_cache[device.key] = (now, fresh)
        params = hit[1]
        if params is None or problem.pattern.kind == "none" or isinstance(problem, GroupedProblem):
            return None
        key = (device.key, problem.key)
        if key in answers:
            return answers[key]
        try:
            s, speedup = predict(problem, device, params)
            got = None if s.is_baseline or speedup < min_speedup else (s, speedup)
        except CostModelError:
            got = None
        with lock:
            if len(answers) >= ANSWERS_MAX:
                answers.clear()
            answers[key] = got
        return got

    return fn


ANSWERS_MAX = 100_000


# ============================================================================ the database


def save_params(database: Any, device: Device, params: Params, *, raw: dict[str, Any] | None = None) -> Any:
    """Store `params` as `device`'s calibration (the newest one is the one used)."""
    from autotuner.snapshot import device_values
    from db import repository as repo

    with database.session() as s:
        dev = repo.upsert_device(s, **device_values(device))
        return repo.add_calibration(s, dev.id, model=f"costmodel-v{VERSION}", params=params.to_dict(),
                                    raw=raw)


def load_params(database: Any, device: Device) -> Params:
    """The newest calibration of `device`; CostModelError if there is none."""
    from db import repository as repo

    with database.session(read_only=True) as s:
        rec = repo.get_calibration(s, device.key, model=f"costmodel-v{VERSION}")
    if rec is None:
        raise CostModelError(f"device {device.label} has no calibration: run `autotuner calibrate --target ...`")
    return Params.from_dict(dict(rec.params))
