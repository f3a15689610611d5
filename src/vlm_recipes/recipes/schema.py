"""The recipe schema: every key a recipe may contain, its type, default and meaning.

This file is the documentation of the recipe format (one fact, one place): `load.py` turns YAML into
these dataclasses, `validate.py` checks every value against its type and its `Range` here, and
`vlm-recipes train --schema` prints them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol

from vlm_recipes.benchmark_metrics import METRICS, eval_metric_names
from vlm_recipes.recipes.data_sources import Sources
from vlm_recipes.recipes.fields import ABOVE_0, AT_LEAST_0, AT_LEAST_1, SEED, Choices, Range, doc

Mode = Literal["frozen", "lora", "full"]
Precision = Literal["auto", "bf16", "fp16", "fp32"]
QuantMode = Literal["none", "4bit", "8bit"]
ParallelMode = Literal["auto", "single", "model-parallel", "ddp", "fsdp", "deepspeed"]
QUANT_SKIPPABLE = ("vision", "projector", "llm", "lm_head")
# What a stage's eval may score its answers by (evaluation/benchmarks.py): the benchmarks' own metrics, one
# module each in benchmark_metrics/, then the two every eval computes (exact match; JSON field F1 where the
# references are JSON objects). Asked of the registry when a recipe is checked: a registered metric is taken.
EVAL_METRICS = Choices(eval_metric_names)


@dataclass
class TrainModes:
    """How each module role is trained in a stage."""

    vision: Mode = doc("vision tower (ViT blocks and patch embedding): frozen | lora | full", "frozen")
    projector: Mode = doc("projector between vision and language model (Qwen2-VL: the merger)", "frozen")
    llm: Mode = doc("language model (decoder layers, embeddings, lm_head)", "frozen")


@dataclass
class LoraSettings:
    rank: int = doc("LoRA rank; higher: more capacity and memory", 16, range=AT_LEAST_1)
    alpha: int = doc("LoRA scaling numerator (scale = alpha / rank)", 32, range=AT_LEAST_1)
    dropout: float = doc("dropout on the LoRA input", 0.05, range=Range(0, 1, high_open=True))
    targets: dict[str, list[str]] = doc(
        "per role, module-name suffixes to adapt (e.g. {llm: [q_proj, v_proj]}); "
        "a role in lora mode that is not listed adapts all its linear layers; `experts` adds a mixture of "
        "experts' fused experts (PEFT's target_parameters; needs dropout 0)",
        factory=dict,
    )


@dataclass
class QuantizationSettings:
    mode: QuantMode = doc("load the base weights quantized with bitsandbytes: none | 4bit | 8bit", "none")
    quant_type: Literal["nf4", "fp4"] = doc("4-bit data type", "nf4")
    double_quant: bool = doc("quantize the 4-bit quantization constants too (saves ~0.4 bit/param)", True)
    skip_roles: list[str] = doc(
        "parts kept in full precision (vision, projector, llm, lm_head): a stage cannot train "
        "what it cannot dequantize, so by default only the language model's decoder is quantized",
        factory=lambda: ["vision", "projector", "lm_head"],
    )


@dataclass
class DataSettings:
    train: Sources = doc(
        "training data: demo:train, a .jsonl/.json/.parquet file or folder, a LLaMA-Factory "
        "dataset_info.json#entry, or a hub dataset id (TRL, LLaMA-Factory, ms-swift and LLaVA rows: "
        "docs/data.md); or a mixture, a list of {path, weight: above 0} or {path, samples: at least 1}, drawn "
        "with training.seed (docs/data.md#mixtures)",
        "demo:train",
    )
    eval: Sources | None = doc(
        "held-out data, same forms as train (a list: its sources' rows together, each row's source kept; "
        "weights optional); null for none",
        "demo:eval",
    )
    train_split: str = doc("split name when `train` is a hub dataset id", "train")
    eval_split: str = doc("split name when `eval` is a hub dataset id", "test")
    max_train_samples: int | None = doc(
        "use only the first N training rows (quick runs); a mixture: its epoch's rows", None, range=AT_LEAST_1
    )
    max_eval_samples: int | None = doc(
        "use only the first N eval rows (an eval list: of each source; with weights, the draw's rows)",
        None,
        range=AT_LEAST_1,
    )
    eval_metrics: list[str] | None = doc(
        f"what the eval's answers are scored by besides exact match: the benchmarks' own metrics "
        f"({', '.join(METRICS)}: docs/evaluation.md, read from the eval rows' `answers`, `options` / "
        "`choices` / A-D columns, boxes), exact_match, json_f1 (always computed); null: what the eval rows "
        f"carry ({', '.join(f'{m.needs}: {m.name}' for m in METRICS.values() if m.by_default)})",
        None,
        range=EVAL_METRICS,
    )
    min_pixels: int | None = doc(
        "image processor lower bound on pixels per image; null: the model's own", None, range=AT_LEAST_1
    )
    max_pixels: int | None = doc(
        "image processor upper bound on pixels per image (200704 = 448x448: 256 visual tokens on "
        "Qwen2-VL and Qwen2.5-VL, 28 px each; 196 on Qwen3-VL, 32 px each); null: the model's own",
        None,
        range=AT_LEAST_1,
    )
    # Video rows (the Qwen line): frames taken and sized by qwen-vl-utils' rules (data/video.py). The
    # defaults fit a 7B model with LoRA or QLoRA on a 24 GB GPU and data.max_length 2048: at most 32 frames
    # of 256x256 px, i.e. 16 x 81 = 1296 video tokens on Qwen2-VL (docs/recipes.md: Videos and several images).
    video_fps: float = doc("frames taken per second of video (qwen-vl-utils' fps)", 2.0, range=ABOVE_0)
    max_frames: int = doc(
        "most frames taken from one video (an even count; a folder of frames counts as a video)",
        32,
        range=Range(2, why="two frames make one temporal patch"),
    )
    video_min_pixels: int = doc("lower bound on pixels per video frame", 3136, range=AT_LEAST_1)
    video_max_pixels: int = doc(
        "upper bound on pixels per video frame (65536 = 256x256: 81 tokens per pair of frames on "
        "Qwen2-VL); qwen-vl-utils lowers it further for long videos",
        65536,
        range=AT_LEAST_1,
    )
    on_bad_sample: Literal["fail", "skip"] = doc(
        "a row that cannot be trained on: fail (list the first bad rows and stop) or skip (count per reason "
        "in the stage report)",
        "fail",
    )
    allow_remote_images: bool = doc("download images given as http(s) URLs (off: a URL is a bad row)", False)
    max_length: int | None = doc(
        "longest tokenized sample, image tokens included; null: no limit", 2048, range=AT_LEAST_1
    )
    streaming: bool = doc(
        "read the training rows as they are trained on (a datasets IterableDataset), never all at once: for a "
        "dataset larger than memory. Each row is checked and length-checked as it comes; the first 100 before "
        "the model loads. Needs training.max_steps (a stream has no row count); sft stages, one source, no "
        "group_by_length (docs/data.md#streaming)",
        False,
    )
    shuffle_buffer: int = doc(
        "streaming: the rows are shuffled within a window of this many (with training.seed)",
        10000,
        range=AT_LEAST_1,
    )


@dataclass
class TrainingSettings:
    epochs: float = doc("passes over the training data", 1.0, range=ABOVE_0)
    max_steps: int = doc(
        "stop after this many optimizer steps; -1: run all epochs", -1, range=Range(1, also=(-1,))
    )
    learning_rate: float = doc("peak learning rate", 2e-4, range=ABOVE_0)
    role_learning_rates: dict[str, float] = doc(
        "per-role learning rate overriding learning_rate (e.g. {vision: 2.0e-5})", factory=dict, range=ABOVE_0
    )
    per_device_batch_size: int = doc("samples per device per step", 4, range=AT_LEAST_1)
    gradient_accumulation_steps: int = doc("steps summed before each optimizer step", 1, range=AT_LEAST_1)
    group_by_length: bool = doc(
        "batch samples of similar length (image tokens counted): less padding, faster steps; off: random order",
        False,
    )
    padding_free: bool = doc(
        "pack each batch's samples into one row, no padding (multimodal RoPE positions kept per sample, no "
        "attention across samples): the same loss for less work",
        False,
    )
    loss_positions_only: bool = doc(
        "run the last decoder layer's output projection and MLP, and the LM head, only at the positions the "
        "loss reads (those whose next token is labelled): the same loss for less work; sft stages",
        False,
    )
    matmul_patch_embedding: bool = doc(
        "compute the vision tower's patch embedding (a convolution over non-overlapping patches) as the matrix "
        "product it is: the same weights and result up to rounding; several times faster on CPU",
        False,
    )
    sparse_lora_dropout: bool = doc(
        "draw only the positions LoRA dropout drops (same distribution as torch's dropout, ~1/p fewer "
        "random numbers): faster LoRA steps when lora.dropout > 0",
        False,
    )
    liger_kernels: bool = doc(
        "Liger's Triton kernels for the model's norms, SwiGLU/GEGLU MLPs and rotary embeddings (pip install "
        "liger-kernel): on a GPU where Liger knows the model type or its text model's or tower's (every family "
        "here); elsewhere the stage trains without them, the reason logged",
        False,
    )
    vision_feature_cache: bool = doc(
        "frozen vision tower and projector only: keep each image's features on disk and reuse them (next "
        "epoch, next run, another seed), keyed by the tower's weights and the processed image",
        False,
    )
    preprocessed_cache: bool = doc(
        "keep each row's tokens, labels and processed pixels on disk and reuse them (next epoch, run, seed, "
        "or stage with the same processor settings); images are decoded only on a miss",
        False,
    )
    cache_max_gb: float | None = doc(
        "size cap in GB of the speed-up caches on disk (preprocessed samples and vision features together, "
        "shared by every run using the same cache directory): past it, the least recently used entries are "
        "deleted; null: no cap",
        50.0,
        range=ABOVE_0,
    )
    dataloader_workers: int = doc(
        "processes preparing batches while the model trains; 0: in the main process", 0, range=AT_LEAST_0
    )
    gradient_checkpointing: bool = doc("recompute activations in backward: less memory, ~30% slower", False)
    warmup_ratio: float = doc("fraction of steps with linear warm-up", 0.0, range=Range(0, 1))
    lr_scheduler: str = doc("transformers scheduler name: cosine, linear, constant, ...", "cosine")
    weight_decay: float = doc("AdamW weight decay", 0.0, range=AT_LEAST_0)
    max_grad_norm: float = doc("gradient clipping norm", 1.0, range=AT_LEAST_0)
    logging_steps: int = doc("log train loss every N optimizer steps", 5, range=AT_LEAST_1)
    save_steps: int = doc(
        "save a checkpoint to resume from every N optimizer steps; 0: none (Ctrl-C still saves one)",
        200,
        range=AT_LEAST_0,
    )
    save_total_limit: int = doc(
        "checkpoints kept (at least 2: one stays complete while the next is written)",
        2,
        range=Range(2, why="one checkpoint stays complete while the next is written"),
    )
    on_nan: Literal["stop", "skip_step"] = doc(
        "NaN/inf loss or gradients: stop the stage (within logging_steps, naming the step; nothing after it "
        "is saved, the last good checkpoint is kept), or skip that step (its gradients dropped; costs one "
        "host read a step). Formerly nan_policy, which still works",
        "stop",
    )
    eval_batch_size: int = doc("samples per device when evaluating", 4, range=AT_LEAST_1)
    max_memory_per_gpu: str | None = doc(
        "model-parallel only: cap per GPU for device_map sharding, e.g. 20GiB (leaves room for activations)",
        None,
    )
    trainable_dtype: Literal["fp32", "compute"] = doc(
        "dtype of fully trained parameters: fp32 master weights, or the compute dtype (less memory)", "fp32"
    )
    seed: int = doc("random seed for weights init of adapters, data order and dropout", 42, range=SEED)
    report_to: list[str] = doc(
        "logging integrations: tensorboard (offline, under checkpoints/runs/), wandb, mlflow, none",
        factory=lambda: ["tensorboard"],
    )


@dataclass
class EvaluationSettings:
    generate: bool = doc("after the stage, generate answers for the eval split and score them", True)
    max_new_tokens: int = doc("longest generated answer", 64, range=AT_LEAST_1)
    batch_size: int = doc("prompts per generation batch", 8, range=AT_LEAST_1)
    numeric_tolerance: float = doc(
        "relative tolerance when comparing numbers in JSON answers", 0.01, range=AT_LEAST_0
    )
    eval_steps: int | None = doc(
        "also compute eval loss every N optimizer steps; null: at the end only", None, range=AT_LEAST_1
    )


# A stage's method when its recipe names none. A recipe of it alone is read without importing the methods
# (MethodSections.asked_for); nothing else decides by a method's name (tests/test_layout.py).
DEFAULT_METHOD = "sft"


@dataclass
class Stage:
    name: str = doc("stage name, unique in the recipe; its directory is stage-<i>-<name>", "")
    description: str = doc("one line on what this stage does", "")
    init_from: str = doc(
        "where the weights come from: `base` (the recipe's model), `previous` (the stage before; "
        "the first stage's previous is base), `stage:<name>`, or a model id / local directory",
        "previous",
    )
    method: str = doc(
        "how the stage trains: sft (supervised, `messages` rows) or another method of methods/, each with its "
        "own rows and its own section of settings named after it (dpo, kto, grpo, rloo, distill: "
        "`vlm-recipes train --schema` lists them)",
        DEFAULT_METHOD,
    )
    train: TrainModes = doc("training mode per module role", factory=TrainModes)
    lora: LoraSettings = doc("LoRA settings, used by roles in lora mode", factory=LoraSettings)
    quantization: QuantizationSettings = doc("how the base weights are loaded", factory=QuantizationSettings)
    precision: Precision = doc(
        "compute precision: auto picks bf16 where the hardware computes it natively (a CPU: measured), else fp16 on GPU, fp32 on CPU",
        "auto",
    )
    parallel: ParallelMode = doc(
        "how the devices are used: auto (several GPUs: DDP if the model fits one GPU, else model-parallel), "
        "single, model-parallel (device_map sharding), ddp, fsdp, deepspeed (one process per GPU)",
        "auto",
    )
    sequence_parallel_size: int = doc(
        "ranks that share one row, each carrying 1/N of its tokens through the language model (Ulysses); "
        "with parallel ddp or fsdp, the processes form processes/N data groups of N sequence ranks; 1: off",
        1,
        range=Range(1),
    )
    data: DataSettings = doc("datasets and image/sequence limits", factory=DataSettings)
    training: TrainingSettings = doc("optimizer and loop settings", factory=TrainingSettings)
    evaluation: EvaluationSettings = doc("what is measured on the eval split", factory=EvaluationSettings)
    # The section of the stage's method (`dpo:`, `grpo:`, ...), typed by that method's module
    # (methods/<method>.py: its `settings`); None for a method without one (sft). Not a key of its own.
    settings: Any = field(default=None, metadata={"recipe_key": False})

    @property
    def quantized(self) -> bool:
        """The base weights load quantized (4-bit or 8-bit) through bitsandbytes."""
        return self.quantization.mode != "none"

    @property
    def vision_trains(self) -> bool:
        """The vision tower or the projector trains: what looks at the images."""
        return self.train.vision != "frozen" or self.train.projector != "frozen"


@dataclass
class Recipe:
    name: str = doc("recipe name (the file name without .yaml)", "")
    description: str = doc("one line shown by --list", "")
    model: str = doc(
        "base model: demo:tiny-qwen2-vl, a hub id (Qwen/Qwen2-VL-2B-Instruct) or a directory", ""
    )
    trust_remote_code: bool = doc(
        "run code shipped with the model repository (off unless you trust it)", False
    )
    stages: list[Stage] = doc("the stages, run in order", factory=list)
    source_file: str = ""  # where the recipe was loaded from (not a YAML key)


# Stage sections a recipe file may also set at its top level, as defaults for every stage.
STAGE_DEFAULT_SECTIONS = (
    "data",
    "training",
    "evaluation",
    "precision",
    "quantization",
    "lora",
    "parallel",
)  # and each method's own section (`dpo:`, `grpo:`, ...), for the stages of that method
# Keys renamed since recipes were written with them, per section: {section: {old name: new name}}. The old
# name is still read (a recipe file, an override, an older run's run.json), with a one-line note.
RENAMED_KEYS: dict[type, dict[str, str]] = {TrainingSettings: {"nan_policy": "on_nan"}}
# Every key a recipe file may hold at its top level, besides the methods' sections.
RECIPE_FILE_KEYS = ("description", "model", "trust_remote_code", "extends", "stages", *STAGE_DEFAULT_SECTIONS)


class StageMethod(Protocol):
    """What loading a recipe asks of a stage's method (methods/<method>.py implements it): its name (the
    stage's `method:`), the dataclass of its section (the key named after it; None: no section), and the
    problems of a stage of it that no single key shows."""

    name: str
    settings: type | None
    takes_loss_positions_cut: bool  # training.loss_positions_only
    takes_streamed_rows: bool  # data.streaming
    takes_sequence_parallel: bool  # sequence_parallel_size > 1

    def problems(self, stage: Stage, at: str, earlier: list[Stage]) -> list: ...


class MethodSections:
    """The stage methods, as reading a recipe needs them: each method's section (`dpo:`, `grpo:`, ...) and its
    checks of a stage. `methods` (recipe.py hands down methods/'s registry) is asked only when a recipe holds
    a key beyond a stage's own or a method other than sft: importing the methods brings TRL and torch
    (seconds), and an SFT recipe, or a bad one, is read at once."""

    def __init__(self, methods: Callable[[], Mapping[str, StageMethod]]):
        self._methods = methods

    @cached_property
    def methods(self) -> Mapping[str, StageMethod]:
        return self._methods()

    @staticmethod
    def asked_for(stage: Stage) -> bool:
        """Whether `stage` needs its method asked. A stage of the default method without a section is read,
        checked and planned without importing the methods: the default takes every stage key and holds no
        frozen model (tests/test_layout.py asks it so)."""
        return stage.method != DEFAULT_METHOD or stage.settings is not None

    @cached_property
    def types(self) -> dict[str, type]:
        """Section name (the method's name) → its dataclass, for the methods that have one."""
        return {name: m.settings for name, m in self.methods.items() if m.settings is not None}

    def names(self, keys) -> tuple[str, ...]:
        """The methods' section names among `keys` (the methods asked only if some key is not a stage's)."""
        own = {f.name for f in dataclasses.fields(Stage)} | set(RECIPE_FILE_KEYS)
        if all(key in own for key in keys):
            return ()
        return tuple(key for key in keys if key in self.types)
