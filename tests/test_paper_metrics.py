"""The paper metrics' ports (benchmark_metrics/, one module each) against their benchmarks' official scorers.

Every expected value below is what the official code itself returned on that case: each scorer's file was
taken from the commit named, run unmodified outside this repository (apart from stubbing an unrelated
import, or, for ANLS, writing the cases as its ground-truth and submission files), and its answers copied
here. The values are compared exactly (==): the ports do the same float arithmetic in the same order."""

from __future__ import annotations

import pytest

from vlm_recipes.benchmark_metrics.anls import anls
from vlm_recipes.benchmark_metrics.box_acc50 import box_acc50
from vlm_recipes.benchmark_metrics.metric import references_of
from vlm_recipes.benchmark_metrics.option_accuracy import option_accuracy, option_letter
from vlm_recipes.benchmark_metrics.relaxed_accuracy import relaxed_accuracy
from vlm_recipes.benchmark_metrics.vqa_accuracy import vqa_accuracy, vqa_normalize

# --- VQA accuracy ------------------------------------------------------------------------------------------
# Source: the VQA challenge server's scorer, Cloud-CV/VQA-Challenge PythonEvaluationTools/vqaEvaluation/
# vqaEval.py at 35c770312739aa8037c004e2f710bd005e173e48 (last changed in 50c6b1e), run unmodified under
# Python 2.7.18 outside this repository: VQAEval(quesIds).evaluate(vqa, vqaRes) on one question per case
# (answers as VQAv2 dicts with answer_ids 1-10), vqa.qa and vqaRes.qa given directly; the value is avgGTAcc,
# the per-question accuracy before setEvalQA rounds it to a percentage.
TEN_YES = ["yes"] * 10
VQA_CASES = [
    pytest.param("2", ["2"] * 10, 1.0, id="digit-vs-ten-digits"),
    # The answer is always normalized; the references are compared as given when they all agree.
    # (GT-Vision-Lab/VQA's vqaEval.py, a013f00, normalizes neither there: 0.0 on these four.)
    pytest.param("two", ["2"] * 10, 1.0, id="number-word-unanimous"),
    pytest.param("Yes.", TEN_YES, 1.0, id="Yes.-unanimous"),
    pytest.param("Yes", TEN_YES, 1.0, id="capital-unanimous"),
    pytest.param("a dog", ["dog"] * 10, 1.0, id="article-unanimous"),
    pytest.param("two", ["2"] * 9 + ["3"], 1.0, id="number-word-normalized"),
    pytest.param("  yes\n", TEN_YES, 1.0, id="whitespace-always-stripped"),
    pytest.param("Yes.", ["yes"] * 8 + ["no"] * 2, 1.0, id="Yes.-normalized"),
    pytest.param("no", ["yes"] * 8 + ["no"] * 2, 0.5999999999999999, id="two-of-ten"),
    pytest.param("a dog", ["dog"] * 2 + ["puppy"] * 8, 0.6, id="article-dropped"),
    pytest.param("10 minutes", ["10"] * 8 + ["10 min"] * 2, 0.0, id="unit-is-not-dropped"),
    pytest.param("10", ["10 minutes"] * 7 + ["10"] * 3, 0.9, id="three-of-ten"),
    pytest.param("dont", ["don't"] * 5 + ["no"] * 5, 1.0, id="contraction-restored"),
    pytest.param(
        "red, white", ["red white"] * 3 + ["red"] * 3 + ["white"] * 4, 0.9, id="comma-space-deleted"
    ),
    pytest.param("red,white", ["red white"] * 3 + ["red"] * 3 + ["white"] * 4, 0.9, id="comma-becomes-space"),
    pytest.param("1,000", ["1000"] * 4 + ["1,000", "1 000"] + ["1000"] * 4, 1.0, id="digit-comma-digit"),
    pytest.param("t-shirt", ["t shirt"] * 3 + ["shirt"] * 7, 0.9, id="hyphen-becomes-space"),
    pytest.param("3.", ["3"] * 9 + ["three"], 1.0, id="trailing-period-dropped"),
    pytest.param("3.5", ["3.5"] * 3 + ["35"] * 2 + ["3"] * 5, 0.9, id="decimal-point-kept"),
    pytest.param("The Cat", ["cat"] * 9 + ["kitten"], 1.0, id="case-and-article"),
    pytest.param("none", ["0"] * 3 + ["zero"] + ["0"] * 6, 1.0, id="none-is-0"),
    # the references get the punctuation step only: "whats" is not restored to "what's" (GT-Vision-Lab: 0.9)
    pytest.param("what's", ["whats"] * 3 + ["what"] * 7, 0.0, id="reference-contraction-not-restored"),
    # periodStrip.sub("", text, re.UNICODE): re.UNICODE (32) is the count, so a 33rd period stays
    pytest.param("yes" + "." * 33, ["yes"] * 9 + ["no"], 0.0, id="33-periods-one-left"),
    pytest.param("yes" + "." * 32, ["yes"] * 9 + ["no"], 1.0, id="32-periods-all-removed"),
    # Python 2's \d is 0-9 only: the period before an Arabic-Indic three is removed (Python 3 would keep it)
    pytest.param("1.\u0663", ["1\u0663"] * 9 + ["no"], 1.0, id="non-ascii-digit-as-python-2"),
    # fewer than 10 references: the same leave-one-out mean over what there is
    pytest.param("cat", ["cat"], 0.0, id="one-reference-always-0"),
    pytest.param("cat", ["cat"] * 3, 0.6666666666666666, id="three-identical"),
    pytest.param("Cat", ["cat", "cat", "dog"], 0.4444444444444444, id="three-mixed"),
    pytest.param("cat", ["cat"] * 4, 1.0, id="four-identical"),
]


@pytest.mark.parametrize(("prediction", "references", "expected"), VQA_CASES)
def test_vqa_accuracy_as_the_vqa_challenge_server(prediction, references, expected):
    # expected: Cloud-CV/VQA-Challenge vqaEval.py (35c7703) VQAEval.evaluate on this question
    assert vqa_accuracy(prediction, references) == expected


# 30 VQAv2 questions (ten answers each, in the form VQAv2's annotation files hold them: lower case, digits)
# with a model's answer as models write them. server: the same run of Cloud-CV/VQA-Challenge's vqaEval.py
# (35c7703). lmms_eval: EvolvingLMMs-Lab/lmms-eval lmms_eval/tasks/vqav2/utils.py at
# 75571cfe0fa36ca5ec2e6aa2bb268f9d38295af3, vqav2_process_results(doc, [answer])["exact_match"] run unmodified
# (its loguru and file_utils imports stubbed) with its EvalAIAnswerProcessor
# (lmms_eval/tasks/_task_utils/vqa_eval_metric.py), gave the same on 27 of the 30: the comments say the rest.
VQAV2_SERVER_CASES = [
    ("Yes.", TEN_YES, 1.0),
    ("Yes", TEN_YES, 1.0),
    ("yes!", TEN_YES, 1.0),
    ("  yes\n", TEN_YES, 1.0),
    ("No.", ["no"] * 10, 1.0),
    ("no", ["yes"] * 8 + ["no"] * 2, 0.5999999999999999),  # lmms-eval 0.6: statistics.mean
    ("Two", ["2"] * 10, 1.0),
    ("two", ["2"] * 9 + ["3"], 1.0),
    ("2.", ["2"] * 10, 1.0),
    ("One", ["1"] * 10, 1.0),
    ("2 dogs", ["2"] * 10, 0.0),
    ("The cat", ["cat"] * 10, 1.0),
    ("a dog", ["dog"] * 7 + ["puppy"] * 3, 1.0),
    ("dog", ["dog"] * 2 + ["puppy"] * 8, 0.6),
    ("Red and white.", ["red and white"] * 6 + ["red"] * 4, 1.0),
    ("red, white", ["red white"] * 3 + ["red"] * 3 + ["white"] * 4, 0.9),
    ("red,white", ["red white"] * 3 + ["red"] * 3 + ["white"] * 4, 0.9),
    ("black/white", ["black and white"] * 7 + ["black white"] * 3, 0.9),
    ("1,000", ["1000"] * 10, 1.0),
    ("3.5", ["3.5"] * 10, 1.0),
    ("10:30", ["10:30"] * 8 + ["10:35"] * 2, 1.0),
    # unanimous references are not processed: the answer's "t shirt" matches no "t-shirt" (lmms-eval: 1.0)
    ("t-shirt", ["t-shirt"] * 10, 0.0),
    ("t-shirt", ["t-shirt"] * 6 + ["shirt"] * 4, 1.0),
    ("dont", ["don't"] * 5 + ["no"] * 5, 1.0),
    ("none", ["0"] * 10, 1.0),
    # the answer's "none" becomes "0"; the references' "none" stays, no processDigitArticle (lmms-eval: 1.0)
    ("None", ["none"] * 6 + ["nothing"] * 4, 0.0),
    ("Nothing.", ["nothing"] * 4 + ["none"] * 6, 1.0),
    ("It is red.", ["red"] * 10, 0.0),
    ("Wii", ["wii"] * 10, 1.0),
    ("skateboarding", ["skateboarding"] * 5 + ["skating"] * 5, 1.0),
]


@pytest.mark.parametrize(
    ("prediction", "answers", "server"),
    VQAV2_SERVER_CASES,
    ids=[f"{i}-{case[0].strip()}" for i, case in enumerate(VQAV2_SERVER_CASES)],
)
def test_vqav2_answers_score_as_the_challenge_server_scores_them(prediction, answers, server):
    """The server normalizes the answer always, so a model saying "Yes." to ten "yes" scores 1. The port of
    GT-Vision-Lab's vqaEval.py (a013f00) this replaced differed on 13 of these 30: 0 on 11 unanimous ones
    with something to normalize, 1 on the "t-shirt" and "None" rows."""
    dicts = [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(answers)]
    assert vqa_accuracy(prediction, dicts) == server


def test_vqav2_answer_dicts_are_read_as_references():
    # VQAv2's own annotation format: the answers of one question, each a dict. Expected values: the server's
    # vqaEval.py (35c7703) on these very dicts (the cases "two-of-ten", "Yes.-normalized", "Yes.-unanimous").
    answers = [
        {"answer": answer, "answer_confidence": "yes", "answer_id": i + 1}
        for i, answer in enumerate(["yes"] * 8 + ["no"] * 2)
    ]
    assert references_of(answers) == ["yes"] * 8 + ["no"] * 2
    assert vqa_accuracy("no", answers) == 0.5999999999999999
    assert vqa_accuracy("Yes.", answers) == 1.0
    unanimous = [{"answer": "yes", "answer_confidence": "yes", "answer_id": i + 1} for i in range(10)]
    assert vqa_accuracy("Yes.", unanimous) == 1.0
    # The same answers as strings, or a bare {"answer": ...}, read the same
    assert vqa_accuracy("no", ["yes"] * 8 + ["no"] * 2) == vqa_accuracy(
        "no", [{"answer": a} for a in references_of(answers)]
    )
    assert references_of("yes") == ["yes"]


def test_references_that_are_not_answers_are_refused():
    with pytest.raises(TypeError):
        references_of([{"text": "yes"}])
    with pytest.raises(TypeError):
        references_of({"answer": "yes"})
    with pytest.raises(ValueError):
        vqa_accuracy("yes", [])


def test_vqa_normalize_is_the_servers_normalization_of_an_answer():
    # expected: the server's vqaEval.py (35c7703) processDigitArticle(processPunctuation(answer)); its
    # processPunctuation also matched this port's on 20,000 random strings of letters, digits, marks and
    # spaces (run once outside the repository, Python 2.7.18 against this module).
    assert vqa_normalize("The Two dogs.") == "2 dogs"
    assert vqa_normalize("red,white") == "red white"
    assert vqa_normalize("1,000") == "1000"
    assert vqa_normalize("dont") == "don't"
    assert vqa_normalize("3.5") == "3.5"
    assert vqa_normalize("t-shirt") == "t shirt"
    assert vqa_normalize("(yes)") == "yes"
    assert vqa_normalize("black/white") == "black white"


# --- ANLS --------------------------------------------------------------------------------------------------
# Source: the RRC scorer for DocVQA / InfographicVQA, QwenLM/Qwen-VL eval_mm/infographicsvqa_eval.py at
# aa00ed04091eea5fcdd32985e7915f1c53e7d599 ("can be downloaded from docvqa.org and rrc.cvc.uab.es"), run
# unmodified: validate_data and evaluate_method on a ground-truth file and a submission file holding the case,
# with --anls_threshold as given; the value is per_sample_result's score. lmms-eval's `anls`
# (lmms_eval/api/metrics.py at 75571cf) gave the same on every case.
ANLS_CASES = [
    pytest.param("Paris", ["paris"], 0.5, 1.0, id="case"),
    pytest.param("PARIS", ["Paris"], 0.5, 1.0, id="upper"),
    pytest.param("  New   York ", ["new york"], 0.5, 1.0, id="whitespace-collapsed"),
    # at the threshold: NL exactly 0.5 is kept (score < threshold is what scores 0)
    pytest.param("ab", ["ac"], 0.5, 0.5, id="NL-exactly-0.5-kept"),
    pytest.param("abcd", ["abxy"], 0.5, 0.5, id="NL-2/4-kept"),
    pytest.param("abcdefghi", ["abcdexxxx"], 0.5, 0.5555555555555556, id="NL-4/9-just-above"),
    pytest.param("abcdefghi", ["abcdxxxxx"], 0.5, 0.0, id="NL-5/9-just-below"),
    pytest.param("abc", ["abd"], 0.5, 0.6666666666666667, id="one-edit"),
    # the lengths are the answers' as given, before the whitespace is collapsed: 2/5, not 2/3
    pytest.param("a   c", ["ab"], 0.5, 0.6, id="length-before-collapsing"),
    pytest.param("", ["abc"], 0.5, 0.0, id="empty-answer"),
    pytest.param("", [""], 0.5, 1.0, id="both-empty"),
    pytest.param("10 minutes", ["10"], 0.5, 0.0, id="unit"),
    pytest.param("1990", ["1991", "the year 1990"], 0.5, 0.75, id="best-reference"),
    pytest.param("the year 1990", ["1991", "1990"], 0.5, 0.0, id="longer-answer"),
    pytest.param("abc", ["abd"], 0.7, 0.0, id="threshold-0.7-on-the-score"),
    pytest.param("\u00df", ["s"], 0.5, 0.5, id="upper-lengthens-sharp-s"),
    pytest.param("$ 12.50", ["$12.50"], 0.5, 0.8571428571428572, id="inner-space"),
    pytest.param("december 5, 1998", ["Dec. 5, 1998"], 0.5, 0.6875, id="date"),
]


@pytest.mark.parametrize(("prediction", "references", "threshold", "expected"), ANLS_CASES)
def test_anls_as_the_rrc_scorer(prediction, references, threshold, expected):
    # expected: Qwen-VL eval_mm/infographicsvqa_eval.py (aa00ed0), the RRC scorer, evaluate_method
    assert anls(prediction, references, threshold) == expected


def test_anls_keeps_a_score_of_exactly_the_threshold():
    # The RRC scorer (Qwen-VL aa00ed0; lmms-eval 75571cf) keeps 1 - NL == 0.5; the paper's formula and
    # pix2struct's anls_metric (NL < 0.5 to score) would give 0 here.
    assert anls("ab", ["ac"]) == 0.5
    assert anls("abcdef", ["abcxyz"]) == 0.5  # the RRC scorer (aa00ed0) on this case: 0.5
    assert anls("abcdefghi", ["abcdxxxxx"]) == 0.0
    with pytest.raises(ValueError):
        anls("ab", [])


# --- Relaxed accuracy (ChartQA) ----------------------------------------------------------------------------
# Source: google-research/pix2struct pix2struct/metrics.py at 945f27e936c9464d9d7c133f1bd1f4f383be9e99,
# imported unmodified (its pycocoevalcap and editdistance imports stubbed), relaxed_correctness(target=
# reference, prediction=prediction); True/False as 1.0/0.0. (A reference of 0: the departure, below.)
RELAXED_CASES = [
    pytest.param("31%", "0.31", 1.0, id="percent-prediction-is-a-fraction"),
    pytest.param("0.31", "31%", 1.0, id="percent-reference-is-a-fraction"),
    pytest.param("31", "31%", 0.0, id="31-is-not-31%"),
    pytest.param("31%", "31", 0.0, id="31%-is-not-31"),
    pytest.param("31%", "31%", 1.0, id="same-percent"),
    pytest.param("105", "100", 1.0, id="exactly-5%"),
    pytest.param("106", "100", 0.0, id="6%"),
    pytest.param("95.1", "100", 1.0, id="4.9%-of-the-reference"),
    pytest.param("94.9", "100", 0.0, id="5.1%"),
    pytest.param("95", "100", 1.0, id="5%-below"),
    pytest.param("0", "0", 1.0, id="zero-same-text"),
    pytest.param("0.01", "0", 0.0, id="near-zero"),
    pytest.param("Yes", "yes", 1.0, id="text-lowercased"),
    pytest.param("yes.", "yes", 0.0, id="text-punctuation-kept"),
    pytest.param("Blue ", "blue", 0.0, id="text-not-stripped"),
    pytest.param("10 minutes", "10", 0.0, id="unit-is-text"),
    pytest.param("1,000", "1000", 0.0, id="thousands-comma-is-text"),
    pytest.param(" 12", "12", 1.0, id="float-strips-spaces"),
    pytest.param("12% ", "12%", 0.0, id="percent-then-space-is-text"),
    pytest.param("-5", "-5.2", 1.0, id="negative"),
    pytest.param("1e3", "1000", 1.0, id="exponent"),
    pytest.param("nan", "nan", 0.0, id="nan"),
    pytest.param("$5", "5", 0.0, id="currency-is-text"),
    pytest.param("2019", "2018", 1.0, id="years-within-5%"),
]


@pytest.mark.parametrize(("prediction", "reference", "expected"), RELAXED_CASES)
def test_relaxed_accuracy_as_pix2struct(prediction, reference, expected):
    # expected: pix2struct/metrics.py (945f27e) relaxed_correctness(reference, prediction)
    assert relaxed_accuracy(prediction, reference) == expected


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [("0.0", "0", 1.0), ("-0", "0", 1.0), ("0%", "0", 1.0), ("0", "0.0", 1.0), ("0.001", "0", 0.0)],
)
def test_relaxed_accuracy_reads_a_zero_reference_as_a_number(prediction, reference, expected):
    """The departure: "0.0" against "0" is right, as ChartQA's rule ("within 5% of the gold answer", Masry
    et al. 2022, 5.1) has it. pix2struct's relaxed_correctness (every commit to 945f27e; lmms-eval's
    chartqa and VLMEvalKit's copies too) skips the number branch when the reference is 0, so compares the
    text there and scores the first four 0 (the last 0 as here)."""
    assert relaxed_accuracy(prediction, reference) == expected


# --- Multiple choice -------------------------------------------------------------------------------------
# Source: open-compass/VLMEvalKit vlmeval/utils/matching_util.py at e8e78f05f3080fe28154f2130321f17951c3be94,
# imported unmodified (its logger import stubbed), can_infer(answer, choices) with VERBOSE unset; its False
# is None here.
ANIMALS = {"A": "dog", "B": "cat", "C": "bird", "D": "fish"}
FIVE = {**ANIMALS, "E": "horse"}
OPTION_CASES = [
    pytest.param("The answer is (B).", ANIMALS, "B", id="the-answer-is-(B)"),
    pytest.param("B", ANIMALS, "B", id="letter"),
    pytest.param("(C)", ANIMALS, "C", id="bracketed"),
    pytest.param("B. cat", ANIMALS, "B", id="letter-and-text"),
    pytest.param("Answer: D", ANIMALS, "D", id="answer-colon"),
    pytest.param("cat", ANIMALS, "B", id="option-text"),
    pytest.param("It is a Cat.", ANIMALS, "B", id="option-text-in-a-sentence"),
    pytest.param("dog or cat", ANIMALS, None, id="two-option-texts"),
    pytest.param("A or B", ANIMALS, None, id="two-letters"),
    pytest.param(
        "B is correct because the animal in the picture has whiskers and pointy ears",
        ANIMALS,
        None,
        id="letter-not-among-the-last-four-words",
    ),
    pytest.param("The answer is b", ANIMALS, "B", id="answer-is-lowercase-letter"),
    # "answer is c(lear)": the verbose pattern has no word boundary after the letter
    pytest.param(
        "I think the answer is clear: the animal is a cat", ANIMALS, "C", id="answer-is-clear-reads-C"
    ),
    pytest.param("A cat", ANIMALS, "A", id="article-A-reads-as-option-A"),
    pytest.param("Cannot determine the answer", ANIMALS, "Z", id="refusal-is-Z"),
    pytest.param("Z", ANIMALS, "Z", id="Z"),
    pytest.param("horse", ANIMALS, None, id="no-option"),
    pytest.param("category", {"A": "cat", "B": "dog"}, "A", id="option-text-as-a-substring"),
    pytest.param("The correct answer is **C**", ANIMALS, "C", id="markdown-bold"),
    pytest.param("E", FIVE, "E", id="fifth-option"),
    pytest.param("The answer is E", FIVE, "E", id="fifth-option-in-a-sentence"),
    pytest.param("Failed to obtain answer via API", ANIMALS, None, id="api-failure"),
]


@pytest.mark.parametrize(("answer", "options", "expected"), OPTION_CASES)
def test_option_letter_as_vlmevalkit(answer, options, expected):
    # expected: VLMEvalKit matching_util.py (e8e78f0) can_infer(answer, options)
    assert option_letter(answer, options) == expected


@pytest.mark.parametrize(
    ("answer", "correct", "expected"),
    [
        ("The answer is (B).", "B", 1.0),
        ("cat", "B", 1.0),
        ("B", "A", 0.0),
        ("dog or cat", "B", 0.0),
        ("Cannot determine the answer", "B", 0.0),
        ("I think the answer is clear: the animal is a cat", "B", 0.0),
    ],
)
def test_option_accuracy_is_the_letter_read_against_the_correct_one(answer, correct, expected):
    # expected: VLMEvalKit (e8e78f0) can_infer's letter (the cases above) compared with the correct letter
    assert option_accuracy(answer, correct, ANIMALS) == expected


@pytest.mark.parametrize(
    ("answer", "expected", "vlmevalkit"),
    [
        ("b", "B", None),
        ("(b)", "B", None),
        ("b.", "B", None),
        ("a", "A", None),
        ("d", "D", None),
        ("e", None, None),  # not an option
        ("b or c", None, None),
        # answers of more words read as VLMEvalKit reads them: "a" is an article there
        ("a cat", "B", "B"),
        ("a dog", "A", "A"),
        ("I see a fish", "D", "D"),
        ("A cat", "A", "A"),
        ("b cat", "B", "B"),
    ],
)
def test_a_lone_lowercase_option_letter_reads_as_that_option(answer, expected, vlmevalkit):
    """The departure: where VLMEvalKit's can_infer (e8e78f0, run unmodified on these: `vlmevalkit`, None for
    its False) reads nothing, an answer that is one lowercase option letter reads as that option. VLMEvalKit
    upper-cases no answer before can_infer; it reads "b" as B only through its LLM judge."""
    assert option_letter(answer, ANIMALS) == expected
    assert vlmevalkit is None or vlmevalkit == expected
    assert option_accuracy(answer, "B", ANIMALS) == float(expected == "B")


def test_option_letter_leaves_the_options_as_they_were():
    # VLMEvalKit's can_infer_text lowercases the caller's dict in place; the port does not
    options = {"A": "Dog", "B": "Cat"}
    assert option_letter("a cat it is", options) == "B"
    assert options == {"A": "Dog", "B": "Cat"}
    with pytest.raises(ValueError):
        option_letter("B", {"b": "cat"})


# --- RefCOCO Acc@0.5 ----------------------------------------------------------------------------------------
# Source: EvolvingLMMs-Lab/lmms-eval lmms_eval/tasks/refcoco/utils_rec.py at
# 75571cfe0fa36ca5ec2e6aa2bb268f9d38295af3, compute_accuracy(pred, ref, 0.5) (with its compute_iou) taken out
# of the file as written; for text, its parse_float_sequence_within first. The IoU it gave is in the id.
BOX_CASES = [
    pytest.param([10, 20, 110, 220], [10, 20, 110, 220], 1.0, id="same-iou-1"),
    pytest.param([0, 0, 10, 10], [0, 0, 10, 5], 1.0, id="iou-exactly-0.5"),
    pytest.param([0, 0, 10, 10], [0, 0, 10, 4.9], 0.0, id="iou-0.49"),
    pytest.param([0, 0, 10, 10], [5, 0, 15, 10], 0.0, id="iou-0.333"),
    pytest.param([0, 0, 10, 10], [3, 0, 13, 10], 1.0, id="iou-0.538"),
    pytest.param([0, 0, 10, 10], [10, 0, 20, 10], 0.0, id="touching-iou-0"),
    pytest.param([0, 0, 10, 10], [20, 20, 30, 30], 0.0, id="apart-iou-0"),
    pytest.param([2, 2, 8, 8], [0, 0, 10, 10], 0.0, id="inside-iou-0.36"),
    pytest.param([0, 0, 100, 100], [10, 10, 90, 90], 1.0, id="around-iou-0.64"),
    pytest.param([0.1, 0.2, 0.5, 0.6], [0.12, 0.22, 0.52, 0.62], 1.0, id="relative-iou-0.822"),
    pytest.param([100, 100, 300, 300], [150, 150, 350, 350], 0.0, id="shifted-iou-0.391"),
    pytest.param("[10, 20, 110, 220]", [10, 20, 110, 220], 1.0, id="text-list"),
    pytest.param("The box is [10,20,110,220].", [10, 20, 110, 220], 1.0, id="text-in-a-sentence"),
    pytest.param("no box here", [10, 20, 110, 220], 0.0, id="no-box"),
]


@pytest.mark.parametrize(("predicted", "reference", "expected"), BOX_CASES)
def test_box_acc50_as_lmms_eval(predicted, reference, expected):
    # expected: lmms-eval refcoco/utils_rec.py (75571cf) compute_accuracy(predicted, reference, 0.5)
    assert box_acc50(predicted, reference) == expected


def test_box_acc50_reads_a_box_as_the_iou_reward_does():
    # Not from lmms-eval: this project's box reader (scoring.first_box, the iou reward's) also reads
    # Qwen2-VL's (x1,y1),(x2,y2), which lmms-eval reads as no box (0.0), and puts corners in order, where
    # lmms-eval would compute with a negative width.
    assert box_acc50("<|box_start|>(10,20),(110,220)<|box_end|>", [10, 20, 110, 220]) == 1.0
    assert box_acc50([110, 220, 10, 20], "[10, 20, 110, 220]") == 1.0
    assert box_acc50([5, 5, 5, 5], [5, 5, 5, 5]) == 0.0  # no area: 0, not a division by zero
    with pytest.raises(ValueError):
        box_acc50([0, 0, 1, 1], "no box")
