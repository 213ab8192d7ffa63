"""Immutable, verified LoRA adapter versions (`<policy>@v<N>`) and how a replica reads them.

The learner publishes, the league refers to versions by name, and every `PolicyServer` replica
loads them on first use. One module per job:

- `names`: the one parser of `base` / `<policy>@v<N>`, the error classes, base-model identity;
- `files`: what makes PEFT files servable (config, safetensors header, fit to a base model);
- `manifest`: the per-version record of sizes and hashes, parsed as untrusted input;
- `pins`: each version's fingerprint, recorded at publish time away from its files;
- `store`: `AdapterStore`, atomic immutable publishing and verified reading.

Everything other code uses is importable from here (`from diprl.inference.adapters import ...`).
"""

from diprl.adapter_files import ADAPTER_FILES, CONFIG_FILE, WEIGHTS_FILE
from diprl.inference.adapters.files import (
    MANIFEST_FILE,
    AdapterShape,
    base_weight_shapes,
    check_compatible,
    check_weights_fit_base,
)
from diprl.inference.adapters.manifest import MANIFEST_FORMAT, AdapterFile, AdapterVersion
from diprl.inference.adapters.names import (
    BASE,
    MAX_VERSION,
    AdapterError,
    CorruptAdapter,
    IncompatibleAdapter,
    InvalidAdapterName,
    UnknownAdapter,
    base_model_key,
    model_ref,
    same_base_model,
    validate_policy_name,
)
from diprl.inference.adapters.pins import PINS_DIR, read_pin
from diprl.inference.adapters.store import INDEX_FILE, INDEX_FORMAT, AdapterStore, SavesPretrained

__all__ = [
    "ADAPTER_FILES",
    "BASE",
    "CONFIG_FILE",
    "INDEX_FILE",
    "INDEX_FORMAT",
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "MAX_VERSION",
    "PINS_DIR",
    "WEIGHTS_FILE",
    "AdapterError",
    "AdapterFile",
    "AdapterShape",
    "AdapterStore",
    "AdapterVersion",
    "CorruptAdapter",
    "IncompatibleAdapter",
    "InvalidAdapterName",
    "SavesPretrained",
    "UnknownAdapter",
    "base_model_key",
    "base_weight_shapes",
    "check_compatible",
    "check_weights_fit_base",
    "model_ref",
    "read_pin",
    "same_base_model",
    "validate_policy_name",
]
