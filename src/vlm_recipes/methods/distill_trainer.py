"""The distillation stage's trainer: TRL's DistillationTrainer with the recipe's mixin, its evaluate() adding
the distance to the teacher on the teacher's own completions; and the teacher, loaded frozen after its
tokenizer is checked against the student's. Imported when a distill stage builds its trainer
(methods/distill.py)."""

from __future__ import annotations

import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer
from trl import DistillationTrainer

from vlm_recipes.errors import GuardError
from vlm_recipes.methods.recipe_trainer import RecipeTrainerMixin


class RecipeDistillationTrainer(RecipeTrainerMixin, DistillationTrainer):
    """The distillation stage's trainer; its evaluate() adds the distance to the teacher on fixed tokens."""

    teacher_completions: list[torch.Tensor] | None = None  # the teacher's greedy eval completions, kept

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        kl, agreement = self.distance_to_teacher(eval_dataset or self.eval_dataset)
        metrics |= {
            f"{metric_key_prefix}_teacher_kl": kl,
            f"{metric_key_prefix}_teacher_agreement": agreement,
        }
        self.log({f"{metric_key_prefix}_teacher_kl": kl, f"{metric_key_prefix}_teacher_agreement": agreement})
        return metrics

    @torch.no_grad()
    def distance_to_teacher(self, rows) -> tuple[float, float]:
        """Mean per-token KL(teacher ‖ student) over the eval prompts' teacher completions (greedy, generated
        on the first call and kept), and the share of those tokens that are the student's most likely one."""
        student = self.accelerator.unwrap_model(self.model)
        was_training = student.training
        student.eval()
        prompts = [self.prompt_inputs(row) for row in rows]
        if self.teacher_completions is None:
            self.teacher_completions = [self.greedy(self.teacher_model, inputs) for inputs in prompts]
        kl_sum, agree, tokens = 0.0, 0, 0
        for inputs, completion in zip(prompts, self.teacher_completions, strict=True):
            if completion.numel() == 0:
                continue
            full = with_completion(inputs, completion)
            start = inputs["input_ids"].shape[1] - 1  # the logits that predict the completion's tokens
            stop = start + completion.numel()
            teacher = self.teacher_model(**full).logits[0, start:stop].float().log_softmax(-1)
            own = student(**full).logits[0, start:stop].float().log_softmax(-1)
            kl_sum += (teacher.exp() * (teacher - own)).sum().item()
            agree += (own.argmax(-1) == completion).sum().item()
            tokens += completion.numel()
        student.train(was_training)
        return (kl_sum / tokens, agree / tokens) if tokens else (float("nan"), float("nan"))

    def prompt_inputs(self, row: dict) -> dict:
        """A prompt row as the models take it: the chat template with the generation prompt, its images."""
        text = self.processing_class.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=False
        )
        images = row.get("images") or None
        inputs = self.processing_class(text=[text], images=images, return_tensors="pt")
        return {key: value.to(self.accelerator.device) for key, value in inputs.items()}

    def greedy(self, model, inputs: dict) -> torch.Tensor:
        length = inputs["input_ids"].shape[1]
        out = model.generate(**inputs, do_sample=False, max_new_tokens=self.args.max_completion_length)
        completion = out[0, length:]
        eos = self.processing_class.tokenizer.eos_token_id
        ends = (completion == eos).nonzero()
        return completion[: ends[0, 0] + 1] if len(ends) else completion


def with_completion(inputs: dict, completion: torch.Tensor) -> dict:
    """A prompt's model inputs with a completion after it: its ids appended, and every other per-token field
    (the attention mask: 1; Qwen's mm_token_type_ids: 0, text) lengthened to match."""
    length = inputs["input_ids"].shape[1]
    full = {}
    for key, value in inputs.items():
        if key == "input_ids":
            full[key] = torch.cat([value, completion[None]], dim=1)
        elif value.dim() == 2 and value.shape == (1, length):
            fill = torch.full((1, completion.numel()), int(key == "attention_mask"), dtype=value.dtype)
            full[key] = torch.cat([value, fill.to(value.device)], dim=1)
        else:
            full[key] = value
    return full


def vision_token_ids(config) -> list[int]:
    """The ids of a VLM's image, video and vision start / end tokens, as its config names them."""
    fields = config.to_dict()
    return sorted(
        {
            value
            for key, value in fields.items()
            if key.endswith(("_token_id", "_token_index"))
            and any(word in key for word in ("image", "video", "vision"))
            and isinstance(value, int)
        }
    )


def tokenizer_differences(student, teacher) -> list[str]:
    """What differs between two tokenizers for a divergence taken token id by token id."""
    differs = [("vocabulary", student.get_vocab() != teacher.get_vocab())]
    differs += [("special tokens", student.all_special_tokens != teacher.all_special_tokens)]
    differs += [
        (key, getattr(student, key) != getattr(teacher, key)) for key in ("eos_token_id", "pad_token_id")
    ]
    return [what for what, bad in differs if bad]


def load_teacher(source: str, student_processor, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The teacher, frozen, after its tokenizer is checked against the student's (GuardError if it differs)."""
    student_tokenizer = getattr(student_processor, "tokenizer", student_processor)
    differences = tokenizer_differences(student_tokenizer, AutoTokenizer.from_pretrained(source))
    if differences:
        raise GuardError(
            f"distill.teacher {source}: its tokenizer differs from the student's ({', '.join(differences)}); "
            "the divergence compares the two models token id by token id. Distill from a teacher of the "
            "student's tokenizer (the same model family and vocabulary)"
        )
    teacher = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype).to(device)
    return teacher.requires_grad_(False).eval()
