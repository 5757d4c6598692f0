"""Commits ahead of vLLM's sampler: a wave hands vLLM several tokens an engine step.

An engine step of the plugin's WFD or DtV schedules one token per request and returns the
readout at R that vLLM samples the next one from. A greedy request's wave need not wait for
vLLM's sample to go on: the token is the argmax of a readout it already holds. So the wave
commits it itself and keeps ticking, up to ``commit_ahead`` tokens past vLLM's next sample, and
hands those tokens to vLLM as speculative tokens (vLLM's ``custom_class`` proposer,
``AheadProposer``). The next step schedules them with the sampled token; the wave returns the
readouts it made for them, and vLLM's rejection sampler accepts each one whose own argmax agrees.
What this buys: fewer engine steps per token (vLLM's per-step work), and a wave that is ahead no
longer idles while another request's wave, refilling after a rejection, takes R ticks to its
next readout: every wave ticks in the same block calls until each is ``commit_ahead`` ahead.

Exactness stays vLLM's: each committed token is one vLLM's sampler accepted from a depth-R
readout. Where vLLM's argmax disagrees with the wave's (a near tie, rounded differently in a
batch), vLLM rejects the wave's token, and the wave restarts from the tokens vLLM committed.
Only requests whose greedy argmax is vLLM's get tokens ahead: greedy, with no penalty, bias,
word or token restriction, minimum length or structured output (``plain_greedy``). A request
may set its own bound with ``SamplingParams(extra_args={"commit_ahead": k})`` (0: none).
"""

from __future__ import annotations

PROPOSER = "wfd.serving.ahead.AheadProposer"


def speculative_config(vllm_config, tokens: int):
    """vLLM's speculative config for ``tokens`` tokens committed ahead (the hook that makes the
    engine's config sets it)."""
    from vllm.config import SpeculativeConfig

    return SpeculativeConfig(method="custom_class", model=PROPOSER,
                             num_speculative_tokens=tokens,
                             target_model_config=vllm_config.model_config,
                             target_parallel_config=vllm_config.parallel_config)


def plain_greedy(params) -> bool:
    """Whether vLLM's token for these sampling parameters is the argmax of the raw logits."""
    from vllm.sampling_params import SamplingType

    return (params.sampling_type == SamplingType.GREEDY and params.presence_penalty == 0
            and params.frequency_penalty == 0 and params.repetition_penalty == 1
            and not params.logit_bias and not params.allowed_token_ids
            and not params.bad_words and not params.min_tokens
            and params.structured_outputs is None)


def bound(runner, req_id: str) -> tuple[int, int]:
    """(tokens the request's wave may commit ahead of vLLM's next sample, the last position
    it may hold a token at) for one request of the model runner's batch."""
    spec = runner.speculative_config
    most = spec.num_speculative_tokens if spec is not None and spec.model == PROPOSER else 0
    state = runner.requests[req_id]
    params = state.sampling_params
    asked = (params.extra_args or {}).get("commit_ahead")
    ahead = min(most, int(asked)) if asked is not None else most if plain_greedy(params) else 0
    longest = runner.model_config.max_model_len
    if params.max_tokens is not None and state.prompt_token_ids is not None:
        longest = min(longest, len(state.prompt_token_ids) + params.max_tokens)
    return max(0, ahead), longest - 1


def proposals(waves: dict, batch: list[str], lengths: list[int], newest: list[int], most: int
              ) -> list[list[int]]:
    """The tokens each request of the step's batch (``batch``: its ids in vLLM's order; each
    one's wave in ``waves``) has committed past its ``length`` tokens, if its newest one
    (vLLM's) is the wave's; at most ``most``."""
    if len(lengths) != len(batch):
        return [[] for _ in lengths]
    out = []
    for req, length, token in zip(batch, lengths, newest, strict=True):
        wave = waves.get(req)
        if wave is None or not 0 < length <= wave.committed + 1 or (
                wave.token_at[length - 1] != token):
            out.append([])
            continue
        end = min(wave.committed, length - 1 + most)
        out.append([wave.token_at[p] for p in range(length, end + 1)])
    return out


class AheadProposer:
    """vLLM's proposer (``speculative_config`` method ``custom_class``) for waves: each
    request's proposal is the tokens its wave committed past vLLM's newest one."""

    def __init__(self, vllm_config):
        self.tokens = vllm_config.speculative_config.num_speculative_tokens
        self.looped = None  # the target model (vLLM hands it over in load_model)

    def load_model(self, model) -> None:
        self.looped = model

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None,
                **_) -> list[list[int]]:
        if self.looped is None or self.looped.wave is None:
            return [[] for _ in sampled_token_ids]
        lengths = [int(n) for n in num_tokens_no_spec[:len(sampled_token_ids)]]
        newest = [int(token_ids_cpu[i, n - 1]) if sampled and n else -1
                  for i, (sampled, n) in enumerate(zip(sampled_token_ids, lengths, strict=True))]
        return self.looped.wave.ahead(lengths, newest, self.tokens)
