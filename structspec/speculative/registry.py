"""The drafter registry: every ``--speculative-algorithm`` name, its factory and what the
config check needs to know about it.

This is the one place a drafter is added. :func:`structspec.config.resolve_engine_config`
checks ``SpecConfig.algorithm`` against :func:`drafter_names` and :func:`drafter_info`, the CLI
takes its ``--speculative-algorithm`` choices from :func:`drafter_names`, and the engine
builds the drafter with :func:`create_drafter`. A test or a plugin adds its own drafter with
:func:`register_drafter` (or the :func:`registered_drafter` context manager) and nothing else.

The module imports neither :mod:`structspec.config` nor torch nor any drafter: config imports
it for the check, so a drafter module (which imports config) must not be reachable from it.
The built-in drafters are registered by module and factory name and imported on first
:func:`create_drafter` (``import structspec.config`` stays cheap, and no import cycle runs
config -> registry -> drafter -> config).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from structspec.speculative.base import Drafter


class AlgorithmSpec(Protocol):
    """What the registry reads of a :class:`structspec.config.SpecConfig` (its drafter name)."""

    @property
    def algorithm(self) -> str: ...


#: ``factory(spec, **context) -> Drafter``. ``spec`` is the engine's ``SpecConfig``;
#: ``context`` is what :class:`~structspec.engine.llm_engine.LLMEngine` passes (see
#: :func:`create_drafter`). A factory takes the keywords it needs and ignores the rest.
DrafterFactory = Callable[..., "Drafter"]


@dataclass(frozen=True)
class DrafterInfo:
    """One registered drafter.

    Attributes:
        name: the ``--speculative-algorithm`` / ``SpecConfig.algorithm`` value.
        factory: builds the drafter (:data:`DrafterFactory`).
        needs_draft_model: the drafter reads ``SpecConfig.draft_model`` (a draft checkpoint or
            an EAGLE head directory); the config check refuses the algorithm without it, before
            the target model loads.
        expands_tree: the drafter grows an EAGLE-2 tree with ``SpecConfig.depth`` and
            ``SpecConfig.topk``; the config check bounds both (``MAX_DRAFT_DEPTH``,
            ``MAX_DRAFT_TOPK``) before any model loads.
        description: a few words on what it drafts with (the CLI's ``--speculative-algorithm``
            help is built from them).
        eagle_head: ``SpecConfig.draft_model`` is an EAGLE head directory: the head shipped
            for the default model is used when none is given, and ``--draft-model`` is
            checked as a head.
    """

    name: str
    factory: DrafterFactory
    needs_draft_model: bool = False
    expands_tree: bool = False
    description: str = ""
    eagle_head: bool = False


_REGISTRY: dict[str, DrafterInfo] = {}


def register_drafter(
    name: str,
    factory: DrafterFactory,
    *,
    needs_draft_model: bool = False,
    expands_tree: bool = False,
    description: str = "",
    eagle_head: bool = False,
    replace: bool = False,
) -> DrafterInfo:
    """Register ``factory`` under ``name`` (a new ``--speculative-algorithm`` value).

    Args:
        name: non-empty algorithm name.
        factory: ``factory(spec, **context) -> Drafter`` (see :func:`create_drafter`).
        needs_draft_model: see :class:`DrafterInfo`.
        expands_tree: see :class:`DrafterInfo`.
        description: see :class:`DrafterInfo`.
        eagle_head: see :class:`DrafterInfo`.
        replace: allow replacing an already registered name.

    Returns:
        The registered :class:`DrafterInfo`.

    Raises:
        ValueError: ``name`` is empty or not a string, or already registered without
            ``replace``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"drafter name {name!r}: expected a non-empty string")
    if name in _REGISTRY and not replace:
        raise ValueError(f"drafter {name!r} is already registered")
    info = DrafterInfo(name=name, factory=factory, needs_draft_model=needs_draft_model,
                       expands_tree=expands_tree, description=description,
                       eagle_head=eagle_head)
    _REGISTRY[name] = info
    return info


def unregister_drafter(name: str) -> None:
    """Remove ``name`` from the registry (undoes :func:`register_drafter`).

    Raises:
        KeyError: ``name`` is not registered.
    """
    if name not in _REGISTRY:
        raise KeyError(f"drafter {name!r} is not registered")
    del _REGISTRY[name]


@contextmanager
def registered_drafter(
    name: str, factory: DrafterFactory, *, needs_draft_model: bool = False,
    expands_tree: bool = False, description: str = "",
) -> Iterator[DrafterInfo]:
    """:func:`register_drafter` for the duration of a ``with`` block, then
    :func:`unregister_drafter` (also when the block raises).

    Raises:
        ValueError: as :func:`register_drafter` (``name`` already registered).
    """
    info = register_drafter(name, factory, needs_draft_model=needs_draft_model,
                            expands_tree=expands_tree, description=description)
    try:
        yield info
    finally:
        unregister_drafter(name)


def drafter_names() -> tuple[str, ...]:
    """The registered algorithm names, in registration order (the built-ins first)."""
    return tuple(_REGISTRY)


def drafter_info(name: str) -> DrafterInfo:
    """The :class:`DrafterInfo` of ``name``.

    Raises:
        KeyError: ``name`` is not registered.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"drafter {name!r} is not registered; known: "
                       f"{', '.join(_REGISTRY)}") from None


def create_drafter(spec: AlgorithmSpec, **context: Any) -> Drafter:
    """Build the drafter named by ``spec.algorithm``: ``factory(spec, **context)``.

    The engine's ``context`` keywords: ``target`` (the target ModelRunner), ``device``,
    ``dtype``, ``max_batch_size``, ``load_format`` and ``seed`` (the engine's: the built-in
    ``draft_model`` drafter loads its model like the target, ``"dummy"`` = seeded random
    weights from its config.json; an EAGLE head is always read from its directory).

    Raises:
        ValueError: for an unknown algorithm name.
    """
    info = _REGISTRY.get(spec.algorithm)
    if info is None:
        raise ValueError(f"unknown speculative_algorithm {spec.algorithm!r}")
    return info.factory(spec, **context)


def _lazy_factory(module: str, attr: str) -> DrafterFactory:
    """A factory that imports ``module`` on its first call and calls its ``attr``: the
    built-in drafters' modules (torch, models) load only when one is created."""

    def factory(spec: AlgorithmSpec, **context: Any) -> Drafter:
        create: DrafterFactory = getattr(importlib.import_module(module), attr)
        return create(spec, **context)

    factory.__qualname__ = f"lazy[{module}:{attr}]"
    return factory


register_drafter("none", _lazy_factory("structspec.speculative.base", "create_no_drafter"),
                 description="no speculation")
register_drafter("ngram", _lazy_factory("structspec.speculative.ngram", "create_ngram_drafter"),
                 description="n-gram prompt lookup")
register_drafter(
    "draft_model",
    _lazy_factory("structspec.speculative.draft_model", "create_draft_model_drafter"),
    needs_draft_model=True, expands_tree=True, description="a small draft model")
register_drafter("eagle", _lazy_factory("structspec.speculative.eagle", "create_eagle_drafter"),
                 needs_draft_model=True, expands_tree=True, description="an EAGLE head",
                 eagle_head=True)
