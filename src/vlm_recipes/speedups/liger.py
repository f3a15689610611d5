"""Liger's Triton kernels for the model's layers (RMSNorm, LayerNorm, SwiGLU/GEGLU MLPs, rotary embeddings) on
a GPU.

Liger's loss kernels stay off: the loss is TRL's (its chunked, fused LM head on the labelled positions, never
the whole logits) and `training.loss_positions_only` hands that head only the positions it scores. Liger
replaces modules' forwards and module-level functions in place; it computes the same functions in a different
order of operations, so a step agrees with the unpatched one up to rounding (tests/test_on_a_gpu.py bounds it
against what training moves).

Liger's kernels reach a model by the first of these that applies (`patch_liger_kernels`):

a. Liger's own function for the model type, through transformers' `apply_liger_kernel` (what
   `use_liger_kernel=True` runs).
b. That same function, where it cannot import the module of its fused loss: with Liger 0.8.5 under
   transformers 5.24 the Qwen-VL line and GLM-4V-MoE, whose loss modules subclass output classes transformers
   renamed. The function imports that module before it patches anything, and binds what it imports only for
   `fused_linear_cross_entropy`, which is off here; so it runs again with a stand-in for that one module
   (its every name raises if called), put in `sys.modules` for the call and taken out after.
c. For a model type Liger has no function for (LLaVA-OneVision, Mistral 3), Liger's functions for its text
   model's and vision tower's types, each run on that sub-model (Liger's own `apply_liger_kernel_to_llava`
   does the same, for LLaVA's attribute names only).
d. Otherwise none, with the reason (Molmo 2: Liger knows neither its text model nor its tower).

Liger 0.8.5's Qwen3-VL function leaves the decoder's MLPs as torch's (its `swiglu` switch does nothing):
Liger's SwiGLU is bound to them with Liger's own helper (SWIGLU_LIGER_LEAVES).

What was patched is then read off the model (`LigerPatch`): each module whose class or forward is now
Liger's, by the kind of layer, and each rotary function Liger put into a modeling module that transformers'
code still calls. A name Liger sets that no code there reads any more (Qwen2-VL's
`apply_multimodal_rotary_pos_emb`, gone from transformers 5.24) does nothing, and is named as such.

Off, with the reason logged, on a CPU (Triton compiles for CUDA) or without the `liger-kernel` package;
`python -m vlm_recipes.benchmarking.liger_table` prints what each family's tiny model gets (docs/results/liger-kernels.md's
"Liger's kernels by family", checked by tests/test_liger.py).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version

from torch import nn
from transformers import PreTrainedModel
from transformers.trainer_utils import unwrap_peft_model

from vlm_recipes.decisions import Decision
from vlm_recipes.errors import GuardError

GUARD = "liger-kernels"
# TRL's fused LM head computes the loss; Liger's would replace the model's forward (TRL refuses that too)
LAYER_KERNELS_ONLY = {"cross_entropy": False, "fused_linear_cross_entropy": False}
# Where Liger keeps the model forwards of its fused loss (lce_forward, causal_forward, multimodal_forward)
FUSED_LOSS_PACKAGE = "liger_kernel.transformers.model."
# The sub-models path (c) patches, by their config's attribute and as the table names them
SUB_MODELS = {"text_config": "text model", "vision_config": "vision tower"}
# The kinds of layer, in the order a description names them
KINDS = ("RMSNorm", "LayerNorm", "SwiGLU", "GEGLU", "SwiGLU experts")
# Decoder MLPs Liger's own function leaves as torch's though they are its SwiGLU (down(silu(gate(x)) * up(x)),
# no biases), by model type: Liger 0.8.5's qwen3_vl function takes `swiglu` and does nothing with it
# (linkedin/Liger-Kernel#956; its PR #1175 binds LigerSwiGLUMLP to these modules, as done here with Liger's own
# helper). Once Liger patches them itself, nothing is left for this to do.
SWIGLU_LIGER_LEAVES = {"qwen3_vl": "Qwen3VLTextMLP"}


@dataclass(frozen=True)
class LigerPatch:
    """What Liger's kernels replaced in a model, read off the model after patching."""

    model_type: str
    path: str  # "a", "b" or "c" (the module docstring)
    how: str  # the path in words, with what it had to leave out or add
    language_model: dict[str, int]  # kind of layer → modules of the language model running Liger's kernel
    vision: dict[str, int]  # the same for the rest (vision tower, projector)
    rotary: tuple[str, ...]  # the rotary functions replaced, where transformers' code calls them
    inert: tuple[str, ...] = ()  # `module.name`s Liger set that no code in that module calls

    def counts(self) -> str:
        """E.g. "5 RMSNorm, 2 SwiGLU, 4 LayerNorm, rope"."""
        total = Counter(self.language_model) + Counter(self.vision)
        return ", ".join([*(f"{total[k]} {k}" for k in KINDS if total[k]), *self.rotary]) or "nothing"

    def rotary_words(self) -> str:
        """The rotary functions replaced, and those Liger set in vain."""
        inert = [f"not `{name}` (set, never called)" for name in self.inert]
        return ", ".join([*self.rotary, *inert]) or "-"


class NoLigerKernels(GuardError):
    """Why Liger's kernels cannot reach this model (path d)."""


def liger_refusal(model: nn.Module) -> str | None:
    """Why Liger's kernels cannot run on this model here (None: they can)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return f"Liger's kernels are Triton kernels for CUDA, and this stage computes on {device.type}"
    if importlib.util.find_spec("liger_kernel") is None:
        return "the liger-kernel package is not installed (pip install liger-kernel)"
    return None


def off(why: str) -> Decision:
    return Decision(GUARD, "off", f"training.liger_kernels is on, but {why}: the stage trains without them")


def use_liger_kernels(model: nn.Module) -> Decision:
    """Liger's layer kernels patched into `model` where they can run; the decision says which, how and why."""
    if why := liger_refusal(model):
        return off(why)
    try:
        patch = patch_liger_kernels(model)
    except NoLigerKernels as refusal:
        return off(str(refusal))
    return Decision(
        GUARD,
        f"Liger's kernels for {patch.model_type}: {patch.counts()} (path {patch.path}: {patch.how}"
        f"{_inert_words(patch)}); TRL's fused LM head keeps the loss",
        "training.liger_kernels is on, the model is on a GPU and liger-kernel is installed: fused Triton kernels "
        "read and write each activation once where torch runs several element-wise kernels",
    )


def _inert_words(patch: LigerPatch) -> str:
    if not patch.inert:
        return ""
    names = ", ".join(f"`{name}`" for name in patch.inert)
    return f"; Liger also sets {names}, which transformers {version('transformers')} no longer calls"


def patch_liger_kernels(model: nn.Module) -> LigerPatch:
    """Patch Liger's layer kernels into `model` (a PEFT model too) by the first path that applies, on any
    device (nothing runs: Triton needs CUDA only once the model computes), and read off what was patched.
    NoLigerKernels: none can (path d), the model untouched."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    from transformers.integrations.liger import apply_liger_kernel

    base = unwrap_peft_model(model)
    model_type = base.config.model_type
    versions = f"liger-kernel {version('liger-kernel')} with transformers {version('transformers')}"
    if model_type in MODEL_TYPE_TO_APPLY_LIGER_FN:
        left_out = _with_fused_loss_left_out(
            lambda: apply_liger_kernel(model, LAYER_KERNELS_ONLY), model_type
        )
        path, how = ("b" if left_out else "a"), f"Liger's own function for {model_type}"
        if left_out:
            how += _left_out_words(left_out, versions)
        if mlps := _swiglu_where_liger_leaves_it(base):
            how += (
                f"; Liger's SwiGLU bound to the {mlps} {SWIGLU_LIGER_LEAVES[model_type]} it leaves as torch's "
                "(its swiglu switch does nothing: linkedin/Liger-Kernel#956)"
            )
    else:
        # Liger registers no function under the VLM's type, but has them for its parts' types: each runs on
        # its own sub-model, which Liger's dispatcher accepts (`model=`), as Liger's own LLaVA function does
        patched, left_out, lacking = [], {}, []
        for attribute, part in SUB_MODELS.items():
            sub_type, sub_model = _sub_model(base, attribute)
            if sub_type is None:
                continue
            if sub_type not in MODEL_TYPE_TO_APPLY_LIGER_FN or sub_model is None:
                lacking.append(f"its {part} `{sub_type}`")
                continue
            left_out |= _with_fused_loss_left_out(lambda m=sub_model: _apply_to_instance(m), sub_type)
            patched.append(f"{sub_type} on its {part}")
        if not patched:
            also = f", nor for {' or '.join(lacking)}" if lacking else ""
            raise NoLigerKernels(f"Liger has no kernels for model type `{model_type}`{also}")
        how = f"no Liger function for {model_type}: Liger's for its parts, {', '.join(patched)}"
        if lacking:
            how += f" (none for {' or '.join(lacking)})"
        if left_out:
            how += _left_out_words(left_out, versions)
        path = "c"
    language = base.get_decoder()
    in_language = {id(m) for m in language.modules()}
    language_kinds, vision_kinds = Counter(), Counter()
    for module in base.modules():
        if kind := liger_kind(module):
            (language_kinds if id(module) in in_language else vision_kinds)[kind] += 1
    rotary, inert = liger_functions_in(base)
    patch = LigerPatch(model_type, path, how, dict(language_kinds), dict(vision_kinds), rotary, inert)
    if not language_kinds and not vision_kinds and not rotary:
        raise NoLigerKernels(f"Liger's patch for `{model_type}` ({how}) replaced none of its layers")
    return patch


def _swiglu_where_liger_leaves_it(base: PreTrainedModel) -> int:
    """Bind Liger's SwiGLU MLP to the decoder MLPs SWIGLU_LIGER_LEAVES names that Liger's patch left alone and
    that are the MLP LigerSwiGLUMLP computes (gate, up and down projections without biases, silu); how many."""
    mlp_class = SWIGLU_LIGER_LEAVES.get(base.config.model_type)
    if mlp_class is None:
        return 0
    from liger_kernel.transformers.monkey_patch import _patch_swiglu_module
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    def swiglu(mlp: nn.Module) -> bool:
        projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        return getattr(getattr(mlp, "config", None), "hidden_act", None) in ("silu", "swish") and all(
            p is not None and getattr(p, "bias", None) is None for p in projections
        )

    mlps = [
        m for m in base.get_decoder().modules() if type(m).__name__ == mlp_class and liger_kind(m) is None
    ]
    mlps = [mlp for mlp in mlps if swiglu(mlp)]
    for mlp in mlps:
        _patch_swiglu_module(mlp, LigerSwiGLUMLP)
    return len(mlps)


def _apply_to_instance(model: nn.Module) -> None:
    # Liger's dispatcher by `model.config.model_type`, each function given only the keywords it takes
    # (Pixtral's has no loss switches): what transformers' apply_liger_kernel calls for a whole model
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, **LAYER_KERNELS_ONLY)


def _sub_model(base: PreTrainedModel, attribute: str) -> tuple[str | None, nn.Module | None]:
    """The model type of `base.config.<attribute>` and its outermost sub-model of that type (None if none)."""
    sub_config = getattr(base.config, attribute, None)
    if sub_config is None:
        return None, None
    sub_type = sub_config.model_type
    for module in base.modules():
        if (
            module is not base
            and isinstance(module, PreTrainedModel)
            and module.config.model_type == sub_type
        ):
            return sub_type, module
    return sub_type, None


def _left_out_words(left_out: dict[str, str], versions: str) -> str:
    modules = "; ".join(f"`{name}` ({error})" for name, error in left_out.items())
    return (
        f", with a stand-in for its fused-loss module, which {versions} cannot import: {modules}; "
        "fused_linear_cross_entropy=False never binds it"
    )


def _with_fused_loss_left_out(apply: Callable[[], None], model_type: str) -> dict[str, str]:
    """Run Liger's patch `apply`; where it fails at importing one of Liger's fused-loss modules, run it again
    with a stand-in for that module. The modules left out, each with the import's error ({}: none).

    Each of Liger's per-model functions imports its fused-loss module at its top, before it patches anything,
    and binds what it imports only under `fused_linear_cross_entropy`, which LAYER_KERNELS_ONLY turns off: so
    the failed import left the model untouched, and the stand-in is never called (it raises if it is). Any
    other failure, or one of these imports from elsewhere than Liger's own per-model function, raises
    NoLigerKernels with the error."""
    left_out: dict[str, str] = {}
    while True:
        try:
            with _standing_in(left_out):
                apply()
            return left_out
        except ImportError as error:
            module = _fused_loss_module_that_failed(error)
            if module is None or module in left_out:
                raise NoLigerKernels(
                    f"liger-kernel {version('liger-kernel')} with transformers {version('transformers')} cannot "
                    f"patch model type `{model_type}` ({error})"
                ) from error
            # the message without the path of the module it names
            left_out[module] = re.sub(r" \([^()]*\)$", "", str(error))


def _fused_loss_module_that_failed(error: ImportError) -> str | None:
    """The fused-loss module (FUSED_LOSS_PACKAGE) whose import raised `error`, where Liger's per-model
    function (in its monkey_patch module) imported it itself; None otherwise."""
    importer = None
    traceback = error.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        name = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name == "<module>" and name.startswith(FUSED_LOSS_PACKAGE):
            return name if importer == "liger_kernel.transformers.monkey_patch" else None
        if not name.startswith("importlib"):
            importer = name
        traceback = traceback.tb_next
    return None


class _FusedLossLeftOut(types.ModuleType):
    """Stands in for a fused-loss module Liger cannot import: its every name is a function that raises."""

    def __init__(self, name: str, error: str):
        super().__init__(name)
        self.error = error

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)

        def left_out(*args, **kwargs):
            raise RuntimeError(
                f"{self.__name__}.{attribute} was left out (it cannot be imported: {self.error}), standing in "
                "while Liger patched the layers with fused_linear_cross_entropy=False; something called it"
            )

        return left_out


@contextmanager
def _standing_in(left_out: dict[str, str]) -> Iterator[None]:
    """`sys.modules` with a stand-in for each module in `left_out`, restored afterwards."""
    saved = {name: sys.modules.get(name) for name in left_out}
    for name, error in left_out.items():
        sys.modules[name] = _FusedLossLeftOut(name, error)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
            package, _, child = name.rpartition(".")
            if isinstance(getattr(sys.modules.get(package), child, None), _FusedLossLeftOut):
                delattr(sys.modules[package], child)


def liger_kind(module: nn.Module) -> str | None:
    """The kind of layer (KINDS) whose Liger kernel `module` runs: its class is Liger's (built after Liger
    replaced the class in its modeling module), or its forward is (patched in place); None: torch's own."""
    if type(module).__module__.startswith("liger_kernel"):
        liger_class = type(module).__name__
    else:
        forward = getattr(module.__dict__.get("forward"), "__func__", None)
        if forward is None or not forward.__module__.startswith("liger_kernel"):
            return None
        liger_class = forward.__qualname__.split(".")[0]
    if liger_class == "LigerExperts":
        return "SwiGLU experts"
    return next((kind for kind in KINDS if kind in liger_class), liger_class)


def liger_functions_in(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the rotary functions Liger put into the model's modeling modules that their code calls, as "rope",
    "vision rope", "multimodal rope"; the names Liger set there that no code in the module reads)."""
    used, inert = [], []
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        if not module_name.startswith("transformers.models.") or module is None:
            continue
        for name, value in sorted(vars(module).items()):
            if not (inspect.isfunction(value) and value.__module__.startswith("liger_kernel")):
                continue
            if name in _names_read_by(module_name):
                used.append(_rotary_words(value.__name__))
            else:
                inert.append(f"{module_name.rpartition('.')[2]}.{name}")
    return tuple(dict.fromkeys(used)), tuple(inert)


def _rotary_words(function: str) -> str:
    for marker, words in (("multimodal", "multimodal rope"), ("vision", "vision rope"), ("rotary", "rope")):
        if marker in function:
            return words
    return function


@functools.cache
def _names_read_by(module_name: str) -> frozenset[str]:
    """The global and attribute names read inside the functions of a module's source (not its top level,
    where every function defined there is stored under its name)."""
    source = inspect.getsource(sys.modules[module_name])
    names: set[str] = set()
    pending = [compile(source, module_name, "exec")]
    while pending:
        code = pending.pop()
        if code.co_flags & inspect.CO_OPTIMIZED:
            names.update(code.co_names)
        pending += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return frozenset(names)
