"""`Strategy.from_key`, the Python side of the CLI's `--strategy KEY` (issue 37): every key the
space offers reads back as its strategy; anything else is a StrategyError naming what a key looks
like. And the note an `xla_windowed` choice carries: the exact flags that compile a whole step
with XLA's own decomposition, per platform."""

from __future__ import annotations

import pytest

from autotuner import Device, Problem, Strategy, space
from autotuner.overlap.choose import _valid
from autotuner.strategy import StrategyError
from service.testing import problem


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_every_key_of_the_space_reads_back(platform: str) -> None:
    for d in (problem(), problem(64, 64, 64)):
        device = Device(platform=platform, device_kind=platform, num_devices=8, num_processes=1, topology="key-test",
                        jax_version="0.10.2", jaxlib_version="0.10.2")
        strategies = space(Problem.from_dict(d), device)
        assert strategies and (platform == "cpu" or any(s.method == "xla_windowed" for s in strategies))
        for s in [*strategies, *(s.serial() for s in strategies if s.method == "ring")]:
            assert Strategy.from_key(s.key) == s, s.key


@pytest.mark.parametrize("bad", ["", "ring", "ring-uni-c3-u1-loop-send", "ring-uni-cx-u1-loop-send",
                                 "ring-sideways-c2-u1-loop-send", "ring-uni-c2-u1-loop-later", "auto", "xla"])
def test_a_bad_key_is_a_strategy_error(bad: str) -> None:
    with pytest.raises(StrategyError):
        Strategy.from_key(bad)


def test_an_xla_windowed_choice_says_which_flags_to_set() -> None:
    p = Problem.from_dict(problem())
    gpu = _valid(p, Strategy("xla_windowed", multi_stream=True), "gpu")
    assert gpu is not None and ("XLA_FLAGS='--xla_gpu_threshold_for_windowed_einsum_mib=0 "
                                "--xla_gpu_multi_streamed_windowed_einsum=true'") in gpu
    tpu = _valid(p, Strategy("xla_windowed"), "tpu")   # said, with what forcing it would be
    assert tpu is not None and "plain jit runs it" in tpu and ("LIBTPU_INIT_ARGS='--xla_tpu_enable_windowed_einsum_for_all_gather=true "
                                "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=true "
                                "--xla_jf_spmd_threshold_for_windowed_einsum_mib=0'") in tpu
    cpu = _valid(p, Strategy("xla_windowed"), "cpu")
    assert cpu is not None and "XLA:CPU has no windowed einsum" in cpu
