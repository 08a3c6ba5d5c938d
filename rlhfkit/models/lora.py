"""LoRA through peft: attach adapters for training, merge them for export."""

from __future__ import annotations

from typing import Any, Optional

from rlhfkit.errors import ConfigError


def lora_config(lora_dim: int, lora_alpha: Optional[float], module_names: str, task_type: str = "CAUSAL_LM"):
    from peft import LoraConfig

    targets = [m.strip() for m in module_names.split(",") if m.strip()]
    if not targets:
        raise ConfigError("--lora_module_name is empty: name at least one module (e.g. q_proj,v_proj)")
    return LoraConfig(r=lora_dim, lora_alpha=lora_alpha if lora_alpha is not None else lora_dim,
                      target_modules=targets, lora_dropout=0.0, bias="none", task_type=task_type)


def apply_lora(model: Any, lora_dim: int, lora_alpha: Optional[float], module_names: str,
               only_optimize_lora: bool, task_type: str = "CAUSAL_LM") -> Any:
    """Wrap ``model`` in a peft LoRA model. Unless ``only_optimize_lora``, the base weights keep
    training too (DeepSpeed-Chat's default); a reward/value head always trains."""
    if lora_dim <= 0:
        return model
    from peft import get_peft_model

    try:
        # adapters in the base weights' dtype: ZeRO-3 flattens a parameter group into one buffer of one
        # dtype (peft's default fp32 adapters beside bf16 weights stop it); ZeRO-0/2 cast them so anyway
        peft_model = get_peft_model(model, lora_config(lora_dim, lora_alpha, module_names, task_type),
                                    autocast_adapter_dtype=False)
    except ValueError as e:
        raise ConfigError(f"LoRA: {e} (check --lora_module_name {module_names})") from None
    for name, p in peft_model.named_parameters():
        if "lora_" in name or not only_optimize_lora or name.split(".")[-2] in ("score", "v_head"):
            p.requires_grad_(True)
    if only_optimize_lora and hasattr(peft_model, "enable_input_require_grads"):
        # the frozen embedding's output then records gradients, as the blocks' inputs do when everything
        # trains: ZeRO-3 gathers each transformer block for its backward in hooks that need them
        peft_model.enable_input_require_grads()
    return peft_model


def is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)


def param_groups(model: Any, weight_decay: float, lr: float, lora_lr: Optional[float]) -> list[dict]:
    """AdamW parameter groups: no decay on biases/norms; LoRA weights may have their own lr."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = name.endswith("bias") or "norm" in name.lower()
        is_lora = "lora_" in name
        groups.setdefault((no_decay, is_lora), []).append(p)
    out = []
    for (no_decay, is_lora), params in groups.items():
        out.append({"params": params, "weight_decay": 0.0 if no_decay else weight_decay,
                    "lr": (lora_lr if (is_lora and lora_lr is not None) else lr)})
    return out
