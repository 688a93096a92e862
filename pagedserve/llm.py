"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Sequence as SequenceABC

from coordinator.engine import LLMEngine
from coordinator.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from coordinator.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedserve.config import BUNDLED_MODEL_ALIAS, EngineConfig

PromptType = str | dict


class LLM:
    """A whole engine in this process. Keyword arguments are the fields of `EngineConfig`."""

    def __init__(self, model: str = BUNDLED_MODEL_ALIAS, **engine_args):
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"LLM takes no argument {', '.join(unknown)}: its keyword arguments are the engine's "
                             f"settings ({', '.join(sorted(known - {'model'}))})")
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine.from_config(self.config)
        # Offline work wants every step at full speed: a server's workers copy their weights onto
        # huge pages beside its start (workers/huge_pages.py), an LLM returns once they are there.
        self.engine.executor.collective_rpc("wait_for_weights")
        self._request_ids = itertools.count()
        self._shut_down = False

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what `generate` uses without SamplingParams: the model's generation defaults
        (`generation_config`, `override_generation_config`) over SamplingParams'."""
        defaults = self.engine.generation_defaults
        kwargs = defaults.fill({})
        if defaults.max_tokens is not None:
            kwargs["max_tokens"] = defaults.max_tokens
        return SamplingParams(**kwargs)

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string or `{"prompt": str}` / `{"prompt_token_ids": [int, ...]}`.
        `priority` (one integer per prompt, lower first) matters with scheduling_policy="priority".
        """
        self._check_open()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif not isinstance(prompts, SequenceABC):
            raise ValueError("prompts must be a prompt (a string, {'prompt': str} or {'prompt_token_ids': [...]}) "
                             f"or a list of them; got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, SequenceABC) or len(sampling_params) != len(prompts):
            got = (f"{len(sampling_params)} of them" if isinstance(sampling_params, SequenceABC)
                   else type(sampling_params).__name__)
            raise ValueError(f"sampling_params must be one SamplingParams or one per prompt "
                             f"({len(prompts)}); got {got}")
        if priority is None:
            priority = [0] * len(prompts)
        elif len(priority) != len(prompts):
            raise ValueError(f"priority must have one integer per prompt ({len(prompts)}); got {len(priority)}")
        ids = []
        final_only = {}  # id(params) -> its copy with output_kind FINAL_ONLY: results come once done
        try:
            for prompt, params, prio in zip(prompts, sampling_params, priority):
                text, token_ids = _split_prompt(prompt)
                request_id = str(next(self._request_ids))
                if isinstance(params, SamplingParams) and params.output_kind is not RequestOutputKind.FINAL_ONLY:
                    params = final_only.setdefault(id(params), dataclasses.replace(
                        params, output_kind=RequestOutputKind.FINAL_ONLY))
                self.engine.add_request(request_id, text, token_ids, params, prio)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # a bad prompt leaves nothing of this call behind
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate replies to conversations (`[{"role": ..., "content": ...}, ...]`, or a list of
        them) through the model's chat template, or `chat_template` (Jinja) in its place, with
        `chat_template_kwargs` as extra variables of the template (vLLM's `LLM.chat` arguments)."""
        self._check_open()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        render = self.engine.input_processor.chat_prompt_ids
        prompts = [{"prompt_token_ids": render(c, add_generation_prompt, continue_final_message, tools, chat_template,
                                               chat_template_kwargs)} for c in conversations]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out in outs:  # as vLLM's: the prompt the chat template rendered
            out.prompt = self.engine.tokenizer.decode(out.prompt_token_ids)
        return outs

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req")
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                if request_id not in results:
                    self.engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's `params.beam_width` best beams, best first (the
        beams share their blocks while they search; coordinator/beam_search.py)."""
        outs = self.generate(prompts, params.sampling_params(), use_tqdm)
        return [BeamSearchOutput([BeamSearchSequence(out.prompt_token_ids + c.token_ids, c.cumulative_logprob, c.text,
                                                     c.finish_reason, c.stop_reason) for c in out.outputs])
                for out in outs]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (device and CPU tier), as vLLM's `LLM.reset_prefix_cache`:
        the next prompts are computed cold. False, and nothing forgotten, while a request holds
        blocks (between `generate` calls none does)."""
        self._check_open()
        return self.engine.scheduler.kv.reset_prefix_cache()

    def stats(self) -> dict:
        self.engine.refresh_stats()  # this thread runs the steps: the snapshot may be taken now
        return self.engine.stats()

    def shutdown(self) -> None:
        """Release the workers (the worker actors and their placement group with Ray). Once
        shut down, the LLM refuses work: it would otherwise take a missing worker group for a
        fault and start a new one."""
        if not self._shut_down:
            self._shut_down = True
            self.engine.shutdown()

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError("this LLM has been shut down (shutdown(), or the end of its with block); "
                               "create a new LLM to generate again")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
    raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}; "
                     f"got {prompt!r:.80}")
