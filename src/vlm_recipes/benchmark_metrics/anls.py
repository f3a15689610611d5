"""ANLS (DocVQA, InfographicVQA): the official scorer's port and the metric, the best over a row's
`answers`, else its answer. Standard library only; tests/test_paper_metrics.py checks the port."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vlm_recipes.benchmark_metrics.metric import BenchmarkMetric, references_of

# ANLS: the RRC scorer of DocVQA and InfographicVQA (rrc.cvc.uab.es, ch=17), as redistributed in
# QwenLM/Qwen-VL eval_mm/infographicsvqa_eval.py at aa00ed04091eea5fcdd32985e7915f1c53e7d599 (evaluate_method,
# levenshtein_distance); lmms-eval's `anls` (EvolvingLMMs-Lab/lmms-eval lmms_eval/api/metrics.py at
# 75571cfe0fa36ca5ec2e6aa2bb268f9d38295af3) and VLMEvalKit's anls_compute are the same code.


def _levenshtein(s1: str, s2: str) -> int:
    """The scorer's levenshtein_distance (unit costs)."""
    if len(s1) > len(s2):
        s1, s2 = s2, s1
    distances = list(range(len(s1) + 1))
    for i2, c2 in enumerate(s2):
        row = [i2 + 1]
        for i1, c1 in enumerate(s1):
            if c1 == c2:
                row.append(distances[i1])
            else:
                row.append(1 + min(distances[i1], distances[i1 + 1], row[-1]))
        distances = row
    return distances[-1]


def anls(prediction: str, references: Sequence[str] | Sequence[Mapping], threshold: float = 0.5) -> float:
    """ANLS of one answer (Biten et al. 2019, "Scene Text Visual Question Answering"), as the RRC scorer
    computes it per question: 1 - min over the references of NL, then 0 where that is below `threshold`.

    NL = Levenshtein(a, g) / max(len(a), len(g)), the distance between the answers lowercased with their
    whitespace collapsed, and, as the scorer does it, the lengths those of the answers as given (before
    collapsing; of `.upper()`): "a   c" against "ab" is 2/5, not 2/3. `threshold` is the scorer's
    --anls_threshold, compared with the score, `1 - NL < threshold -> 0`: an NL of exactly 0.5 scores 0.5,
    where the paper's formula (0 when NL >= tau) and pix2struct's anls_metric give 0; and a threshold other
    than 0.5 is not the paper's tau (tau = 0.3 there keeps NL < 0.3, here threshold 0.3 keeps NL <= 0.7).
    Two empty answers score 1."""
    answers = references_of(references)
    if not answers:
        raise ValueError("anls needs at least one reference answer (the official code's min() of nothing)")
    detected = " ".join(prediction.strip().lower().split())
    values = []
    for answer in answers:
        gt_answer = " ".join(answer.strip().lower().split())
        dist = _levenshtein(gt_answer, detected)
        length = max(len(answer.upper()), len(prediction.upper()))
        values.append(0.0 if length == 0 else float(dist) / float(length))
    result = 1 - min(values)
    return 0.0 if result < threshold else float(result)


ANLS = BenchmarkMetric(
    name="anls",
    heading="ANLS",
    needs="a reference answer",
    scores_row=lambda targets: True,
    score=lambda answer, targets, _box: anls(answer, targets.answers),
    # every row has an answer, and no column tells a document question from another: asked for by name
    by_default=False,
    mark="P",
)
