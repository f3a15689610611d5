"""The metrics papers report, each as its benchmark's official scorer computes it: pure functions, standard
library only (the box reader is scoring.py's, itself standard library only).

- `vqa_accuracy`: VQAv2 soft accuracy, the VQA challenge server's vqaEval.py (Cloud-CV/VQA-Challenge).
- `anls`: DocVQA / InfographicVQA ANLS, the RRC scorer (as lmms-eval and VLMEvalKit also compute it).
- `relaxed_accuracy`: ChartQA, pix2struct's `relaxed_correctness`.
- `option_letter`, `option_accuracy`: MMBench / MMMU / ScienceQA multiple choice, VLMEvalKit's `can_infer`.
- `box_acc50`: RefCOCO Acc@0.5, IoU >= 0.5 as lmms-eval's refcoco task computes it.

Each function names the file and commit it ports. Where the port departs from the official code, or the
official code from its paper, a comment says so; docs/evaluation.md lists them. tests/test_paper_metrics.py
checks every function against values the official code itself gave on the same cases."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence

from vlm_recipes.scoring import box_iou, first_box

# ---------------------------------------------------------------------------------------------------------
# VQA accuracy: the VQA challenge server's scorer, Cloud-CV/VQA-Challenge (EvalAI's VQA Real Image Challenge)
# PythonEvaluationTools/vqaEvaluation/vqaEval.py at 35c770312739aa8037c004e2f710bd005e173e48 (the file last
# changed in 50c6b1e48366ee1d9002442d0b2ea3dda15fb6ed): contractions, manualMap, articles, its regular
# expressions, VQAEval.evaluate, processPunctuation, processDigitArticle. The tables are GT-Vision-Lab/VQA's
# (a013f00) as they are; the punctuation step is the server's own, a set of regular expressions.

_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's",
    "howd": "how'd", "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm",
    "Ive": "I've", "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll",
    "let's": "let's", "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've",
    "mightn'tve": "mightn't've", "mightve": "might've", "mustnt": "mustn't", "mustve": "must've",
    "neednt": "needn't", "notve": "not've", "oclock": "o'clock", "oughtnt": "oughtn't",
    "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at", "shant": "shan't",
    "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's", "shouldve": "should've",
    "shouldnt": "shouldn't", "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've",
    "somebody'd": "somebodyd", "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll", "somebodys": "somebody's", "someoned": "someone'd",
    "someoned've": "someone'd've", "someone'dve": "someone'd've", "someonell": "someone'll",
    "someones": "someone's", "somethingd": "something'd", "somethingd've": "something'd've",
    "something'dve": "something'd've", "somethingll": "something'll", "thats": "that's",
    "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've", "therere": "there're",
    "theres": "there's", "theyd": "they'd", "theyd've": "they'd've", "they'dve": "they'd've",
    "theyll": "they'll", "theyre": "they're", "theyve": "they've", "twas": "'twas", "wasnt": "wasn't",
    "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't", "whatll": "what'll",
    "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd",
    "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've", "who'dve": "who'd've",
    "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're",
    "whys": "why's", "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't",
    "wouldnt've": "wouldn't've", "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll",
    "y'allll": "y'all'll", "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've",
    "youd": "you'd", "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're",
    "youve": "you've",
}  # fmt: skip
# (The keys with capitals, "Im", "Ive", "Id've", are never matched: processDigitArticle lowercases first.)
_MANUAL_MAP = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}  # fmt: skip
_ARTICLES = ("a", "an", "the")
# The server's punctuation marks (; / [ ] " { } ( ) = + \ _ - > < @ ` , ? !), in its character classes.
_MARKS = r"\\;/\"`\[\](){}<>@=+_\-,?!"
_PUNCT_BEGIN = re.compile(rf"\A([ {_MARKS}]+)(?=[a-zA-Z0-9 ])")  # marks (and spaces) opening the answer
_PUNCT_END = re.compile(rf"(?<=[a-zA-Z0-9 ])([ {_MARKS}]+)\Z")  # and closing it
_PUNCT_BESIDE = re.compile(rf"(?<=[ {_MARKS}])([{_MARKS}])|([{_MARKS}])(?=[ {_MARKS}])")  # by a space or mark
_PUNCT_IN_WORD = re.compile(rf"(?<=[a-zA-Z])([{_MARKS}])(?=[a-zA-Z])")  # between two letters
_SPACES = re.compile(r"([ ]+)")
# re.ASCII: the server is Python 2, where these patterns' \d is 0-9 only (under Python 3 it is any script's
# digit: "1.\u0663" keeps its period there, loses it here and on the server).
_COMMA_STRIP = re.compile(r"(?<=\d)(\,)+(?=\d)", re.ASCII)  # "1,000" -> "1000"
# As written officially: "(?!<=\d)" is a lookahead for the text "<=" and a digit, not the lookbehind it looks
# like, so this removes every "." not followed by a digit ("3." loses its period, "3.5" keeps it).
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)", re.ASCII)
# The official call is `periodStrip.sub("", outText, re.UNICODE)`: re.UNICODE lands in `count`, so at most
# 32 (re.UNICODE's value) periods are removed. Kept.
_PERIOD_COUNT = int(re.UNICODE)


def _process_punctuation(text: str) -> str:
    """The server's processPunctuation: marks opening and closing the answer go, commas between digits go, a
    mark beside a space or another mark becomes a space, spaces are single, a mark between two letters
    becomes a space ("t-shirt" -> "t shirt"; the second pass, deleting, finds none left), periods go."""
    out = _PUNCT_END.sub("", _PUNCT_BEGIN.sub("", text))
    out = _SPACES.sub(" ", _PUNCT_BESIDE.sub(" ", _COMMA_STRIP.sub("", out)))
    out = _PUNCT_IN_WORD.sub("", _PUNCT_IN_WORD.sub(" ", out))
    return _PERIOD_STRIP.sub("", out, count=_PERIOD_COUNT)


def _process_digit_article(text: str) -> str:
    """processDigitArticle: lower case, number words zero-ten to digits ("none" to 0), articles dropped,
    contractions restored ("dont" to "don't"), single spaces."""
    # The official `manualMap.setdefault(word, word)` also adds each word to the map; a lookup is the same.
    words = [_MANUAL_MAP.get(word, word) for word in text.lower().split()]
    words = [word for word in words if word not in _ARTICLES]
    return " ".join(_CONTRACTIONS.get(word, word) for word in words)


def vqa_normalize(answer: str) -> str:
    """What the server does to a model's answer, always: newlines and tabs to spaces, stripped,
    processPunctuation, then processDigitArticle ("Yes." -> "yes", "The Two dogs" -> "2 dogs")."""
    cleaned = answer.replace("\n", " ").replace("\t", " ").strip()
    return _process_digit_article(_process_punctuation(cleaned))


def vqa_accuracy(prediction: str, references: Sequence[str] | Sequence[Mapping]) -> float:
    """VQAv2 accuracy of one answer, in [0, 1], as the VQA challenge server computes it for one question
    (Cloud-CV/VQA-Challenge, PythonEvaluationTools/vqaEvaluation/vqaEval.py at 35c7703, VQAEval.evaluate):
    the mean over the references of min(1, (matches among the *other* references) / 3).

    As the server:
    - the answer is always normalized (vqa_normalize): "Yes." against ten "yes" scores 1. GT-Vision-Lab/VQA's
      vqaEval.py (a013f00) normalizes it only where the references disagree, and scores that 0.
    - the references are compared as given where they all agree, and only punctuation-processed where they
      disagree (no lower case, no number words, no articles): VQAv2's answers are already in that form.
      So ten "t-shirt" match no answer ("t-shirt" becomes "t shirt"), and "none" (read as "0") matches no
      reference "none". lmms-eval (lmms_eval/tasks/vqav2/utils.py at 75571cf) normalizes the references
      too, with GT-Vision-Lab's punctuation step, and takes statistics.mean: it gives 1 on those two, and
      0.6 where this gives 0.5999999999999999 (tests/test_paper_metrics.py has both on 30 VQAv2 cases).
    - with fewer than 10 references the same formula runs on what there is: one reference always scores 0
      (no other reference is left to match), three identical ones give at most 2/3, 4 give 1. The evals
      choose it only for rows with ten answers (evaluation/benchmarks.py).

    `references`: strings, or VQAv2's own answer dicts ({"answer": ..., "answer_id": ...}; `references_of`).
    The server leaves one answer dict out by `!=`, which VQAv2's distinct answer_ids make one dict at a time;
    here the reference left out is the one at that position, the same thing for VQAv2's data. The server is
    Python 2 on JSON's unicode strings; this port's patterns match digits as there, 0-9 only."""
    answers = references_of(references)
    if not answers:
        raise ValueError("vqa_accuracy needs at least one reference answer (the official code divides by 0)")
    predicted = vqa_normalize(prediction)
    if len(set(answers)) > 1:
        answers = [_process_punctuation(answer) for answer in answers]
    accuracies = []
    for left_out in range(len(answers)):
        matches = sum(1 for i, answer in enumerate(answers) if i != left_out and answer == predicted)
        accuracies.append(min(1, float(matches) / 3))
    return float(sum(accuracies)) / len(accuracies)


def references_of(value) -> list[str]:
    """Reference answers as a list of strings, from a list of strings or of VQAv2-style answer dicts
    ({"answer": "2", "answer_confidence": "yes", "answer_id": 1}); a single string is one reference."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping) or not isinstance(value, Sequence):
        raise TypeError(
            f"references: a list of strings or of {{'answer': ...}} dicts, not {type(value).__name__}"
        )
    answers = []
    for item in value:
        if isinstance(item, str):
            answers.append(item)
        elif isinstance(item, Mapping) and isinstance(item.get("answer"), str):
            answers.append(item["answer"])
        else:
            raise TypeError(f"a reference answer is a string or an {{'answer': str}} dict, not {item!r}")
    return answers


# ---------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------
# Relaxed accuracy: google-research/pix2struct pix2struct/metrics.py at
# 945f27e936c9464d9d7c133f1bd1f4f383be9e99 (relaxed_correctness; ChartQA, Masry et al. 2022, section 5.1).


def _to_float(text: str) -> float | None:
    """relaxed_correctness's _to_float: a trailing "%" divides by 100 (on either side); Python's float()
    otherwise, so " 12", "1e3" and "1_000" are numbers and "1,000", "$5" and "10 minutes" are not."""
    try:
        if text.endswith("%"):
            return float(text.rstrip("%")) / 100.0
        return float(text)
    except ValueError:
        return None


def relaxed_accuracy(prediction: str, reference: str, max_relative_change: float = 0.05) -> float:
    """ChartQA relaxed accuracy of one answer, 1.0 or 0.0, as pix2struct's relaxed_correctness(target,
    prediction): where both parse as numbers and the reference is not zero, |prediction - reference| /
    |reference| <= 5%; otherwise the two strings equal after lowercasing (no stripping, no other
    normalization). "31%" is 0.31: it matches "0.31" and not "31".

    One departure: a reference of 0 and an answer that parses as 0 ("0.0", "-0", "0%") score 1, numbers
    equal as numbers. pix2struct (every commit to 945f27e), lmms-eval's chartqa (75571cf) and VLMEvalKit
    (e8e78f0) compare them as text there, to avoid dividing by 0, and score "0.0" against "0" wrong; the
    paper's rule ("within 5% of the gold answer", Masry et al. 2022, 5.1) scores it right.
    Qwen-VL's evaluate_vqa.py (and code copied from it) passes the model's answer as `target`, so its
    relative error is over the answer, not the reference: 95.1 against 100 passes here (4.9%) and fails
    there (5.15%)."""
    prediction_float = _to_float(prediction)
    target_float = _to_float(reference)
    if prediction_float is not None and target_float:
        relative_change = abs(prediction_float - target_float) / abs(target_float)
        return float(relative_change <= max_relative_change)
    if prediction_float is not None and target_float == 0:  # the departure: 0 within 5% of 0 is 0 alone
        return float(prediction_float == 0)
    return float(prediction.lower() == reference.lower())


# ---------------------------------------------------------------------------------------------------------
# Multiple choice: open-compass/VLMEvalKit vlmeval/utils/matching_util.py at
# e8e78f05f3080fe28154f2130321f17951c3be94 (can_infer_option, can_infer_text, can_infer; the file last
# changed in 2cf2a36c6e79b51faf676a7011b3a0f5b579814d).

_REFUSALS = (
    "Sorry, I can't help with images of people yet.",
    "I can't process this file.",
    "I'm sorry, but without the image provided",
    "Cannot determine the answer",
)
_API_FAILURE = "Failed to obtain answer via API"
_SEPARATORS = ".()[],:;!*#{}"
# Added in VLMEvalKit a67ace5 ("Match verbose Chain-of-Thought in eval"). It has no word boundary after the
# letter, so "the answer is clear" reads as C and "the answer is a cat" as A, when those are options. Kept.
_VERBOSE_ANSWER = re.compile(r"(?i)(?:correct\s+)?answer\s+is\s+\**([ABCD])\**")


def _can_infer_option(answer: str, choices: Mapping[str, str]) -> str | None:
    """can_infer_option: an option letter standing alone among the answer's last four words (after
    .()[],:;!*#{} become spaces), when exactly one letter does; "Z" for a refusal or a lone Z; then the
    "answer is X" pattern."""
    if _API_FAILURE in answer:
        return None
    if any(refusal in answer for refusal in _REFUSALS):
        return "Z"
    answer_mod = answer
    for c in _SEPARATORS:
        answer_mod = answer_mod.replace(c, " ")
    splits = [x.strip() for x in answer_mod.split()]
    count = sum(1 for c in choices if c in splits)
    if count == 1:
        # The official code first returns False (no letter) when "A" is a word of a 4+ word answer, a
        # quantifier more likely than an option, but only with the VERBOSE environment variable set (to
        # anything, "0" too); VLMEvalKit runs without it, and so does this port: "A cat" reads as A.
        for ch in choices:
            if ch in splits and splits.index(ch) > (len(splits) - 5):
                return ch
    elif count == 0 and "Z" in splits:  # official: count_choice(splits, {'Z', ''}) == 1
        return "Z"
    match = _VERBOSE_ANSWER.search(answer or "")
    if match and match.group(1).upper() in choices:
        return match.group(1).upper()
    return None


def _can_infer_text(answer: str, choices: Mapping[str, str]) -> str | None:
    """can_infer_text: the one option whose text (lowercased) is in the lowercased answer, a substring
    ("cat" is in "category"); none when several are, or when the answer is over twice the options' text."""
    answer = answer.lower()
    if len(answer) > 2 * sum(len(str(v)) for v in choices.values()):
        return None
    # The official code lowercases the caller's dict in place; this works on a copy.
    texts = {k: str(v).lower() for k, v in choices.items()}
    candidates = [k for k, text in texts.items() if text in answer]
    return candidates[0] if len(candidates) == 1 else None


def _lone_letter(answer: str, choices: Mapping[str, str]) -> str | None:
    """The departure: an answer that is one option letter and nothing else, in lower case ("b", "(b)", "b.")."""
    for c in _SEPARATORS:
        answer = answer.replace(c, " ")
    words = answer.split()
    letter = words[0].upper() if len(words) == 1 and len(words[0]) == 1 else None
    return letter if letter in choices else None


def option_letter(answer: str, options: Mapping[str, str]) -> str | None:
    """The option a multiple-choice answer picks, as VLMEvalKit's can_infer(answer, choices) reads it (its
    "exact matching" step, before any LLM judge): a letter ("B", "(B)", "The answer is (B).") first, else
    the one option whose text the answer contains. None where it cannot tell (VLMEvalKit's False: several
    letters or option texts, none, or a long answer); "Z" where the answer refuses ("Cannot determine the
    answer") or says Z, VLMEvalKit's "no option", which matches no option letter A-Y.

    One departure: where can_infer reads nothing, an answer that is a lone lowercase option letter ("b",
    "(b)", "b.") reads as that option. VLMEvalKit (e8e78f0) upper-cases no answer before can_infer (only its
    "answer is x" pattern's letter, a67ace5); a lowercase letter reads as an option only through its LLM judge,
    and without one scores Z, wrong. Answers of more words read as there: "a cat" is option text "cat"
    (B), not the letter A, and "A cat" is A.

    `options`: {"A": "dog", "B": "cat", ...}, the keys single capital letters (the official code asserts so,
    here a ValueError)."""
    if not all(isinstance(k, str) and len(k) == 1 and k in string.ascii_uppercase for k in options):
        raise ValueError(
            f"option keys are single capital letters (A, B, ...), not {sorted(map(str, options))}"
        )
    answer = str(answer)
    return (
        _can_infer_option(answer, options)
        or _can_infer_text(answer, options)
        or _lone_letter(answer, options)
    )


def option_accuracy(prediction: str, correct_letter: str, options: Mapping[str, str]) -> float:
    """1.0 where `option_letter` reads the prediction as the correct option, else 0.0 (VLMEvalKit scores an
    answer it cannot read as "Z", wrong, when no LLM judge is used). MMBench's circular evaluation (every
    rotation of the options right) is a later aggregation over rows, not this."""
    return float(option_letter(prediction, options) == correct_letter)


# ---------------------------------------------------------------------------------------------------------
# RefCOCO Acc@0.5: no scorer ships with the dataset; papers count IoU >= 0.5, as lmms-eval's refcoco task
# does (EvolvingLMMs-Lab/lmms-eval lmms_eval/tasks/refcoco/utils_rec.py at
# 75571cfe0fa36ca5ec2e6aa2bb268f9d38295af3: compute_iou, compute_accuracy(threshold=0.5)) and Qwen-VL's
# eval_mm/evaluate_grounding.py (`iou >= 0.5`).

Box = tuple[float, float, float, float]


def _box_of(value) -> Box | None:
    """A box from text (the iou reward's reader, scoring.first_box: the first [x1, y1, x2, y2] or
    (x1,y1),(x2,y2)) or from four numbers; its corners in order, as first_box puts them."""
    if isinstance(value, str):
        return first_box(value)
    if isinstance(value, Sequence) and len(value) == 4 and all(isinstance(v, int | float) for v in value):
        x1, y1, x2, y2 = (float(v) for v in value)
        return min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)
    raise TypeError(f"a box is text or [x1, y1, x2, y2], not {value!r}")


def box_acc50(predicted_box, reference_box) -> float:
    """RefCOCO Acc@0.5 of one answer: 1.0 where the IoU of the predicted and reference boxes ([x1, y1, x2,
    y2], the same coordinates; or text, read as the iou reward reads it) is >= 0.5, else 0.0. An answer with
    no box scores 0 (lmms-eval reads it as [0, 0, 0, 0], no overlap). Unlike lmms-eval, corners given in the
    wrong order are put in order (first_box's rule), and boxes with no area score 0 rather than dividing by
    zero. A reference with no box is an error."""
    reference = _box_of(reference_box)
    if reference is None:
        raise ValueError(f"the reference has no box: {reference_box!r}")
    predicted = _box_of(predicted_box)
    if predicted is None:
        return 0.0
    return float(box_iou(predicted, reference) >= 0.5)
