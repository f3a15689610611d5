"""Datasets people already have: LLaMA-Factory, ms-swift and LLaVA files read as they are, text-only and
video-only datasets, photos as a viewer shows them, clips in every container, and the data check command.

Every file here is written by the test: JPEG photos (an asymmetric picture, so a wrong orientation shows),
PNGs in every mode, H.264 clips (VP9 in .webm, the codecs that container holds), in the shapes of
LLaMA-Factory's data/ folder (mllm_demo.json, mllm_video_demo.json, dataset_info.json)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import OPENAI_TAGS, TINY_MODELS
from PIL import Image
from test_speedups import padded_collator
from test_video import make_clip
from transformers import AutoProcessor

from vlm_recipes.cli.data_check import main as data_main
from vlm_recipes.cli.train import main
from vlm_recipes.data.collate import VideoCollator, with_upright_images
from vlm_recipes.data.formats import content_parts
from vlm_recipes.data.images import upright_rgb
from vlm_recipes.data.lengths import sample_token_counts
from vlm_recipes.data.preference import PREFERENCE
from vlm_recipes.data.rows import load_split, undecoded
from vlm_recipes.data.video import VideoSampling, load_video, read_header
from vlm_recipes.errors import DataError
from vlm_recipes.files import read_json

SAMPLING = VideoSampling(2.0, 4, 1000, 4000)
ONE_STEP = [
    "--max-steps",
    "1",
    "training.per_device_batch_size=2",
    "data.eval=null",
    f"data.video_fps={SAMPLING.fps}",
    f"data.max_frames={SAMPLING.max_frames}",
    f"data.video_max_pixels={SAMPLING.max_pixels}",
]


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A picture whose left, right, top and bottom differ: red on the left, blue on the right, a green
    band at the top, noise to make JPEG work."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 40, (height, width, 3), dtype=np.uint8)
    pixels[:, : width // 2, 0] = 220
    pixels[:, width // 2 :, 2] = 220
    pixels[: height // 4, :, 1] = 220
    return Image.fromarray(pixels)


def write_sideways_jpeg(path: Path, upright: Image.Image) -> None:
    """The photo as a phone stores it when held upright: pixels rotated, EXIF orientation 6 (rotate 90°
    clockwise to view)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    upright.transpose(Image.Transpose.ROTATE_90).save(path, "JPEG", quality=95, exif=exif)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def llama_factory_dir(tmp_path_factory) -> Path:
    """A folder laid out as LLaMA-Factory's data/: JPEG photos and .mp4 / .avi clips in mllm_demo_data/,
    mllm_demo.json (a JSON array, OpenAI-style messages, multi-turn, `<image>` placeholders),
    mllm_video_demo.json (`<video>`), text.json (text-only turns) and dataset_info.json naming them."""
    root = tmp_path_factory.mktemp("llama-factory-data")
    media = root / "mllm_demo_data"
    media.mkdir()
    for i, (width, height) in enumerate([(96, 64), (64, 80), (80, 80)], start=1):
        photo(width, height, i).save(media / f"{i}.jpg", "JPEG", quality=90)
    make_clip(media / "1.mp4", 8, 4, 64, 48)
    make_clip(media / "2.avi", 8, 4, 48, 64)
    images = [
        {
            "messages": [
                user("<image>Who are they?"),
                assistant("Two players in red."),
                user("What are they doing?<image>"),
                assistant("They celebrate a goal."),
            ],
            "images": ["mllm_demo_data/1.jpg", "mllm_demo_data/1.jpg"],
        },
        {
            "messages": [user("<image>\nWhat colour is on the left?"), assistant("red")],
            "images": ["mllm_demo_data/2.jpg"],
        },
        {
            "messages": [
                {"role": "system", "content": "Answer in one word."},
                user("Compare <image> and <image>."),
                assistant("different"),
            ],
            "images": ["mllm_demo_data/2.jpg", "mllm_demo_data/3.jpg"],
        },
        {"messages": [user("Say hello."), assistant("hello")], "images": []},
    ]
    videos = [
        {
            "messages": [user("<video>What moves?"), assistant("the colour")],
            "videos": ["mllm_demo_data/1.mp4"],
        },
        {"messages": [user("<video>Which way?"), assistant("up")], "videos": ["mllm_demo_data/2.avi"]},
    ]
    (root / "mllm_demo.json").write_text(json.dumps(images, indent=2))
    (root / "mllm_video_demo.json").write_text(json.dumps(videos, indent=2))
    text = [
        {"messages": [user(f"Count to {n}."), assistant(" ".join(map(str, range(1, n + 1))))]}
        for n in range(1, 7)
    ]
    (root / "text.json").write_text(json.dumps(text, indent=2))
    info = {
        "mllm_demo": {
            "file_name": "mllm_demo.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": OPENAI_TAGS,
        },
        "mllm_video_demo": {
            "file_name": "mllm_video_demo.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "videos": "videos"},
            "tags": OPENAI_TAGS,
        },
        "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    }
    (root / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return root


def as_trl(row: dict) -> dict:
    """The same row written by hand in TRL's form."""
    messages = [{"role": m["role"], "content": content_parts(m["content"])} for m in row["messages"]]
    return {"messages": messages, "images": row.get("images", [])}


def without_nones(turns: list[dict]) -> list[dict]:
    """A conversation without the `None` fields Arrow fills in where parts of one column differ in keys
    (an image part reads back with `text: None`, as in TRL's own datasets)."""
    return [
        {**turn, "content": [{k: v for k, v in part.items() if v is not None} for part in turn["content"]]}
        for turn in turns
    ]


def messages_of(ds) -> list[list[dict]]:
    return [without_nones(messages) for messages in undecoded(ds)["messages"]]


def as_llava(row: dict) -> dict:
    """The same one-image row in LLaVA-Instruct's form: `conversations` of from/value, one `image`."""
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    turns = [{"from": names[m["role"]], "value": m["content"]} for m in row["messages"]]
    return {"id": "x", "image": row["images"][0], "conversations": turns}


def write_jsonl(path: Path, rows: list[dict], bom: bool = False, crlf: bool = False) -> Path:
    end = "\r\n" if crlf else "\n"
    text = "".join(json.dumps(row) + end for row in rows)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


# --------------------------------------------------------------------------- formats


def test_placeholders_become_parts_where_they_stand_with_the_text_kept_exactly():
    assert content_parts("<image>Who?") == [{"type": "image"}, {"type": "text", "text": "Who?"}]
    assert content_parts("Compare <image> and <image>.") == [
        {"type": "text", "text": "Compare "},
        {"type": "image"},
        {"type": "text", "text": " and "},
        {"type": "image"},
        {"type": "text", "text": "."},
    ]
    assert content_parts("<video>\nWhy?") == [{"type": "video"}, {"type": "text", "text": "\nWhy?"}]
    assert content_parts("<image>") == [{"type": "image"}]
    assert content_parts("no media") == [{"type": "text", "text": "no media"}]


def test_llama_factory_files_and_their_dataset_info_entries_read_as_trl_rows(llama_factory_dir, caplog):
    caplog.set_level("INFO")
    path = llama_factory_dir / "mllm_demo.json"
    ds, _ = load_split(str(path), "train", None)
    assert "OpenAI-style messages" in caplog.text and "4 rows, 5 images" in caplog.text
    expected = [as_trl(row) for row in json.loads(path.read_text())]
    plain = undecoded(ds)
    assert messages_of(ds) == [row["messages"] for row in expected]
    assert [len(images) for images in plain["images"]] == [2, 1, 2, 0]
    assert messages_of(ds)[2][0] == {
        "role": "system",
        "content": [{"type": "text", "text": "Answer in one word."}],
    }
    by_entry, _ = load_split(f"{llama_factory_dir}/dataset_info.json#mllm_demo", "train", None)
    assert messages_of(by_entry) == messages_of(ds)
    with pytest.raises(DataError, match="formatting 'alpaca' is not read"):
        load_split(f"{llama_factory_dir}/dataset_info.json#alpaca_en_demo", "train", None)
    with pytest.raises(DataError, match="no entry 'nope'; its entries are alpaca_en_demo, mllm_demo"):
        load_split(f"{llama_factory_dir}/dataset_info.json#nope", "train", None)


def test_same_rows_in_trl_llama_factory_and_llava_form_give_the_same_tokens_and_labels(
    tiny_family, llama_factory_dir, tmp_path
):
    """Token by token, through the collator SFTTrainer trains with: a multi-turn two-image row, a one-image
    row with a system turn, a text-only row."""
    family, model_dir = tiny_family
    source = json.loads((llama_factory_dir / "mllm_demo.json").read_text())
    one_image = {
        "messages": [user("<image>What is it?"), assistant("a photo")],
        "images": source[1]["images"],
    }
    rows = [source[0], source[1], one_image, source[3]]
    forms = {
        "llama-factory": (tmp_path / "lf.json", json.dumps(rows)),
        "trl": (tmp_path / "trl.jsonl", "".join(json.dumps(as_trl(r)) + "\n" for r in rows)),
    }
    for path, text in forms.values():
        path.write_text(text.replace("mllm_demo_data/", f"{llama_factory_dir}/mllm_demo_data/"))
    llava = tmp_path / "llava.json"
    llava.write_text(
        json.dumps([as_llava(one_image)]).replace("mllm_demo_data/", f"{llama_factory_dir}/mllm_demo_data/")
    )

    processor = AutoProcessor.from_pretrained(model_dir)
    collate = VideoCollator.extending(padded_collator(processor), videos=None)
    loaded = {name: list(load_split(str(path), "train", None)[0]) for name, (path, _) in forms.items()}
    trl, lf = collate(loaded["trl"]), collate(loaded["llama-factory"])
    assert trl.keys() == lf.keys()
    for key in trl:
        assert torch.equal(trl[key], lf[key]), key
    assert (trl["labels"] != -100).any(dim=1).all(), "every row has answer tokens to learn"
    labelled = (lf["labels"][0] != -100).int()
    assert (labelled.diff() == 1).sum() == 2, "the two-turn row learns both assistant turns"
    from_llava, alone = collate(list(load_split(str(llava), "train", None)[0])), collate(loaded["trl"][2:3])
    assert from_llava.keys() == alone.keys()
    for key in alone:
        assert torch.equal(from_llava[key], alone[key]), key


def test_rows_that_cannot_be_read_name_the_file_line_and_fix(tmp_path, llama_factory_dir):
    image = str(llama_factory_dir / "mllm_demo_data" / "1.jpg")
    path = tmp_path / "bad.json"
    rows = [
        {"messages": [user("<image>ok"), assistant("fine")], "images": [image]},
        {"messages": [user("<image><image>two?"), assistant("one file")], "images": [image]},
        {"messages": [user("<image>hm"), {"role": "observation", "content": "x"}], "images": [image]},
    ]
    path.write_text(json.dumps(rows, indent=2))
    with pytest.raises(DataError) as error:
        load_split(str(path), "train", None)
    text = str(error.value)
    lines = path.read_text().splitlines()
    two = next(i for i, line in enumerate(lines) if "two?" in line)
    second = max(i for i, line in enumerate(lines[:two], 1) if line == "  {")  # the row's opening `{`
    assert (
        f"{path}:line {second}: image count mismatch: 2 <image> placeholder(s) in the text but 1 file(s)"
        in text
    )
    assert "put one <image> where each image belongs" in text
    assert (
        "unknown role: turn 1: `role` is 'observation'; this file's roles are user/assistant/system" in text
    )
    assert "2 bad row(s)" in text
    kept, skipped = load_split(str(path), "train", None, on_bad_sample="skip")
    assert len(kept) == 1 and skipped == {"image count mismatch": 1, "unknown role": 1}

    mixed = tmp_path / "mixed.jsonl"
    write_jsonl(mixed, [as_trl(rows[0]), {"conversations": [{"from": "human", "value": "hi"}]}])
    with pytest.raises(
        DataError, match=rf"{mixed}:line 2: a row in sharegpt conversations .* but {mixed}:line 1 is in TRL"
    ):
        load_split(str(mixed), "train", None)
    unknown = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "a", "output": "b"}])
    with pytest.raises(DataError, match=r"keys \['instruction', 'output'\] are in no format .* 'Your data'"):
        load_split(str(unknown), "train", None)


def test_a_bad_row_of_a_one_line_json_array_is_skipped_not_the_first_row(tmp_path):
    """Every row of a JSON array written on one line is at `line 1`: the bad row was found by its place, so
    `skip` dropped the first row and kept the bad one (a missing image, a crash at the length check)."""
    image = tmp_path / "red.png"
    Image.new("RGB", (56, 56), "red").save(image)
    rows = [{"messages": [user(f"<image>q{i}"), assistant("red")], "images": [str(image)]} for i in range(4)]
    rows[2]["images"] = [str(tmp_path / "gone.png")]
    rows[3]["messages"][1]["role"] = "observation"  # refused as the file is read (not a row of the table)
    path = tmp_path / "one-line.json"
    path.write_text(json.dumps(rows))
    kept, skipped = load_split(str(path), "train", None, on_bad_sample="skip")
    assert skipped == {"unknown role": 1, "image not found": 1}
    assert [m[0]["content"][-1]["text"] for m in kept["messages"]] == ["q0", "q1"]


def test_a_windows_written_jsonl_with_bom_and_crlf_is_read(tmp_path, llama_factory_dir):
    row = {
        "messages": [user("<image>What?"), assistant("red")],
        "images": [str(llama_factory_dir / "mllm_demo_data/1.jpg")],
    }
    path = write_jsonl(tmp_path / "windows.jsonl", [row, row], bom=True, crlf=True)
    ds, _ = load_split(str(path), "train", None)
    assert messages_of(ds) == [as_trl(row)["messages"]] * 2


def test_preference_rows_in_llama_factory_and_ms_swift_form_read_as_trl_preference(
    tmp_path, llama_factory_dir
):
    image = str(llama_factory_dir / "mllm_demo_data" / "1.jpg")
    llama_factory = {
        "conversations": [{"from": "human", "value": "<image>Which colour is left?"}],
        "chosen": {"from": "gpt", "value": "red"},
        "rejected": {"from": "gpt", "value": "blue"},
        "images": [image],
    }
    ms_swift = {
        "messages": [user("<image>Which colour is left?"), assistant("red")],
        "rejected_response": "blue",
        "images": [image],
    }
    trl = {
        "prompt": [{"role": "user", "content": content_parts("<image>Which colour is left?")}],
        "chosen": [{"role": "assistant", "content": content_parts("red")}],
        "rejected": [{"role": "assistant", "content": content_parts("blue")}],
    }
    for name, row in (("lf", llama_factory), ("swift", ms_swift)):
        ds, _ = load_split(
            str(write_jsonl(tmp_path / f"{name}.jsonl", [row])), "train", None, row_format=PREFERENCE
        )
        plain = undecoded(ds)[0]
        assert {k: without_nones(plain[k]) for k in trl} == trl, name
        assert len(plain["images"]) == 1


# --------------------------------------------------------------------------- photos and clips


def test_a_sideways_phone_photo_reaches_the_model_upright(tmp_path):
    """EXIF orientation 6: the length check counts the upright size and the processor gets the upright
    pixels (its image grid is the upright one, the pixels match the upright photo's)."""
    from vlm_recipes.demo.models import DEMO_MODELS, ensure_demo_model

    upright = photo(96, 64)
    write_sideways_jpeg(tmp_path / "phone.jpg", upright)
    upright.save(tmp_path / "upright.png")
    rows = [
        {"messages": [user("<image>Left colour?"), assistant("red")], "images": [name]}
        for name in ("phone.jpg", "upright.png")
    ]
    ds, _ = load_split(str(write_jsonl(tmp_path / "photos.jsonl", rows)), "train", None)
    family = DEMO_MODELS[TINY_MODELS["qwen2-vl"]].family
    processor = AutoProcessor.from_pretrained(ensure_demo_model(TINY_MODELS["qwen2-vl"]))
    phone, png = sample_token_counts(undecoded(ds), processor, family)
    assert phone == png, "the sideways file is counted as the upright photo"
    batch = processor.image_processor(
        images=[with_upright_images(row)["images"][0] for row in ds], return_tensors="pt"
    )
    grids = batch["image_grid_thw"].tolist()
    assert grids[0] == grids[1] and grids[0][1] < grids[0][2], "64 high, 96 wide, both"
    half = batch["pixel_values"].shape[0] // 2
    difference = (batch["pixel_values"][:half] - batch["pixel_values"][half:]).abs().mean()
    sideways = processor.image_processor(
        images=[Image.open(tmp_path / "phone.jpg").convert("RGB").resize((96, 64))], return_tensors="pt"
    )
    wrong = (sideways["pixel_values"] - batch["pixel_values"][half:]).abs().mean()
    assert difference < wrong / 10, (difference, wrong)  # JPEG's loss against a wrong orientation


def test_every_image_mode_becomes_rgb_as_a_photo_viewer_shows_it(tmp_path):
    """Palette with a transparent colour and RGBA: transparency over white. 16-bit grayscale: scaled from
    0-65535, not clipped. CMYK and grayscale JPEG: converted. Read back through load_split (datasets'
    decoding), as training reads them."""
    palette = Image.new("P", (4, 2), 0)
    palette.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    palette.putpixel((1, 0), 1)
    palette.save(tmp_path / "palette.png", transparency=0)
    rgba = Image.new("RGBA", (4, 2), (0, 0, 255, 0))
    rgba.putpixel((0, 0), (0, 0, 255, 255))
    rgba.save(tmp_path / "rgba.png")
    sixteen = Image.fromarray(np.array([[0, 32896, 65535, 65535]] * 2, dtype=np.uint16))
    sixteen.save(tmp_path / "deep.png")
    Image.new("CMYK", (4, 2), (0, 0, 0, 0)).save(tmp_path / "cmyk.jpg", quality=100)
    Image.new("L", (4, 2), 77).save(tmp_path / "gray.jpg", quality=100)
    names = ["palette.png", "rgba.png", "deep.png", "cmyk.jpg", "gray.jpg"]
    rows = [{"messages": [user("<image>?"), assistant("!")], "images": [name]} for name in names]
    ds, _ = load_split(str(write_jsonl(tmp_path / "modes.jsonl", rows)), "train", None)
    seen = {
        name: np.asarray(with_upright_images(row)["images"][0]) for name, row in zip(names, ds, strict=True)
    }
    assert all(pixels.shape == (2, 4, 3) for pixels in seen.values())
    assert seen["palette.png"][0, 0].tolist() == [255, 255, 255] and seen["palette.png"][0, 1].tolist() == [
        200,
        10,
        10,
    ]
    assert seen["rgba.png"][0, 0].tolist() == [0, 0, 255] and seen["rgba.png"][0, 1].tolist() == [
        255,
        255,
        255,
    ]
    assert seen["deep.png"][0].tolist() == [[0] * 3, [128] * 3, [255] * 3, [255] * 3]
    assert (np.abs(seen["cmyk.jpg"].astype(int) - 255) <= 2).all(), "CMYK (0,0,0,0) is white paper"
    assert (np.abs(seen["gray.jpg"].astype(int) - 77) <= 2).all()
    assert upright_rgb(Image.new("RGB", (2, 2))).mode == "RGB"


@pytest.mark.parametrize("container", ["mp4", "avi", "mkv", "mov", "webm"])
def test_clips_in_every_container_are_read(tmp_path, container):
    """H.264 in .mp4, .avi, .mkv and .mov; VP9 in .webm (the codecs WebM holds): PyAV reads every one,
    header and frames."""
    path = tmp_path / f"clip.{container}"
    make_clip(path, 8, 4, 64, 48, codec="libvpx-vp9" if container == "webm" else "libx264")
    header = read_header(path, SAMPLING)
    assert header.frames == 8 and (header.height, header.width) == (48, 64)
    frames, _ = load_video(path, SAMPLING, 28)
    assert frames.shape[:2] == (4, 3), "2 s at 2 fps, RGB"
    assert frames.float().std() > 10, "decoded pictures, not blank frames"


# --------------------------------------------------------------------------- datasets that train


def mixed_rows(root: Path, family) -> Path:
    """The LLaMA-Factory folder's image rows, text-only rows and, for a family that takes video, its video
    rows, in one LLaMA-Factory-form file."""
    rows = (
        json.loads((root / "mllm_demo.json").read_text()) + json.loads((root / "text.json").read_text())[:2]
    )
    if family.takes_video:
        rows += json.loads((root / "mllm_video_demo.json").read_text())
    path = root / f"mixed-{family.name}.json"
    path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize("kind", ["text only", "video only", "images, text and video"])
def test_datasets_of_one_kind_or_mixed_train_on_every_family(tiny_family, kind, llama_factory_dir, tmp_path):
    """r1 (LoRA on the 4-bit language model) trains on a dataset of text rows only, of video rows only
    (a family that takes no video refuses it, saying which do) and on them mixed with image rows."""
    family, _ = tiny_family
    data = {
        "text only": llama_factory_dir / "text.json",
        "video only": llama_factory_dir / "dataset_info.json#mllm_video_demo",
        "images, text and video": mixed_rows(llama_factory_dir, family),
    }[kind]
    args = ["--recipe", "r1-llm-only", "--output-dir", str(tmp_path), "--run-name", "t", *ONE_STEP]
    code = main([*args, f"model={TINY_MODELS[family.name]}", f"data.train={data}", "precision=fp32"])
    if kind == "video only" and not family.takes_video:
        assert code == 2
        return
    assert code == 0
    stage = read_json(tmp_path / "r1-llm-only" / "t" / "run.json")["stages"][0]
    assert stage["steps"] == 1 and np.isfinite(stage["train_loss"])


def test_a_video_only_dataset_is_refused_with_the_reason_where_the_family_takes_no_video(
    llama_factory_dir, tmp_path, capsys
):
    args = ["--recipe", "r1-llm-only", "--output-dir", str(tmp_path), *ONE_STEP]
    data = f"data.train={llama_factory_dir}/dataset_info.json#mllm_video_demo"
    assert main([*args, "model=demo:tiny-smolvlm", data]) == 2
    err = capsys.readouterr().err
    assert (
        "video not supported" in err and "smolvlm takes no video here (the families that do: qwen2-vl" in err
    )


def test_a_vision_only_stage_on_text_only_rows_is_refused(llama_factory_dir, tmp_path, capsys):
    args = ["--recipe", "r2-vision-only", "--output-dir", str(tmp_path), *ONE_STEP]
    assert main([*args, f"data.train={llama_factory_dir}/text.json"]) == 2
    assert "trains only the vision tower / projector, but no row" in capsys.readouterr().err


def test_the_llama_factory_folder_trains_through_r1_and_r3_as_it_is(llama_factory_dir, tmp_path):
    """Both dataset_info entries at once, as LLaMA-Factory's `dataset: mllm_demo,mllm_video_demo`: JPEG
    photos (multi-turn, several images a row, a system turn, a text-only row) and .mp4 / .avi clips, on
    the tiny Qwen2-VL, through r1 and through both stages of r3."""
    data = f"data.train={llama_factory_dir}/dataset_info.json#mllm_demo,mllm_video_demo"
    common = ["--output-dir", str(tmp_path), "--run-name", "t", *ONE_STEP, data, "data.eval=" + data[11:]]
    for recipe, stages in (("r1-llm-only", 1), ("r3-two-stage", 2)):
        assert main(["--recipe", recipe, *common, "evaluation.max_new_tokens=2"]) == 0
        manifest = read_json(tmp_path / recipe / "t" / "run.json")
        assert manifest["status"] == "finished" and len(manifest["stages"]) == stages
        report = read_json(Path(manifest["stages"][0]["dir"]) / "report.json")
        assert report["data"]["train_rows"] == 6


def test_an_image_the_processor_refuses_is_a_data_error_naming_the_row(tmp_path, capsys):
    """A 2400x4 strip: Qwen's resize refuses aspect ratios over 200. Exit 2 naming the row and the
    processor's words, not a traceback from the collator; `skip` trains without it."""
    photo(2400, 4).save(tmp_path / "strip.png")
    photo(64, 64).save(tmp_path / "square.png")
    rows = [
        {"id": f"r{i}", "messages": [user("<image>What?"), assistant("a strip")], "images": [name]}
        for i, name in enumerate(["square.png", "strip.png", "square.png", "square.png"])
    ]
    data = write_jsonl(tmp_path / "strip.jsonl", rows)
    args = [
        "--recipe",
        "r1-llm-only",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "t",
        *ONE_STEP,
        f"data.train={data}",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        f"{data} row r1: image the processor refuses: 4x2400 px: absolute aspect ratio must be smaller than 200"
        in err
    )
    assert main([*args, "data.on_bad_sample=skip", "--run-name", "skip"]) == 0
    stage = read_json(tmp_path / "r1-llm-only" / "skip" / "run.json")["stages"][0]
    assert read_json(Path(stage["dir"]) / "report.json")["data"]["skipped_rows"] == {
        "train": {"image the processor refuses": 1}
    }


def test_data_check_lists_format_lengths_and_every_problem(llama_factory_dir, tmp_path, capsys, caplog):
    caplog.set_level("INFO")
    assert data_main(["check", f"{llama_factory_dir}/dataset_info.json#mllm_demo"]) == 0
    out = capsys.readouterr().out
    assert "read as r1-llm-only stage 1 (llm-lora, method sft): qwen2-vl" in out
    assert "sharegpt (dataset_info.json#mllm_demo) format, 4 rows, 5 images" in caplog.text
    assert "tokens per sample: p50 " in out and "(4 samples)" in out and "no problems" in out

    image = str(llama_factory_dir / "mllm_demo_data" / "1.jpg")
    bad = [
        {"messages": [user("<image><image>?"), assistant("!")], "images": [image]},
        {"messages": [user("<image>?"), assistant("!")], "images": [str(tmp_path / "gone.jpg")]},
        {"messages": [user("<image>" + "word " * 300), assistant("!")], "images": [image]},
        {"messages": [user("<image>?"), assistant("fine")], "images": [image]},
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", bad)
    assert data_main(["check", str(path), "data.max_length=200"]) == 2
    captured = capsys.readouterr()
    assert "image count mismatch" in caplog.text and "image not found" in caplog.text
    assert "longer than max_length" in caplog.text
    assert "problems: 1 image count mismatch, 1 image not found, 1 longer than max_length" in captured.err
    assert "(2 samples)" in captured.out, "the lengths of the rows the stage would read"
