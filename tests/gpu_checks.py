"""Checks tests/test_on_a_gpu.py runs in a process of their own that sees the GPU (the suite's own processes
hide it: tests/conftest.py), each printing one JSON line last.

    python tests/gpu_checks.py dtype-boundaries FAMILY [--device cpu]   # --device cpu: the same check, here
    python tests/gpu_checks.py host-syncs OUTPUT_DIR GPU_ID   # GPU_ID cpu: the same run, no debug mode

- dtype-boundaries: every split of the roles between trained (fp32 masters), frozen (bf16) and LoRA, built
  and guarded as a stage builds them, meets in a forward under CUDA's autocast, a backward, a forward
  without autocast and generate(); frozen floating-point weights end in bf16, trained ones in fp32, and every
  tensor on the device.
- host-syncs: r1's stage (4-bit QLoRA) on the tiny Qwen2-VL, 8 steps, a log every 4th, with
  `torch.cuda.set_sync_debug_mode("warn")` over the training loop: every synchronising CUDA call is counted
  by the step whose work asked for it and by who asked (the innermost frame outside torch).
"""

from __future__ import annotations

import json
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

SYNC_WARNING = "called a synchronizing CUDA operation"
STEPS, LOGGING_STEPS = 8, 4
# who asked, by the innermost frame outside torch: the first package here its file is under. transformers'
# code other than its Trainer (modeling, masking, attention integrations) runs inside the model's forward
ASKERS = (
    ("vlm_recipes", "ours"),
    ("/trl/", "TRL"),
    ("/transformers/trainer", "Trainer (transformers)"),
    ("/transformers/", "the model's forward (transformers)"),
    ("/accelerate/", "accelerate"),
    ("/peft/", "PEFT"),
    ("/bitsandbytes/", "bitsandbytes"),
)


def dtype_boundaries(family_name: str, device: str) -> dict:
    from conftest import TINY_MODELS, model_inputs, single_image_demo_rows
    from test_dtype_boundaries import MODE_SETS, stage_with

    from vlm_recipes.decisions import Environment
    from vlm_recipes.demo.models import DEMO_MODELS, ensure_demo_model
    from vlm_recipes.model.build import build_stage_model, load_processor
    from vlm_recipes.model.guards import keep_fp32_patterns, matches_any
    from vlm_recipes.recipes.schema import DataSettings
    from vlm_recipes.stages import run

    family = DEMO_MODELS[TINY_MODELS[family_name]].family
    model_dir = ensure_demo_model(TINY_MODELS[family_name])
    environment = Environment(device, int(device == "cuda"), bf16_supported=True)
    processor = load_processor(str(model_dir), DataSettings(max_pixels=200704), family)
    inputs = model_inputs(processor, single_image_demo_rows(2)).to(device)
    labels = inputs["input_ids"].clone()
    checked = []
    for modes in MODE_SETS:
        stage = stage_with(modes)
        built = build_stage_model(str(model_dir), stage, "bf16", device, processor=processor)
        run.apply_guards(built, stage, "bf16", environment)
        model = built.model
        elsewhere = {
            n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != device
        }
        assert not elsewhere, (modes, sorted(elsewhere)[:5])
        # frozen weights in the compute dtype, but for those a trained role computes with and the model's own
        # fp32-kept modules (model/guards.py: cast_frozen_to_compute)
        keep = keep_fp32_patterns(model, torch.bfloat16)
        frozen_fp32 = [
            n
            for n, p in model.named_parameters()
            if not p.requires_grad
            and p.dtype == torch.float32
            and n not in built.frozen_in_trained_roles
            and not (keep and matches_any(n, keep))
        ]
        assert not frozen_fp32, (modes, frozen_fp32[:5])
        trained_not_fp32 = [
            n for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32
        ]
        assert not trained_not_fp32, (modes, trained_not_fp32[:5])
        with torch.autocast(device, dtype=torch.bfloat16):  # as Trainer runs it
            loss = model(**inputs, labels=labels).loss
        assert torch.isfinite(loss), modes
        if any(mode != "frozen" for mode in modes.values()):
            loss.backward()
            missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
            assert not missing, (modes, missing[:5])
        model.eval()
        with torch.no_grad():  # no autocast: each crossing alone decides
            assert torch.isfinite(model(**inputs, labels=labels).loss), modes
            out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        assert out.shape[1] == inputs["input_ids"].shape[1] + 2, modes
        checked.append({"modes": modes, "loss": loss.item(), "kept_fp32": len(built.frozen_in_trained_roles)})
    return {"family": family_name, "device": device, "checked": checked}


def asker_frame(frame):
    """The innermost frame outside torch (and the warnings machinery): the code that asked."""
    while frame is not None and (
        "/torch/" in frame.f_code.co_filename or "warnings" in frame.f_code.co_filename
    ):
        frame = frame.f_back
    return frame


def asker_of(frame) -> str:
    path = frame.f_code.co_filename
    return next((who for part, who in ASKERS if part in path), f"other ({Path(path).name})")


def step_of(frame) -> int | None:
    """The optimizer step (1-based) whose work asked, from the training loop's frame; a batch fetched for the
    next step counts for it (None: outside the training loop)."""
    after_the_step = False
    while frame is not None:
        name = frame.f_code.co_name
        after_the_step |= name in ("on_step_end", "_maybe_log_save_evaluate")
        if name == "_inner_training_loop":
            return frame.f_locals["self"].state.global_step + (0 if after_the_step else 1)
        frame = frame.f_back
    return None


def host_syncs(output_dir: str, gpu: str) -> dict:
    from transformers import TrainerCallback

    import vlm_recipes.stages.run as stage_run
    from vlm_recipes.cli.train import main

    syncs: dict[int, Counter] = {}
    where: Counter = Counter()

    def counted(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frame = sys._getframe(1)
        if (step := step_of(frame)) is not None and (asker := asker_frame(frame)) is not None:
            who = asker_of(asker)
            syncs.setdefault(step, Counter())[who] += 1
            where[
                f"{who}: {Path(asker.f_code.co_filename).name}:{asker.f_lineno} {asker.f_code.co_name}"
            ] += 1

    on_gpu = gpu != "cpu"  # `cpu`: the same run without the debug mode, to try this script on a CPU

    class SyncDebugMode(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if on_gpu:
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_end(self, args, state, control, **kwargs):
            if on_gpu:
                torch.cuda.set_sync_debug_mode(0)

    stage_callbacks = stage_run.stage_callbacks

    def with_the_debug_mode(*args, **kwargs):
        callbacks, decision = stage_callbacks(*args, **kwargs)
        return {**callbacks, "sync_debug_mode": SyncDebugMode()}, decision

    stage_run.stage_callbacks = with_the_debug_mode
    shown = warnings.showwarning
    warnings.showwarning = counted
    warnings.simplefilter("always")
    code = main(
        [
            *("--recipe", "r1-llm-only", "--output-dir", output_dir, "--run-name", "syncs"),
            *(("--gpu", gpu) if on_gpu else ()),
            *("--max-steps", str(STEPS), f"training.logging_steps={LOGGING_STEPS}", "training.save_steps=0"),
            *("evaluation.generate=false", "data.max_eval_samples=4", "data.max_train_samples=32"),
            "training.per_device_batch_size=2",
            "model=demo:tiny-qwen2-vl",
        ]
    )
    return {
        "exit": code,
        "logging_steps": sorted({1, *range(LOGGING_STEPS, STEPS + 1, LOGGING_STEPS)}),
        "syncs_by_step": {step: dict(by) for step, by in sorted(syncs.items())},
        "where": dict(where.most_common(20)),
    }


if __name__ == "__main__":
    check, *arguments = sys.argv[1:]
    if check == "dtype-boundaries":
        device = arguments[arguments.index("--device") + 1] if "--device" in arguments else "cuda"
        result = dtype_boundaries(arguments[0], device)
    else:
        result = host_syncs(*arguments)
    print(json.dumps(result))
