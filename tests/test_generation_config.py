"""The model's generation config (vLLM's --generation-config, --override-generation-config): its
sampling settings are the defaults of every request that leaves them unset (offline, OpenAI HTTP,
gRPC), a request's own values win, beam search takes none of them, and its EOS ids end a reply.
Bad settings are refused naming the field."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import openai
import pytest
import ray

from coordinator.generation_defaults import load_generation_defaults
from coordinator.grpc_server import sampling_from_proto
from coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest
from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.v1 import serving_pb2
from tests.serving import running_coordinator

RECOMMENDED = {"temperature": 0.0, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0, "max_new_tokens": 5,
               "do_sample": True, "eos_token_id": [2, 7]}
PROMPT = [{"prompt_token_ids": [5, 9, 14, 3, 11]}]


def _model_with(tiny_llama: str, path, generation_config: dict) -> str:
    """A copy of the tiny model whose generation_config.json is `generation_config`."""
    folder = shutil.copytree(tiny_llama, path / "model")
    (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return str(folder)


def test_the_file_gives_its_non_default_sampling_settings_and_eos_ids(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    auto = load_generation_defaults("auto", None, str(tmp_path))
    # top_k 50 and repetition_penalty 1.0 are transformers' own defaults, written into every file
    assert auto.sampling == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5} and auto.max_tokens == 5
    assert auto.eos_token_ids == {2, 7}
    vllm = load_generation_defaults("vllm", None, str(tmp_path))
    assert vllm.sampling == {} and vllm.eos_token_ids == {2, 7}
    elsewhere = load_generation_defaults(str(tmp_path), {"top_p": 0.5}, "/nonexistent")
    assert elsewhere.sampling == {"temperature": 0.0, "top_p": 0.5, "max_tokens": 5}
    assert load_generation_defaults("auto", None, str(tmp_path), is_gguf=True).sampling == {}
    assert load_generation_defaults("auto", {"temperature": 0.7}, str(tmp_path / "none")).sampling == \
        {"temperature": 0.7}


def test_bad_settings_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="^generation_config .* holds no generation_config.json"):
        load_generation_defaults(str(tmp_path), None, str(tmp_path))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="^generation_config: .* cannot be read as JSON"):
        load_generation_defaults("auto", None, str(tmp_path))
    for override, message in (({"do_sample": True}, "override_generation_config.do_sample is not"),
                              ({"temperature": "hot"}, "override_generation_config.temperature must be a number"),
                              ({"top_p": 0}, "override_generation_config: .* top_p must be in"),
                              ({"top_k": 2.5}, "override_generation_config: .* top_k must be an integer"),
                              ({"max_new_tokens": 0}, "override_generation_config: .* max_tokens must be")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(override_generation_config=override)  # refused before anything starts
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -0.5}))
    with pytest.raises(ValueError, match="^generation_config: .* temperature must be >= 0"):
        load_generation_defaults("auto", None, str(tmp_path))


def test_requests_take_the_defaults_for_what_they_leave_unset(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20,
                                                                 "repetition_penalty": 1.1, "max_new_tokens": 9}))
    defaults = load_generation_defaults("auto", None, str(tmp_path))
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = chat.sampling_params(None, defaults)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.max_tokens) == (0.6, 20, 1.1, 9)
    own = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.0, max_tokens=3)
    assert (own.sampling_params(None, defaults).temperature, own.sampling_params(None, defaults).max_tokens) == (0, 3)
    completion = CompletionRequest(prompt="hi", top_k=5).sampling_params(defaults)
    assert (completion.top_k, completion.temperature, completion.max_tokens) == (5, 0.6, 9)
    beams = CompletionRequest(prompt="hi", n=2, use_beam_search=True, temperature=0.0).sampling_params(defaults)
    assert beams.repetition_penalty == 1.0 and beams.top_k == -1  # beam search takes no sampling defaults
    grpc = sampling_from_proto(serving_pb2.SamplingParams(), defaults)
    assert (grpc.temperature, grpc.top_k, grpc.max_tokens) == (0.6, 20, 9)
    grpc = sampling_from_proto(serving_pb2.SamplingParams(temperature=0.0, max_tokens=2), defaults)
    assert (grpc.temperature, grpc.top_k, grpc.max_tokens) == (0.0, 20, 2)
    assert sampling_from_proto(serving_pb2.SamplingParams()).temperature == 1.0  # no defaults: SamplingParams'
    assert sampling_from_proto(serving_pb2.SamplingParams(truncate_prompt_tokens=4)).truncate_prompt_tokens == 4


def test_offline_generate_uses_the_model_defaults_and_its_eos_ids(tiny_llama, tmp_path):
    plain = LLM(tiny_llama, kv_cache_memory=1 << 22, distributed_executor_backend="uni")
    try:
        greedy = plain.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids
        assert plain.get_default_sampling_params().max_tokens == 16  # no recommendation: SamplingParams'
    finally:
        plain.shutdown()
    stop_at = next(k for k, t in enumerate(greedy) if k >= 2 and t not in greedy[:k] and t != 2)
    model = _model_with(tiny_llama, tmp_path, {**RECOMMENDED, "max_new_tokens": 4, "eos_token_id": [2]})
    llm = LLM(model, kv_cache_memory=1 << 22, distributed_executor_backend="uni")
    try:
        out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]  # greedy, 4 tokens: the file's
        assert list(out.token_ids) == greedy[:4] and out.finish_reason == "length"
    finally:
        llm.shutdown()
    # an EOS id only the generation config names ends the reply, with or without its sampling settings
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, greedy[stop_at]]}))
    for mode in ("auto", "vllm"):
        llm = LLM(model, kv_cache_memory=1 << 22, distributed_executor_backend="uni", generation_config=mode)
        try:
            out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
            assert list(out.token_ids) == greedy[:stop_at + 1] and out.finish_reason == "stop"
        finally:
            llm.shutdown()


@pytest.fixture(scope="module")
def server(ray_session, tiny_llama, tmp_path_factory):
    model = _model_with(tiny_llama, tmp_path_factory.mktemp("gen"), {"temperature": 0.0, "max_new_tokens": 6})
    config = EngineConfig(model=model, kv_cache_memory=1 << 22, distributed_executor_backend="uni",
                          override_generation_config={"top_p": 0.5})
    with running_coordinator(config) as (actor, _):
        status = ray.get(actor.status.remote())
        yield SimpleNamespace(actor=actor, url=f"http://127.0.0.1:{status['http_port']}/v1", model=model,
                              target=f"127.0.0.1:{status['port']}")


def test_a_served_request_takes_the_defaults_and_overrides_them(server):
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Tell me a story"}]
    explicit = client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=6,
                                              extra_body={"ignore_eos": True})
    implicit = client.chat.completions.create(model=server.model, messages=messages, extra_body={"ignore_eos": True})
    assert implicit.usage.completion_tokens == 6  # max_new_tokens, greedy: the same reply every time
    assert implicit.choices[0].message.content == explicit.choices[0].message.content
    longer = client.completions.create(model=server.model, prompt="Once", max_tokens=9,
                                       extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 9
    # the override is applied (the Responses API echoes the sampling it used)
    assert client.responses.create(model=server.model, input="Hi", max_output_tokens=1).top_p == 0.5
    # a default length is no promise the prompt must leave room for: 4 tokens fit, the reply ends there
    max_len = client.models.list().data[0].max_model_len
    near_full = [5] * (max_len - 4)
    cut = client.completions.create(model=server.model, prompt=near_full, extra_body={"ignore_eos": True})
    assert cut.usage.completion_tokens == 4 and cut.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:  # asked for by the client, it is checked
        client.completions.create(model=server.model, prompt=near_full, max_tokens=6)
    assert info.value.body["param"] == "max_tokens"


def test_the_cli_leaves_unset_sampling_to_the_server(server, capsys):
    """`pagedserve generate` sends no max_tokens or temperature of its own: the generation config's
    6 greedy tokens apply, as over HTTP, where the CLI once sent 64 greedy tokens of its own."""
    from pagedserve import cli

    def reply(*flags) -> str:
        assert cli.main(["generate", "Tell me a story", "--target", server.target, *flags]) == 0
        return capsys.readouterr().out

    implicit = reply()
    assert implicit == reply("--max-tokens", "6", "--temperature", "0")
    assert implicit != reply("--max-tokens", "40", "--temperature", "0")
