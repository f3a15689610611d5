"""The GRPO sampling speed-ups (speedups/sampling.py). grpo.sample_with_merged_lora: sampling with the LoRA
adapter merged into a copy of the weights computes what the adapter computes (without its dropout), up to
rounding, and the original weights come back untouched. grpo.inverse_cdf_sampling: each draw follows
softmax(logits / T), as torch.multinomial's does, from another random stream. Where either is not the same,
its key is refused. grpo.cpu_log_probs: the log-probability pass's LM head computes what TRL's fused head
computes, within its own rounding."""

from __future__ import annotations

import pytest
import torch
from conftest import demo_paths
from peft import LoraConfig, get_peft_model
from test_grpo import _exits_2, assert_moved, base_weights, final_weights, grpo_recipe, moving_grpo_recipe
from transformers import AutoModelForImageTextToText

from vlm_recipes.cli.train import main
from vlm_recipes.files import read_json
from vlm_recipes.speedups import log_probs
from vlm_recipes.speedups.sampling import (
    InverseCdfDraw,
    inverse_cdf_refusal,
    lora_merged,
    merged_sampling_refusal,
)

TEXT_LAYERS = r"model\.language_model\..*\.(q|k|v|o|gate|up|down)_proj"


def adapted_tiny_model(dtype: torch.dtype):
    """The tiny Qwen2-VL with a LoRA adapter on its language model whose B is not zero (a trained adapter:
    it moves the logits), in `dtype`."""
    from vlm_recipes.demo.models import ensure_demo_model

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(ensure_demo_model("demo:tiny-qwen2-vl"), dtype=dtype)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TEXT_LAYERS)
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    return model.eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def test_merged_weights_compute_what_the_adapter_computes_within_fp32_rounding(private_demo_cache):
    """Against the float64 forward through the adapter (the exact arithmetic), the merged fp32 forward is as
    close as the unmerged fp32 forward is (the noise floor: fp32 rounding itself), and both are far closer
    than what the adapter changes: a merge that dropped or doubled the adapter, or missed its scale, would
    be off by the adapter's whole effect."""
    ids = torch.randint(10, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    model = adapted_tiny_model(torch.float64)
    exact = logits(model, ids)
    with model.disable_adapter():
        adapter_effect = (exact - logits(model, ids)).abs().max().item()
    model = model.float()
    unmerged_error = (logits(model, ids) - exact).abs().max().item()
    with lora_merged(model):
        merged_error = (logits(model, ids) - exact).abs().max().item()
    print(
        f"merged sampling (fp32): max |logits - float64| merged {merged_error:.1e}, unmerged (the noise floor) "
        f"{unmerged_error:.1e}, the adapter's effect {adapter_effect:.1e}"
    )
    assert merged_error <= 10 * unmerged_error, (merged_error, unmerged_error)
    assert adapter_effect > 1000 * max(merged_error, unmerged_error), (adapter_effect, merged_error)


def test_the_original_weights_and_adapters_come_back_bit_for_bit_in_bf16(private_demo_cache):
    """In bf16, W + D - D is not W: the base tensors themselves are put back, never unmerged in place."""
    model = adapted_tiny_model(torch.bfloat16)
    ids = torch.randint(10, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    before_logits = logits(model, ids)
    before = {
        name: (p.data_ptr(), p.detach().clone(), p.requires_grad) for name, p in model.named_parameters()
    }
    with lora_merged(model):
        merged_logits = logits(model, ids)
        moved = [name for name, p in model.named_parameters() if not torch.equal(p, before[name][1])]
        assert moved and all("base_layer" in name for name in moved), "the adapted layers compute merged"
    assert not torch.equal(merged_logits, before_logits), "the merge ran (bf16 rounds it differently)"
    for name, p in model.named_parameters():
        pointer, value, requires_grad = before[name]
        assert p.data_ptr() == pointer and torch.equal(p, value) and p.requires_grad == requires_grad, name
    assert torch.equal(logits(model, ids), before_logits), "the adapter is on again"


def test_greedy_completions_are_the_same_tokens_merged_or_not(private_demo_cache):
    model = adapted_tiny_model(torch.float32)
    ids = torch.randint(10, 200, (3, 12), generator=torch.Generator().manual_seed(2))
    settings = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        through_adapter = model.generate(input_ids=ids, **settings)
        with lora_merged(model):
            merged = model.generate(input_ids=ids, **settings)
        with model.disable_adapter():
            without_adapter = model.generate(input_ids=ids, **settings)
    assert torch.equal(merged, through_adapter)
    assert not torch.equal(without_adapter, through_adapter), "the adapter changes the completions"


def draw_frequencies(logits: torch.Tensor, temperature: float, draws: int, off_by: int = 0) -> torch.Tensor:
    """How often each token is drawn in `draws` inverse-CDF draws (off_by 1: each draw names its neighbour,
    the interval read one place off)."""
    torch.manual_seed(0)
    scores = logits.expand(draws, -1).clone()
    drawn = InverseCdfDraw(temperature)(None, scores)
    assert (torch.isfinite(drawn).sum(-1) == 1).all(), "exactly one token is left finite in each row"
    winners = (drawn.argmax(-1) + off_by) % logits.numel()
    return torch.bincount(winners, minlength=logits.numel()).double() / draws


def test_inverse_cdf_draws_follow_softmax_of_logits_over_temperature():
    """200,000 draws: every token's frequency is within 5 standard errors of softmax(logits / T) (the
    sampling noise, sqrt(p (1 - p) / n)); a suppressed token (-inf) is never drawn. The wrong temperature, or
    the interval read one place off, is off by far more than that bound."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5])
    temperature, draws = 0.7, 200_000
    expected = torch.softmax(logits.double() / temperature, -1)
    bound = 5 * (expected * (1 - expected) / draws).sqrt() + 1e-12
    drawn = draw_frequencies(logits, temperature, draws)
    print(
        f"inverse-CDF draws: max |frequency - softmax| {(drawn - expected).abs().max():.1e}, bound {bound.max():.1e}"
    )
    assert ((drawn - expected).abs() <= bound).all(), (drawn, expected)
    assert drawn[5] == 0, "a suppressed token is never drawn"
    wrong_temperature = torch.softmax(logits.double(), -1)
    assert ((wrong_temperature - expected).abs() > 10 * bound).any()
    assert ((draw_frequencies(logits, temperature, draws, off_by=1) - expected).abs() > 10 * bound).any()


# A GRPO stage of 2 steps on one prompt (its group of 4 completions sampled at temperature 0.7 each step), run
# from the same seed with the sampling speed-ups off, with the merged adapter only, and with all three on.
SAMPLING_RUNS = {
    "off": "",
    "merged": ", sample_with_merged_lora: true",
    "all on": ", sample_with_merged_lora: true, inverse_cdf_sampling: true, cpu_log_probs: true",
}
# The merged adapter's sampling logits against the adapter's own, fp32, at step 2: 1.3e-7 seen (rounding: the
# same function summed in another order), the adapter's effect on them after one step 1.1e-1 (AMD EPYC). The
# bound is 75x the one and 1/11,000 of the other; the adapter's scale left out of the merge puts them 5.6e-2
# apart, a merge not put back after sampling ends with other weights.
MERGED_LOGITS_BOUND = 1e-5


def test_a_grpo_stage_samples_with_the_speedups_as_their_promises_say(
    tmp_path, private_demo_cache, monkeypatch
):
    """The merged adapter samples what the adapter samples: from the same seed, the same completions at both
    steps, and the same trained weights bit for bit, which the stage moved; at step 2 (step 1's adapter is
    still zero) its sampling logits are within MERGED_LOGITS_BOUND of the adapter's, far below what the
    adapter changes in them. LoRA dropout is 0 here: TRL samples in training mode, so with dropout the
    adapter's samples carry dropout noise (and its masks use the random stream), which the merged weights
    do not: with dropout on, merged sampling draws other completions by design. Inverse-CDF draws are the
    same distribution from another random stream (the draw tests above): here every token of every
    completion is the processor's draw, at the recipe's temperature; each group's completions differ
    (sampled, not greedy), and the completions and weights differ from multinomial's. The log-probability
    passes go through speedups/log_probs.py."""
    from vlm_recipes.methods.sampling_trainers import SamplingTrainerMixin

    seen: dict[str, dict] = {}
    generate, draw, forward = (
        SamplingTrainerMixin._generate_single_turn,
        InverseCdfDraw.__call__,
        log_probs.CpuLogProbs.forward,
    )

    def recording_generate(self, *args, **kwargs):
        """The completions TRL scores and trains on, the first sampled position's logits, and the draws."""
        run = seen[current]
        head, first = self.accelerator.unwrap_model(self.model).get_output_embeddings(), []

        def first_logits(module, inputs, out) -> None:
            if not first:
                first.append(out[0, -1].double())

        hook = head.register_forward_hook(first_logits)
        run["draws"].append([])
        try:
            completion_ids, logprobs = generate(self, *args, **kwargs)
        finally:
            hook.remove()
        run["completions"].append(completion_ids)
        run["logits"].append(first[0])
        return completion_ids, logprobs

    def recording_draw(self, input_ids, scores):
        drawn = draw(self, input_ids, scores)
        seen[current]["temperatures"].add(self.temperature)
        seen[current]["draws"][-1].append(drawn.argmax(-1).tolist())
        return drawn

    monkeypatch.setattr(SamplingTrainerMixin, "_generate_single_turn", recording_generate)
    monkeypatch.setattr(InverseCdfDraw, "__call__", recording_draw)

    def counting_forward(*args):
        seen[current]["passes"] += 1
        return forward(*args)

    monkeypatch.setattr(log_probs.CpuLogProbs, "forward", counting_forward)
    weights, decisions = {}, {}
    for current, settings in SAMPLING_RUNS.items():
        seen[current] = {"completions": [], "logits": [], "draws": [], "temperatures": set(), "passes": 0}
        recipe = moving_grpo_recipe(
            tmp_path,
            monkeypatch,
            data="{train: demo:prompt-train, eval: null, max_train_samples: 1}",
            training="{max_steps: 2, per_device_batch_size: 4, learning_rate: 1.0e-3}",
            grpo=f", temperature: 0.7{settings}",
        )
        # TRL samples in training mode: LoRA dropout would perturb the adapter's samples (and draw masks) where
        # the merged weights have no dropout; without it the two are the same function
        recipe.write_text(recipe.read_text().replace("{llm: lora}", "{llm: lora}\n    lora: {dropout: 0.0}"))
        name = current.replace(" ", "-")
        assert main(["--recipe", str(recipe), "--output-dir", str(tmp_path), "--run-name", name]) == 0
        stage = tmp_path / "grpo" / name / "stage-1-grpo"
        weights[current] = final_weights(stage)
        decisions[current] = {d["guard"]: d["choice"] for d in read_json(stage / "report.json")["decisions"]}
    off, merged, on = (seen[run] for run in SAMPLING_RUNS)
    assert len(off["completions"]) == 2, "one group sampled a step"
    start = base_weights()
    assert_moved(weights["off"], start)

    # merged adapter: the same completions and weights; the sampling logits within rounding
    assert "merged" in decisions["merged"]["merged-sampling"] and "merged-sampling" not in decisions["off"]
    assert merged["completions"] == off["completions"]
    differ = [n for n, value in weights["off"].items() if not torch.equal(weights["merged"][n], value)]
    assert not differ, f"{len(differ)} trained tensors differ, e.g. {differ[:1]}"
    assert torch.equal(merged["logits"][0], off["logits"][0]), "step 1: the adapter is zero, the merge exact"
    rounding = (merged["logits"][1] - off["logits"][1]).abs().max().item()
    adapter_effect = (off["logits"][1] - off["logits"][0]).abs().max().item()  # one prompt, both steps
    print(
        f"merged sampling in a stage (fp32): |logits merged - through the adapter| {rounding:.1e}, bound "
        f"{MERGED_LOGITS_BOUND:.0e}; the adapter's effect on them after one step {adapter_effect:.1e}"
    )
    assert rounding <= MERGED_LOGITS_BOUND, rounding
    assert adapter_effect > 100 * MERGED_LOGITS_BOUND, adapter_effect

    # inverse-CDF draws: the processor drew every token, at the recipe's temperature; another stream
    assert "cumulative" in decisions["all on"]["inverse-cdf-sampling"]
    assert "one vocabulary tile" in decisions["all on"]["cpu-log-probs"]
    assert on["temperatures"] == {0.7} and not off["draws"][0] and not merged["draws"][0]
    for completions, draws in zip(on["completions"], on["draws"], strict=True):
        for row, completion in enumerate(completions):
            assert completion == [step[row] for step in draws][: len(completion)], (completion, draws)
        assert len({tuple(c) for c in completions}) > 1, "sampled: a greedy group's completions are all one"
    assert on["completions"] != off["completions"], "another random stream than torch.multinomial's"
    assert any(not torch.equal(weights["all on"][n], v) for n, v in weights["off"].items())
    assert_moved(weights["all on"], start)
    assert on["passes"] and not off["passes"], "the log-probability passes went through speedups/log_probs.py"


def test_a_grpo_trainers_log_probabilities_are_the_same_with_cpu_log_probs(
    tmp_path, demo_model_dir, monkeypatch
):
    """fp32, the tiny Qwen2-VL's GRPO trainer: the per-token log-probabilities and entropies of a batch whose
    second completion is half padding, with the speed-up on (the labelled positions only, our head) and off
    (TRL's, every position), agree within 1e-5 (fp32 rounding of values up to ~10 in a different order); a
    position read one place off differs by over 1000x that."""
    from vlm_recipes.data.prompts import PROMPTS
    from vlm_recipes.data.stage_data import load_stage_data
    from vlm_recipes.decisions import Environment
    from vlm_recipes.methods.grpo import GRPO
    from vlm_recipes.methods.trainer import ConfigInputs
    from vlm_recipes.model.build import build_stage_model, detect_family, load_processor
    from vlm_recipes.recipe import load_recipe

    stage = load_recipe(str(grpo_recipe(tmp_path))).stages[0]
    family, _ = detect_family(str(demo_model_dir))
    processor = load_processor(str(demo_model_dir), stage.data, family)
    built = build_stage_model(str(demo_model_dir), stage, "fp32", "cpu", processor=processor)
    config = ConfigInputs(stage, tmp_path / "out", "fp32", Environment("cpu", 0, False), has_eval=False)
    trainer = GRPO().build_trainer(
        built,
        stage,
        GRPO().build_config(config),
        load_stage_data(stage.data, PROMPTS, paths=demo_paths(stage.data)),
    )
    ids = torch.randint(10, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[1, -3:] = 0  # padding after the second completion

    def per_token(cpu_log_probs: bool):
        trainer.cpu_log_probs = cpu_log_probs
        with torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, attention, 6, compute_entropy=True
            )

    rows = []  # the positions our head scored
    forward = log_probs.CpuLogProbs.forward
    monkeypatch.setattr(
        log_probs.CpuLogProbs, "forward", lambda c, h, *a: rows.append(len(h)) or forward(c, h, *a)
    )
    (on, on_entropy, _), (off, off_entropy, _) = per_token(True), per_token(False)
    assert rows == [6 + 3], "the speed-up's head scored the completions' labelled positions, and only it"
    worst = max((on - off).abs().max().item(), (on_entropy - off_entropy).abs().max().item())
    print(f"log-probabilities and entropies, speed-up on against off: {worst:.1e} (bound 1e-5)")
    assert worst <= 1e-5
    assert (on[:, 1:] - off[:, :-1]).abs().max().item() > 1000 * 1e-5


def fused_head(function, hidden, weight, targets, temperature, grad_out):
    """Log-probabilities, entropies and d(sum grad_out x log-probabilities)/d hidden through `function`
    (TRL's ChunkedLogProbFunction, or ours), as TRL's fused head calls it."""
    hidden = hidden.clone().requires_grad_(True)
    chunk = 32768  # TRL 1.16's vocabulary tile
    out, entropy, *_ = function.apply(
        hidden, weight, None, targets, temperature, chunk, None, 1.0, log_probs.OUTPUTS
    )
    (out * grad_out).sum().backward()
    return out.detach().double(), entropy.detach().double(), hidden.grad.double()


def exact_head(hidden, weight, targets, temperature, grad_out):
    """The same three in float64 from the same bf16 numbers: what both should compute, unrounded."""
    h = hidden.double().requires_grad_(True)
    logp = torch.log_softmax(h @ weight.double().t() / temperature, -1)
    out = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    (out * grad_out.double()).sum().backward()
    return out.detach(), entropy.detach(), h.grad


def test_cpu_log_probs_compute_what_trls_fused_head_computes_within_its_rounding():
    """bf16, a sampling step's shapes scaled down (200 tokens, a quarter of them masked, 256 wide, a
    5,000-entry vocabulary), T = 0.7:
    against float64 from the same bf16 numbers, our log-probabilities, entropies and hidden-state gradient
    are each within 2x TRL's own error (its rounding: the measured floor) plus 1e-6. A temperature left
    out, or the target read one entry off, puts one of the three over 50x its bound."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(200, 256, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(5000, 256, generator=generator) * 0.05).to(torch.bfloat16)
    targets = torch.randint(0, 5000, (200,), generator=generator)
    grad_out = torch.randn(200, generator=generator)
    grad_out[::4] = 0  # positions the loss masks (TRL scores the prompt's too off a GPU)
    exact = exact_head(hidden, weight, targets, 0.7, grad_out)
    trls = fused_head(ChunkedLogProbFunction, hidden, weight, targets, 0.7, grad_out)
    ours = fused_head(log_probs.CpuLogProbs, hidden, weight, targets, 0.7, grad_out)
    names = ("log-probabilities", "entropies", "hidden-state gradient")
    bounds = [2 * (t - e).abs().max().item() + 1e-6 for t, e in zip(trls, exact, strict=True)]
    for name, mine, e, bound in zip(names, ours, exact, bounds, strict=True):
        print(f"{name}: ours {(mine - e).abs().max():.2e} from float64, bound {bound:.2e}")
        assert (mine - e).abs().max().item() <= bound, name
    no_temperature = fused_head(log_probs.CpuLogProbs, hidden, weight, targets, 1.0, grad_out)
    one_off = fused_head(log_probs.CpuLogProbs, hidden, weight, (targets + 1) % 5000, 0.7, grad_out)
    for broken in (no_temperature, one_off):
        worst = max(
            (x - e).abs().max().item() / bound for x, e, bound in zip(broken, exact, bounds, strict=True)
        )
        assert worst > 50, worst


def test_cpu_log_probs_leave_to_trl_what_they_do_not_handle():
    """A GPU tensor, a vocabulary over one tile, a bias or a soft cap: TRL's own path computes."""
    hidden, weight = torch.zeros(2, 4), torch.zeros(10, 4)
    assert log_probs.handles(hidden, weight, None, 32768, None, log_probs.OUTPUTS)
    assert not log_probs.handles(hidden, weight, None, 8, None, log_probs.OUTPUTS)
    assert not log_probs.handles(hidden, weight, torch.zeros(10), 32768, None, log_probs.OUTPUTS)
    assert not log_probs.handles(hidden, weight, None, 32768, 30.0, log_probs.OUTPUTS)
    assert not log_probs.handles(hidden.to("meta"), weight, None, 32768, None, log_probs.OUTPUTS)


def test_inverse_cdf_sampling_is_refused_where_trl_filters_the_distribution(tmp_path):
    from trl import GRPOConfig

    plain = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert inverse_cdf_refusal(plain) is None
    filtered = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", top_p=0.9)
    assert "top_p 0.9" in inverse_cdf_refusal(filtered)


STAGE = "    precision: fp32\n    evaluation: {generate: false}\n"


@pytest.mark.parametrize(
    ("grpo", "stage", "message"),
    [
        ("use_vllm: true", STAGE, "vLLM, which merges the adapter itself"),
        ("use_vllm: false", STAGE + "    quantization: {mode: 4bit}\n", "a quantized base cannot"),
    ],
    ids=["vllm", "4-bit"],
)
def test_merged_sampling_is_refused_at_load_where_a_merge_is_not_the_same_function(
    tmp_path, capsys, grpo, stage, message
):
    settings = f"{{num_generations: 4, max_completion_length: 4, sample_with_merged_lora: true, {grpo}}}"
    err = _exits_2(grpo_recipe(tmp_path, grpo=settings, extra=stage), tmp_path, capsys)
    assert "grpo.sample_with_merged_lora" in err and message in err


def test_a_model_without_an_adapter_is_refused_with_the_reason(private_demo_cache):
    from vlm_recipes.demo.models import ensure_demo_model

    model = AutoModelForImageTextToText.from_pretrained(ensure_demo_model("demo:tiny-qwen2-vl"))
    assert "no LoRA adapter" in merged_sampling_refusal(model)
