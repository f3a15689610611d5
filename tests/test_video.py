"""Video rows (the Qwen line and GLM-4V): the frames are qwen-vl-utils' own, the length check counts exactly what the
collator makes, bad videos are refused at the data check, and the speed-ups (packing, vision feature
cache, preprocessed samples) change nothing for rows with videos.

Clips are a few frames of 64x48-ish px, encoded here with PyAV (libx264 encodes deterministically)."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import qwen_vl_utils.vision_process as qwen_vision
import torch
from conftest import TINY_MODELS, assert_reads_back_the_batch
from PIL import Image
from test_speedups import PER_SAMPLE_LOSS_TOLERANCE, padded_collator, token_losses
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlm_recipes.caches.preprocessed import PreprocessedSampleCollator
from vlm_recipes.cli.train import main
from vlm_recipes.data.collate import VideoCollator
from vlm_recipes.data.lengths import sample_token_counts
from vlm_recipes.data.preference import PREFERENCE
from vlm_recipes.data.rows import VideoRules, load_split, undecoded, video_rules
from vlm_recipes.data.video import VideoLoader, VideoSampling, load_video
from vlm_recipes.demo.models import DEMO_MODELS, ensure_demo_model
from vlm_recipes.errors import DataError
from vlm_recipes.families import FAMILIES
from vlm_recipes.methods import method_of
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipe import load_recipe
from vlm_recipes.recipes.schema import DataSettings
from vlm_recipes.speedups.frozen_vision import VisionFeatureCache
from vlm_recipes.speedups.packing import PaddingFreeVisionCollator, attend_per_sample

QWEN = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]
# the families whose video rows the tests below train on: the Qwen line, and GLM-4V dense and MoE (Qwen's
# frames, its own prompt: an image block and a timestamp per pair of frames)
VIDEO_FAMILIES = [*QWEN, "glm4v", "glm4v-moe"]

# name: (frames, fps, width, height)
CLIPS = {"short": (8, 4, 64, 48), "wide": (12, 6, 96, 40), "tall": (10, 2.5, 48, 64)}
IMAGES = {"a.png": (60, 40, "red"), "b.png": (30, 90, "blue")}

# The recipe defaults; then settings that take fewer frames than the clips have at 4 fps, at frames small
# enough to be shrunk (Qwen2.5-VL's seconds per temporal patch are 2/3 and 4/3, not 1); then more frames
# per second than the clips have (every frame), enlarged.
SAMPLINGS = {
    "defaults": VideoSampling(2.0, 64, 3136, 65536),
    "few small frames": VideoSampling(4.0, 6, 1000, 2500),
    "every frame": VideoSampling(8.0, 16, 8000, 20000),
}
SAMPLING = SAMPLINGS["few small frames"]  # the speed-up tests'


def make_clip(path: Path, frames: int, fps: float, width: int, height: int, codec: str = "libx264") -> None:
    """A clip whose frames all differ (a colour ramp over time, noise in one channel); its container is
    the file's extension."""
    rng = np.random.default_rng(frames)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "18", "threads": "1"} | ({"b": "0"} if codec == "libvpx-vp9" else {})
        for i in range(frames):
            image = np.zeros((height, width, 3), np.uint8)
            image[..., 0] = (np.arange(width) * 255 // width)[None]
            image[..., 1] = i * 255 // (frames - 1)
            image[..., 2] = rng.integers(0, 256, (height, width), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def row(videos=(), images=(), answer: str = "a shape moves to the right") -> dict:
    parts = [{"type": "video"} for _ in videos] + [{"type": "image"} for _ in images]
    return {
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        "images": list(images),
        "videos": list(videos),
    }


ROWS = {
    "video": row(["short.mp4"]),
    "video and two images": row(["wide.mp4"], ["a.png", "b.png"], "it slides"),
    "two images": row([], ["a.png", "b.png"], "red then blue"),
    "image": row([], ["a.png"], "red"),
    "two videos and an image": row(["tall.mp4", "short.mp4"], ["a.png"], "both fade in"),
}


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    return write_media(tmp_path_factory.mktemp("video-data"))


def write_media(root: Path) -> Path:
    """The clips, the images and a data file of ROWS (paths relative to it), in `root`."""
    for name, clip in CLIPS.items():
        make_clip(root / f"{name}.mp4", *clip)
    for name, (width, height, colour) in IMAGES.items():
        Image.new("RGB", (width, height), colour).save(root / name)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS.values()))
    return root


@pytest.fixture(scope="module", params=VIDEO_FAMILIES)
def qwen(request, private_demo_cache):
    """(family, model directory, processor) of the tiny model of one family taking video, the processor as a
    stage loads it (GLM-4V's with its training chat template, the one the length check counts with)."""
    family = DEMO_MODELS[TINY_MODELS[request.param]].family
    model_dir = ensure_demo_model(TINY_MODELS[request.param])
    return family, model_dir, load_processor(str(model_dir), DataSettings(), family)


def load_rows(media: Path, family, processor, sampling: VideoSampling = SAMPLING):
    """ROWS as the stage loads them (checked, images decodable, video paths from the working directory):
    the dataset, and its rows as the collator receives them."""
    rules = VideoRules(sampling, family.video_frame_factor(processor))
    ds, skipped = load_split(str(media / "train.jsonl"), "train", None, video=rules)
    assert not skipped and len(ds) == len(ROWS)
    return ds, [dict(r) for r in ds]


def video_collator(family, processor, sampling: VideoSampling = SAMPLING) -> VideoCollator:
    """The collator the SFT stage trains with: TRL's, as SFTTrainer builds it, with videos."""
    return VideoCollator.extending(
        padded_collator(processor), VideoLoader.for_model(family, processor, sampling)
    )


def tiny_model(model_dir: Path):
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


# --------------------------------------------------------------------------- frames


def pyav_reader(ele: dict):
    """qwen-vl-utils' torchvision reader (`_read_video_torchvision`: every frame decoded, smart_nframes
    evenly spaced indices, the sampled fps), on PyAV: torchvision 0.24 removed `read_video` it calls."""
    with av.open(ele["video"]) as container:
        video_fps = float(container.streams.video[0].average_rate)
        frames = [
            torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
            for frame in container.decode(video=0)
        ]
    video = torch.stack(frames)
    total_frames = video.size(0)
    nframes = qwen_vision.smart_nframes(ele, total_frames=total_frames, video_fps=video_fps)
    idx = torch.linspace(0, total_frames - 1, nframes).round().long()
    sample_fps = nframes / max(total_frames, 1e-6) * video_fps
    metadata = {"fps": video_fps, "frames_indices": idx, "total_num_frames": total_frames}
    return video[idx], {**metadata, "video_backend": "pyav"}, sample_fps


FRAME_CASES = {  # clip, sampling, patch size (Qwen2-VL and Qwen2.5-VL: 14 px; Qwen3-VL: 16 px)
    "4 of 8 frames, enlarged": ("short", SAMPLINGS["defaults"], 14),
    "max_frames of 12, shrunk": ("wide", SAMPLINGS["few small frames"], 14),
    "every frame, 16 px patches": ("tall", SAMPLINGS["every frame"], 16),
    "at least 4 frames, 16 px patches": ("wide", VideoSampling(1.0, 16, 3136, 65536), 16),
    "fps 2 of 2.5, shrunk": ("tall", VideoSampling(2.0, 64, 1000, 3000), 14),
}


@pytest.mark.parametrize("case", list(FRAME_CASES))
def test_frames_are_what_qwen_vl_utils_fetch_video_returns(media, monkeypatch, case):
    clip, sampling, patch = FRAME_CASES[case]
    path = media / f"{clip}.mp4"
    backend = qwen_vision.get_video_reader_backend()  # its readers can't run here: ours in its place
    monkeypatch.setitem(qwen_vision.VIDEO_READER_BACKENDS, backend, pyav_reader)
    ele = {
        "video": str(path),
        "fps": sampling.fps,
        "max_frames": sampling.max_frames,
        "min_pixels": sampling.min_pixels,
        "max_pixels": sampling.max_pixels,
    }
    (expected, about), sample_fps = qwen_vision.fetch_video(
        ele, image_patch_size=patch, return_video_sample_fps=True, return_video_metadata=True
    )
    frames, metadata = load_video(path, sampling, factor=patch * qwen_vision.SPATIAL_MERGE_SIZE)
    assert frames.dtype == expected.dtype and frames.shape == expected.shape, case
    assert torch.equal(frames, expected), (frames - expected).abs().max()
    assert metadata.frames_indices == about["frames_indices"].tolist()
    assert metadata.total_num_frames == about["total_num_frames"] == CLIPS[clip][0]
    assert metadata.fps == pytest.approx(about["fps"])
    assert metadata.sampled_fps == pytest.approx(sample_fps, rel=1e-12)


def test_a_folder_of_frames_is_a_video_taken_at_data_video_fps(media, tmp_path):
    """The same frames as PNG files, at the clip's own frame rate: the same frames, sizes and times."""
    path = media / "short.mp4"
    frames, fps = CLIPS["short"][0], CLIPS["short"][1]
    with av.open(str(path)) as container:
        for i, frame in enumerate(container.decode(video=0)):
            frame.to_image().save(tmp_path / f"{i:03d}.png")
    sampling = VideoSampling(fps, 6, 1000, 2500)
    from_file, about_file = load_video(path, sampling, 28)
    from_folder, about_folder = load_video(tmp_path, sampling, 28)
    assert from_folder.shape[0] == 6 < frames
    assert torch.equal(from_folder, from_file)
    assert about_folder.frames_indices == about_file.frames_indices
    assert about_folder.sampled_fps == about_file.sampled_fps


# --------------------------------------------------------------------------- the length check


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_video_token_count_matches_the_processor(qwen, media, sampling):
    """Counted from the headers (the length check) as the collator makes them, row by row: videos alone,
    with two images, two videos; Qwen3-VL's `<t seconds>` text before every pair of frames included."""
    family, _, processor = qwen
    settings = SAMPLINGS[sampling]
    ds, rows = load_rows(media, family, processor, settings)
    # the same files for every sampling: a count remembered under other settings would be wrong here
    counts = sample_token_counts(undecoded(ds), processor, family, settings)
    collator = video_collator(family, processor, settings)
    image_sizes = {name: (height, width) for name, (width, height, _) in IMAGES.items()}
    for name, (text, vision), example in zip(ROWS, counts, rows, strict=True):
        batch = collator([dict(example)])
        ids = batch["input_ids"][0]
        assert text + vision == len(ids), (name, text, vision)
        # by the processor's token types (GLM-4V writes a video's frames with the image token)
        images = int((batch["mm_token_type_ids"][0] == 1).sum())
        videos = int((batch["mm_token_type_ids"][0] == 2).sum())
        assert vision == images + videos, name
        expected = family.image_token_counts(processor, [image_sizes[i] for i in ROWS[name]["images"]])
        assert images == sum(expected), name  # two images: each its own size, its own grid
        assert len(batch.get("image_grid_thw", [])) == len(ROWS[name]["images"]), name
        assert len(batch.get("video_grid_thw", [])) == len(ROWS[name]["videos"]), name
        assert (videos > 0) == bool(ROWS[name]["videos"]), name


# --------------------------------------------------------------------------- bad input


def test_bad_videos_are_refused_at_the_data_check(media, tmp_path):
    """Each bad row is named by its line, with the reason and the file."""
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "text.mp4").write_text("this is not a video\n" * 20)
    (tmp_path / "noise.mp4").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4000)))
    (tmp_path / "no-frames").mkdir()
    (tmp_path / "no-frames" / "notes.txt").write_text("frames come later")
    (tmp_path / "ok.mp4").write_bytes((media / "short.mp4").read_bytes())
    # index first (faststart), then cut in half: the header still counts every frame
    with av.open(str(tmp_path / "whole.mp4"), "w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for seed in range(12):
            noise = np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(noise, format="rgb24")))
        container.mux(stream.encode())
    whole = (tmp_path / "whole.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(whole[: len(whole) // 2])
    one_video_part = row(["ok.mp4"])
    cases = [  # row, expected "reason: detail" after "train.jsonl:line N: "
        (row(["gone.mp4"]), f"video not found: {tmp_path / 'gone.mp4'}"),
        (row(["empty.mp4"]), f"unreadable video: {tmp_path / 'empty.mp4'}: the file is empty"),
        (row(["text.mp4"]), f"unreadable video: {tmp_path / 'text.mp4'}: not a readable video"),
        (row(["noise.mp4"]), f"unreadable video: {tmp_path / 'noise.mp4'}: not a readable video"),
        (row(["no-frames"]), f"unreadable video: {tmp_path / 'no-frames'}: the folder holds no frame images"),
        (
            row(["cut.mp4"]),
            f"unreadable video: {tmp_path / 'cut.mp4'}: cut short: the header counts 12 frames",
        ),
        ({**one_video_part, "videos": []}, "video count mismatch: 1 video parts in messages but 0 videos"),
        (
            {**one_video_part, "videos": ["ok.mp4", "ok.mp4"]},
            "video count mismatch: 1 video parts in messages but 2 videos",
        ),
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r, _ in [*cases, (one_video_part, "")]))
    rules = VideoRules(SAMPLINGS["defaults"], 28)
    with pytest.raises(DataError) as error:
        load_split(str(data), "train", None, video=rules)
    message = str(error.value)
    assert message.startswith(f"{len(cases)} bad row(s) in {data}")
    for line, (_, expected) in enumerate(cases, start=1):
        assert f"{data}:line {line}: {expected}" in message, (line, message)
    assert f"line {len(cases) + 1}:" not in message, "the good row is not blamed"
    # under `skip`, only the good row stays, its video path resolved
    ds, skipped = load_split(str(data), "train", None, on_bad_sample="skip", video=rules)
    assert ds["videos"] == [[str(tmp_path / "ok.mp4")]]
    assert skipped == {"video not found": 1, "unreadable video": 5, "video count mismatch": 2}


def test_video_rows_where_videos_are_not_taken_are_refused(media, tmp_path):
    """A DPO stage (TRL's collator takes images only) refuses a preference row with a video."""
    model_dir = ensure_demo_model(TINY_MODELS["qwen2-vl"])
    family = DEMO_MODELS[TINY_MODELS["qwen2-vl"]].family
    stage = load_recipe("r5-sft-then-dpo").stages[-1]
    assert stage.method == "dpo"
    rules = video_rules(stage, family, AutoProcessor.from_pretrained(model_dir), method_of(stage).takes_video)
    sft = row(["short.mp4"])
    pair = {
        "prompt": sft["messages"][:1],
        "chosen": sft["messages"][1:],
        "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "nothing"}]}],
        "images": [],
        "videos": [str(media / "short.mp4")],
    }
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(pair) + "\n")
    with pytest.raises(DataError) as error:
        load_split(str(data), "train", None, row_format=PREFERENCE, video=rules)
    assert f"{data}:line 1: video not supported: method dpo takes images only" in str(error.value)


def run_cli(tmp_path: Path, data: Path, *overrides: str) -> int:
    return main(
        [
            "--recipe",
            "r1-llm-only",
            f"data.train={data}",
            "data.eval=null",
            "--output-dir",
            str(tmp_path / "runs"),
            "--run-name",
            "bad",
            *overrides,
        ]
    )


VIDEO_TAKERS = "qwen2-vl, qwen2.5-vl, qwen3-vl, qwen3.5, qwen3.5-moe, glm4v, glm4v-moe"
NO_VIDEO = [family.name for family in FAMILIES if not family.takes_video]


@pytest.mark.parametrize(
    "model, overrides, message",
    [
        *(
            (
                TINY_MODELS[name],
                [],
                f"train.jsonl:line 1: video not supported: {name} takes no video here (the families that do: "
                f"{VIDEO_TAKERS})",
            )
            for name in NO_VIDEO
        ),
        (  # 64x48 px frames within 100 pixels: a side shorter than 28 px, which smart_resize makes 0
            "demo:tiny-qwen2-vl",
            ["data.video_max_pixels=100", "data.video_min_pixels=50"],
            "short.mp4: 64x48 px frames shrink to 0x0 px within 100 pixels a frame (sides are multiples of "
            "28 px): raise data.video_max_pixels",
        ),
    ],
    ids=[*(f"{name} takes no video" for name in NO_VIDEO), "frames shrunk to nothing"],
)
def test_the_cli_refuses_video_rows_before_training(media, tmp_path, capsys, model, overrides, message):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(row([str(media / "short.mp4")])) + "\n")
    assert run_cli(tmp_path, data, f"model={model}", *overrides) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert str(data) in err and "Traceback" not in err
    runs = tmp_path / "runs"
    assert not list(runs.glob("**/DONE")) and not list(runs.glob("**/final")), "nothing was trained"


# --------------------------------------------------------------------------- speed-ups


@pytest.mark.parametrize("attention", ["sdpa with a block mask", "sdpa_per_sample"])
def test_packed_video_rows_keep_per_sample_losses(qwen, media, attention):
    """Padding-free packing of rows with videos, two images, one image: each token's loss is the one it
    has alone (the mRoPE positions of the video tokens, Qwen2.5-VL's timing included, are the sample's)."""
    family, model_dir, processor = qwen
    model = tiny_model(model_dir)
    if attention == "sdpa_per_sample":
        assert attend_per_sample(model) == "sdpa"
    _, rows = load_rows(media, family, processor)
    collator = video_collator(family, processor)
    packed = PaddingFreeVisionCollator(collator, family.rope_index(model), family.rope_index_keys)(
        [dict(r) for r in rows]
    )
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    assert len(packed["video_grid_thw"]) == 4 and len(packed["image_grid_thw"]) == 6
    if family.name == "qwen2.5-vl":  # not 1 s, the default get_rope_index assumes without them
        assert (packed["second_per_grid_ts"] != 1).all(), packed["second_per_grid_ts"]
    one_by_one = torch.cat([token_losses(model, collator([dict(r)])) for r in rows])
    together = token_losses(model, packed)
    assert together.shape == one_by_one.shape
    assert (together - one_by_one).abs().max() < PER_SAMPLE_LOSS_TOLERANCE


def vision_units(family, batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(pixels, grid) of every image, then every video, of a batch: the feature cache's entries."""
    units = family.image_units(batch["pixel_values"], batch["image_grid_thw"])
    return units + family.image_units(batch["pixel_values_videos"], batch["video_grid_thw"])


def test_vision_feature_cache_covers_video_frames(qwen, media, tmp_path):
    """Videos are cached per video like images (Qwen2-VL, Qwen2.5-VL: get_video_features hooked; Qwen3-VL:
    it goes through get_image_features): cold misses, warm hits, logits bit for bit the uncached ones."""
    family, model_dir, processor = qwen
    model = tiny_model(model_dir)
    _, rows = load_rows(media, family, processor)
    batch = video_collator(family, processor)([dict(r) for r in rows])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        expected = model(**inputs).logits
    cache = VisionFeatureCache(tmp_path, model, family).install()
    units = len(vision_units(family, batch))
    assert units == 6 + 4  # images, videos
    # a unit the batch holds twice (the demo rows repeat an image or a clip) is computed once
    distinct = len({(p.numpy().tobytes(), tuple(g.tolist())) for p, g in vision_units(family, batch)})
    with torch.no_grad():
        first = model(**inputs).logits
        assert (cache.hits, cache.misses) == (units - distinct, distinct)
        second = model(**inputs).logits
        assert (cache.hits, cache.misses) == (2 * units - distinct, distinct)
    assert torch.equal(first, expected) and torch.equal(second, expected)

    # other frames (data.max_frames 4 of the 6 taken): new entries for the videos, the images hit
    fewer = video_collator(family, processor, VideoSampling(SAMPLING.fps, 4, 1000, 2500))
    other = fewer([dict(r) for r in rows])
    seen = {(pixels.numpy().tobytes(), tuple(grid.tolist())) for pixels, grid in vision_units(family, batch)}
    new = [(p.numpy().tobytes(), tuple(g.tolist())) not in seen for p, g in vision_units(family, other)]
    assert sum(new) == 4, "every video has other frames"
    with torch.no_grad():
        model(**{k: v for k, v in other.items() if k != "labels"})
    fresh = {(p.numpy().tobytes(), tuple(g.tolist())) for p, g in vision_units(family, other)} - seen
    assert (cache.hits, cache.misses) == (3 * units - distinct - len(fresh), distinct + len(fresh))


def test_preprocessed_cache_stores_video_rows(qwen, media, tmp_path):
    """Cold (videos decoded from their files) and warm (read back): the VideoCollator's batch, tensor for
    tensor. Other video settings: the video rows are made afresh, the others read back."""
    family, _, processor = qwen
    ds, rows = load_rows(media, family, processor)
    collator = video_collator(family, processor)
    other = VideoSampling(SAMPLING.fps, 4, SAMPLING.min_pixels, SAMPLING.max_pixels)
    other_collator = video_collator(family, processor, other)
    expected = collator([dict(r) for r in rows])
    stored = [dict(r) for r in undecoded(ds)]  # images as file references
    cached = PreprocessedSampleCollator(collator, tmp_path)
    assert_reads_back_the_batch(cached, stored, expected)
    assert (cached.misses, cached.hits) == (len(rows), len(rows))

    recached = PreprocessedSampleCollator(other_collator, tmp_path)
    assert recached.directory == cached.directory
    batch = recached([dict(r) for r in stored])
    with_videos = sum(bool(r["videos"]) for r in ROWS.values())
    assert (recached.misses, recached.hits) == (with_videos, len(rows) - with_videos)
    assert torch.equal(batch["video_grid_thw"][:, 0], torch.tensor([2, 2, 2, 2])), "4 frames each"


def test_preprocessed_video_samples_are_not_read_by_another_processor(media, tmp_path):
    """Qwen2-VL's and Qwen2.5-VL's tiny processors have the same image settings, template and tokenizer,
    so they share a cache directory; Qwen2.5-VL's video samples also carry `second_per_grid_ts` (its
    video timing), so it must not read Qwen2-VL's."""
    batches = {}
    for name in ("qwen2-vl", "qwen2.5-vl"):
        family = DEMO_MODELS[TINY_MODELS[name]].family
        processor = AutoProcessor.from_pretrained(ensure_demo_model(TINY_MODELS[name]))
        _, rows = load_rows(media, family, processor)
        collator = video_collator(family, processor)
        cached = PreprocessedSampleCollator(collator, tmp_path)
        batches[name] = (cached([dict(r) for r in rows]), collator([dict(r) for r in rows]))
    assert len({p.parent for p in tmp_path.glob("*/*.safetensors")}) == 1, "one shared directory"
    batch, expected = batches["qwen2.5-vl"]
    assert batch.keys() == expected.keys()
    assert torch.equal(batch["second_per_grid_ts"], expected["second_per_grid_ts"])
