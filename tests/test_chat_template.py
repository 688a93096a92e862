"""Chat templates from the server and from requests, as vLLM takes them: `--chat-template` (a file
or inline) gives a model without a template a chat API, for both doors; `chat_template_kwargs`
reach the template as variables; a request's own `chat_template` is refused unless the server
was started with `--trust-request-chat-template`. Offline, `LLM.chat` takes both arguments. The
module's server also answers to names of its own (`--served-model-name`), as a vLLM server does."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request

import openai
import pytest
import ray

import pagedserve
from coordinator.chat_template import load_chat_template
from coordinator.input_processor import PromptError
from coordinator.server_options import ServerOptions
from pagedserve import LLM, SamplingParams, cli
from pagedserve.config import EngineConfig
from tests.serving import running_coordinator

# Plain text around each message, so the expected prompt is easy to write out by hand; `persona`
# is a variable only chat_template_kwargs can set.
# (the effort spelled out letter by letter: "low" and "high" are one token each, "l o w" and "h i g h" are not)
TEMPLATE = ("{% if reasoning_effort is defined %}[effort: {{ reasoning_effort | list | join(' ') }}]\n{% endif %}"
            "{% if persona is defined %}[persona: {{ persona }}]\n{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
OTHER = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}REPLY:"
HI = [{"role": "user", "content": "Hi there"}]
SERVED = ["house-model", "house-model-v2"]
GREEDY = dict(temperature=0, max_tokens=4, extra_body={"ignore_eos": True})


def expected_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory, tiny_llama) -> str:
    """tiny_llama's weights and tokenizer without its chat template."""
    path = tmp_path_factory.mktemp("no_template") / "model"
    shutil.copytree(tiny_llama, path)
    (path / "chat_template.jinja").unlink()
    return str(path)


def test_the_flag_takes_a_file_or_an_inline_template(tmp_path):
    file = tmp_path / "chat.jinja"
    file.write_text(TEMPLATE)
    assert load_chat_template(str(file)) == TEMPLATE
    assert load_chat_template(OTHER) == OTHER
    with pytest.raises(ValueError, match=r"chat_template: '/no/such.jinja' is neither a file nor a Jinja template"):
        load_chat_template("/no/such.jinja")
    file.write_text("{% for m in messages %}{{ m }}")  # the loop never ends
    with pytest.raises(ValueError, match=r"chat_template \(the file .*chat.jinja'\) is not a valid Jinja template"):
        load_chat_template(str(file))
    with pytest.raises(ValueError, match="chat_template is not a valid Jinja template"):
        ServerOptions(chat_template="{% if %}")


def test_serve_refuses_a_missing_template_before_ray_starts(capsys):
    assert cli.main(["serve", "--chat-template", "/no/such.jinja"]) == 2
    assert "chat_template: '/no/such.jinja' is neither a file nor a Jinja template" in capsys.readouterr().err


def test_llm_chat_takes_a_template_and_its_variables(no_template_model, bundled_tokenizer):
    llm = LLM(model=no_template_model, kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match="this model has no chat template"):
        llm.chat(HI, params, use_tqdm=False)
    (out,) = llm.chat(HI, params, use_tqdm=False, chat_template=TEMPLATE, chat_template_kwargs={"persona": "pirate"})
    assert out.prompt_token_ids == expected_ids(bundled_tokenizer, "[persona: pirate]\n<user> Hi there\n<assistant>")
    (plain,) = llm.generate([{"prompt_token_ids": out.prompt_token_ids}], params, use_tqdm=False)
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids
    (cont,) = llm.chat(HI, params, use_tqdm=False, chat_template=TEMPLATE, add_generation_prompt=False)
    assert cont.prompt_token_ids == expected_ids(bundled_tokenizer, "<user> Hi there\n")
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tokenize"):
        llm.chat(HI, params, use_tqdm=False, chat_template=TEMPLATE, chat_template_kwargs={"tokenize": False})
    # a template's own refusal names the field, and keeps its reason apart for a door that names it otherwise
    with pytest.raises(PromptError, match="^messages: the chat template refused them: roles must alternate") as info:
        llm.chat(HI, params, use_tqdm=False, chat_template="{{ raise_exception('roles must alternate') }}")
    assert info.value.by_template and info.value.detail == "roles must alternate"
    assert not llm.engine.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0


@pytest.fixture(scope="module")
def server(ray_session, no_template_model):
    """A server whose model has no template of its own, given one by the operator."""
    config = EngineConfig(model=no_template_model, kv_cache_memory=1 << 22, distributed_executor_backend="uni")
    with running_coordinator(config, chat_template=TEMPLATE, served_model_name=SERVED) as (actor, target):
        port = ray.get(actor.status.remote())["http_port"]
        yield actor, target, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)


def _tokenize(client: openai.OpenAI, **body) -> dict:
    """POST /tokenize (beside /v1) with `body`."""
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/tokenize"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def assert_renders(client: openai.OpenAI, prompt: list[int], **fields) -> None:
    """A chat with the template `fields` was asked exactly `prompt`, and /tokenize agrees."""
    chat = client.chat.completions.create(model="", messages=HI, temperature=0, max_tokens=2,
                                          extra_body={"ignore_eos": True, **fields})
    assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == 2
    assert _tokenize(client, messages=HI, **fields)["tokens"] == prompt


def _idle(actor) -> dict:
    """The server's stats once nothing runs (a finished request's blocks free after its step)."""
    deadline = time.monotonic() + 10
    while True:
        stats = ray.get(actor.stats.remote(), timeout=30)
        if stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0 or time.monotonic() > deadline:
            return stats


def test_the_server_template_serves_both_doors(server, bundled_tokenizer):
    actor, target, client = server
    prompt = expected_ids(bundled_tokenizer, "<user> Hi there\n<assistant>")
    chat = client.chat.completions.create(model="", messages=HI, **GREEDY)
    assert chat.usage.prompt_tokens == len(prompt)
    plain = client.completions.create(model="", prompt=prompt, **GREEDY)
    assert chat.choices[0].message.content == plain.choices[0].text  # the reply to exactly that prompt
    assert _tokenize(client, messages=HI)["tokens"] == prompt
    with pagedserve.Client(target, timeout=60) as grpc_client:  # gRPC's chat renders with it too
        reply = grpc_client.generate(HI, max_tokens=4, temperature=0, ignore_eos=True)
    assert reply.usage["prompt_tokens"] == len(prompt) and reply.text == plain.choices[0].text


def test_template_kwargs_reach_the_template_and_bad_ones_are_refused(server, bundled_tokenizer):
    actor, _, client = server
    prompt = expected_ids(bundled_tokenizer, "[persona: a careful librarian]\n<user> Hi there\n<assistant>")
    assert_renders(client, prompt, chat_template_kwargs={"persona": "a careful librarian"})
    refusals = [({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
                 "chat_template_kwargs may not set add_generation_prompt"),
                ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs", "must map variable names"),
                ({"chat_template": OTHER}, "chat_template", "--trust-request-chat-template")]
    for extra, param, message in refusals:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="", messages=HI, max_tokens=2, extra_body=extra)
        assert err.value.body["param"] == param and message in err.value.body["message"], err.value.body
    stats = _idle(actor)
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_reasoning_effort_reaches_the_template(server, bundled_tokenizer):
    """OpenAI's reasoning_effort is the template's `reasoning_effort` variable, as the Responses
    API's reasoning.effort is; a value the request's chat_template_kwargs set wins."""
    _, _, client = server

    def prompt_tokens(**fields) -> int:
        return client.chat.completions.create(model="", messages=HI, **GREEDY, **fields).usage.prompt_tokens

    low = expected_ids(bundled_tokenizer, "[effort: l o w]\n<user> Hi there\n<assistant>")
    high = expected_ids(bundled_tokenizer, "[effort: h i g h]\n<user> Hi there\n<assistant>")
    assert len(low) != len(high)
    assert prompt_tokens(reasoning_effort="low") == len(low)
    both = dict(GREEDY["extra_body"], chat_template_kwargs={"reasoning_effort": "high"})
    reply = client.chat.completions.create(model="", messages=HI, temperature=0, max_tokens=4,
                                           reasoning_effort="low", extra_body=both)
    assert reply.usage.prompt_tokens == len(high)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=HI, max_tokens=2, extra_body={"reasoning_effort": "extreme"})
    assert err.value.body["param"] == "reasoning_effort", err.value.body


def test_grpc_chat_takes_the_template_options(server, bundled_tokenizer):
    """The gRPC door's chat prompt takes what the HTTP chat takes: template variables, no
    generation prompt, a continued last message; bad ones are INVALID_ARGUMENT naming the field."""
    _, target, _ = server
    with pagedserve.Client(target, timeout=60) as grpc_client:
        def prompt_tokens(messages=HI, **options):
            return grpc_client.generate(messages, max_tokens=1, temperature=0, **options).usage["prompt_tokens"]

        persona = expected_ids(bundled_tokenizer, "[persona: a careful librarian]\n<user> Hi there\n<assistant>")
        assert prompt_tokens(chat_template_kwargs={"persona": "a careful librarian"}) == len(persona)
        assert prompt_tokens(add_generation_prompt=False) == len(expected_ids(bundled_tokenizer, "<user> Hi there\n"))
        for options, message in [({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs may not set"),
                                 ({"chat_template": OTHER}, "chat_template: this server does not take"),
                                 ({"continue_final_message": True}, "continue_final_message and add_generation")]:
            with pytest.raises(pagedserve.client.ServingError) as err:
                prompt_tokens(**options)
            assert err.value.code.name == "INVALID_ARGUMENT" and message in err.value.details, err.value.details
        with pytest.raises(ValueError, match="chat_template_kwargs applies to a chat prompt"):
            grpc_client.generate("plain", chat_template_kwargs={"persona": "x"})


def test_a_trusting_server_takes_a_request_template(ray_session, tiny_llama, bundled_tokenizer):
    config = EngineConfig(model=tiny_llama, kv_cache_memory=1 << 22, distributed_executor_backend="uni")
    with running_coordinator(config, trust_request_chat_template=True) as (actor, _):
        port = ray.get(actor.status.remote())["http_port"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        own = bundled_tokenizer.apply_chat_template(HI, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert _tokenize(client, messages=HI)["tokens"] == list(own)  # the model's template by default
        assert_renders(client, expected_ids(bundled_tokenizer, "USER: Hi there\nREPLY:"), chat_template=OTHER)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="", messages=HI, max_tokens=2,
                                           extra_body={"chat_template": "{% for m in messages %}"})
        assert err.value.body["param"] == "chat_template" and "not a valid Jinja" in err.value.body["message"]
        stats = _idle(actor)
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_the_server_answers_to_its_served_names_only(server, no_template_model):
    _, _, client = server
    models = client.models.list().data
    assert [m.id for m in models] == SERVED and all(m.root == no_template_model for m in models)
    reply = client.completions.create(model=SERVED[1], prompt="Hello", max_tokens=2)
    assert reply.model == SERVED[0]  # responses carry the first name, as vLLM's do
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model=no_template_model, prompt="Hello", max_tokens=2)
    assert err.value.body["param"] == "model" and "'house-model' or 'house-model-v2'" in err.value.body["message"]
    # Metrics are labelled with the name clients use, as vLLM's model_name label is (dashboards filter on it).
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
    with urllib.request.urlopen(url, timeout=60) as resp:
        metrics = resp.read().decode()
    assert f'vllm:num_requests_running{{model_name="{SERVED[0]}"' in metrics
    assert no_template_model not in metrics
    with pytest.raises(ValueError, match="served_model_name must be a list of one or more non-empty names"):
        ServerOptions(served_model_name=[""])
