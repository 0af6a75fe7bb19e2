"""Shape and numerics of a Llama-family checkpoint, read from its HF config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        """Build from a HF ``config.json`` dict; raises ValueError for unsupported architectures."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_ARCHS}")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers 5 moved rope settings into "rope_parameters"; older configs use top-level keys.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or (rope if rope else None)
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            scaling["rope_type"] = kind
            scaling.pop("type", None)
            scaling.pop("rope_theta", None)
            if kind == "default":
                scaling = None
        max_pos = cfg.get("max_position_embeddings", 2048)
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window", model_type == "mistral"):
            # Attention here is full-context; capping the context at the window keeps it exact.
            max_pos = min(max_pos, int(window))
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token across all layers, for 4-byte elements (scale by dtype size / 4)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every weight tensor a checkpoint of this shape holds, with its shape (HF parameter names)."""
    h, hd, inter = args.hidden_size, args.head_dim, args.intermediate_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (args.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (args.vocab_size, h),
    }
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
        if args.attention_bias:
            shapes.update({
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            })
    return shapes
