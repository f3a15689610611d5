"""VQA accuracy (VQAv2, TextVQA, VizWiz, OK-VQA): the official scorer's port and the metric, scoring the
rows with ten annotators' `answers`. Standard library only. tests/test_paper_metrics.py checks the port
against values the official code itself gave on the same cases."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from vlm_recipes.benchmark_metrics.metric import BenchmarkMetric, Targets, references_of
from vlm_recipes.scoring import exact_match

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
      choose it only for rows with ten answers (VQA_ACCURACY below).

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


# A row whose `answers` are this many or more is VQAv2's shape, ten annotators' answers, the one VQA accuracy
# is made for (a match needs 3 of the other 9): VQAv2, TextVQA, VizWiz, OK-VQA (5 answers, each twice) and
# A-OKVQA ship exactly 10. Fewer are accepted answers (DocVQA, InfographicVQA: 1-3), where VQA accuracy gives
# a perfect answer 0 (1 answer) or 2/3 at most (3 the same), so exact match takes the best over them.
VQA_ANSWERS = 10


def _few_answers_advice(targets: Sequence[Targets]) -> str:
    """Asked for on rows with a few accepted answers: what scores them instead."""
    if any(t.references for t in targets):
        return (
            "(its rows' few accepted answers: exact match scores the best over them; add anls for partial "
            "credit) "
        )
    return ""


VQA_ACCURACY = BenchmarkMetric(
    name="vqa_accuracy",
    heading="VQA acc",
    needs="ten annotators' answers (`answers`, VQAv2's shape)",
    scores_row=lambda targets: len(targets.references) >= VQA_ANSWERS,
    score=lambda answer, targets, _box: vqa_accuracy(answer, targets.answers),
    by_default=True,  # ten answers are VQAv2's shape: no other benchmark ships them
    mark="D",
    advice=_few_answers_advice,
)


def accepted_answers(targets: Targets) -> tuple[str, ...]:
    """The answers exact match accepts: the row's answer, and each of a few accepted `answers` (fewer than
    VQA_ANSWERS, DocVQA's). Ten annotators' answers are not each accepted: VQA accuracy gives one annotator's
    answer 1/3, so exact match stays against the row's answer there."""
    few = 0 < len(targets.references) < VQA_ANSWERS
    return (targets.reference, *targets.references) if few else (targets.reference,)


def exact_match_score(answer: str, targets: Targets | None, reference: str) -> float:
    """Exact match (scoring.exact_match) of `answer`: the best over the row's accepted answers, or against
    `reference` for a row without targets."""
    candidates = accepted_answers(targets) if targets is not None else (reference,)
    return max(exact_match(answer, candidate) for candidate in candidates)
