"""Shared engine fixtures: SmolLM2 engines (CPU, fp32), built once per session."""

from __future__ import annotations

import ctypes
import gc
import json
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

smollm2 = pytest.importorskip("structspec.models.default_model")

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "List three colors.",
    "Write a haiku about the sea.",
    "Repeat exactly: alpha beta gamma delta alpha beta gamma delta alpha beta",
    "Explain photosynthesis briefly.",
    "Give me a JSON object with keys a and b.",
    "Count from one to ten in words.",
    "Name a famous scientist and one discovery.",
    "Translate 'good morning' to Spanish.",
    "Who wrote Romeo and Juliet?",
    "The user Maria Lopez (age 34, city Madrid, email maria.lopez@example.org) signed up. "
    "Summarise: name Maria Lopez, age 34, city Madrid.",
    "Write a short sentence that uses the word 'lantern'.",
    "What is 12 times 12?",
    "Describe a cat in five words.",
    "Tell me a fun fact about octopuses.",
    "Spell the word 'necessary' letter by letter.",
    "Give two synonyms for 'happy'.",
    "What day comes after Monday?",
    "Write the first line of a fairy tale.",
    "Name the largest planet in the solar system.",
    "Copy this list: red, green, blue, red, green, blue, red, green",
    "What is the boiling point of water in Celsius?",
]

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def default_model_dir() -> str:
    try:
        return smollm2.resolve_model_path(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smol_dir() -> str:
    return default_model_dir()


@pytest.fixture(scope="session")
def smol_first_layers_dir(smol_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """SmolLM2 truncated to its first 4 layers: a same-tokenizer draft model that is often
    wrong (its drafts get rejected)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("smol4")
    src = Path(smol_dir)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for f in src.glob("*.safetensors"):
        for k, v in load_file(f).items():
            if ".layers." in k and int(k.split(".layers.")[1].split(".")[0]) >= 4:
                continue
            tensors[k] = v
    save_file(tensors, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    return str(out)


@pytest.fixture(scope="session")
def tiny_model_dir(smol_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Llama with SmolLM2's tokenizer (so the engine can load it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaked next-token distributions
    model.save_pretrained(out, safe_serialization=True)
    for f in Path(smol_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            (out / f.name).write_bytes(f.read_bytes())
    return str(out)


@pytest.fixture(scope="session")
def tiny_drafters(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Engine options per drafter on the tiny target: a different random tiny draft model
    (its drafts are mostly rejected) and a random EAGLE head (prefix caching, chunked
    prefill and preemption tests)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from structspec.config import ModelConfig
    from structspec.models.eagle_head import build_random_eagle_head

    draft_dir = tmp_path_factory.mktemp("tiny_draft")
    torch.manual_seed(1)
    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    cfg.num_hidden_layers = 1
    LlamaForCausalLM(cfg).save_pretrained(draft_dir, safe_serialization=True)
    eagle_dir = tmp_path_factory.mktemp("tiny_eagle")
    target_cfg = ModelConfig.from_hf_config(
        json.loads((Path(tiny_model_dir) / "config.json").read_text()))
    build_random_eagle_head(target_cfg, str(eagle_dir), seed=0)
    return {
        "none": {},
        "ngram": dict(speculative_algorithm="ngram", num_draft_tokens=6),
        "draft_model": dict(speculative_algorithm="draft_model", draft_model=str(draft_dir),
                            num_draft_tokens=5, speculative_depth=3, speculative_topk=2),
        "eagle": dict(speculative_algorithm="eagle", draft_model=str(eagle_dir),
                      num_draft_tokens=5, speculative_depth=3, speculative_topk=2),
    }



def feature_drafters() -> list[Any]:
    """The drafters an engine-feature test (preemption, chunked prefill, prefix cache: the
    feature on against off) runs with: no drafter, the n-gram one (host trees) and EAGLE (a
    device tree and stored target features) in the default suite; the draft-model drafter
    under ``-m slow`` (the suite's 10-minute budget on 2 cores; its speculation-on against
    -off outputs are checked in ``test_spec.py`` by default)."""
    return [pytest.param(d, marks=pytest.mark.slow) if d == "draft_model"
            else d for d in ("none", "ngram", "draft_model", "eagle")]

# Engines kept alive at once by ``make_llm``. Each SmolLM2 engine holds its weights (plus a
# draft model's) and a 4096-token fp32 KV pool, about 0.8-1.5 GB; a test uses at most two at a
# time, and the tests that share a configuration sit next to each other, so three keeps the
# rebuilds rare while bounding the suite's peak memory.
MAX_LIVE_ENGINES = 3

# KV cache of a cached engine. The largest batch a test runs needs ~2,700 tokens (MaskBench's
# eight schema prompts with 160 new tokens each); 12288 held 380 MB more per engine.
KV_CAPACITY_TOKENS = 4096

try:
    _LIBC: Any = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018 - glibc only
except (OSError, AttributeError):
    _LIBC = None


def release_memory() -> None:
    """Collect garbage (engines hold reference cycles) and hand the heap's free pages back to
    the system (glibc ``malloc_trim``). An engine's per-layer weights (a few MB each) come
    from the heap once freed chunks have raised malloc's mmap threshold, and glibc kept them
    after the engine was gone: measured, each engine built and dropped left ~400 MB in the
    process, and the suite's peak RSS grew with the number of engines it had built."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class EngineCache:
    """An LRU of CPU fp32 :class:`~structspec.LLM` engines keyed by their options.

    Building an engine costs seconds of CPU (weights, KV pool, grammar backend) and its memory
    only goes when the last reference does, so engines are built once per session and shared
    by every test that asks for the same options; the least recently used one is dropped when
    more than ``capacity`` are alive (a test still holding it keeps it until it ends)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._engines: OrderedDict[tuple, Any] = OrderedDict()

    def get(self, **kw: Any) -> Any:
        from structspec import LLM

        key = tuple(sorted(kw.items()))
        if key in self._engines:
            self._engines.move_to_end(key)
            return self._engines[key]
        while len(self._engines) >= self.capacity:
            self._engines.popitem(last=False)
            release_memory()  # free its tensors now, and give the pages back
        # float32 weights unless a test asks for --quantization: the lossless tests (spec on
        # == spec off) and the HF comparisons run on the float32 path. Fixed trees (adaptive
        # sizing off): what a test asserts about accept lengths must not depend on this
        # machine's timings; the adaptive tests turn the sizing on themselves.
        opts: dict[str, Any] = dict(device="cpu", dtype="float32", quantization="none",
                                    kv_capacity_tokens=KV_CAPACITY_TOKENS, max_batch_size=32,
                                    speculative_adaptive="off")
        opts.update(kw)
        self._engines[key] = llm = LLM(**opts)
        return llm

    def clear(self) -> None:
        self._engines.clear()
        release_memory()


@pytest.fixture(scope="session")
def engine_cache() -> Iterator[EngineCache]:
    cache = EngineCache(MAX_LIVE_ENGINES)
    yield cache
    cache.clear()


@pytest.fixture(scope="session")
def make_llm(engine_cache: EngineCache) -> Callable[..., Any]:
    """``make_llm(**kw)`` -> an LLM on CPU in float32 (``quantization="none"`` unless ``kw``
    says otherwise) for those options, shared by the whole
    session (see :class:`EngineCache`)."""
    return engine_cache.get


def step_under_sync_check(engine: Any, max_steps: int, *, check: bool = True) -> int:
    """Run up to ``max_steps`` engine steps with ``torch.cuda.set_sync_debug_mode("error")``
    (any host sync raises; ``check=False`` runs the same steps unchecked, e.g. to capture CUDA
    graphs first), then finish the remaining requests unchecked.

    Returns:
        The number of steps run under the check.
    """
    import torch

    steps = 0
    if check:
        torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished_requests() and steps < max_steps:
            engine.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return steps
