"""A seeded sampled request's output is a function of its seed and prompt alone: the same with
no drafter, any drafter, fixed or adaptive tree sizes, alone or in a batch (its token at output
position p is drawn with the uniform of (seed, p): layers/keyed_sampling.py)."""

from __future__ import annotations

from structspec import SamplingParams

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):",
           "In 1969, the first"]


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=20, temperature=1.0, top_p=0.98, seed=seed, ignore_eos=True)


def test_seeded_output_is_the_same_with_every_drafter_and_tree_size(
        make_llm, tiny_model_dir: str, tiny_drafters: dict) -> None:
    seeds = [3, 11, 2**40 + 5, 77]
    params = [_params(s) for s in seeds]
    plain = make_llm(model=tiny_model_dir)
    want = [o.token_ids for o in plain.generate(PROMPTS, params, raw_prompt=True)]
    # the target as its own draft model: its (greedy) drafts are accepted whenever the draw
    # takes the argmax, so tree nodes below the root are kept too (depth > 0)
    self_draft = dict(speculative_algorithm="draft_model", draft_model=tiny_model_dir,
                      num_draft_tokens=5, speculative_depth=3, speculative_topk=2)
    configs = {
        "self_draft": self_draft,
        "self_draft_adaptive": {**self_draft, "speculative_adaptive": "on"},
        "ngram": tiny_drafters["ngram"],
        "eagle": tiny_drafters["eagle"],
    }
    for name, opts in configs.items():
        llm = make_llm(model=tiny_model_dir, **opts)
        outs = llm.generate(PROMPTS, params, raw_prompt=True)
        assert [o.token_ids for o in outs] == want, name
        if name == "self_draft":
            assert sum(o.spec.draft_tokens_accepted for o in outs) > 0
    # alone, and next to an unseeded request, the same tokens
    alone = plain.generate(PROMPTS[1], params[1], raw_prompt=True)[0]
    mixed = plain.generate([PROMPTS[0], PROMPTS[1]],
                           [SamplingParams(max_tokens=20, temperature=1.0), params[1]],
                           raw_prompt=True)[1]
    assert alone.token_ids == mixed.token_ids == want[1]
    # and the draws are really random: other seeds give other outputs
    others = plain.generate([PROMPTS[0]] * 6, [_params(100 + s) for s in range(6)],
                            raw_prompt=True)
    assert len({tuple(o.token_ids) for o in others} | {tuple(want[0])}) > 2


def test_unseeded_requests_repeat_for_one_engine_seed_whatever_the_drafter(
        tiny_model_dir: str) -> None:
    """A request without a seed gets one drawn from the engine seed when it is added: two
    fresh engines with one engine seed give the same sampled outputs, one without drafter
    and one with an adaptive self-drafting tree; another engine seed gives others."""
    from structspec import LLM

    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    common = dict(model=tiny_model_dir, device="cpu", dtype="float32", quantization="none",
                  kv_capacity_tokens=1024, max_batch_size=8)
    outs = []
    for seed, opts in ((5, {}), (5, dict(speculative_algorithm="draft_model",
                                         draft_model=tiny_model_dir, num_draft_tokens=4,
                                         speculative_depth=3, speculative_adaptive="on")),
                       (6, {})):
        llm = LLM(seed=seed, **common, **opts)
        try:
            outs.append([o.token_ids for o in llm.generate(PROMPTS, params, raw_prompt=True)])
        finally:
            llm.close()
    assert outs[0] == outs[1]
    assert outs[2] != outs[0]
