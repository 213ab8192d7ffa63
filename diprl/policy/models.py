"""Model presets (tiny / Qwen3-8B / Qwen3-14B) and the offline tiny Qwen3 they can point to.

The embedded mode must run the whole actor/learner loop with no model hub, so the `tiny` and
`small` presets are real `Qwen3ForCausalLM`s (same architecture and chat format as Qwen3-8B, so
vLLM, PEFT and the learner exercise the code paths of the cluster) with random weights, built from
a seed into the cache. Their tokenizer is the compact BPE of `diprl.policy.compact_tokenizer`
(a few thousand ids: cheap to sample on a CPU, and the parameters go into the body instead of the
embedding); a spec can ask for Qwen's own tokenizer and 151,936-id width instead, which is how the
tests keep the real models' tokenizer under the constraint. Building is deterministic: the same
spec gives the same bytes, so logprob parity tests between vLLM and the learner are reproducible
anywhere.

Setup flows one way: an entry point (train, evaluate, the web app, a benchmark, the test session) calls
`build_model` once, up front, which builds the tokenizer, then the body from it. Everything after that
only looks the model up (`resolve_model_path`), which never builds: a lookup of a model nobody built is
a `ModelNotBuilt` error naming the fix, not a build hidden inside deploying a server or starting an actor.

Presets are typed dataclasses. The YAML files in `conf/model/` are the editable copies Hydra
composes (`model=tiny`); they extend the `base_model` schema registered in Hydra's ConfigStore, so a
typo'd key or a wrong type fails at composition, and `load_preset` applies the same schema when
read without Hydra: the YAML files are the one source of the presets. torch and transformers are
imported only when a model is actually built, so reading a preset stays cheap.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diprl.policy.compact_tokenizer import (
    MIN_VOCAB_SIZE,
    compact_tokenizer_fingerprint,
    compact_tokenizer_path,
)
from diprl.policy.tokenizer import (
    QWEN3_VOCAB_LEN,
    build_cached_dir,
    cache_root,
    fingerprint,
    hub_offline,
    looks_like_hub_id,
    qwen_tokenizer_path,
    tokenizer_fingerprint,
    verify_cached_dir,
)

if TYPE_CHECKING:
    from transformers import Qwen3Config, Qwen3ForCausalLM

TINY_RECIPE_VERSION = 2
"""Bump when `tiny_config` or the saved files change in a way the spec does not show."""

DTYPES = ("float32", "bfloat16", "float16")
QWEN3_LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every linear layer of a Qwen3 block; the LM head is tied to the embeddings and stays frozen."""

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


class ModelNotBuilt(FileNotFoundError):
    """A model was looked up before any entry point built it (`build_model`)."""


class TokenizerKind(StrEnum):
    """Which tokenizer a tiny model ships: the compact BPE, or Qwen3's own (the GPU models')."""

    compact = "compact"
    qwen3 = "qwen3"


class ModelSource(StrEnum):
    """Where the weights come from. Member names equal values so YAML can say `source: tiny`."""

    tiny = "tiny"
    hub_or_path = "hub_or_path"


@dataclass
class TinyModelSpec:
    """Shape, tokenizer and seed of the random tiny Qwen3.

    head_dim 32 because vLLM's CPU attention rejects 16. `vocab_size` is the logits width: for
    the compact tokenizer exactly its number of ids (the BPE is trained to that size); for
    `qwen3` at least the tokenizer's 151,669 ids (Qwen3 checkpoints use 151,936).
    """

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 1024
    tokenizer: TokenizerKind = TokenizerKind.compact
    seed: int = 0
    max_position_embeddings: int = 4096

    def problems(self) -> list[str]:
        """What is inconsistent in this spec (empty when it can be built)."""
        if self.tokenizer is TokenizerKind.qwen3 and self.vocab_size < QWEN3_VOCAB_LEN:
            return [f"vocab_size {self.vocab_size} is below the Qwen3 tokenizer's {QWEN3_VOCAB_LEN} ids"]
        if self.tokenizer is TokenizerKind.compact and self.vocab_size < MIN_VOCAB_SIZE:
            return [f"a compact vocabulary needs at least {MIN_VOCAB_SIZE} ids, got vocab_size {self.vocab_size}"]
        return []


@dataclass
class LoraSettings:
    """The LoRA adapter shape the learner trains and vLLM serves (`max_lora_rank` >= rank)."""

    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(QWEN3_LINEAR_MODULES))


@dataclass
class ModelPreset:
    """One base model and its adapter shape.

    `path` is a hub id or a local directory for `hub_or_path`; `tiny` is the spec for `tiny`, whose
    `path`, when set, names a trained body of that spec (relative paths from the repository root)
    instead of the seeded random one.
    `max_model_len` bounds prompt + completion for vLLM and the learner alike.
    """

    name: str
    source: ModelSource
    path: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int = 8192
    tiny: TinyModelSpec | None = None
    lora: LoraSettings = field(default_factory=LoraSettings)

    def __post_init__(self) -> None:
        problems = []
        if self.source is ModelSource.tiny and self.tiny is None:
            problems.append("source 'tiny' needs a 'tiny' spec")
        if self.source is ModelSource.hub_or_path and not self.path:
            problems.append("source 'hub_or_path' needs 'path' (a hub id or a local directory)")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len <= 0:
            problems.append(f"max_model_len must be positive, got {self.max_model_len}")
        if self.tiny is not None:
            problems.extend(self.tiny.problems())
        if self.tiny is not None and self.max_model_len > self.tiny.max_position_embeddings:
            problems.append(
                f"max_model_len {self.max_model_len} exceeds the tiny model's "
                f"max_position_embeddings {self.tiny.max_position_embeddings}"
            )
        if self.lora.rank <= 0 or self.lora.alpha <= 0:
            problems.append(f"LoRA rank and alpha must be positive, got {self.lora.rank}, {self.lora.alpha}")
        if not 0.0 <= self.lora.dropout < 1.0:
            problems.append(f"LoRA dropout must be in [0, 1), got {self.lora.dropout}")
        if not self.lora.target_modules:
            problems.append("LoRA target_modules is empty")
        if problems:
            raise ValueError(f"model preset {self.name!r}: " + "; ".join(problems))


def register_configs() -> None:
    """Register the `base_model` schema in Hydra's ConfigStore (group `model`).

    The YAML presets list it first in their defaults, so Hydra validates them against
    `ModelPreset`. The presets themselves are not stored under their own names: Hydra 1.3 would
    then "automatically match" each YAML file against the same-named node, a deprecated behaviour
    that warns on every composition.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="model", name="base_model", node=ModelPreset)


def _preset_dir(conf_dir: Path | None) -> Path:
    return (conf_dir if conf_dir is not None else CONF_DIR) / "model"


def known_presets(conf_dir: Path | None = None) -> list[str]:
    """Names of the YAML presets (`conf/model/<name>.yaml`)."""
    directory = _preset_dir(conf_dir)
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else []


def preset_from_config(cfg: Any) -> ModelPreset:
    """A `ModelPreset` from a composed Hydra node or a plain mapping, validated against the schema.

    A wrong key or type raises `ValueError` naming the offending key.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    raw = OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else dict(cfg)
    if not isinstance(raw, dict):
        raise ValueError(f"invalid model preset: expected a mapping, got {type(raw).__name__}")
    raw.pop("defaults", None)  # the YAML's Hydra defaults list (`base_model`, `_self_`)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ModelPreset), raw)
        preset = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ValueError(f"invalid model preset: {err}") from err
    assert isinstance(preset, ModelPreset)
    return preset


def load_preset(name: str, conf_dir: Path | None = None) -> ModelPreset:
    """Read `conf/model/<name>.yaml` into a validated `ModelPreset`.

    Raises `KeyError` listing the known presets for an unknown name and `ValueError` naming the file
    and key for a typo'd key, a wrong type or an inconsistent preset.
    """
    from omegaconf import OmegaConf

    path = _preset_dir(conf_dir) / f"{name}.yaml"
    if not path.is_file() or "/" in name or name.startswith("."):
        known = ", ".join(known_presets(conf_dir)) or "none"
        raise KeyError(f"unknown model preset {name!r} (known: {known}; looked in {path.parent})")
    try:
        return preset_from_config(OmegaConf.load(path))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def spec_tokenizer_path(spec: TinyModelSpec) -> Path:
    """The built tokenizer directory a tiny model of `spec` ships (built on first use)."""
    if spec.tokenizer is TokenizerKind.qwen3:
        return qwen_tokenizer_path()
    return compact_tokenizer_path(spec.vocab_size)


def spec_tokenizer_fingerprint(spec: TinyModelSpec) -> str:
    """The content key of the tokenizer `spec` ships, part of the tiny model's own key."""
    if spec.tokenizer is TokenizerKind.qwen3:
        return tokenizer_fingerprint()
    return compact_tokenizer_fingerprint(spec.vocab_size)


@dataclass(frozen=True)
class ChatTokenIds:
    """The ids the model config and generation config name, read from the tokenizer itself."""

    endoftext: int
    im_end: int


def chat_token_ids(tokenizer_dir: Path) -> ChatTokenIds:
    """`<|endoftext|>` and `<|im_end|>` as the tokenizer in `tokenizer_dir` numbers them."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = {token: backend.token_to_id(token) for token in ("<|endoftext|>", "<|im_end|>")}
    endoftext, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    if endoftext is None or im_end is None:
        raise ValueError(f"tokenizer in {tokenizer_dir} lacks <|endoftext|> or <|im_end|>: {ids}")
    return ChatTokenIds(endoftext=endoftext, im_end=im_end)


def tiny_config(spec: TinyModelSpec, ids: ChatTokenIds | None = None) -> Qwen3Config:
    """The Qwen3-8B configuration shrunk to `spec`: same rope, norms and tied embeddings, and the
    chat token ids of the spec's tokenizer (read from it when `ids` is not given)."""
    from transformers import Qwen3Config

    if ids is None:
        ids = chat_token_ids(spec_tokenizer_path(spec))
    return Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        max_window_layers=spec.num_hidden_layers,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=True,
        bos_token_id=ids.endoftext,
        eos_token_id=ids.im_end,
        architectures=["Qwen3ForCausalLM"],
    )


def create_tiny_model(spec: TinyModelSpec, ids: ChatTokenIds | None = None) -> Qwen3ForCausalLM:
    """A freshly initialised tiny Qwen3 in float32, seeded so the weights depend on `spec` only.

    The global torch RNG is restored afterwards: building a model must not shift a caller's
    random stream.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(tiny_config(spec, ids))
        torch.nn.init.normal_(model.model.embed_tokens.weight, std=embedding_std(spec))
    return model.float().eval()


def embedding_std(spec: TinyModelSpec) -> float:
    """Init std of the tied embedding: 1/sqrt(hidden), so an embedding row has norm about 1.

    Why not transformers' 0.02: the embedding is also the (frozen, tied) LM head, and the final RMSNorm
    (weight 1, frozen too) gives the last hidden state a norm of sqrt(hidden). A logit is their dot
    product, so with rows of norm 0.02 * sqrt(hidden) no hidden state can move a logit beyond
    +-0.02 * hidden: +-1.3 for `tiny`, where the best of ten legal targets could never get more than
    about 30% of the probability, whatever LoRA learned. The policy stayed near uniform (entropy 1.05 a
    token after 1,000 steps, sampled returns flat). Rows of norm 1 give logits a range of +-sqrt(hidden)
    (+-8 for `tiny`): a trained model can be confident, and at init the logits have a std of about 1 over
    the vocabulary, as in a pretrained LM (docs/results.md, "What unlocked learning").
    """
    return float(spec.hidden_size) ** -0.5


def tiny_model_dir_name(spec: TinyModelSpec) -> str:
    """`tiny-qwen3-<hash>`: one cache directory per distinct spec (and recipe version)."""
    return "tiny-qwen3-" + fingerprint({"recipe": TINY_RECIPE_VERSION, "spec": asdict(spec)})[:12]


def _tiny_model_key(spec: TinyModelSpec) -> str:
    """The content key of a built tiny model: its spec, the recipe and its tokenizer (no build needed)."""
    tokenizer = spec_tokenizer_fingerprint(spec)
    return fingerprint({"recipe": TINY_RECIPE_VERSION, "spec": asdict(spec), "tokenizer": tokenizer})


def save_tiny_model(model: Qwen3ForCausalLM, spec: TinyModelSpec, out: Path, tokenizer_dir: Path | None = None) -> None:
    """`model` (of `spec`'s shape) as a loadable checkpoint: safetensors, config, generation config, tokenizer.

    The seeded random body and a pretrained one (`diprl.imitation.pretrain`) are written alike, so vLLM,
    PEFT and the learner load either the same way. `tokenizer_dir`: the spec's built tokenizer (built
    here when not given).
    """
    import shutil

    from transformers import GenerationConfig

    tokenizer_dir = tokenizer_dir if tokenizer_dir is not None else spec_tokenizer_path(spec)
    ids = chat_token_ids(tokenizer_dir)
    model.save_pretrained(out, safe_serialization=True)
    # No sampling defaults: vLLM would adopt them silently as request defaults.
    GenerationConfig(
        bos_token_id=ids.endoftext, eos_token_id=[ids.im_end, ids.endoftext], pad_token_id=ids.endoftext
    ).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)


def tiny_model_dir(spec: TinyModelSpec) -> Path:
    """Where the seeded tiny model of `spec` lives once built: `<cache_root()>/models/tiny-qwen3-<hash>`."""
    return cache_root() / "models" / tiny_model_dir_name(spec)


def build_tiny_model(spec: TinyModelSpec, out_dir: Path | None = None) -> Path:
    """Directory of a loadable tiny Qwen3 checkpoint (safetensors, config, generation config,
    tokenizer), built when missing and reused while its stamp verifies.

    The tokenizer is built first and handed down, so the body, its config and the copied tokenizer
    files all come from one directory. `out_dir` defaults to `tiny_model_dir(spec)`. The directory is
    written to a temp sibling and renamed into place, so a concurrent or killed build never leaves
    a half-written model; a changed tokenizer recipe or a corrupt file triggers a rebuild.
    """
    target = out_dir if out_dir is not None else tiny_model_dir(spec)
    key = _tiny_model_key(spec)
    if verify_cached_dir(target, key):
        return target
    tokenizer_dir = spec_tokenizer_path(spec)
    return build_cached_dir(target, key, lambda out: _write_tiny_model(spec, tokenizer_dir, out))


def _write_tiny_model(spec: TinyModelSpec, tokenizer_dir: Path, out: Path) -> None:
    save_tiny_model(create_tiny_model(spec, chat_token_ids(tokenizer_dir)), spec, out, tokenizer_dir)


def build_model(preset: ModelPreset | str) -> Path | str:
    """Build what `preset` needs on this machine (tokenizer and seeded body of a tiny preset) and return
    its path: what an entry point calls once, up front, before anything looks the model up.

    A name is a preset's (`conf/model/<name>.yaml`), or else a checkpoint path (a server's `model`),
    returned as it is: nothing of ours to build.
    """
    if isinstance(preset, str):
        if preset not in known_presets():
            return preset
        preset = load_preset(preset)
    if preset.source is ModelSource.tiny and preset.tiny is not None and not preset.path:
        return build_tiny_model(preset.tiny)
    return resolve_model_path(preset)


def resolve_model_path(preset: ModelPreset) -> Path | str:
    """What to hand to vLLM / transformers for `preset`: a local directory, or a hub id. Never builds.

    A seeded tiny model is found where `build_model` put it (`ModelNotBuilt` before that). A real
    preset's `path` is used when it is a local directory; otherwise it must be a hub id. With
    `HF_HUB_OFFLINE` set a hub id resolves only to a snapshot already in the local Hugging Face cache,
    and anything else is a clear error here rather than a network timeout deep inside vLLM.
    """
    if preset.source is ModelSource.tiny:
        if preset.tiny is None:
            raise ValueError(f"model preset {preset.name!r}: source 'tiny' needs a 'tiny' spec")
        if preset.path:
            return pretrained_tiny_dir(preset)
        directory = tiny_model_dir(preset.tiny)
        if not verify_cached_dir(directory, _tiny_model_key(preset.tiny)):
            raise ModelNotBuilt(
                f"model preset {preset.name!r} is not built on this machine (no verified model at {directory}): "
                "entry points build it up front with `diprl.policy.models.build_model(preset)`; call that first"
            )
        return directory
    if not preset.path:
        raise ValueError(f"model preset {preset.name!r}: source 'hub_or_path' needs 'path'")
    local = Path(preset.path).expanduser()
    if local.is_dir():
        return local
    if not looks_like_hub_id(preset.path):
        raise FileNotFoundError(f"model preset {preset.name!r}: local model directory {preset.path!r} does not exist")
    if not hub_offline():
        return preset.path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(preset.path, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError) as err:
        raise FileNotFoundError(
            f"model preset {preset.name!r}: {preset.path!r} is neither a local directory nor in the local "
            f"Hugging Face cache, and HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')} forbids downloading it. "
            "Set the preset's path to a local checkout, or unset HF_HUB_OFFLINE where the hub is reachable."
        ) from err


def preset_tokenizer_path(preset: ModelPreset) -> Path | str:
    """Where `preset`'s tokenizer is, without building or requiring its weights: a tiny preset's is its
    spec's (the random body and a pretrained one ship the same files), a real model's is its own."""
    if preset.tiny is not None:
        return spec_tokenizer_path(preset.tiny)
    return resolve_model_path(preset)


def repo_path(path: str) -> Path:
    """`path` as given when absolute, else relative to the repository root (where `conf/` and `zoo/` live),
    so a preset that names shipped weights resolves the same from any working directory (Ray workers too)."""
    local = Path(path).expanduser()
    return local if local.is_absolute() else CONF_DIR.parent / local


def pretrained_tiny_dir(preset: ModelPreset) -> Path:
    """The directory of a tiny preset's trained body (`path`), checked against its spec.

    A tiny preset with a `path` is a body trained on the game (`python -m diprl.imitation.pretrain`)
    instead of the seeded random one: the spec still says its shape and tokenizer, which every consumer
    (masks, plan, vocabulary) reads, so weights of another shape are refused here, not deep in vLLM.
    """
    import json

    assert preset.tiny is not None and preset.path
    directory = repo_path(preset.path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"model preset {preset.name!r}: no trained body at {directory} (config.json missing); "
            f"build it with `python -m diprl.imitation.pretrain model={preset.name}`"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"model preset {preset.name!r}: unreadable {config_file} ({err})") from err
    spec = preset.tiny
    expected = {
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
    }
    wrong = {k: (config.get(k), v) for k, v in expected.items() if config.get(k) != v}
    if wrong:
        detail = ", ".join(f"{k} {got} (spec {want})" for k, (got, want) in sorted(wrong.items()))
        raise ValueError(f"model preset {preset.name!r}: the body at {directory} does not fit its spec: {detail}")
    return directory


def logits_width(preset: ModelPreset) -> int:
    """Rows of the preset's LM head: the width of every logits row and constraint mask.

    A tiny preset says it in its spec; a real model's `config.json` does (Qwen3-8B/14B: 151,936,
    more than its tokenizer's ids).
    """
    if preset.tiny is not None:
        return preset.tiny.vocab_size
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(resolve_model_path(preset)))
    return int(config.vocab_size)


register_configs()


def random_lora_model(seed: int, rank: int = 8, alpha: int | None = None) -> Any:
    """A PEFT LoRA model on the tiny Qwen3 whose lora_A / lora_B weights are ~ N(0, 0.02²) from `seed`.

    PEFT initialises lora_B to zeros (a fresh adapter computes exactly the base model), so tests and
    benchmarks that need adapters which really differ from the base and from each other use these.
    The base is loaded from the built tiny directory, so `base_model_name_or_path` is what vLLM serves.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    preset = load_preset("tiny")
    base = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(preset)), dtype=torch.float32).eval()
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(preset.lora.target_modules),
        lora_dropout=0.0,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model.eval()


def save_random_lora(out_dir: Path, seed: int, rank: int = 8) -> Path:
    """`random_lora_model(seed, rank)` saved with `save_pretrained` (safetensors) into `out_dir`."""
    random_lora_model(seed, rank).save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir
