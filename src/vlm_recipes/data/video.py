"""Video samples (the Qwen line): which frames, at what size, decoded how.

qwen-vl-utils decides the frames and their size, as the Qwen models were trained with: `smart_nframes`
(frames at `data.video_fps`, between 4 and `data.max_frames`, an even count), evenly spaced indices, and
`smart_resize` within the per-frame pixel bounds of its `fetch_video`. Its readers need torchcodec (FFmpeg
installed on the system), decord, or torchvision's `read_video` (removed in torchvision 0.24), so none of
them runs from the package index alone. PyAV does (its wheels carry FFmpeg): frames are read here with
PyAV, and otherwise exactly as qwen-vl-utils' torchvision reader reads them (same count, same indices, same
bicubic resize). tests/test_video.py checks the frames against `qwen_vl_utils.fetch_video`.

The frame plan is computed from the container's header alone, so the length check counts a video's tokens
before anything is decoded (`Family.count_tokens`). A folder of frame images is a video whose frames were
taken at `data.video_fps`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from qwen_vl_utils import smart_resize
from qwen_vl_utils.vision_process import (
    FRAME_FACTOR,
    MODEL_SEQ_LEN,
    VIDEO_MAX_TOKEN_NUM,
    smart_nframes,
)
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as F
from transformers.video_utils import VideoMetadata

from vlm_recipes.errors import VideoError

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass(frozen=True)
class VideoSampling:
    """The recipe's `data.video_*` keys: how frames are taken and sized."""

    fps: float
    max_frames: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_settings(cls, data) -> VideoSampling:
        return cls(data.video_fps, data.max_frames, data.video_min_pixels, data.video_max_pixels)

    def key(self) -> str:
        """Part of every cache key of a video sample: other settings, other frames."""
        return (
            f"video fps={self.fps} max_frames={self.max_frames} pixels={self.min_pixels}..{self.max_pixels}"
        )


@dataclass(frozen=True)
class VideoHeader:
    """What the container says, read without decoding a frame."""

    frames: int
    fps: float
    height: int
    width: int


@dataclass(frozen=True)
class FramePlan:
    """The frames a sample uses: their indices in the video, and the size each is resized to."""

    indices: tuple[int, ...]
    total_frames: int
    fps: float  # the video's own frame rate
    height: int
    width: int

    def metadata(self) -> VideoMetadata:
        """What the processor reads the frame times from (Qwen2.5-VL: seconds per temporal patch;
        Qwen3-VL: the `<t seconds>` text before each pair of frames)."""
        return VideoMetadata(
            total_num_frames=self.total_frames, fps=self.fps, frames_indices=list(self.indices)
        )

    def grid(self, patch_size: int, temporal_patch_size: int) -> tuple[int, int, int]:
        """(t, h, w) patches, as the processor's `video_grid_thw` (it pads the frames to whole temporal
        patches by repeating the last one)."""
        frames = -(-len(self.indices) // temporal_patch_size)
        return frames, self.height // patch_size, self.width // patch_size


def _frame_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)


def read_header(path: Path, sampling: VideoSampling) -> VideoHeader:
    """Frame count, frame rate and size, from the container's header (a folder: its images' count and the
    first one's size, at `data.video_fps`)."""
    path = Path(path)
    if path.is_dir():
        frames = _frame_files(path)
        if not frames:
            raise VideoError(f"{path}: the folder holds no frame images ({', '.join(FRAME_SUFFIXES)})")
        with Image.open(frames[0]) as first:
            return VideoHeader(len(frames), sampling.fps, first.height, first.width)
    import av

    if not path.is_file():
        raise VideoError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise VideoError(f"{path}: the file is empty")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoError(f"{path}: the file has no video stream")
            stream = container.streams.video[0]
            # every packet is read (not decoded): a file cut short still has a header counting every frame
            packets = sum(1 for packet in container.demux(stream) if packet.size)
            if stream.frames and packets < stream.frames:
                raise VideoError(
                    f"{path}: cut short: the header counts {stream.frames} frames, the file holds {packets}"
                )
            frames = stream.frames or packets
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            height, width = stream.codec_context.height, stream.codec_context.width
    except av.FFmpegError as exc:
        raise VideoError(f"{path}: not a readable video ({exc})") from exc
    if frames == 0 or not fps or not height or not width:
        raise VideoError(f"{path}: the video has no frames")
    return VideoHeader(frames, fps, height, width)


def plan_frames(header: VideoHeader, sampling: VideoSampling, factor: int) -> FramePlan:
    """qwen-vl-utils' choice of frames and size for this video (`factor`: the processor's patch size times
    its merge size, the multiple both sides are rounded to)."""
    if header.frames < FRAME_FACTOR:
        raise VideoError(f"{header.frames} frame(s): a video needs at least {FRAME_FACTOR}")
    wanted = {"fps": sampling.fps, "max_frames": sampling.max_frames}
    count = smart_nframes(wanted, total_frames=header.frames, video_fps=header.fps)
    indices = torch.linspace(0, header.frames - 1, count).round().long().tolist()
    # fetch_video's per-frame bounds: at most VIDEO_MAX_TOKEN_NUM tokens a frame, and the whole clip within
    # 90 % of MODEL_SEQ_LEN tokens; never below the lower bound (x1.05); then the recipe's upper bound.
    total_pixels = MODEL_SEQ_LEN * factor * factor * 0.9
    ceiling = max(
        min(VIDEO_MAX_TOKEN_NUM * factor * factor, total_pixels / count * FRAME_FACTOR),
        int(sampling.min_pixels * 1.05),
    )
    height, width = smart_resize(
        header.height,
        header.width,
        factor=factor,
        min_pixels=sampling.min_pixels,
        max_pixels=min(sampling.max_pixels, ceiling),
    )
    if not height or not width:  # smart_resize floors a side shorter than `factor` to 0
        raise VideoError(
            f"{header.width}x{header.height} px frames shrink to {width}x{height} px within "
            f"{min(sampling.max_pixels, ceiling):.0f} pixels a frame (sides are multiples of {factor} px): "
            "raise data.video_max_pixels"
        )
    return FramePlan(tuple(indices), header.frames, header.fps, height, width)


def decode_frames(path: Path, plan: FramePlan) -> torch.Tensor:
    """The planned frames, resized: float [frames, 3, height, width] in 0..255, as fetch_video returns."""
    path = Path(path)
    wanted = set(plan.indices)
    found: dict[int, torch.Tensor] = {}
    if path.is_dir():
        files = _frame_files(path)
        for index in sorted(wanted):
            with Image.open(files[index]) as frame:
                found[index] = _as_tensor(frame.convert("RGB"))
    else:
        import av

        try:
            with av.open(str(path)) as container:
                for index, frame in enumerate(container.decode(video=0)):
                    if index in wanted:
                        found[index] = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
                    if index >= plan.indices[-1]:
                        break
        except av.FFmpegError as exc:
            raise VideoError(f"{path}: decoding failed ({exc})") from exc
    if len(found) < len(wanted):
        raise VideoError(f"{path}: the header says {plan.total_frames} frames but only {len(found)} decode")
    sizes = {tuple(frame.shape) for frame in found.values()}
    if len(sizes) > 1:
        raise VideoError(f"{path}: frames of different sizes {sorted(sizes)}")
    video = torch.stack([found[i] for i in plan.indices])
    return F.resize(
        video, [plan.height, plan.width], interpolation=InterpolationMode.BICUBIC, antialias=True
    ).float()


def _as_tensor(image: Image.Image) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        .view(image.height, image.width, 3)
        .permute(2, 0, 1)
    )


def load_video(path: Path, sampling: VideoSampling, factor: int) -> tuple[torch.Tensor, VideoMetadata]:
    """The frames a sample trains on and the metadata the processor times them with."""
    plan = plan_frames(read_header(path, sampling), sampling, factor)
    return decode_frames(path, plan), plan.metadata()


@dataclass(frozen=True)
class VideoLoader:
    """A sample's videos for one model: decoded at its frame sizes, and the processor's arguments for them
    (`Family.video_processor_kwargs`). Used alike by the collator, evaluation and predict."""

    sampling: VideoSampling
    factor: int
    processor_kwargs: Callable[[list[VideoMetadata]], dict]

    @classmethod
    def for_model(cls, family, processor, sampling: VideoSampling) -> VideoLoader | None:
        """None when the family takes no video."""
        factor = family.video_frame_factor(processor)
        if factor is None:
            return None
        return cls(sampling, factor, lambda metadata: family.video_processor_kwargs(processor, metadata))

    def load(self, path: str | Path) -> tuple[torch.Tensor, VideoMetadata]:
        return load_video(Path(path), self.sampling, self.factor)


def video_identity(path: str) -> bytes:
    """What identifies a video's content in cache keys: path, size and modification time (of every frame,
    for a folder)."""
    path_ = Path(path)
    files = _frame_files(path_) if path_.is_dir() else [path_]
    return "\n".join(f"{f} {f.stat().st_size} {f.stat().st_mtime_ns}" for f in files).encode()
