"""Bootstrap builds its SFT pairs in ``rollout.prompt_format``: the scratch tokenizer has no
chat template, so ``chat`` stops the stage before any training, with the field named."""

from __future__ import annotations

import pytest

from components.core.errors import UserError
from components.core.recipe import parse_recipe
from components.core.runner import make_context
from components.core.storage import Store


def test_chat_with_the_scratch_tokenizer_is_a_user_error(tmp_path, posttrain_home) -> None:
    from components.bootstrap import stage

    recipe = parse_recipe({"pipeline": "boot", "rollout": {"prompt_format": "chat"}})
    ctx = make_context("bootstrap", recipe, Store(str(tmp_path / "store")).uri, 0, None)
    with pytest.raises(UserError) as err:
        stage.run(ctx)
    assert (err.value.field, err.value.value) == ("rollout.prompt_format", "chat")
    assert "no chat template" in err.value.problem
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("*.safetensors"))
