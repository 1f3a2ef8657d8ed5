"""The routing geometry ``routeplay inspect`` checks a body against: from a model's
``config.json``, a preset, or ``--layers/--top-k/--experts``, exactly one of them.

A ``config.json`` is read as plain JSON (the CLI never imports transformers) and handed
to ``spec_from_hf_config``, which owns the per-family rules (dense first layers, MoE
every N layers, MLP-only layers; MTP layers past ``num_hidden_layers`` route nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Final

from routeplay.core import RouteSpec, preset, spec_from_hf_config
from routeplay.errors import MisuseError, SpecMismatch

__all__ = ["ConfigJson", "spec_from_config_file", "spec_from_flags"]

_MAX_CONFIG_BYTES: Final = 16 << 20
"""A config.json is a few KB; anything this big is another file."""


class ConfigJson(SimpleNamespace):
    """A ``config.json`` object read as attributes, the way ``spec_from_hf_config`` reads
    a transformers ``PretrainedConfig`` (nested objects, e.g. ``text_config``, too)."""


def spec_from_flags(
    *,
    config: Path | None = None,
    model: str | None = None,
    layers: int | None = None,
    top_k: int | None = None,
    experts: int | None = None,
) -> RouteSpec:
    """The spec of whichever geometry the flags name; ``MisuseError`` for none or two.

    Example:
        >>> spec_from_flags(layers=3, top_k=2, experts=8).describe()
        'L=3 K=2 E=8 dtype=uint8 6 B/token'
    """
    flags = {"--config": config, "--preset": model, "--layers": layers}
    flags.update({"--top-k": top_k, "--experts": experts})
    named = [flag for flag, value in flags.items() if value is not None]
    if named == ["--config"] and config is not None:
        return spec_from_config_file(config)
    if named == ["--preset"] and model is not None:
        return preset(model)
    if layers is not None and top_k is not None and experts is not None and len(named) == 3:
        return RouteSpec(num_layers=layers, top_k=top_k, num_experts=experts)
    raise MisuseError(
        "inspect needs the model's routing geometry from exactly one place",
        expected="--config (a model's config.json), --preset, or all of --layers, "
        "--top-k and --experts",
        found=" and ".join(named) if named else "none of them",
    )


def spec_from_config_file(path: Path) -> RouteSpec:
    """The routing geometry of a transformers ``config.json``.

    Raises ``OSError`` when it cannot be read, ``MisuseError`` when it is not one JSON
    object, and ``SpecMismatch`` naming the keys it looked for when it describes no MoE.

    Example:
        >>> spec_from_config_file(Path("DeepSeek-V3/config.json"))  # doctest: +SKIP
        RouteSpec(deepseek_v3: L=58 (+3 dense) K=8 E=256 dtype=uint8 464 B/token)
    """
    config = _load(path)
    where = f"{path} (model_type {getattr(config, 'model_type', None)!r})"
    try:
        return spec_from_hf_config(config)
    except SpecMismatch as exc:  # the same error, told which file it came from
        found = exc.found
        if isinstance(found, str):  # "ConfigJson without them" reads better as the file
            found = found.replace(ConfigJson.__name__, path.name)
        raise SpecMismatch(
            exc.summary, expected=exc.expected, found=found, where=where, hint=exc.hint
        ) from exc


def _load(path: Path) -> ConfigJson:
    with path.open("rb") as stream:
        text = stream.read(_MAX_CONFIG_BYTES + 1)
    if len(text) > _MAX_CONFIG_BYTES:
        raise MisuseError(
            "the model config is too large to be a config.json",
            expected=f"at most {_MAX_CONFIG_BYTES} bytes",
            found="more",
            where=str(path),
        )
    try:
        config = json.loads(text, object_hook=lambda fields: ConfigJson(**fields))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        raise MisuseError(
            "the model config is not JSON",
            expected="a transformers config.json",
            found=str(exc)[:160],
            where=str(path),
        ) from exc
    if not isinstance(config, ConfigJson):
        raise MisuseError(
            "the model config is not a JSON object",
            expected="a transformers config.json (one object)",
            found=type(config).__name__,
            where=str(path),
        )
    return config
