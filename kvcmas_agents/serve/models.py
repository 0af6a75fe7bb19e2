"""The model ids a request may name: the served id and its documented aliases; any other is a 404."""
from __future__ import annotations

from typing import Iterable

from ..model.loader import DEFAULT_MODEL
from .errors import APIError

# The default packaged model is also known by its Hugging Face repository id.
DEFAULT_MODEL_ALIASES = ("HuggingFaceTB/SmolLM2-135M-Instruct",)


def model_ids(served: str, engine_model: str, aliases: Iterable[str] = ()) -> tuple[str, ...]:
    """The served id first, then the engine's model name, the default model's aliases (when it is the
    default model) and the configured ``aliases``; no duplicates."""
    ids = [served, engine_model]
    if engine_model == DEFAULT_MODEL:
        ids += DEFAULT_MODEL_ALIASES
    ids += list(aliases)
    return tuple(dict.fromkeys(i for i in ids if i))


def check_model(model: object, ids: tuple[str, ...]) -> None:
    """Raise 400 when ``model`` is missing, 404 ``model_not_found`` when it is none of ``ids``."""
    if not isinstance(model, str) or not model:
        raise APIError(400, "model must be a non-empty string (the id GET /v1/models lists)", "model",
                       "invalid_value")
    if model not in ids:
        raise APIError(404, f"The model {model!r} does not exist; this server serves {ids[0]!r} "
                            f"(also known as {', '.join(repr(i) for i in ids[1:]) or 'nothing else'})",
                       "model", "model_not_found")
