"""Recipe mistakes the review found worded wrongly or accepted silently: YAML 1.1 number
forms, a scratch model too big to build, an interpreter the sandbox cannot show, and
fixes that lowered a pattern's case or pointed at a file without the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core.errors import UserError
from components.core.recipe import MAX_SCRATCH_PARAMETERS, ModelConfig, load_recipe, sandbox_python_problem


def _error(tmp_path: Path, text: str) -> UserError:
    path = tmp_path / "r.yaml"
    path.write_text("pipeline: demo\n" + text)
    with pytest.raises(UserError) as info:
        load_recipe(path)
    assert "\n" not in info.value.line()
    return info.value


# (recipe lines after "pipeline: demo", field after the path, value, problem, fix)
NUMBER_FORMS = [
    ("rollout: {shards: 010}\n", "rollout.shards", "010", "reads as octal 8 in YAML 1.1 (line 2)",
     "write 8, or 10 if you meant it as a decimal number"),
    ("seed: 0x10\n", "seed", "0x10", "reads as hexadecimal 16 in YAML 1.1 (line 2)", "write it in decimal: 16"),
    ("seed: 0b11\n", "seed", "0b11", "reads as binary 3 in YAML 1.1 (line 2)", "write it in decimal: 3"),
    ("timeouts:\n  trainer: 1:00:00\n", "timeouts.trainer", "1:00:00", "reads as base 60 (3600) in YAML 1.1 (line 3)",
     "write 3600 if you mean that number, or quote it if it is text"),
    ("trainer: {learning_rate: 1:30.5}\n", "trainer.learning_rate", "1:30.5", "reads as base 60 (90.5) in YAML 1.1 (line 2)",
     "write 90.5 if you mean that number, or quote it if it is text"),
    ("seed: 0o10\n", "seed", "0o10", "is text in YAML 1.1, not the octal number 8 (line 2)",
     "write it in decimal: 8 (or quote it if it is text)"),
    ("seed: 08\n", "seed", "08", "is text in YAML 1.1 (a number with a leading zero that is not octal) (line 2)",
     "write 8 (or quote it if it is text)"),
    ("seed: 07\n", "seed", "07", "reads as octal 7 in YAML 1.1 (line 2)", "write 7 without the leading zero"),
    ("taskgen:\n  curriculum:\n  - {until: 010, weights: {arithmetic: 1}}\n", "taskgen.curriculum[0].until", "010",
     "reads as octal 8 in YAML 1.1 (line 4)", "write 8, or 10 if you meant it as a decimal number"),
    ("timeouts: {010: 5}\n", "timeouts.010", "010", "reads as octal 8 in YAML 1.1 (line 2)",
     "write 8, or 10 if you meant it as a decimal number"),
]


@pytest.mark.parametrize(("text", "field", "value", "problem", "fix"), NUMBER_FORMS,
                         ids=[case[1] + ":" + case[2] for case in NUMBER_FORMS])
def test_yaml_1_1_number_forms_are_refused_naming_key_and_line(tmp_path, text, field, value, problem, fix):
    """Before, 010 was 8, 0x10 16 and 1:00:00 3600 without a word, and 0o10 (unquoted) was
    "not text (write it without quotes)"."""
    err = _error(tmp_path, text)
    assert (err.field, err.value, err.problem, err.fix) == (f"{tmp_path / 'r.yaml'}: {field}", value, problem, fix)


@pytest.mark.parametrize("text", ["seed: 0\n", "seed: 1_000\n", "trainer: {learning_rate: 0.5}\n",
                                  "taskgen: {oversample: 01.5}\n", "seed: -0\n"])
def test_plain_numbers_still_load(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text("pipeline: demo\n" + text)
    load_recipe(path)


def test_a_quoted_number_is_text_as_before(tmp_path):
    err = _error(tmp_path, 'seed: "010"\n')
    assert (err.value, err.problem) == ("010", "input should be a valid integer, not text (write it without quotes)")


def test_a_5000_digit_integer_names_its_key_and_line(tmp_path):
    """It was "--recipe=...: a value YAML cannot convert (ValueError)", no key, no line."""
    err = _error(tmp_path, "rollout:\n  shards: " + "7" * 5000 + "\n")
    assert err.field == f"{tmp_path / 'r.yaml'}: rollout.shards"
    assert err.problem == "is a whole number of 5,000 digits (line 3)"
    assert err.fix == "write a number of at most 19 digits (the largest a recipe takes is seed's 2**63 - 1)"


def test_a_scratch_model_too_big_to_build_is_refused_at_load(tmp_path):
    """Each size was within its bound, together 17 billion parameters: a traceback in
    bootstrap, retried by Airflow, or the machine out of memory."""
    err = _error(tmp_path, "model: {hidden_size: 65536, num_layers: 1, num_heads: 1, intermediate_size: 8}\n")
    assert err.field == f"{tmp_path / 'r.yaml'}: model"
    assert err.value == "hidden_size: 65536, num_layers: 1, intermediate_size: 8"
    assert err.problem == ("builds a model of 17,188,257,792 parameters (69 GB of float32 weights, about 4 times that "
                           "to train), more than the 2,000,000,000 a scratch model may have")
    assert err.fix.startswith("make model.hidden_size, model.num_layers or model.intermediate_size smaller")


def test_the_cap_leaves_room_for_a_real_scratch_model(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("pipeline: demo\nmodel: {hidden_size: 2048, num_layers: 24, num_heads: 16, intermediate_size: 8192}\n")
    assert load_recipe(path).model.scratch_parameters() == 1_610_919_936 < MAX_SCRATCH_PARAMETERS


def test_a_pretrained_source_is_not_sized_by_the_scratch_fields(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("pipeline: demo\nmodel: {source: /models/x, hidden_size: 65536, num_heads: 1}\n")
    assert load_recipe(path).model.hidden_size == 65536


def test_every_shipped_recipe_is_far_below_the_cap():
    from tests.fixtures.runs import REPO

    paths = sorted((REPO / "recipes").glob("*.yaml"))
    assert len(paths) == 5
    for path in paths:
        model = load_recipe(path).model
        assert model.source != "scratch" or model.scratch_parameters() < MAX_SCRATCH_PARAMETERS / 1000, path
    assert ModelConfig().scratch_parameters() == 3_436_032


@pytest.mark.parametrize(("python", "problem"), [
    ("/no/such", "is outside /usr, the only host folder the bwrap sandbox shows, so no job could start it"),
    ("/usr/../opt/python3", "is outside /usr, the only host folder the bwrap sandbox shows, so no job could start it"),
    ("python3", "is not an absolute path"),
])
def test_sandbox_python_outside_usr_is_refused_at_load(tmp_path, python, problem):
    """It was refused only when the sandbox stage started, after bootstrap, and blamed the
    host (sandbox.allow_weak_isolation)."""
    err = _error(tmp_path, f"sandbox: {{python: {python!r}}}\n")
    assert (err.field, err.value, err.problem) == (f"{tmp_path / 'r.yaml'}: sandbox.python", python, problem)
    assert err.fix == ("name a Python 3 interpreter under /usr (e.g. /usr/bin/python3.11), or leave sandbox.python "
                       "empty to use /usr/bin/python3")


def test_sandbox_python_rule_by_backend(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("pipeline: demo\nsandbox: {backend: subprocess, python: /opt/py/bin/python3}\n")
    assert load_recipe(path).sandbox.python == "/opt/py/bin/python3"  # the subprocess backend mounts nothing
    assert sandbox_python_problem("/usr/bin/nope") is None  # existence is the run's check, where the jobs run


def test_a_pattern_keeps_its_case_and_memory_gets_a_worded_fix(tmp_path):
    """The fix was '... (string should match pattern '^[0-9]+(ki|mi|gi|ti)?$')': a pattern
    64gi does not match either."""
    err = _error(tmp_path, "resources: {trainer: {memory: 64GB}}\n")
    assert err.problem == "String should match pattern '^[0-9]+(Ki|Mi|Gi|Ti)?$'"
    assert err.fix == ("set 'resources.trainer.memory' to a Kubernetes memory quantity: a whole number with an optional "
                       "Ki, Mi, Gi or Ti suffix, e.g. 16Gi (not 16GB or 16gi)")


SCRATCH_FIX = ("set 'resources.trainer.scratch' to a Kubernetes storage quantity: a whole number from 1 to 999999 "
               "with a Ki, Mi, Gi or Ti suffix, e.g. 50Gi (not 50GB or lots)")


@pytest.mark.parametrize(("text", "value"), [("lots", "lots"), ("50GB", "50GB"), ("50gi", "50gi"), ("0Gi", "0Gi"),
                                             ("1000000Ti", "1000000Ti"), ("'50'", "50"), ("50", 50)])
def test_a_bad_scratch_is_one_line_naming_the_field_the_value_and_the_fix(tmp_path, text, value):
    """``resources.<stage>.scratch``, the stage's local disk (its /tmp and home on a read-only
    root, its ephemeral-storage), is checked as memory is, with a worded fix, not a regular
    expression; a bare number (bytes, or YAML's integer) or one past int64 bytes is refused too."""
    err = _error(tmp_path, f"resources: {{trainer: {{scratch: {text}}}}}\n")
    assert (err.field, err.value, err.fix) == (f"{tmp_path / 'r.yaml'}: resources.trainer.scratch", value, SCRATCH_FIX)
    assert err.line() == (f"{tmp_path / 'r.yaml'}: resources.trainer.scratch={value!r}: {err.problem}; fix: {SCRATCH_FIX}")


def test_a_good_scratch_overrides_the_registrys(tmp_path):
    from components.core.stages import resources, spec

    path = tmp_path / "r.yaml"
    path.write_text("pipeline: demo\nresources: {trainer: {scratch: 100Gi}, taskgen: {cpu: '1'}}\n")
    recipe = load_recipe(path)
    assert resources("trainer", recipe).scratch == "100Gi"
    assert resources("taskgen", recipe).scratch == spec("taskgen").scratch == "4Gi"  # unset: the registry's
    assert resources("trainer").scratch == "50Gi"


def test_a_generic_fix_lowers_only_its_first_letter(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("pipeline: Demo\n")
    with pytest.raises(UserError) as info:
        load_recipe(path)
    assert info.value.fix == "set 'pipeline' to a valid value (string should match pattern '^[a-z][a-z0-9-]{0,62}$')"


@pytest.mark.parametrize(("text", "field", "fix"), [
    ("rollout: {gruop_size: 4}\n", "rollout.gruop_size", "remove 'rollout.gruop_size' or correct its spelling to 'rollout.group_size'"),
    ("modle: {hidden_size: 64}\n", "modle", "remove 'modle' or correct its spelling to 'model'"),
    ("resources: {trainer: {gpu: 1}}\n", "resources.trainer.gpu",
     "remove 'resources.trainer.gpu' or correct its spelling to 'resources.trainer.gpus'"),
    ("taskgen: {curriculum: [{until: 2, weights: {arithmetic: 1}, wieghts: 1}]}\n", "taskgen.curriculum[0].wieghts",
     "remove 'taskgen.curriculum[0].wieghts' or correct its spelling to 'taskgen.curriculum[0].weights'"),
    ("trainer: {lora: {zzz: 1}}\n", "trainer.lora.zzz",
     "remove 'trainer.lora.zzz' or correct its spelling to one of the keys of trainer.lora: rank, alpha, dropout, target_modules"),
])
def test_an_unknown_key_names_the_key_it_is_closest_to(tmp_path, text, field, fix):
    """The fix said "see recipes/demo.yaml for the known keys", which holds few of them."""
    err = _error(tmp_path, text)
    assert (err.field, err.problem, err.fix) == (f"{tmp_path / 'r.yaml'}: {field}", "Extra inputs are not permitted", fix)


def test_heads_that_do_not_divide_are_named_as_model_num_heads(tmp_path):
    """It was model='{...}' (the model validator's whole section)."""
    err = _error(tmp_path, "model: {hidden_size: 100, num_heads: 3}\n")
    assert (err.field, err.value, err.problem) == (f"{tmp_path / 'r.yaml'}: model.num_heads", 3,
                                                   "hidden_size 100 is not divisible by num_heads 3")
    assert err.fix.startswith("set 'model.num_heads' to a divisor of model.hidden_size")


def test_a_missing_pipeline_shows_no_mapping(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("seed: 1\ndomains: [arithmetic]\n")
    with pytest.raises(UserError) as info:
        load_recipe(path)
    assert info.value.line() == f"{path}: pipeline=None: Field required; fix: add 'pipeline' to the recipe"
