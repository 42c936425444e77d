"""The engine-flag table shared by ``generate`` and ``serve`` (:mod:`structspec.engine_args`),
and the import edges it and :mod:`structspec.models.architectures` exist to remove."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from structspec.engine_args import (
    FLAG_OF_ENGINE_FIELD,
    add_engine_args,
    engine_kwargs,
    flag_error,
    int_range,
    unused_speculative_flags,
)
from structspec.speculative.registry import drafter_names

PACKAGE = Path(__file__).resolve().parents[1] / "structspec"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_speculative_algorithm_choices_are_the_registry_names() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    action = next(a for a in parser._actions if "--speculative-algorithm" in a.option_strings)
    assert list(action.choices or ()) == list(drafter_names())
    for name in drafter_names():
        assert engine_kwargs(parse("--speculative-algorithm", name))[
            "speculative_algorithm"] == name


def test_flags_the_drafter_ignores_are_named() -> None:
    """A speculative flag set away from its default that the chosen drafter does not read is
    named (the CLI warns); defaults, and flags the drafter reads, are not."""
    assert unused_speculative_flags(parse()) == []
    assert unused_speculative_flags(parse("--num-draft-tokens", "16",
                                          "--speculative-adaptive", "off")) == [
        "--num-draft-tokens", "--speculative-adaptive"]
    assert unused_speculative_flags(parse("--speculative-algorithm", "ngram",
                                          "--num-draft-tokens", "16", "--speculative-depth",
                                          "6", "--draft-model", "x")) == [
        "--draft-model", "--speculative-depth"]
    assert unused_speculative_flags(parse("--speculative-algorithm", "draft_model",
                                          "--draft-model", "x", "--speculative-topk", "3",
                                          "--speculative-draft-vocab", "full")) == [
        "--speculative-draft-vocab"]
    assert unused_speculative_flags(parse(
        "--speculative-algorithm", "eagle", "--num-draft-tokens", "12", "--speculative-depth",
        "5", "--speculative-topk", "3", "--speculative-adaptive", "on",
        "--speculative-draft-vocab", "full")) == []


def test_every_engine_option_has_its_flag() -> None:
    """Each option :func:`engine_kwargs` hands the engine (but the free-form model path and
    seed) is named back as its flag in the engine's errors, and that flag exists."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {opt for a in parser._actions for opt in a.option_strings}
    kw = engine_kwargs(parse())
    assert set(kw) - {"draft_model", "seed"} == set(FLAG_OF_ENGINE_FIELD)
    assert set(FLAG_OF_ENGINE_FIELD.values()) <= flags
    assert (kw["overlap"], kw["cuda_graph"]) == (True, True)
    kw = engine_kwargs(parse("--no-overlap", "--no-cuda-graph",
                             "--grammar-compile-timeout", "2.5"))
    assert (kw["overlap"], kw["cuda_graph"], kw["grammar_compile_timeout_s"]) == (
        False, False, 2.5)


def test_no_prefix_cache_reaches_the_frozen_config() -> None:
    """``--no-prefix-cache`` -> ``enable_prefix_caching=False`` -> ``CacheConfig`` (serve's
    config builder; ``generate`` passes the same keyword to ``LLM``)."""
    from structspec.server.launch import build_engine_config

    assert engine_kwargs(parse())["enable_prefix_caching"] is True
    kw = engine_kwargs(parse("--no-prefix-cache"))
    assert kw["enable_prefix_caching"] is False
    assert build_engine_config(None, **kw).cache.enable_prefix_caching is False
    assert build_engine_config(None).cache.enable_prefix_caching is True


@pytest.mark.parametrize("message,shown", [
    ("max_model_len=5 is greater than the model's", "--max-model-len: max_model_len=5 is"),
    ("overlap needs CUDA", "--no-overlap: overlap needs CUDA"),
    ("something else broke", "something else broke"),
])
def test_flag_error_names_the_flag(message: str, shown: str) -> None:
    assert flag_error(message).startswith(shown)
    assert flag_error("seed must be", {"seed": "--request-seed"}) == "--request-seed: seed must be"


def test_int_range() -> None:
    parse_port = int_range(0, 10)
    assert parse_port("7") == 7
    for bad, words in [("11", "11 is outside 0..10"), ("x", "invalid int value: 'x'")]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse_port(bad)


def imported_modules(path: Path) -> set[str]:
    """Every ``structspec`` module ``path`` imports, at module level or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.split(".")[0] == "structspec"}


@pytest.mark.parametrize("module,forbidden", [
    ("server/launch.py", "structspec.cli"),
    ("engine_args.py", "structspec.cli"),
    ("engine_args.py", "structspec.server"),
    ("constraint_parse.py", "structspec.cli"),
    ("constraint_parse.py", "structspec.server"),
])
def test_no_import_back_into_the_entry_points(module: str, forbidden: str) -> None:
    """``cli`` -> ``server.launch`` -> ``cli`` was a cycle (function-level imports count)."""
    found = [m for m in imported_modules(PACKAGE / module)
             if m == forbidden or m.startswith(forbidden + ".")]
    assert not found, f"{module} imports {found}"


def test_architecture_names_are_a_leaf() -> None:
    """``config -> models.registry -> models.llama -> config`` was a cycle: config reads the
    names from a module that imports nothing of structspec, and the registry has a class for
    each of them."""
    from structspec.models.architectures import SUPPORTED_ARCHITECTURES
    from structspec.models.registry import get_model_class

    assert imported_modules(PACKAGE / "models" / "architectures.py") == set()
    config_imports = imported_modules(PACKAGE / "config.py")
    assert "structspec.models.registry" not in config_imports
    assert "structspec.models.architectures" in config_imports
    for arch in SUPPORTED_ARCHITECTURES:
        assert get_model_class(arch).__name__ == arch
