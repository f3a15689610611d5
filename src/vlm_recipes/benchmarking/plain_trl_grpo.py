"""The GRPO script a user would write by hand, the way TRL's own VLM GRPO example does it: load the model
and processor, an exact-match reward, GRPOTrainer with a peft_config, train. The GRPO benchmark's baseline.

    python plain_trl_grpo.py --model DIR --data PROMPTS.jsonl --rows 16 --out r.json

Same model, prompts, seed and GRPOConfig numbers as the vlm-recipes stage it is compared with
(benchmarking/bench_recipes/bench-llm-grpo.yaml). Only the step timer is shared with vlm-recipes; the peak RSS
is measured by whoever runs it (the whole process), the GPU peak over the training loop as vlm-recipes reads it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import datasets
import torch
from peft import LoraConfig
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import GRPOConfig, GRPOTrainer

from vlm_recipes.methods.callbacks import StepTimer


def load_prompts(path: str, rows: int) -> datasets.Dataset:
    """The first `rows` prompt rows (prompt, solution, images), images decoded by `datasets.Image`."""
    root = Path(path).parent
    ds = datasets.load_dataset("json", data_files=path, split="train")
    ds = ds.select(range(min(rows, len(ds))))
    ds = ds.map(lambda row: {"images": [str(root / p) for p in row["images"]]})
    ds = ds.cast_column("images", datasets.List(datasets.Image()))
    return ds.select_columns(["prompt", "solution", "images"])


def exact_match(completions, solution, **kwargs) -> list[float]:
    """1 where the completion's text, stripped, is the solution."""
    return [float(c[0]["content"].strip() == s.strip()) for c, s in zip(completions, solution, strict=True)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--rows", type=int, default=16, help="prompts: one group of completions a step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    model = AutoModelForImageTextToText.from_pretrained(
        args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32
    )
    processor = AutoProcessor.from_pretrained(args.model)
    processor.image_processor.size = {"shortest_edge": 3136, "longest_edge": 200704}
    peft_config = LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        target_modules=r"model\.language_model\..*\.(q|k|v|o|gate|up|down)_proj",
    )
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vlm-recipes-baseline-grpo-"),
        num_train_epochs=1,
        per_device_train_batch_size=args.num_generations,  # one prompt's group a step
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        learning_rate=1e-5,
        lr_scheduler_type="cosine",
        logging_steps=1,
        logging_first_step=True,
        save_strategy="no",
        report_to="none",
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
        data_seed=args.seed,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        logging_nan_inf_filter=False,
        gradient_checkpointing=False,  # TRL's default is True; the recipes' stages train without it
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=load_prompts(args.data, args.rows),
        processing_class=processor,
        peft_config=peft_config,
        callbacks=[timer],
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # as vlm-recipes does before training
    output = trainer.train()
    gpu_peaks = {}
    if torch.cuda.is_available():
        gpu_peaks["peak_gpu_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    curve = {e["step"]: e["reward"] for e in trainer.state.log_history if "reward" in e}
    result = {
        "way": "baseline",
        "steps": trainer.state.global_step,
        "train_runtime_s": output.metrics["train_runtime"],
        "reward_curve": curve,
        **gpu_peaks,
        **timer.summary(),
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    shutil.rmtree(config.output_dir)


if __name__ == "__main__":
    main()
