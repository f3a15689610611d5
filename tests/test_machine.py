"""What this CPU computes bf16 with, decided by what it does: the instruction set names the machine, a probe
timing a bf16 against an fp32 matmul decides wherever that name does not (vlm_recipes/machine.py).

The bug this file pins (issue: precision decided by what the machine does): `precision: auto` asked oneDNN,
which says bf16 is supported on every CPU with AVX512BW, and trained in emulated bf16 on Xeons with AVX512
but no BF16, 3-5x slower than fp32. Tests inject the instruction set and the probe's timings."""

from __future__ import annotations

import pytest

from vlm_recipes import machine
from vlm_recipes.decisions import Environment
from vlm_recipes.machine import CpuBf16, decide_cpu_bf16, detect_environment
from vlm_recipes.model.guards import decide_precision

# Measured on 2 threads of a Xeon with AVX512 and no BF16 (the issue): a 2048x2048 matmul at 0.242 TFLOP/s
# in fp32 and 0.045 in bf16, i.e. 5.4x slower in bf16. Times in ms of that matmul.
AVX512_NO_BF16_TIMINGS = (2 * 2048**3 / 0.242e12 * 1e3, 2 * 2048**3 / 0.045e12 * 1e3)
AVX512_BF16_TIMINGS = (71.0, 38.0)  # bf16 dot products: about twice fp32's rate


@pytest.fixture()
def this_machine(monkeypatch, tmp_path):
    """A machine whose instruction set and probe timings the test sets; its answer kept under tmp_path."""
    monkeypatch.setenv("VLM_RECIPES_CACHE", str(tmp_path))
    monkeypatch.setattr(machine.torch.cuda, "is_available", lambda: False)
    probes = []

    def fake(instruction_set: str, timings: tuple[float, float] | None):
        def probe():
            probes.append(timings)
            return timings

        monkeypatch.setattr(machine, "cpu_instruction_set", lambda: instruction_set)
        monkeypatch.setattr(machine, "time_bf16_against_fp32", probe)
        machine.cpu_bf16.cache_clear()
        return probes

    yield fake
    machine.cpu_bf16.cache_clear()


def test_avx512_without_bf16_trains_in_fp32_saying_what_the_probe_measured(this_machine):
    this_machine("AVX512", AVX512_NO_BF16_TIMINGS)
    env = detect_environment()
    decision = decide_precision("auto", env, quantized=False)
    assert decision.choice == "fp32"
    assert decision.reason.startswith(
        "AVX512 without BF16: bf16 matmul measured 5.4x slower than fp32 → fp32"
    )
    assert env.describe() == "CPU, AVX512 (bf16 emulated)"


@pytest.mark.parametrize(
    ("instruction_set", "timings", "reason"),
    [
        ("AMX", None, "AMX: bf16 matmuls run on its tile units"),
        ("AVX512-BF16", AVX512_BF16_TIMINGS, "AVX512-BF16: bf16 matmul measured 1.9x faster than fp32"),
        ("Arm BF16", (10.0, 6.0), "Arm BF16: bf16 matmul measured 1.7x faster than fp32"),
    ],
)
def test_a_cpu_that_computes_bf16_natively_trains_in_bf16(this_machine, instruction_set, timings, reason):
    probes = this_machine(instruction_set, timings)
    env = detect_environment()
    decision = decide_precision("auto", env, quantized=False)
    assert decision.choice == "bf16" and decision.reason.startswith(reason)
    assert env.describe() == f"CPU, {instruction_set} (bf16 native)"
    assert probes == ([] if instruction_set == "AMX" else [timings])  # AMX needs no probe


def test_bf16_instructions_the_probe_finds_slow_are_not_trusted(this_machine):
    """A VM may report AVX512-BF16 while bf16 runs emulated: the measurement decides, and says so."""
    this_machine("AVX512-BF16", AVX512_NO_BF16_TIMINGS)
    decision = decide_precision("auto", detect_environment(), quantized=False)
    assert decision.choice == "fp32"
    assert decision.reason.startswith("AVX512-BF16 reported, but bf16 matmul measured 5.4x slower than fp32")


def test_the_answer_is_kept_per_machine_and_the_probe_runs_once(this_machine):
    probes = this_machine("AVX2", (0.5, 26.0))
    first = detect_environment()
    this_machine("AVX2", (0.5, 0.4))  # another process on the same machine: the kept answer, no probe
    second = detect_environment()
    assert probes == [(0.5, 26.0)] and first == second and not second.bf16_supported
    assert "52.0x slower" in second.bf16_reason


def test_an_explicit_bf16_on_a_cpu_that_emulates_it_trains_in_bf16_and_says_it_is_emulated(this_machine):
    this_machine("AVX2", (0.5, 26.0))
    decision = decide_precision("bf16", detect_environment(), quantized=False)
    assert decision.choice == "bf16"
    assert decision.reason == (
        "set in the recipe; this CPU emulates bf16: AVX2 without BF16: bf16 matmul measured 52.0x slower than fp32"
    )


def test_gpus_are_decided_as_before():
    h100 = Environment("cuda", 1, bf16_supported=True, gpu_name="NVIDIA H100 80GB HBM3")
    t4 = Environment("cuda", 1, bf16_supported=False, gpu_name="Tesla T4")
    assert str(decide_precision("auto", h100, quantized=False)) == "precision: bf16 (GPU supports bf16)"
    assert decide_precision("auto", t4, quantized=False).choice == "fp16"
    assert h100.describe() == "1 × NVIDIA H100 80GB HBM3 (bf16 yes)"


@pytest.mark.parametrize(
    ("timings", "native"),
    [((1.0, 1.4), True), ((1.0, 1.6), False), ((1.0, 0.2), True), ((1.0, 3.0), False)],
)
def test_the_bound_between_native_and_emulated(timings, native):
    assert decide_cpu_bf16("AVX512", timings).native is native


def test_the_probe_on_this_machine_is_short_and_decides_by_its_own_timings():
    """The real probe here (whatever this CPU is): both matmuls timed, and the answer follows the ratio."""
    import time

    started = time.perf_counter()
    fp32_ms, bf16_ms = machine.time_bf16_against_fp32()
    took = time.perf_counter() - started
    assert fp32_ms > 0 and bf16_ms > 0
    assert took < 1.0  # ~50 ms where bf16 is native, ~2 emulated bf16 matmuls (~50 ms on AVX2) elsewhere
    answer = decide_cpu_bf16(machine.cpu_instruction_set(), (fp32_ms, bf16_ms))
    assert isinstance(answer, CpuBf16)
    if answer.instruction_set != "AMX":
        assert answer.native is (bf16_ms / fp32_ms <= machine.NATIVE_BF16_BOUND)


def test_the_suite_runs_auto_in_fp32_on_every_cpu():
    """conftest.py keeps this machine's answer as "no native bf16", so no test's path depends on the CPU."""
    machine.cpu_bf16.cache_clear()
    env = detect_environment()
    assert not env.bf16_supported and "tests/conftest.py" in env.bf16_reason
    assert decide_precision("auto", env, quantized=False).choice == "fp32"
