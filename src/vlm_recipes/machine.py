"""The machine a stage runs on, found once: its GPUs, or its CPU's instruction set and whether that CPU
computes bf16 natively, measured.

"Native bf16" on a CPU is a question about speed, not about what runs: every x86 CPU with AVX512BW runs bf16
through oneDNN (`torch.ops.mkldnn._is_mkldnn_bf16_supported()` says yes), but without AVX512-BF16 or AMX it
converts every operand to fp32 first. Measured on 2 threads of a Xeon with AVX512 and no BF16: a 2048x2048
bf16 matmul 5.4x slower than fp32, a Linear's forward and backward under bf16 autocast 3.2x slower; on an
AMD EPYC with AVX2 only, a 256x256 bf16 matmul ~90x slower. So the instruction set names the machine, and
a ~50 ms probe that times a bf16 against an fp32 matmul decides, wherever the instruction set alone does not
settle it (AMX settles it: its tiles multiply bf16 at several times fp32's rate). The answer is kept per
machine (CPU model, instruction set, torch version, torch's thread count: oneDNN picks its kernels by the
threads too) in the vlm-recipes cache, so a run pays for the probe once per machine and thread count;
`vlm-recipes machine --reprobe` asks again. Every consumer (the precision guard, the plan, `inspect`,
`predict`, the benchmarks' labels) reads it through `detect_environment()`.

Also here: the cores this process may use (`usable_cores`: CPU affinity and the cgroup's CPU quota), and a
Mac's MPS, found and left unused (`detect_environment`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from filelock import FileLock

from vlm_recipes.decisions import Environment
from vlm_recipes.files import cache_dir, read_json, write_json

log = logging.getLogger(__name__)

# bf16 counts as native where its matmul takes at most this many times fp32's. Native bf16 measures at or
# below 1x (AVX512-BF16 ~0.5-1x, AMX ~0.1-0.3x); emulation measures 3x and more (5.4x on AVX512, ~90x on
# AVX2): the bound sits between the two with room for a noisy probe on either side.
NATIVE_BF16_BOUND = 1.5
PROBE_SIZE = 256  # a square matmul: large enough that the kernel, not the call, takes the time
PROBE_BUDGET_S = 0.05  # the probe's whole time, warm-up included, where bf16 is native (emulated: ~2 matmuls)
CGROUP_ROOT = Path("/sys/fs/cgroup")  # where Linux mounts the cgroup files (a container sees its own there)
# Why the training runs on the CPU where a Mac has MPS: the runner places, casts and checks tensors on CUDA or
# the CPU (its guards, the bf16 probe, the suite), and tells Trainer `use_cpu` off CUDA
MPS_LEFT_UNUSED = (
    "Apple MPS found, left unused: this runner trains on CUDA or the CPU (its guards are tested on those)"
)


@dataclass(frozen=True)
class Cores:
    """The cores this process may run on, and why fewer than the machine has ("" where it may use them all)."""

    count: int
    limit: str = ""  # e.g. "cgroup quota 200000/100000 of 16 on the machine"

    def __str__(self) -> str:
        cores = f"{self.count} core{'s' if self.count != 1 else ''}"
        return f"{cores}: {self.limit}" if self.limit else cores


def usable_cores(cgroup_root: Path | None = None) -> Cores:
    """The cores this process may keep busy: its CPU affinity where the system has one (Linux), else
    `os.cpu_count()` (macOS; Python 3.13's os.process_cpu_count does the same), capped by the cgroup's CPU
    quota rounded up (a container limited to 2 CPUs on a 16-core machine: 2). Our own, as loky's `cpu_count`
    (joblib) is: torch's `_utils.cpu_count` and psutil read the affinity only, and loky is not installed."""
    on_machine = os.cpu_count() or 1
    affinity = getattr(os, "sched_getaffinity", None)  # Linux only
    allowed = len(affinity(0)) if affinity else on_machine
    limit = f"CPU affinity, of {on_machine} on the machine" if allowed < on_machine else ""
    quota = cgroup_cpu_quota(CGROUP_ROOT if cgroup_root is None else cgroup_root)
    if quota is not None and (capped := max(1, math.ceil(quota[0] / quota[1]))) < allowed:
        return Cores(capped, f"cgroup quota {quota[0]}/{quota[1]} of {on_machine} on the machine")
    return Cores(allowed, limit)


def cgroup_cpu_quota(root: Path) -> tuple[int, int] | None:
    """The cgroup's CPU quota and period in µs, or None where there is none: cgroup v2's `cpu.max`
    ("200000 100000"; "max 100000": none), else v1's `cpu.cfs_quota_us` (-1: none) and `cpu.cfs_period_us`."""
    found = None
    try:
        found = (root / "cpu.max").read_text().split()[:2]
    except OSError:
        for folder in ("cpu", "cpu,cpuacct"):  # v1: one folder per controller, or the two joined
            try:
                found = [
                    (root / folder / f"cpu.cfs_{part}_us").read_text().strip() for part in ("quota", "period")
                ]
                break
            except OSError:
                continue
    try:
        quota, period = (int(value) for value in found or ())
    except ValueError:  # "max", or a file not as the kernel writes it
        return None
    return (quota, period) if quota > 0 and period > 0 else None


def peak_rss_gb(ru_maxrss: int) -> float:
    """`getrusage`'s peak resident memory in GB: Linux counts it in KiB, macOS in bytes."""
    return ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)


@dataclass(frozen=True)
class CpuBf16:
    """What this CPU does with bf16: its instruction set's label, whether bf16 is native, and why."""

    instruction_set: str  # AMX, AVX512-BF16, AVX512, AVX2, Arm BF16, Arm, or the machine's architecture
    native: bool
    reason: str  # what was found, e.g. "AVX512 without BF16: bf16 matmul measured 5.4x slower than fp32"
    fp32_ms: float | None = None  # the probe's best matmul times (None: not probed)
    bf16_ms: float | None = None


def decide_cpu_bf16(instruction_set: str, timings: tuple[float, float] | None) -> CpuBf16:
    """Pure: native bf16 or not, from the instruction set and the probe's best (fp32, bf16) matmul times in
    ms. AMX decides alone; everywhere else the probe does, the instruction set named in the reason."""
    if instruction_set == "AMX":
        return CpuBf16(instruction_set, True, "AMX: bf16 matmuls run on its tile units")
    if timings is None:
        has_bf16 = instruction_set in ("AVX512-BF16", "Arm BF16")
        why = "has bf16 instructions" if has_bf16 else "without bf16 instructions"
        return CpuBf16(instruction_set, has_bf16, f"{instruction_set} {why} (not measured)")
    fp32_ms, bf16_ms = timings
    ratio = bf16_ms / fp32_ms
    native = ratio <= NATIVE_BF16_BOUND
    measured = (
        f"bf16 matmul measured {ratio:.1f}x slower than fp32"
        if ratio >= 1
        else f"bf16 matmul measured {1 / ratio:.1f}x faster than fp32"
    )
    has_bf16 = instruction_set in ("AVX512-BF16", "Arm BF16")
    if has_bf16 and not native:
        label = f"{instruction_set} reported, but"
    elif has_bf16 or instruction_set not in ("AVX512", "AVX2", "Arm"):
        label = f"{instruction_set}:"
    else:
        label = f"{instruction_set} without BF16:"
    return CpuBf16(instruction_set, native, f"{label} {measured}", round(fp32_ms, 4), round(bf16_ms, 4))


def cpu_instruction_set() -> str:
    """The label of the CPU's best instruction set for matmuls, from torch's own cpuinfo: AMX (whose tiles
    the OS must also grant, `_init_amx`), AVX512-BF16, AVX512, AVX2; on Arm, BF16 or not."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        cpu = torch.cpu

        def has(name: str) -> bool:
            check = getattr(cpu, name, None)  # torch's private probes: missing in older releases
            return bool(check and check())

        if has("_is_amx_tile_supported") and has("_init_amx"):
            return "AMX"
        for name, label in (("_is_avx512_bf16_supported", "AVX512-BF16"), ("_is_avx512_supported", "AVX512")):
            if has(name):
                return label
        return "AVX2" if has("_is_avx2_supported") else "x86-64"
    if machine in ("arm64", "aarch64"):
        return "Arm BF16" if arm_has_bf16() else "Arm"
    return machine or "unknown"


def arm_has_bf16() -> bool:
    """Linux lists `bf16` among /proc/cpuinfo's Features; macOS answers `sysctl hw.optional.arm.FEAT_BF16`."""
    try:
        features = Path("/proc/cpuinfo").read_text()
        return any(
            "bf16" in line.split(":", 1)[1].split()
            for line in features.splitlines()
            if line.startswith("Features")
        )
    except OSError:
        pass
    try:
        found = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True)
        return found.stdout.strip() == "1"
    except OSError:
        return False


def time_bf16_against_fp32(size: int = PROBE_SIZE, budget_s: float = PROBE_BUDGET_S) -> tuple[float, float]:
    """The best time in ms of a size x size matmul in fp32 and in bf16, interleaved on the current threads
    after one warm-up each, until `budget_s` is spent (at least one timed of each)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    pairs = {torch.float32: (a, b), torch.bfloat16: (a.bfloat16(), b.bfloat16())}
    best = {dtype: float("inf") for dtype in pairs}
    started = time.perf_counter()
    for round_ in range(100):
        for dtype, (x, y) in pairs.items():
            began = time.perf_counter()
            torch.mm(x, y)
            if round_:  # round 0 warms up (oneDNN's kernel choice, the pages)
                best[dtype] = min(best[dtype], time.perf_counter() - began)
        if round_ >= 1 and time.perf_counter() - started > budget_s:
            break
    return best[torch.float32] * 1e3, best[torch.bfloat16] * 1e3


@functools.cache
def processor_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def remembered_answer_path(instruction_set: str, threads: int | None = None) -> Path:
    """Where this machine's answer is kept: one file per CPU model, instruction set, torch version and thread
    count (this process's, unless given), so a home directory shared by several kinds of machine keeps each
    one's, and a run on 1 thread (each rank of a DDP group on a CPU) gets an answer measured on 1 thread."""
    threads = torch.get_num_threads() if threads is None else threads
    key = f"{processor_model()}|{instruction_set}|{torch.__version__}|{threads} threads"
    return cache_dir() / "machine" / f"cpu-bf16-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def remember_cpu_bf16(answer: CpuBf16, threads: int | None = None) -> Path:
    """Keep this machine's answer (a read-only or full cache only means probing again next time); its path."""
    threads = torch.get_num_threads() if threads is None else threads
    path = remembered_answer_path(answer.instruction_set, threads)
    kept = {"processor": processor_model(), "torch": torch.__version__, "threads": threads, **asdict(answer)}
    try:
        write_json(path, kept)
    except OSError as error:
        log.debug("could not keep the bf16 probe's answer in %s: %s", path, error)
    return path


def kept_cpu_bf16(path: Path) -> CpuBf16 | None:
    """The answer kept at `path`, or None (none yet, or unreadable)."""
    try:
        kept = read_json(path)
        return CpuBf16(**{k: kept[k] for k in CpuBf16.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def probe_cpu_bf16(instruction_set: str, threads: int) -> CpuBf16:
    """Probe now (~50 ms) on this process's threads, and keep the answer."""
    timings = None if instruction_set == "AMX" else time_bf16_against_fp32()
    answer = decide_cpu_bf16(instruction_set, timings)
    log.info(
        "CPU bf16 on %d threads: %s (%s)", threads, "native" if answer.native else "emulated", answer.reason
    )
    remember_cpu_bf16(answer, threads)
    return answer


def cpu_bf16() -> CpuBf16:
    """This CPU's answer at this process's thread count (`cpu_bf16_on`)."""
    return cpu_bf16_on(torch.get_num_threads())


@functools.cache
def cpu_bf16_on(threads: int) -> CpuBf16:
    """This CPU's answer on `threads` threads: kept from an earlier process on this machine, else probed
    and kept. One process probes at a time (a file lock), the others then read its answer: the ranks of a
    group starting together decide alike."""
    instruction_set = cpu_instruction_set()
    path = remembered_answer_path(instruction_set, threads)
    if (kept := kept_cpu_bf16(path)) is not None:
        return kept
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{path}.lock", timeout=60):
            return kept_cpu_bf16(path) or probe_cpu_bf16(instruction_set, threads)
    except OSError as error:  # a read-only cache (no lock file) or a lock never released: probe alone
        log.debug("probing without the lock %s.lock: %s", path, error)
        return probe_cpu_bf16(instruction_set, threads)


def reprobe_cpu_bf16() -> tuple[CpuBf16, Path]:
    """Probe again on this process's threads, whatever is kept, and keep the new answer (`vlm-recipes
    machine --reprobe`: after a BIOS, kernel or VM change the kept answer no longer describes)."""
    threads = torch.get_num_threads()
    instruction_set = cpu_instruction_set()
    answer = probe_cpu_bf16(instruction_set, threads)
    cpu_bf16_on.cache_clear()
    return answer, remembered_answer_path(instruction_set, threads)


def detect_environment() -> Environment:
    """The machine this process computes on: its GPUs (CUDA's bf16 answer), or its CPU (`cpu_bf16`), a
    Mac's MPS named as left unused."""
    if torch.cuda.is_available():
        return Environment(
            device="cuda",
            gpu_count=torch.cuda.device_count(),
            bf16_supported=torch.cuda.is_bf16_supported(),
            gpu_name=torch.cuda.get_device_name(0),
        )
    answer = cpu_bf16()
    mps = getattr(torch.backends, "mps", None)
    return Environment(
        device="cpu",
        gpu_count=0,
        bf16_supported=answer.native,
        instruction_set=answer.instruction_set,
        bf16_reason=answer.reason,
        left_unused=MPS_LEFT_UNUSED if mps is not None and mps.is_available() else "",
    )
