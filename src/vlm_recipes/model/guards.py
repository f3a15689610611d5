"""Guards: pure decisions (facts in → choice + reason out) and the small steps that apply them.

Every failure here has cost real users days; each guard owns one:

- precision:    bf16/fp16/fp32 from the hardware and the real parameter dtypes (`model.dtype` reports the
                first parameter only, and a PEFT wrapper's first parameter is not the model's)
- parallelism:  never torch.nn.DataParallel (its threads drop autocast → `float != BFloat16`)
- dtypes:       frozen weights in the compute dtype, trainable ones in fp32 masters, the model's own
                fp32-kept modules in fp32, buffers following their module
- quantization: 4-bit/8-bit only where the recipe allows, verified after loading
- placement:    no tensor on `meta`, none stranded on another device, rotary frequencies sane

Decisions are printed before training and saved in the stage's report.json, so a failed run explains
itself. The pure functions take an Environment, so tests fake 2 GPUs or an fp16-only GPU on a CPU.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection

import torch
from torch import nn

from vlm_recipes.decisions import Decision, Environment, dtype_name
from vlm_recipes.errors import GuardError

# ---------------------------------------------------------------------------------------------
# Precision


def decide_precision(requested: str, env: Environment, quantized: bool) -> Decision:
    """Pick the compute precision before loading. An explicit request wins unless the hardware cannot do it."""
    if requested != "auto":
        if requested == "fp16" and env.device == "cpu":
            raise GuardError(
                "precision fp16 was requested but this machine has no GPU: use bf16, fp32 or auto on CPU"
            )
        if requested == "bf16" and env.device == "cuda" and not env.bf16_supported:
            raise GuardError(
                f"precision bf16 was requested but {env.gpu_name or 'this GPU'} does not support it: use fp16 or auto"
            )
        if requested == "bf16" and env.device == "cpu" and not env.bf16_supported:
            found = f": {env.bf16_reason}" if env.bf16_reason else ""
            return Decision("precision", "bf16", f"set in the recipe; this CPU emulates bf16{found}")
        return Decision("precision", requested, "set in the recipe")
    if env.device == "cuda":
        if env.bf16_supported:
            why = "quantized weights compute in bf16" if quantized else "GPU supports bf16"
            return Decision("precision", "bf16", why)
        return Decision("precision", "fp16", "GPU does not support bf16: fp16 autocast with loss scaling")
    found = env.bf16_reason or ("CPU has native bf16" if env.bf16_supported else "CPU without native bf16")
    if env.bf16_supported:
        return Decision(
            "precision", "bf16", f"{found} → bf16: autocast at fp32's speed or better, half the memory"
        )
    return Decision("precision", "fp32", f"{found} → fp32: bf16 would be emulated, and slow")


def dtype_histogram(model: nn.Module) -> dict[str, dict[str, int]]:
    """Tensor counts by dtype for trainable and frozen parameters: the real dtypes, not `model.dtype`."""
    hist: dict[str, Counter] = {"trainable": Counter(), "frozen": Counter()}
    for _, param in model.named_parameters():
        hist["trainable" if param.requires_grad else "frozen"][dtype_name(param.dtype)] += 1
    return {k: dict(v) for k, v in hist.items()}


def check_precision_agrees(precision: str, model: nn.Module) -> Decision:
    """After loading: the Trainer flags must fit the weights actually there."""
    hist = dtype_histogram(model)
    trainable = hist["trainable"]
    if precision == "fp16" and trainable.get("fp16"):
        raise GuardError(
            f"{trainable['fp16']} trainable tensors are fp16, and fp16 training unscales gradients in fp32 "
            "only for fp32 parameters: set training.trainable_dtype: fp32"
        )
    if precision == "fp32" and (hist["frozen"].get("bf16") or hist["frozen"].get("fp16")):
        raise GuardError(
            "precision fp32 but frozen weights are half precision: the loader and the Trainer disagree"
        )
    flags = {"bf16": "Trainer bf16=True", "fp16": "Trainer fp16=True", "fp32": "no autocast"}[precision]
    seen = ", ".join(f"{kind} {dict(sorted(c.items()))}" for kind, c in hist.items() if c)
    return Decision("precision-check", flags, f"weights as loaded: {seen}")


# ---------------------------------------------------------------------------------------------
# Parallelism


def decide_parallelism(env: Environment, world_size: int = 1, mode: str = "ddp") -> Decision:
    """Never torch.nn.DataParallel: its worker threads lose the autocast context, so bf16 and fp32
    tensors meet in one matmul (`expected mat1 and mat2 to have the same dtype`)."""
    if world_size > 1 and mode == "fsdp":
        return Decision(
            "parallelism",
            "FSDP2, weights, gradients and optimizer state sharded over the processes",
            f"{world_size} processes launched through accelerate; Trainer shards the model with fully_shard",
        )
    if world_size > 1:
        return Decision(
            "parallelism",
            "DistributedDataParallel, one process per device",
            f"{world_size} processes launched; Trainer wraps the model in DDP, never DataParallel",
        )
    if env.device == "cuda" and env.gpu_count > 1:
        return Decision(
            "parallelism",
            "single device (Trainer n_gpu forced to 1)",
            f"{env.gpu_count} GPUs visible to one process: Trainer would wrap the model in DataParallel",
        )
    where = "one GPU" if env.device == "cuda" else "CPU"
    unused = f"; {env.left_unused}" if env.left_unused else ""  # a Mac: why not its MPS
    return Decision("parallelism", "single device", f"{where}, one process{unused}")


def apply_parallelism(args) -> None:
    """Make Trainer see one GPU, before it is built, so it never wraps the model in DataParallel (and
    TRL's SFTTrainer, which refuses DataParallel, does not stop the run). Every stage, whatever its source.
    transformers 5.x dropped the `is_parallelizable`/`model_parallel` flags that used to prevent it."""
    if args.n_gpu > 1:
        args._n_gpu = 1


# ---------------------------------------------------------------------------------------------
# Trainable vs frozen dtypes


def keep_fp32_patterns(model: nn.Module, compute_dtype: torch.dtype) -> list[str]:
    """The model's own fp32 modules: `_keep_in_fp32_modules_strict` under any half precision,
    `_keep_in_fp32_modules` under fp16 only (the rule transformers applies when loading)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    patterns = set()
    if compute_dtype in (torch.float16, torch.bfloat16):
        patterns |= set(getattr(base, "_keep_in_fp32_modules_strict", None) or [])
    if compute_dtype == torch.float16:
        patterns |= set(getattr(base, "_keep_in_fp32_modules", None) or [])
    return sorted(patterns)


def matches_any(name: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        regex = r"(^|\.)" + re.escape(pattern).replace(r"\*", r"[^.]*") + r"($|\.)"
        if re.search(regex, name):
            return True
    return False


def _is_quantized(param: torch.Tensor) -> bool:
    return not param.is_floating_point()  # bitsandbytes stores 4-bit/8-bit weights as uint8/int8


def cast_frozen_to_compute(
    model: nn.Module, compute_dtype: torch.dtype, frozen_in_trained_roles: Collection[str] = ()
) -> Decision:
    """Frozen floating weights → compute dtype (memory, and no fp32 activation reaching a bf16 layer);
    their module's floating buffers follow. fp32-kept modules, trainable parameters and
    `frozen_in_trained_roles` (frozen weights a trained role computes with: a bf16 norm fed by fp32 layers
    stops with `mixed dtype`) are left alone."""
    keep = keep_fp32_patterns(model, compute_dtype)
    exempt = set(frozen_in_trained_roles)
    cast, kept = 0, 0
    for module_name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        casted_here = False
        for pname, param in own:
            if param.requires_grad or _is_quantized(param) or f"{module_name}.{pname}".lstrip(".") in exempt:
                continue
            if keep and matches_any(f"{module_name}.{pname}".lstrip("."), keep):
                if param.dtype != torch.float32:
                    param.data = param.data.float()
                kept += 1
                continue
            if param.dtype != compute_dtype:
                param.data = param.data.to(compute_dtype)
                cast += 1
            casted_here = True
        if casted_here:
            for bname, buffer in module.named_buffers(recurse=False):
                if buffer.is_floating_point() and buffer.dtype != compute_dtype:
                    module._buffers[bname] = buffer.to(compute_dtype)
                    cast += 1
    in_trained = f"; {len(exempt)} in fully trained roles keep their dtype" if exempt else ""
    return Decision(
        "frozen-dtype",
        f"frozen weights in {dtype_name(compute_dtype)}",
        f"{cast} tensors cast; {kept} kept fp32 ({', '.join(keep) or 'the model declares none'}){in_trained}",
    )


def apply_trainable_dtype(
    model: nn.Module, trainable_dtype: str, compute_dtype: torch.dtype, when: str
) -> Decision:
    """Trainable weights (full roles and LoRA adapters) in the recipe's `trainable_dtype`.

    Run again after SFTTrainer is built: TRL 1.16 casts QLoRA adapters to bf16 (the QLoRA paper's choice),
    where small updates round away, and which an fp16-only GPU cannot compute."""
    expected = torch.float32 if trainable_dtype == "fp32" else compute_dtype
    recast = Counter()
    for _, param in model.named_parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != expected:
            recast[dtype_name(param.dtype)] += 1
            param.data = param.data.to(expected)
    found = ", ".join(f"{n} were {d}" for d, n in recast.items()) or "none needed recasting"
    return Decision("trainable-dtype", f"trainable weights in {dtype_name(expected)}", f"{when}: {found}")


# ---------------------------------------------------------------------------------------------
# Quantization scope

MIN_BNB_CPU = "0.46"  # first bitsandbytes release whose 4-bit/8-bit layers run on the CPU


def check_quantization_backend(mode: str, env: Environment) -> Decision | None:
    """Before loading: bitsandbytes must be importable, and able to run on this device."""
    if mode == "none":
        return None
    try:
        import bitsandbytes
    except ImportError as exc:
        raise GuardError(
            f"quantization {mode} needs bitsandbytes, which cannot be imported here ({exc}): "
            "pip install bitsandbytes, or set quantization.mode: none"
        ) from None
    from packaging.version import Version

    version = bitsandbytes.__version__
    if env.device == "cpu" and Version(version) < Version(MIN_BNB_CPU):
        raise GuardError(
            f"quantization {mode} on CPU needs bitsandbytes >= {MIN_BNB_CPU} (installed: {version}): "
            "upgrade it, run on a GPU, or set quantization.mode: none"
        )
    return Decision("quantization-backend", f"bitsandbytes {version}", f"{mode} layers run on {env.device}")


def verify_quantization_scope(model: nn.Module, family, mode: str, skip_parts: list[str]) -> Decision:
    """After a quantized load: no skipped part holds a quantized weight (a wrong skip list quantizes
    the vision tower silently), and something was actually quantized."""
    if mode == "none":
        return Decision("quantization", "none", "full-precision weights")
    quantized = [n.removeprefix("base_model.model.") for n, p in model.named_parameters() if _is_quantized(p)]
    leaked = []
    for name in quantized:
        part = "lm_head" if family.is_lm_head(name) else family.role_of(name)
        if part in skip_parts:
            leaked.append(name)
    if leaked:
        raise GuardError(
            f"{len(leaked)} weights of parts listed in quantization.skip_roles were quantized anyway, e.g. "
            f"{leaked[0]}: the skip list did not match the model's module names"
        )
    if not quantized:
        raise GuardError(
            f"quantization {mode} was requested but no weight was quantized: is bitsandbytes working?"
        )
    return Decision(
        "quantization", mode, f"{len(quantized)} weights quantized; unquantized: {', '.join(skip_parts)}"
    )


def keep_cpu_4bit_weights_trainable(model: nn.Module) -> Decision | None:
    """bitsandbytes (0.50) repacks 4-bit weights in place for fast CPU inference the first time a layer
    runs in eval mode on an AVX512-BF16 CPU, and never unpacks them: the next training step fails with
    `a view of a leaf Variable that requires grad is being used in an in-place operation`. A stage that
    evaluates mid-training (eval_steps) or after training (generation) must not let that happen."""
    layers = [m for m in model.modules() if getattr(m, "support_avx512bf16_for_cpu", False)]
    if not layers:
        return None
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return Decision(
        "cpu-4bit",
        "inference repacking off",
        f"{len(layers)} 4-bit layers: bitsandbytes' CPU repacking in eval would break the next training step",
    )


# ---------------------------------------------------------------------------------------------
# Placement


def module_devices(model: nn.Module) -> dict[str, torch.device]:
    """The device each module runs on: that of its first parameter (its own or a child's); a module
    without parameters (rotary embeddings) runs where its parent does."""
    first = next(model.parameters(), None)
    root = first.device if first is not None else torch.device("cpu")
    devices: dict[str, torch.device] = {}
    for name, module in model.named_modules():
        param = next(module.parameters(), None)
        parent = devices.get(name.rpartition(".")[0], root) if name else root
        devices[name] = param.device if param is not None else parent
    return devices


def place_tensors(model: nn.Module, target: torch.device | str | None = None) -> Decision:
    """Move buffers (and stray parameters) to the device their module runs on.

    Buffers made with `torch.tensor(...)` in `__init__` stay where they were built when the weights are
    loaded elsewhere. `target` forces one device for all (single-device runs); parameters still on
    `meta` were never loaded and are an error."""
    devices = module_devices(model)
    moved, meta = [], []
    for module_name, module in model.named_modules():
        want = torch.device(target) if target is not None else devices[module_name]
        for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
            for tname, tensor in tensors.items():
                if tensor is None or tensor.device == want:
                    continue
                full = f"{module_name}.{tname}".lstrip(".")
                if tensor.device.type == "meta" and want.type != "meta":
                    meta.append(full)
                    continue
                if kind == "param":
                    tensor.data = tensor.data.to(want)
                else:
                    tensors[tname] = tensor.to(want)
                moved.append(full)
    if meta:
        raise GuardError(
            f"{len(meta)} tensors were never loaded (still on meta), e.g. {meta[0]}: "
            "the checkpoint lacks them or the model class does not match it"
        )
    check_rotary_frequencies(model)
    detail = f"moved {len(moved)} stranded: {', '.join(moved[:5])}" if moved else "nothing stranded"
    where = str(target) if target is not None else ", ".join(sorted({str(d) for d in devices.values()}))
    return Decision("placement", f"all tensors on {where}", detail)


def check_rotary_frequencies(model: nn.Module) -> None:
    for name, buffer in model.named_buffers():
        if name.endswith("inv_freq") and buffer.device.type != "meta":
            values = buffer.float()
            if not torch.isfinite(values).all() or not values.abs().sum() > 0:
                raise GuardError(
                    f"rotary frequencies {name} are not finite or all zero: the buffer was created on `meta` "
                    "and never computed; load the model without low_cpu_mem_usage tricks or recompute it"
                )
