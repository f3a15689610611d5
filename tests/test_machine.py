"""What this CPU computes bf16 with, decided by what it does: the instruction set names the machine, a probe
timing a bf16 against an fp32 matmul decides wherever that name does not (vlm_recipes/machine.py).

The bug this file pins (issue: precision decided by what the machine does): `precision: auto` asked oneDNN,
which says bf16 is supported on every CPU with AVX512BW, and trained in emulated bf16 on Xeons with AVX512
but no BF16, 3-5x slower than fp32. Tests inject the instruction set and the probe's timings."""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import datasets
import pytest
import torch
from filelock import FileLock

from vlm_recipes import machine
from vlm_recipes.cli import main as cli_main
from vlm_recipes.data import parallel
from vlm_recipes.decisions import Environment
from vlm_recipes.files import read_json
from vlm_recipes.machine import CpuBf16, decide_cpu_bf16, detect_environment
from vlm_recipes.model.guards import decide_parallelism, decide_precision

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
        machine.cpu_bf16_on.cache_clear()
        return probes

    yield fake
    machine.cpu_bf16_on.cache_clear()


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
    machine.cpu_bf16_on.cache_clear()
    before = torch.get_num_threads()
    try:
        for threads in sorted({1, before}):  # an xdist worker's and a CPU group's rank's 1, and this one's
            torch.set_num_threads(threads)
            env = detect_environment()
            assert not env.bf16_supported and "tests/conftest.py" in env.bf16_reason
            assert decide_precision("auto", env, quantized=False).choice == "fp32"
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# The probe's answer per thread count, and asked again


def test_the_answer_is_kept_per_thread_count(this_machine):
    """oneDNN picks its kernels by the threads: an answer measured on 2 threads is not one rank's on 1."""
    probes = this_machine("AVX2", (0.5, 26.0))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            assert not detect_environment().bf16_supported
    finally:
        torch.set_num_threads(before)
    assert probes == [(0.5, 26.0)] * 2  # once per thread count
    paths = {threads: machine.remembered_answer_path("AVX2", threads) for threads in (1, 2)}
    assert paths[1] != paths[2]
    assert {threads: read_json(path)["threads"] for threads, path in paths.items()} == {1: 1, 2: 2}


def test_a_process_that_finds_the_probe_under_way_waits_and_reads_its_answer(this_machine):
    """The ranks of a CPU group start together on an empty cache: one probes, the others read its answer
    (two probes near the bound could disagree, and the ranks train in two precisions)."""
    probes = this_machine("AVX2", (0.5, 26.0))
    threads = torch.get_num_threads()
    path = machine.remembered_answer_path("AVX2", threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(1) as pool:
        with FileLock(f"{path}.lock"):  # another rank is probing
            waiting = pool.submit(machine.cpu_bf16_on, threads)
            time.sleep(0.5)
            assert not waiting.done()
            machine.remember_cpu_bf16(CpuBf16("AVX2", True, "the other rank's answer"), threads)
        assert waiting.result(timeout=30).reason == "the other rank's answer" and probes == []


def test_machine_reprobe_probes_again_and_rewrites_the_kept_answer(this_machine, capsys):
    """`vlm-recipes machine --reprobe`: the kept answer (emulated) is replaced by what the probe finds now."""
    probes = this_machine("AVX512-BF16", AVX512_NO_BF16_TIMINGS)
    assert not detect_environment().bf16_supported
    path = machine.remembered_answer_path("AVX512-BF16")
    this_machine("AVX512-BF16", AVX512_BF16_TIMINGS)  # the VM now passes bf16 through: kept, not probed
    assert not detect_environment().bf16_supported and len(probes) == 1
    assert cli_main(["machine", "--reprobe"]) == 0
    said = capsys.readouterr().out
    assert probes == [AVX512_NO_BF16_TIMINGS, AVX512_BF16_TIMINGS]
    assert "CPU bf16: native on" in said and f"probed again, kept in {path}" in said
    assert read_json(path)["native"] is True and detect_environment().bf16_supported
    assert cli_main(["machine"]) == 0 and len(probes) == 2  # without --reprobe: the kept answer
    assert "kept in" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# A Mac: MPS found and left unused, its memory counted in bytes


def test_a_mac_with_mps_mocked_trains_on_the_cpu_and_the_guard_says_why(this_machine, monkeypatch):
    this_machine("Arm BF16", (10.0, 6.0))
    monkeypatch.setattr(machine.torch.backends.mps, "is_available", lambda: True)
    env = detect_environment()
    assert env.device == "cpu" and env.bf16_supported
    decision = decide_parallelism(env)
    assert decision.choice == "single device"
    assert decision.reason == f"CPU, one process; {machine.MPS_LEFT_UNUSED}"
    assert decision.reason.startswith("CPU, one process; Apple MPS found, left unused: this runner trains on")


def test_peak_memory_on_a_mac_mocked_reads_ru_maxrss_in_bytes(monkeypatch):
    """getrusage's ru_maxrss: KiB on Linux, bytes on macOS (a Mac's 1 GB read as 1,024 GB before)."""
    from vlm_recipes.evaluation import metrics

    cpu = Environment("cpu", 0, bf16_supported=False)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    linux_gb = metrics.peak_memory(cpu)["rss_gb"]
    assert linux_gb == usage.ru_maxrss / 2**20  # this machine: Linux, in KiB
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(metrics.resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=2**30))
    assert metrics.peak_memory(cpu)["rss_gb"] == 1.0


# ---------------------------------------------------------------------------------------------
# The cores a dataset is read with: affinity where the system has one, the cgroup's CPU quota


@pytest.fixture()
def cgroup(monkeypatch, tmp_path):
    """The cgroup files read from tmp_path: what the test writes there (nothing: no quota)."""
    monkeypatch.setattr(machine, "CGROUP_ROOT", tmp_path)

    def write(files: dict[str, str]) -> None:
        for name, text in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)

    return write


@pytest.fixture()
def sixteen_cores_mocked(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)


def test_a_2_cpu_cgroup_quota_reads_in_2_processes_on_16_cores_mocked(cgroup, sixteen_cores_mocked):
    cgroup({"cpu.max": "200000 100000\n"})
    assert parallel.parallel_processes(100_000) == 2
    assert parallel.processes_decision(100_000, 2) == (
        "100,000 rows in 2 processes "
        "(2 cores: cgroup quota 200000/100000 of 16 on the machine; 2,000+ rows each, at most 16)"
    )


@pytest.mark.parametrize(
    ("files", "cores"),
    [
        ({"cpu.max": "max 100000\n"}, "16 cores"),
        ({"cpu.max": "150000 100000\n"}, "2 cores: cgroup quota 150000/100000 of 16 on the machine"),
        ({"cpu.max": "50000 100000\n"}, "1 core: cgroup quota 50000/100000 of 16 on the machine"),
        ({"cpu.max": "3200000 100000\n"}, "16 cores"),  # a quota over the cores: the cores
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "16 cores"),
        (
            {"cpu,cpuacct/cpu.cfs_quota_us": "400000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            "4 cores: cgroup quota 400000/100000 of 16 on the machine",
        ),
        ({}, "16 cores"),  # no cgroup files: macOS, or no cpu controller
    ],
)
def test_the_cores_from_cgroup_v2_and_v1_files_on_16_cores_mocked(cgroup, sixteen_cores_mocked, files, cores):
    cgroup(files)
    assert str(machine.usable_cores()) == cores


def test_the_affinity_narrower_than_the_machine_is_said_on_16_cores_mocked(cgroup, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert str(machine.usable_cores()) == "3 cores: CPU affinity, of 16 on the machine"


def test_a_stage_reads_in_parallel_where_os_has_no_sched_getaffinity_as_on_macos(cgroup, monkeypatch, caplog):
    """macOS has no os.sched_getaffinity: the cores are os.cpu_count()'s, and the rows are checked in
    parallel where there are several (here, this machine's), as on Linux."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(parallel, "MIN_ROWS_PER_PROCESS", 10)
    caplog.set_level(logging.INFO)
    ds = datasets.Dataset.from_dict({"n": list(range(100))})
    odd = {n: ("odd", str(n)) for n in range(1, 100, 2)}
    assert parallel.problems_per_row(ds, lambda row: odd.get(row["n"]), "checking rows") == odd
    cores = os.cpu_count() or 1
    processes = min(cores, parallel.MAX_PROCESSES, 10)  # 100 rows, 10 a process
    assert parallel.parallel_processes(100) == processes
    assert f"checking rows: {parallel.processes_decision(100, processes)}" in caplog.text
    assert machine.usable_cores() == machine.Cores(cores)
