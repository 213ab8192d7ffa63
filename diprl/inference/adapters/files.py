"""What makes a PEFT LoRA directory servable: its config, its weights' header, and its fit to a base model.

Every check runs before an adapter becomes a version (at publish) and against the serving model when
a replica loads it: vLLM reports a bad rank or a foreign module as an engine error, and an adapter of
the wrong shape or for another base model would either crash a replica or load silently and play
nonsense. The `safetensors` library reads the weights' header (it rejects truncation, a mangled or
oversized header, unknown dtypes, and tensors whose bytes overlap, leave gaps or disagree with their
shapes); the checks here add what LoRA serving needs on top. Only `check_finite_weights` reads the
tensors' values, once, at publish: a diverged adapter (NaN or inf in any LoRA weight) would load and
make every request it serves sample garbage, so it never becomes a version.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from diprl.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from diprl.inference.adapters.names import CorruptAdapter, IncompatibleAdapter, same_base_model

if TYPE_CHECKING:
    from diprl.inference.adapters.manifest import AdapterVersion

MANIFEST_FILE = "DIPRL_MANIFEST.json"
"""Every version holds `ADAPTER_FILES` (`diprl.adapter_files`) and this manifest of their fingerprints."""
CANARY_FILE = "canary.json"
OPTIONAL_FILES = (CANARY_FILE,)
"""Files a version may hold too, fingerprinted like the others: the canary (`diprl.inference.canary`)
that the learner publishes with the weights and a replica checks after loading them."""

SERVABLE_DTYPES = frozenset({"F16", "BF16", "F32"})
"""Weight dtypes vLLM's LoRA layers accept (they are cast to the model dtype on load)."""
MAX_LORA_ALPHA = 1e4
"""`lora_alpha` above this is a mistake (1e308 scales every update to infinity), not a setting."""
_MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class AdapterShape:
    """What an adapter's files say about it, cross-checked between config and weights."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None


def positive_number(value: Any) -> bool:
    """A finite number > 0 that is not a bool (JSON `true` is not a rank)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0 and math.isfinite(value)


def read_config(data: bytes, where: str) -> dict[str, Any]:
    """The parsed `adapter_config.json`, or `CorruptAdapter`/`IncompatibleAdapter` saying what is wrong."""
    if len(data) > _MAX_CONFIG_BYTES:
        raise CorruptAdapter(f"{where}: {CONFIG_FILE} is {len(data)} bytes, more than any LoRA config needs")
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CorruptAdapter(f"{where}: {CONFIG_FILE} is not valid JSON ({type(err).__name__}: {err})") from None
    if not isinstance(config, dict):
        raise CorruptAdapter(f"{where}: {CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise IncompatibleAdapter(f"{where}: peft_type {peft_type!r} is not supported (only LoRA adapters are served)")
    if config.get("use_dora"):
        raise IncompatibleAdapter(f"{where}: DoRA adapters are not supported (vLLM serves plain LoRA)")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise CorruptAdapter(f"{where}: {CONFIG_FILE} needs a positive integer 'r' (LoRA rank), got {rank!r}")
    alpha: Any = config.get("lora_alpha")
    if not positive_number(alpha) or alpha > MAX_LORA_ALPHA:
        raise CorruptAdapter(
            f"{where}: {CONFIG_FILE} needs a finite 'lora_alpha' in (0, {MAX_LORA_ALPHA:g}], got {alpha!r}"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or not all(
            positive_number(v) and v <= MAX_LORA_ALPHA for v in pattern.values()
        ):
            raise CorruptAdapter(f"{where}: {CONFIG_FILE} '{key}' must map module names to finite positive numbers")
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise CorruptAdapter(f"{where}: {CONFIG_FILE} 'base_model_name_or_path' must be a string, got {base!r}")
    return config


def _specs(pairs: Any) -> dict[str, TensorSpec]:
    return {str(name): TensorSpec(str(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in pairs}


def tensor_specs_of_file(path: Path, where: str) -> dict[str, TensorSpec]:
    """Dtype and shape of every tensor in a safetensors file, read by the `safetensors` library (header only)."""
    try:
        with safe_open(str(path), framework="numpy") as fh:
            metadata = fh.metadata()
            pairs = [(k, fh.get_slice(k).get_dtype(), fh.get_slice(k).get_shape()) for k in fh.keys()]  # noqa: SIM118 (a safe_open handle, not a dict)
    except (SafetensorError, OSError) as err:
        raise CorruptAdapter(f"{where}/{WEIGHTS_FILE}: not a readable safetensors file ({err}; truncated?)") from None
    _check_metadata(metadata, where)
    return _specs(pairs)


_EXPONENT_BITS: dict[str, tuple[Any, Any, int]] = {}
"""dtype name -> (torch int view, numpy uint view, exponent mask); filled on first use (torch loads lazily)."""


def _nonfinite_count(tensor: Any) -> int:
    """NaN and inf values in a float tensor: those whose IEEE exponent bits are all ones.

    Read on the raw bits with NumPy: `torch.isfinite` was 60x slower on a loaded 2-core machine
    (4.5 s against 0.07 s for 56M values), and NumPy has no bfloat16 to call `isfinite` on.
    """
    import numpy as np
    import torch

    if not _EXPONENT_BITS:
        _EXPONENT_BITS.update(
            {
                "torch.bfloat16": (torch.int16, np.uint16, 0x7F80),
                "torch.float16": (torch.int16, np.uint16, 0x7C00),
                "torch.float32": (torch.int32, np.uint32, 0x7F800000),
            }
        )
    spec = _EXPONENT_BITS.get(str(tensor.dtype))
    if spec is None:
        return int((~torch.isfinite(tensor)).sum())
    int_view, uint_view, mask = spec
    bits = tensor.contiguous().view(int_view).numpy().view(uint_view)
    return int(np.count_nonzero((bits & uint_view(mask)) == mask))


def check_finite_weights(path: Path, where: str) -> None:
    """`CorruptAdapter` unless every value of every tensor in the safetensors file at `path` is finite.

    Tensors are read one at a time (memory stays at the largest one, a few MB for a 14B LoRA), in
    whatever dtype they were saved (bf16 included).
    """
    try:
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                tensor = fh.get_tensor(key)
                bad = _nonfinite_count(tensor)
                if bad:
                    raise CorruptAdapter(
                        f"{where}/{WEIGHTS_FILE}: tensor {key[:120]!r} has {bad} non-finite values (NaN or inf) "
                        f"of {tensor.numel()}; a diverged adapter is not published"
                    )
    except (SafetensorError, OSError) as err:
        raise CorruptAdapter(f"{where}/{WEIGHTS_FILE}: not a readable safetensors file ({err}; truncated?)") from None


def _check_metadata(metadata: Mapping[str, str] | None, where: str) -> None:
    fmt = (metadata or {}).get("format", "pt")
    if fmt != "pt":
        raise IncompatibleAdapter(f"{where}/{WEIGHTS_FILE}: saved for framework {fmt!r}; vLLM loads 'pt' adapters")


def module_of(key: str) -> str:
    """Leaf module a weight key belongs to (`...mlp.down_proj.lora_A.weight` -> `down_proj`)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part.startswith("lora_") and i > 0:
            return parts[i - 1]
    return parts[-2] if len(parts) >= 2 else key


def _lora_pairs(specs: Mapping[str, TensorSpec], where: str) -> dict[str, tuple[TensorSpec, TensorSpec]]:
    """`{module path: (A, B)}`; every tensor must be a 2-D lora_A/lora_B weight of a servable dtype."""
    halves: dict[str, dict[str, TensorSpec]] = {}
    for key, spec in specs.items():
        for half in ("lora_A", "lora_B"):
            suffix = f".{half}.weight"
            if key.endswith(suffix) and key.count(suffix) == 1:
                halves.setdefault(key[: -len(suffix)], {})[half] = spec
                break
        else:
            raise IncompatibleAdapter(
                f"{where}/{WEIGHTS_FILE}: tensor {key[:120]!r} is not a LoRA weight (vLLM applies only "
                "'<module>.lora_A.weight' / '<module>.lora_B.weight'; modules_to_save and embeddings are not served)"
            )
        if spec.dtype not in SERVABLE_DTYPES:
            raise CorruptAdapter(
                f"{where}/{WEIGHTS_FILE}: tensor {key[:120]!r} has dtype {spec.dtype}; "
                f"LoRA weights must be one of {sorted(SERVABLE_DTYPES)}"
            )
        if len(spec.shape) != 2 or 0 in spec.shape:
            raise CorruptAdapter(f"{where}/{WEIGHTS_FILE}: tensor {key[:120]!r} has shape {list(spec.shape)}, not 2-D")
    pairs = {}
    for module, parts in sorted(halves.items()):
        if set(parts) != {"lora_A", "lora_B"}:
            raise CorruptAdapter(f"{where}/{WEIGHTS_FILE}: module {module[:120]!r} has lora_A or lora_B but not both")
        a, b = parts["lora_A"], parts["lora_B"]
        if a.shape[0] != b.shape[1]:
            raise CorruptAdapter(
                f"{where}/{WEIGHTS_FILE}: module {module[:120]!r} has lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)}: their ranks differ"
            )
        pairs[module] = (a, b)
    if not pairs:
        raise CorruptAdapter(f"{where}/{WEIGHTS_FILE}: no LoRA weights (lora_A / lora_B tensors) found")
    return pairs


def adapter_shape(
    config: dict[str, Any], specs: Mapping[str, TensorSpec], where: str, base_model: str | None
) -> AdapterShape:
    """Rank, alpha and modules as the weights show them, cross-checked with the config.

    The modules come from the tensor names, not from `target_modules` (which may be a regex), so
    a server's allow-list is checked against what will actually be applied.
    """
    pairs = _lora_pairs(specs, where)
    weight_rank = max(a.shape[0] for a, _ in pairs.values())
    declared = max([int(config["r"]), *(int(v) for v in (config.get("rank_pattern") or {}).values())])
    if weight_rank > declared:
        raise CorruptAdapter(f"{where}: weights have rank {weight_rank} but {CONFIG_FILE} declares at most {declared}")
    recorded = base_model if base_model is not None else config.get("base_model_name_or_path")
    return AdapterShape(
        rank=declared,
        alpha=float(config["lora_alpha"]),
        target_modules=tuple(sorted({module_of(m + ".lora_A.weight") for m in pairs})),
        base_model=str(recorded) if recorded else None,
    )


# --------------------------------------------------------------------------------------------
# Fit to a base model


@lru_cache(maxsize=8)
def base_weight_shapes(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """`{module path: weight shape}` of a local model directory's linear layers, from safetensors headers.

    None when `model_dir` is not a local directory of safetensors files (a hub name the machine has
    not downloaded): the name is still compared, the shapes cannot be.
    """
    directory = Path(model_dir)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        for key, spec in tensor_specs_of_file(file, str(directory)).items():
            if key.endswith(".weight") and len(spec.shape) == 2:
                shapes[key[: -len(".weight")]] = spec.shape
    return shapes


def _base_key(module: str) -> str:
    """PEFT's module path (`base_model.model.model.layers.0.mlp.up_proj`) as the base checkpoint names it."""
    prefix = "base_model.model."
    return module[len(prefix) :] if module.startswith(prefix) else module


def check_weights_fit_base(specs: Mapping[str, TensorSpec], base_model: str, where: str) -> None:
    """Every LoRA module exists in the base model and its A/B shapes match the base weight's (in, out).

    A no-op when the base model's weights are not on this machine (see `base_weight_shapes`).
    """
    base = base_weight_shapes(str(Path(base_model).expanduser()))
    if base is None:
        return
    for module, (a, b) in _lora_pairs(specs, where).items():
        weight = base.get(_base_key(module))
        if weight is None:
            raise IncompatibleAdapter(
                f"{where}: module {_base_key(module)[:120]!r} does not exist in base model {base_model!r}"
            )
        out_features, in_features = weight
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise IncompatibleAdapter(
                f"{where}: module {_base_key(module)[:120]!r} has lora_A {list(a.shape)} / lora_B "
                f"{list(b.shape)}, but the base weight is {list(weight)} "
                f"(expected lora_A [r, {in_features}], lora_B [{out_features}, r])"
            )


def check_compatible(
    version: AdapterVersion,
    max_rank: int,
    base_model: str | None = None,
    allowed_modules: set[str] | None = None,
) -> None:
    """Raise `IncompatibleAdapter` unless a server with these limits can apply `version`.

    Checked before loading, because vLLM reports a too-large rank or a foreign module as an engine
    error, and an adapter trained on another base model would load silently and play nonsense.
    An adapter that records no base model is rejected when the server names its base: it cannot
    be shown to fit. With a local base model, every module's shapes are compared with its weights.
    """
    problems = []
    if version.rank > max_rank:
        problems.append(f"rank {version.rank} exceeds the server's max LoRA rank {max_rank}")
    if base_model is not None:
        if version.base_model is None:
            problems.append(f"it records no base model, the server runs {base_model!r}")
        elif not same_base_model(version.base_model, base_model):
            problems.append(f"it was trained on base model {version.base_model!r}, the server runs {base_model!r}")
    if allowed_modules is not None:
        extra = sorted(set(version.target_modules) - set(allowed_modules))
        if extra:
            problems.append(
                f"it targets modules {extra} the server does not support (allowed: {sorted(allowed_modules)})"
            )
    if problems:
        raise IncompatibleAdapter(f"adapter {version.name} is incompatible: " + "; ".join(problems))
    if base_model is not None and str(version.path) not in ("", "."):
        specs = tensor_specs_of_file(version.path / WEIGHTS_FILE, f"{version.name} at {version.path}")
        check_weights_fit_base(specs, base_model, f"adapter {version.name} is incompatible")
