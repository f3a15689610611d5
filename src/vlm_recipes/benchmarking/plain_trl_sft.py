"""The script a user would write by hand, the way TRL's own VLM SFT example does it: load the model and
processor, freeze, SFTTrainer with a peft_config, train, save. The benchmark's baseline.

    python plain_trl_sft.py --stage llm-lora --model DIR --data FILE.jsonl --epochs 1 --out r.json

Same model, data, seed and SFTConfig numbers as the vlm-recipes stage it is compared with. Only the
step timer (a TrainerCallback that reads the clock) is shared with vlm-recipes. The process's peak RSS is
measured by whoever runs it (scripts/benchmark.py: the whole process, as for vlm-recipes); the GPU peak is
read over the same window as vlm-recipes reads it: reset before training, read after evaluating.
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
from transformers import AutoModelForImageTextToText, AutoProcessor, BitsAndBytesConfig
from trl import SFTConfig, SFTTrainer

from vlm_recipes.methods.callbacks import StepTimer


def load_data(path: str, rows: int) -> datasets.Dataset:
    """The first `rows` rows, images decoded by `datasets.Image` as TRL's examples load them."""
    root = Path(path).parent
    ds = datasets.load_dataset("json", data_files=path, split="train")
    ds = ds.select(range(min(rows, len(ds))))
    ds = ds.map(lambda row: {"images": [str(root / p) for p in row["images"]]})
    return ds.cast_column("images", datasets.List(datasets.Image())).select_columns(["messages", "images"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", choices=["llm-lora", "vision-full"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--rows", type=int, help="train on the first N rows (default: all)")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=-1, help="stop after N steps (default: --epochs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument(
        "--adapter-dtype",
        choices=["fp32"],
        help="recast TRL's QLoRA adapters (bf16, its cast) to this dtype once SFTTrainer is built: the "
        "benchmark's overhead check in fp32, where vlm-recipes keeps them in fp32",
    )
    parser.add_argument(
        "--eval-rows", type=int, default=32, help="eval loss on the first N rows (the loss check)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    peft_config = None
    if args.stage == "llm-lora":  # r1: 4-bit language model, LoRA on its linear layers
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            llm_int8_skip_modules=["model.visual", "lm_head"],
        )
        model = AutoModelForImageTextToText.from_pretrained(
            args.model, dtype=dtype, quantization_config=quantization
        )
        peft_config = LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.05,
            task_type="CAUSAL_LM",
            target_modules=r"model\.language_model\..*\.(q|k|v|o|gate|up|down)_proj",
        )
        learning_rate = 2e-4
    else:  # r2: vision tower and merger fully trained, language model frozen
        model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype)
        for name, param in model.named_parameters():
            param.requires_grad = name.startswith("model.visual")
            if param.requires_grad:
                param.data = param.data.float()
        learning_rate = 2e-5
    processor = AutoProcessor.from_pretrained(args.model)
    processor.image_processor.size = {"shortest_edge": 3136, "longest_edge": 200704}

    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="vlm-recipes-baseline-"),
        num_train_epochs=args.epochs,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        logging_steps=5,
        logging_first_step=True,
        save_strategy="no",
        report_to="none",
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
        data_seed=args.seed,
        max_length=None,
        assistant_only_loss=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        logging_nan_inf_filter=False,
        gradient_checkpointing=False,  # TRL's default is True; the recipes' stages train without it
    )
    timer = StepTimer()
    rows = args.rows or len(Path(args.data).read_text().splitlines())
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=load_data(args.data, rows),
        eval_dataset=load_data(args.data, args.eval_rows),
        processing_class=processor,
        peft_config=peft_config,
        callbacks=[timer],
    )
    if args.adapter_dtype:
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # as vlm-recipes does before training
    output = trainer.train()
    # bitsandbytes 0.50 repacks 4-bit weights for CPU inference on AVX512-BF16 CPUs and then fails on them
    # (`shape '[512, 21]' is invalid`): without this line a plain QLoRA script crashes at evaluation here.
    for module in trainer.model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
    eval_loss = trainer.evaluate()["eval_loss"]
    gpu_peaks = {}
    if torch.cuda.is_available():  # as vlm-recipes reads them: after evaluating, before saving
        gpu_peaks["peak_gpu_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        gpu_peaks["peak_gpu_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    trainer.save_model(config.output_dir)  # as TRL's examples/scripts/sft_vlm.py ends
    curve = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    losses = list(curve.values())
    result = {
        "way": "baseline",
        "steps": trainer.state.global_step,
        "train_runtime_s": output.metrics["train_runtime"],
        "final_loss": losses[-1] if losses else None,
        "loss_curve": curve,
        "eval_loss": eval_loss,
        "trainable_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters() if p.requires_grad}),
        **gpu_peaks,
        **timer.summary(),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    shutil.rmtree(config.output_dir)


if __name__ == "__main__":
    main()
