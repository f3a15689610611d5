"""`python scripts/predict.py`: run a trained model on images and/or videos + a prompt, or on a data file,
with the same prompting, decoding and scoring as the evaluation after each stage. Videos are sampled with
the recipe defaults of data.video_fps, data.max_frames and data.video_min/max_pixels (or the flags)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlm_recipes.errors import EXIT_BAD_INPUT, BadInput
from vlm_recipes.files import read_json, write_jsonl
from vlm_recipes.runs.layout import FINAL_DIR
from vlm_recipes.runs.manifest import run_state


def resolve_model_dir(path: str) -> str:
    """A run directory (its final model), a stage directory (its final/), a model directory or id."""
    from vlm_recipes.demo.models import resolve_model_source

    candidate = Path(path)
    if (candidate / "run.json").is_file():
        manifest = read_json(candidate / "run.json")
        if "final_model" not in manifest:
            _, why = run_state(candidate)
            raise FileNotFoundError(f"{path}: the run has no final model: {why or 'it has not finished'}")
        return manifest["final_model"]
    if (candidate / FINAL_DIR / "config.json").is_file():
        return str(candidate / FINAL_DIR)
    return resolve_model_source(path)


def main(argv: list[str] | None = None, prog: str = "predict.py") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--model", required=True, help="run dir, stage dir, model dir, or model id")
    parser.add_argument("--image", type=Path, action="append", default=[], help="image file (repeatable)")
    parser.add_argument(
        "--video", type=Path, action="append", default=[], help="video file or folder of frames (repeatable)"
    )
    parser.add_argument("--video-fps", type=float, help="frames taken per second of video (data.video_fps)")
    parser.add_argument("--max-frames", type=int, help="most frames taken from a video (data.max_frames)")
    parser.add_argument("--prompt", help="the question")
    parser.add_argument("--data", help="a .jsonl file (or demo:eval) to answer and score instead")
    parser.add_argument("--max-samples", type=int, help="with --data: only the first N rows")
    parser.add_argument("--output", type=Path, help="with --data: write predictions.jsonl here")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    if bool(args.data) == bool(args.prompt):
        parser.error("give --prompt (with --image / --video) or --data")

    from vlm_recipes.logs import setup_logging

    setup_logging()
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlm_recipes.benchmark_metrics import METRICS
    from vlm_recipes.data.formats import EVAL_COLUMNS
    from vlm_recipes.data.images import upright_rgb
    from vlm_recipes.data.rows import VideoRules, load_split
    from vlm_recipes.data.video import VideoLoader, VideoSampling
    from vlm_recipes.decisions import DTYPES
    from vlm_recipes.demo.dataset import resolve_data_source
    from vlm_recipes.errors import DataError
    from vlm_recipes.evaluation.generation import Prompt, evaluate_generation, generate_answers
    from vlm_recipes.machine import detect_environment
    from vlm_recipes.model.build import detect_family
    from vlm_recipes.model.guards import decide_precision
    from vlm_recipes.recipes.schema import DataSettings

    try:
        model_dir = resolve_model_dir(args.model)
        env = detect_environment()
        dtype = DTYPES[decide_precision("auto", env, quantized=False).choice]
        model = AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=dtype, device_map="auto" if env.device == "cuda" else None
        )
        family, _ = detect_family(model_dir)
        family.repair(model)
        processor = AutoProcessor.from_pretrained(model_dir, **family.processor_load_kwargs)
        defaults = DataSettings()
        sampling = VideoSampling(
            args.video_fps or defaults.video_fps,
            args.max_frames or defaults.max_frames,
            defaults.video_min_pixels,
            defaults.video_max_pixels,
        )
        videos = VideoLoader.for_model(family, processor, sampling)
        if args.data:
            rules = VideoRules(sampling, videos and videos.factor, f"{family.name} takes no video")
            rows, _ = load_split(
                args.data,
                "test",
                args.max_samples,
                video=rules,
                path=resolve_data_source(args.data, bool(videos)),
                extra_columns=EVAL_COLUMNS,  # what the rows carry for the benchmarks' metrics
            )
            scores, records = evaluate_generation(
                model,
                processor,
                rows,
                args.max_new_tokens,
                args.batch_size,
                0.01,
                videos=videos,
                box_format=family.box_format,
            )
            for record in records:
                print(
                    f"[{record['id']}] {record['prompt']}\n  → {record['output']}   (reference: {record['reference']})"
                )
            overall = scores["all"]
            print(
                f"\nexact match {overall['exact_match']:.3f} on {overall['rows']} rows"
                + (f"; JSON field F1 {overall['json_fields']['f1']:.3f}" if "json_fields" in overall else "")
                + "".join(f"; {m} {overall[m]:.3f}" for m in METRICS if m in overall)
            )
            if args.output:
                write_jsonl(args.output, records)
            return 0
        missing = [str(p) for p in [*args.image, *args.video] if not p.exists()]
        if missing:
            raise FileNotFoundError(f"not found: {', '.join(missing)}")
        if args.video and videos is None:
            raise DataError(f"{model_dir} is a {family.name} model, which takes no video: give --image only")
        content = [{"type": "image", "image": upright_rgb(Image.open(p))} for p in args.image]
        content += [{"type": "video"} for _ in args.video]
        content.append({"type": "text", "text": args.prompt})
        prompt = Prompt(
            id="cli", messages=[{"role": "user", "content": content}], videos=[str(p) for p in args.video]
        )
        (answer,) = generate_answers(model, processor, [prompt], args.max_new_tokens, 1, videos=videos)
        print(answer)
        return 0
    except (OSError, BadInput) as exc:  # a missing file is bad input too
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
