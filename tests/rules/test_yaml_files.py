"""One YAML loader, one error mapper, one error class: a rule file, a runbook file and
the configuration file fail alike, each mistake one ``file:line: message``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from vllm_runbook.rules.errors import CatalogError
from vllm_runbook.rules.model import load_catalog as load_rules
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.model.spec import load_catalog as load_runbooks


@pytest.fixture(autouse=True)
def relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # every loader shows paths relative to the working directory


def rule_file(text: str) -> CatalogError:
    Path("rules").mkdir(exist_ok=True)
    Path("rules/x.yaml").write_text(text, encoding="utf-8")
    with pytest.raises(CatalogError) as info:
        load_rules(Path("rules"))
    return info.value


def runbook_file(text: str) -> CatalogError:
    Path("runbooks").mkdir(exist_ok=True)
    Path("runbooks/x.yaml").write_text(text, encoding="utf-8")
    with pytest.raises(CatalogError) as info:
        load_runbooks([Path("runbooks")])
    return info.value


def config_file(text: str) -> CatalogError:
    Path("x.yaml").write_text(text, encoding="utf-8")
    with pytest.raises(CatalogError) as info:
        load_config(Path("x.yaml"))
    return info.value


LOADERS: dict[str, tuple[Callable[[str], CatalogError], str, str]] = {
    "rule catalog": (rule_file, "rules/x.yaml", "rule catalog"),
    "runbook catalog": (runbook_file, "runbooks/x.yaml", "runbook catalog"),
    "configuration": (config_file, "x.yaml", "configuration"),
}

MISTAKES = [
    ("rules: []\nrules: []\n", "2: duplicate key 'rules'"),
    ("base: &b {x: 1}\nother:\n  <<: *b\n", "3: YAML merge keys (<<) are not supported"),
    ("? [a, b]\n: 1\n", "1: a mapping key must be a string or a number, not a sequence"),
    ("? {a: b}\n: 1\n", "1: a mapping key must be a string or a number, not a mapping"),
    ("~: 1\n", "1: mapping key '~' must be a string or a number"),
    ("a: [\n", "2: invalid YAML: expected the node content, but found '<stream end>'"),
]


@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize(("text", "message"), MISTAKES)
def test_the_same_yaml_mistake_reads_the_same_in_every_file(
    kind: str, text: str, message: str
) -> None:
    load, shown, what = LOADERS[kind]
    error = load(text)
    assert (type(error), error.what) == (CatalogError, what)
    assert [str(p) for p in error.problems] == [f"{shown}:{message}"]


def test_a_list_of_the_wrong_shape_names_its_own_items_keys() -> None:
    # The item keys come from the model at that place (the receivers' own, not the engines').
    error = config_file("notifications:\n  receivers: {name: ops}\nengines: 3\n")
    assert [str(p) for p in error.problems] == [
        "x.yaml:2: notifications.receivers must be a list of {name, type, url, token_file}",
        "x.yaml:3: engines must be a list of {name, agent, vllm, labels, router}",
    ]
    error = config_file("notifications:\n  receivers:\n    - 7\n")
    assert [str(p) for p in error.problems] == [
        "x.yaml:3: notifications.receivers[0] must be a mapping with name, type and url"
    ]


def test_an_item_of_a_block_list_is_named_at_its_own_line() -> None:
    text = (
        "name: x\ndescription: d\ntriggers:\n  - VllmOOMPressure\n  - [nested]\n"
        "steps:\n  - action: advise\n    params: {text: t}\n"
    )
    error = runbook_file(text)
    assert [str(p) for p in error.problems] == [
        "runbooks/x.yaml:5: runbook x: triggers[1]: Input should be a valid string"
    ]
