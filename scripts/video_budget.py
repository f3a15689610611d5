"""Tokens and memory of one video sample at Qwen2-VL-7B's dimensions, for a few frame settings: computed
from the frame plan the length check uses (data/video.py), nothing run.

    python scripts/video_budget.py            # prints the Markdown table in docs/results/video-budget.md

Memory is what grows with the video, per sample, on a GPU in bf16 (the weights are the same for every
row: about 5.5 GB for the 4-bit language model plus the bf16 vision tower of r1):
- pixels: `pixel_values_videos` as the processor returns it (fp32, 3 x 2 x 14 x 14 values a patch);
- LLM activations: with activation checkpointing, each of the 28 layers keeps its bf16 input
  (tokens x 3584 x 2 bytes), plus the fp32 logits over the 152,064-token vocabulary that the loss reads;
- vision activations (only when the tower trains, r2): the 32 checkpointed layer inputs of the tower
  (patches x 1280 x 2 bytes).
Attention itself is not counted (flash / memory-efficient SDPA keep no score matrix).
"""

from __future__ import annotations

from vlm_recipes.data.video import FramePlan, VideoHeader, VideoSampling, plan_frames

# Qwen/Qwen2-VL-7B-Instruct, config.json: the dimensions the table depends on
PATCH, MERGE, TEMPORAL = 14, 2, 2
LLM_LAYERS, LLM_HIDDEN, VOCAB = 28, 3584, 152_064
VISION_LAYERS, VISION_WIDTH = 32, 1280
TEXT_TOKENS = 60  # template, question and a short answer around the video

CLIP = VideoHeader(frames=1800, fps=30.0, height=720, width=1280)  # a 60 s 720p clip
SETTINGS = [  # (video_fps, max_frames, video_max_pixels)
    (0.5, 32, 65_536),
    (2.0, 16, 65_536),
    (2.0, 32, 65_536),  # the defaults
    (2.0, 64, 65_536),
    (2.0, 32, 200_704),
    (2.0, 64, 200_704),
]
GB = 2**30


def budget(plan: FramePlan) -> dict:
    t, h, w = plan.grid(PATCH, TEMPORAL)
    patches = t * h * w
    video_tokens = patches // MERGE**2
    tokens = video_tokens + TEXT_TOKENS
    return {
        "frames": len(plan.indices),
        "frame": f"{plan.width}x{plan.height}",
        "video_tokens": video_tokens,
        "pixels_mb": patches * 3 * TEMPORAL * PATCH * PATCH * 4 / 2**20,
        "llm_gb": (LLM_LAYERS * tokens * LLM_HIDDEN * 2 + tokens * VOCAB * 4) / GB,
        "vision_gb": VISION_LAYERS * patches * VISION_WIDTH * 2 / GB,
    }


def main() -> None:
    print(
        f"A {CLIP.frames / CLIP.fps:.0f} s {CLIP.width}x{CLIP.height} clip at {CLIP.fps:.0f} fps, Qwen2-VL-7B "
        "(computed by scripts/video_budget.py, not run)\n"
    )
    print(
        "| data.video_fps | data.max_frames | data.video_max_pixels | frames | frame size | video tokens "
        "| pixels (MB) | LLM activations + logits (GB) | vision activations if trained (GB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for fps, max_frames, max_pixels in SETTINGS:
        plan = plan_frames(CLIP, VideoSampling(fps, max_frames, 3136, max_pixels), PATCH * MERGE)
        b = budget(plan)
        print(
            f"| {fps:g} | {max_frames} | {max_pixels:,} | {b['frames']} | {b['frame']} | {b['video_tokens']:,} "
            f"| {b['pixels_mb']:.0f} | {b['llm_gb']:.2f} | {b['vision_gb']:.2f} |"
        )


if __name__ == "__main__":
    main()
