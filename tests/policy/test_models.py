"""Model presets and the offline tiny Qwen3: exact size, faithful save/load, determinism, vLLM."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import diprl.policy.models as models
from diprl.policy.models import (
    CONF_DIR,
    ModelPreset,
    ModelSource,
    TinyModelSpec,
    TokenizerKind,
    build_tiny_model,
    create_tiny_model,
    known_presets,
    load_preset,
    logits_width,
    preset_from_config,
    resolve_model_path,
)
from diprl.policy.tokenizer import QWEN3_VOCAB_LEN, STAMP_FILE, load_tokenizer
from diprl.torch_threads import torch_threads

CHAT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN_PROMPT_IDS = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]  # CHAT under Qwen3's tokenizer
QWEN_SPEC = TinyModelSpec(vocab_size=151936, tokenizer=TokenizerKind.qwen3)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return build_tiny_model(TinyModelSpec())


@pytest.fixture(scope="module")
def prompt_ids(tiny_dir: Path) -> list[int]:
    ids = load_tokenizer(tiny_dir).encode(CHAT)
    assert ids[0] == 1 and 2 in ids  # <|im_start|> and <|im_end|> are the compact ids 1 and 2
    return list(ids)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_parameter_count() -> None:
    # Per layer: q 64x128 + k 64x64 + v 64x64 + o 128x64 = 24,576; q_norm + k_norm 2 x 32 = 64;
    # MLP gate/up 64x128 + down 128x64 = 24,576; two RMSNorms 2 x 64 = 128 -> 49,344.
    # 2 layers = 98,688, final norm 64. Embeddings (the LM head is tied to them, counted once):
    # compact 1,024 x 64 = 65,536 -> 164,288; Qwen's 151,936 x 64 = 9,723,904 -> 9,822,656.
    model = create_tiny_model(TinyModelSpec())
    assert sum(p.numel() for p in model.parameters()) == 164_288
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in create_tiny_model(QWEN_SPEC).parameters()) == 9_822_656


def test_saved_model_loads_with_identical_logits(tiny_dir: Path, prompt_ids: list[int]) -> None:
    from transformers import AutoModelForCausalLM

    in_memory = create_tiny_model(TinyModelSpec())
    loaded = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        assert torch.equal(in_memory(ids).logits, loaded(ids).logits)

    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["tie_word_embeddings"], config["head_dim"], config["vocab_size"]) == (True, 32, 1024)
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 2)  # the compact <|endoftext|>, <|im_end|>
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]
    assert generation["pad_token_id"] == 0
    assert "temperature" not in generation  # vLLM would adopt sampling defaults silently
    tokenizer = load_tokenizer(tiny_dir)
    assert len(tokenizer) == 1024
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 2)


def test_the_qwen_tokenizer_spec_keeps_qwen_ids(tmp_path: Path) -> None:
    """A tiny model with Qwen3's tokenizer names Qwen3's ids, read from that tokenizer."""
    directory = build_tiny_model(QWEN_SPEC, tmp_path / "qwen")
    config = json.loads((directory / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (151936, 151643, 151645)
    generation = json.loads((directory / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == ([151645, 151643], 151643)
    tokenizer = load_tokenizer(directory)
    assert len(tokenizer) == QWEN3_VOCAB_LEN
    assert tokenizer.encode(CHAT) == QWEN_PROMPT_IDS


def test_a_spec_whose_vocabulary_does_not_fit_its_tokenizer_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"below the Qwen3 tokenizer's 151669 ids"):
        replace_tiny(TinyModelSpec(vocab_size=4096, tokenizer=TokenizerKind.qwen3))
    with pytest.raises(ValueError, match=r"at least 512 ids"):
        replace_tiny(TinyModelSpec(vocab_size=300))


def replace_tiny(spec: TinyModelSpec) -> ModelPreset:
    return ModelPreset(name="x", source=ModelSource.tiny, dtype="float32", max_model_len=2048, tiny=spec)


def test_logits_width_comes_from_the_preset(tmp_path: Path) -> None:
    assert logits_width(load_preset("tiny")) == 1024
    assert logits_width(replace_tiny(QWEN_SPEC)) == 151936
    local = tmp_path / "checkpoint"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 151936}))
    assert logits_width(ModelPreset(name="local", source=ModelSource.hub_or_path, path=str(local))) == 151936


def test_build_is_deterministic(tmp_path: Path) -> None:
    spec = TinyModelSpec(seed=0)
    first = build_tiny_model(spec, tmp_path / "a")
    second = build_tiny_model(spec, tmp_path / "b")
    assert _sha256(first / "model.safetensors") == _sha256(second / "model.safetensors")
    other_seed = build_tiny_model(TinyModelSpec(seed=1), tmp_path / "c")
    assert _sha256(other_seed / "model.safetensors") != _sha256(first / "model.safetensors")


def test_the_tied_head_can_express_a_confident_policy(prompt_ids: list[int]) -> None:
    """The frozen tied head bounds every logit by |final hidden| x |embedding row|; at transformers' init
    (std 0.02) that is +-1.3 for `tiny`, too little for any LoRA to make one of ten orders likely. Rows of
    norm about 1 give logits a std of about 1 over the vocabulary and a bound of +-8 (the hidden norm)."""
    model = create_tiny_model(TinyModelSpec())
    rows = model.model.embed_tokens.weight.detach().norm(dim=1)
    assert 0.8 < float(rows.mean()) < 1.2
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0]
    assert float(logits.std(dim=-1).mean()) > 0.5
    # Confidence reachable by moving the last hidden state alone: aligned with one row, that token's logit
    # is |h| |row| = sqrt(hidden) |row|, far above a typical other logit.
    assert 8.0 * float(rows.min()) > 4.0


def test_building_does_not_disturb_the_callers_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    create_tiny_model(TinyModelSpec())
    assert torch.equal(torch.rand(3), expected)


def test_cached_model_is_reused_and_a_corrupt_one_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = TinyModelSpec()
    target = build_tiny_model(spec, tmp_path / "tiny")
    weights_sha = _sha256(target / "model.safetensors")
    builds: list[Path] = []
    real = models._write_tiny_model

    def counting(spec: TinyModelSpec, tokenizer_dir: Path, out: Path) -> None:
        builds.append(out)
        real(spec, tokenizer_dir, out)

    monkeypatch.setattr(models, "_write_tiny_model", counting)
    assert build_tiny_model(spec, target) == target
    assert builds == []

    with (target / "model.safetensors").open("r+b") as fh:
        fh.truncate(1000)
    assert build_tiny_model(spec, target) == target
    assert len(builds) == 1
    assert _sha256(target / "model.safetensors") == weights_sha
    assert (target / STAMP_FILE).is_file()


def test_default_location_is_keyed_by_spec() -> None:
    assert models.tiny_model_dir_name(TinyModelSpec()) != models.tiny_model_dir_name(TinyModelSpec(seed=1))
    assert models.tiny_model_dir_name(TinyModelSpec()).startswith("tiny-qwen3-")


def test_preset_values() -> None:
    tiny, small, q8, q14 = (load_preset(n) for n in ("tiny", "small", "qwen3_8b", "qwen3_14b"))
    assert [p.name for p in (tiny, small, q8, q14)] == ["tiny", "small", "qwen3_8b", "qwen3_14b"]
    assert tiny.source is ModelSource.tiny and tiny.dtype == "float32" and tiny.tiny == TinyModelSpec()
    assert (tiny.lora.rank, tiny.lora.alpha, tiny.lora.target_modules) == (8, 16, ALL_LINEAR)
    assert small.source is ModelSource.tiny and small.dtype == "float32" and small.max_model_len == 4096
    assert small.tiny == TinyModelSpec(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4
    )
    assert (small.lora.rank, small.lora.alpha, small.lora.dropout) == (16, 32, 0.0)
    for preset, hub_id in ((q8, "Qwen/Qwen3-8B"), (q14, "Qwen/Qwen3-14B")):
        assert preset.source is ModelSource.hub_or_path and preset.path == hub_id and preset.dtype == "bfloat16"
        assert (preset.lora.rank, preset.lora.alpha) == (16, 32)
        assert preset.lora.target_modules == ALL_LINEAR
    assert known_presets() == [
        "qwen3_14b",
        "qwen3_8b",
        "small",
        "tiny",
        "tiny_dagger",
        "tiny_deep",
        "tiny_pretrained",
        "tiny_qwen",
        "tiny_wide",
    ]
    wide = load_preset("tiny_wide")  # the imitation warm start's: tiny's body and files, rank-32 adapters
    assert (wide.tiny, wide.lora.rank, wide.lora.alpha) == (tiny.tiny, 32, 64)
    assert resolve_model_path(wide) == resolve_model_path(tiny)


def test_hydra_composes_the_same_presets() -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for name in ("tiny", "qwen3_8b"):
            cfg = compose(config_name=None, overrides=[f"+model={name}"])
            assert preset_from_config(cfg.model) == load_preset(name)
        cfg = compose(config_name=None, overrides=["+model=qwen3_8b", "model.path=/data/Qwen3-8B"])
        assert preset_from_config(cfg.model).path == "/data/Qwen3-8B"
        # The base_model schema types the composed node: a wrong type fails at composition.
        with pytest.raises(Exception, match="rank"):
            compose(config_name=None, overrides=["+model=tiny", "model.lora.rank=many"])


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(KeyError, match=r"qwen3_7b.*known: qwen3_14b, qwen3_8b, small, tiny"):
        load_preset("qwen3_7b")


def _write_preset(conf_dir: Path, name: str, text: str) -> None:
    (conf_dir / "model").mkdir(parents=True, exist_ok=True)
    (conf_dir / "model" / f"{name}.yaml").write_text(text)


def test_bad_yaml_key_and_type_are_clear_errors(tmp_path: Path) -> None:
    good = (CONF_DIR / "model" / "tiny.yaml").read_text()
    _write_preset(tmp_path, "typo", good.replace("  rank: 8", "  rnak: 8"))
    with pytest.raises(ValueError, match=r"(?s)typo\.yaml.*rnak"):
        load_preset("typo", tmp_path)
    _write_preset(tmp_path, "wrong_type", good.replace("max_model_len: 4096", "max_model_len: lots"))
    with pytest.raises(ValueError, match=r"(?s)wrong_type\.yaml.*max_model_len"):
        load_preset("wrong_type", tmp_path)
    _write_preset(tmp_path, "bad_dtype", good.replace("dtype: float32", "dtype: fp8"))
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        load_preset("bad_dtype", tmp_path)
    _write_preset(tmp_path, "no_path", "name: no_path\nsource: hub_or_path\n")
    with pytest.raises(ValueError, match=r"needs 'path'"):
        load_preset("no_path", tmp_path)


def test_looking_up_an_unbuilt_model_is_a_clear_error_and_builds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found: a lookup built the tiny model (and its tokenizer) as a side effect, so deploying a server or
    starting an actor built it wherever that happened to run. Only `build_model` builds."""
    monkeypatch.setenv("DIPRL_CACHE_DIR", str(tmp_path))
    preset = load_preset("tiny")
    with pytest.raises(models.ModelNotBuilt, match=r"'tiny' is not built.*build_model"):
        resolve_model_path(preset)
    assert list(tmp_path.iterdir()) == []  # no tokenizer, no model: nothing was built
    built = models.build_model(preset)
    assert resolve_model_path(preset) == built == tmp_path / "models" / models.tiny_model_dir_name(TinyModelSpec())


def test_resolve_model_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> None:
    assert resolve_model_path(load_preset("tiny")) == tiny_dir

    local = ModelPreset(name="local", source=ModelSource.hub_or_path, path=str(tmp_path))
    assert resolve_model_path(local) == tmp_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"qwen3_8b.*HF_HUB_OFFLINE"):
        resolve_model_path(load_preset("qwen3_8b"))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert resolve_model_path(load_preset("qwen3_8b")) == "Qwen/Qwen3-8B"  # handed to vLLM as a hub id

    missing = ModelPreset(name="missing", source=ModelSource.hub_or_path, path=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(missing)


def test_vllm_loads_the_tiny_model_and_matches_transformers(
    tiny_dir: Path, prompt_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One engine start (about 10 s): greedy tokens and their logprobs agree with transformers."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with torch_threads():  # vLLM's CPU worker sets torch's thread count for serving
        llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=512, enforce_eager=True, seed=0)
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
        (result,) = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)
        completion = result.outputs[0]
        vllm_ids = list(completion.token_ids)
        vllm_logprobs = [step[token].logprob for step, token in zip(completion.logprobs or [], vllm_ids, strict=True)]
        del llm

    model = create_tiny_model(TinyModelSpec())
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
        hf_ids = out[0, len(prompt_ids) :].tolist()
        logprobs = torch.log_softmax(model(out).logits[0, len(prompt_ids) - 1 : -1], dim=-1)
    hf_logprobs = [logprobs[i, t].item() for i, t in enumerate(hf_ids)]

    assert len(vllm_ids) == 5
    assert vllm_ids == hf_ids
    assert vllm_logprobs == pytest.approx(hf_logprobs, abs=1e-4)
