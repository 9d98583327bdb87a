"""tools.quality.choice_task: the lm-evaluation-harness task built from a local text."""

import json

import yaml

from tools.quality.__main__ import DEFAULT_TEXT
from tools.quality.choice_task import CHOICES, items, main, sentences


def test_sentences_split_at_ends_before_capitals():
    assert sentences("One two. Three four!  'Five,' she said? six. 'Go on!' Seven") == [
        "One two.",
        "Three four!",
        "'Five,' she said? six.",
        "'Go on!'",  # the closing quote stays with its sentence
        "Seven",
    ]


def test_each_item_holds_the_sentence_that_follows_its_context():
    text = DEFAULT_TEXT.read_text(encoding="utf-8")
    flat = " ".join(text.split())
    made = items(text, 50, 2, seed=3)
    assert len(made) == 50 and made == items(text, 50, 2, seed=3)
    golds = {item["gold"] for item in made}
    assert golds <= set(range(CHOICES)) and len(golds) > 1  # the answer's place varies
    for item in made:
        assert len(item["choices"]) == len(set(item["choices"])) == CHOICES
        truth = item["choices"][item["gold"]]
        assert f"{item['context']} {truth}" in flat  # the true sentence follows its context
        assert all(f"{item['context']} {c}" not in flat for c in item["choices"] if c != truth)


def test_too_many_items_is_refused():
    try:
        items("Only one sentence here, and it is long enough.", 1, 1, seed=0)
    except ValueError as exc:
        assert "usable sentences" in str(exc)
    else:
        raise AssertionError("a text without enough sentences made a task")


def test_main_writes_a_task_lm_eval_reads(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--items", "12", "--name", "alice"]) == 0
    task = yaml.safe_load((tmp_path / "alice.yaml").read_text())
    assert task["task"] == "alice" and task["output_type"] == "multiple_choice"
    data = task["dataset_kwargs"]["data_files"]["test"]
    lines = [json.loads(line) for line in open(data, encoding="utf-8")]
    assert len(lines) == 12 and {"context", "choices", "gold"} <= set(lines[0])
    assert "--tasks alice" in capsys.readouterr().out
