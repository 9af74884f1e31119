"""LoRA adapters merged into the DiT weights at load.

Accepted key styles (all map to our diffusers-named parameters):
- original / ComfyUI names (`blocks.N.attn.qkv_proj`, `token_refiner.blocks.N...`, `final_layer...`),
  optionally prefixed `diffusion_model.` or `model.diffusion_model.` (ai-toolkit, ComfyUI);
- diffusers names (`transformer_blocks.N.attn.to_q`), optionally prefixed `transformer.`;
- musubi-tuner flattened names (`lora_unet_blocks_0_attn_qkv_proj`);
- pairs named `lora_A`/`lora_B` (peft, with or without a `.default` infix) or `lora_down`/`lora_up`
  (kohya, with an optional per-layer `.alpha`; a `__metadata__` "alpha" is the network alpha);
- full deltas `.diff` (weight) / `.diff_b` (bias);
- full replacement tensors for pruned checkpoints (`adaln_proj.linear.weight|bias`, `adaln_t_table`,
  also written `.set_weight`), merged as base + strength * (new - base).
- a PDD head bank beside the pairs (pdd.py: `proj_out.weight` [32, 96, 5376], ..., or ComfyUI's converted
  `final_layer.video_out.set_weight` [32 x 96, 5376], ...), installed whole on the DiT (`head_bank`) for recipe
  pdd to mix per step; pairs written without `.weight` (`...to_q.lora_down`) as PDD files have them.

A fused qkv LoRA shares lora_A and splits lora_B into q, k, v (stacked, or per-head interleaved
for DiffSynth's peft dumps); an original-named fc1 LoRA swaps the halves of lora_B, `.diff` and
`.diff_b` ([gate; value] -> [value; gate]).
Keys that map to nothing are an error: a half-applied LoRA is worse than none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import CheckpointError, InputError
from .keymap import original_layer_to_diffusers, split_qkv, swap_halves
from .pdd import bank_part, check_bank_strength, read_head_bank

_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.", "base_model.model.")
_PAIR = re.compile(r"^(?P<layer>.+?)\.(?:(?P<peft>lora_[AB])(?:\.default)?|(?P<kohya>lora_down|lora_up))(?:\.weight)?$")
_REPLACEMENT = re.compile(r"^(?P<layer>.+?)\.(?:set_)?(?P<param>weight|bias)$")


@dataclass
class LoraSpec:
    path: Path
    strength: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "LoraSpec":
        """`PATH` or `PATH:STRENGTH` (the last colon splits, so Windows drive letters survive)."""
        path, strength = text, 1.0
        head, sep, tail = text.rpartition(":")
        if sep and head:
            try:
                strength = float(tail)
                path = head
            except ValueError:
                pass
        return cls(Path(path), strength)


def _strip(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


class _LayerResolver:
    """Maps a LoRA layer name in any accepted style to (diffusers layer, kind)."""

    def __init__(self, model):
        self.diffusers_layers = {name.rpartition(".")[0] for name in lora_targets(model)}
        self.flat: dict[str, str] = {}
        for layer in self.diffusers_layers:
            self.flat[layer.replace(".", "_")] = layer
        for block in range(model.config.num_layers):
            for name in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2", "adaln_proj.linear"):
                self.flat[f"blocks.{block}.{name}".replace(".", "_")] = f"blocks.{block}.{name}"
        for block in range(model.config.num_refiner_layers):
            for name in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
                original = f"token_refiner.blocks.{block}.{name}"
                self.flat[original.replace(".", "_")] = original
        for original in ("video_patch_proj", "audio_patch_proj", "condition_proj", "final_layer.adaln_proj.linear",
                         "final_layer.video_out", "final_layer.audio_out", "time_embedder.proj_in",
                         "time_embedder.proj_out"):
            self.flat[original.replace(".", "_")] = original

    def resolve(self, layer: str) -> str | None:
        layer = _strip(layer)
        if layer.startswith("lora_unet_"):
            layer = self.flat.get(layer[len("lora_unet_"):], "")
        if layer in self.diffusers_layers:
            return layer
        mapped = original_layer_to_diffusers(layer)
        if mapped is not None and (mapped in self.diffusers_layers or mapped.endswith(".attn.to_qkv")):
            return mapped
        return None


def check_lora_path(path: Path) -> None:
    """What can be said of a LoRA path before reading it: it exists and is a safetensors file."""
    if not path.is_file():
        raise InputError(f"{path}: no such LoRA file")
    if path.suffix != ".safetensors":
        raise InputError(f"{path}: LoRAs load from .safetensors only (pickle files are refused)")


def read_lora(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    check_lora_path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    return tensors, metadata


def lora_targets(model) -> dict[str, tuple[int, ...]]:
    """Every parameter a LoRA may change, with its shape: the model's parameters and the weights of the linears
    kept in their stored form (StoredLinear), which a merge first turns dense (`dense_weights`)."""
    from ...kernels.stored_linear import StoredLinear

    out = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, StoredLinear):
            out[f"{name}.weight"] = module.shape
    return out


@torch.no_grad()
def dense_weights(model, params) -> int:
    """The StoredLinears owning any of `params` become nn.Linears of their exact dequantized weight (a LoRA
    merges into values, not into int8 or FP4 codes); returns how many. They then hold the compute dtype's
    bytes: the price of a merged LoRA on a quantized file, paid by the layers it touches only."""
    from ...kernels.stored_linear import StoredLinear

    changed = 0
    for owner in sorted({p.rpartition(".")[0] for p in params if p.endswith(".weight")}):
        module = model.get_submodule(owner) if owner else model
        if not isinstance(module, StoredLinear):
            continue
        model.set_submodule(owner, module.to_linear())
        changed += 1
    return changed


def _network_alpha(metadata: dict[str, str]) -> float | None:
    for key in ("alpha", "ss_network_alpha", "lora_alpha"):
        if key in metadata:
            try:
                return float(metadata[key])
            except ValueError:
                raise CheckpointError(f"LoRA metadata {key}={metadata[key]!r} is not a number") from None
    return None


def _original_fc1(raw_layer: str) -> bool:
    """Whether a LoRA layer is fc1 under original names, whose rows are [gate; value] where ours are
    [value; gate]: every output-side tensor (lora_B, .diff, .diff_b) needs its halves swapped."""
    return raw_layer.endswith(("mlp.fc1", "mlp_fc1"))


@dataclass
class _Op:
    """One change to one parameter, resolved (names, shapes) before any arithmetic."""

    kind: str  # "delta" (lora pair or diff) or "replace"
    param: str
    shape: tuple[int, ...]
    compute: object  # () -> fp32 tensor: the delta, or the replacement value


def plan_lora(model, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
              interleaved_qkv: bool = False) -> tuple[list[_Op], list[str]]:
    """(operations, unmatched keys). Products are deferred so merging holds one delta at a time."""
    resolver = _LayerResolver(model)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    ops: list[_Op] = []
    unmatched: list[str] = []
    alphas = {k[: -len(".alpha")]: v for k, v in tensors.items() if k.endswith(".alpha")}
    for key, value in tensors.items():
        if key.endswith(".alpha") or bank_part(key, value.ndim) is not None:
            continue  # a head bank is installed whole (read_head_bank), not merged
        m = _PAIR.match(key)
        if m:
            part = {"lora_A": "down", "lora_down": "down", "lora_B": "up", "lora_up": "up"}[m["peft"] or m["kohya"]]
            pairs.setdefault(m["layer"], {})[part] = value
            continue
        if key.endswith((".diff", ".diff_b")):
            layer = resolver.resolve(key.rsplit(".", 1)[0])
            if layer is None or layer.endswith("to_qkv"):
                unmatched.append(key)
            else:
                param = "weight" if key.endswith(".diff") else "bias"
                # Swapped when applied, after the shape check, so a misfit is reported as one.
                swap = swap_halves if _original_fc1(key.rsplit(".", 1)[0]) else (lambda t: t)
                ops.append(_Op("delta", f"{layer}.{param}", tuple(value.shape), lambda v=value, f=swap: f(v).float()))
            continue
        if _strip(key) == "adaln_t_table":
            ops.append(_Op("replace", "adaln_t_table", tuple(value.shape), lambda v=value: v.float()))
            continue
        r = _REPLACEMENT.match(key)
        layer = resolver.resolve(r["layer"]) if r else None
        if r and layer is not None and (".adaln_proj.linear" in layer or layer == "norm_out.linear"):
            ops.append(_Op("replace", f"{layer}.{r['param']}", tuple(value.shape), lambda v=value: v.float()))
            continue
        unmatched.append(key)

    network_alpha = _network_alpha(metadata)
    config = model.config
    for raw_layer, parts in pairs.items():
        layer = resolver.resolve(raw_layer)
        if layer is None or set(parts) != {"down", "up"}:
            unmatched.append(raw_layer)
            continue
        down, up = parts["down"], parts["up"]
        rank = down.shape[0]
        if down.ndim != 2 or up.ndim != 2 or up.shape[1] != rank:
            raise CheckpointError(f"{raw_layer}: LoRA down {tuple(down.shape)} and up {tuple(up.shape)} do not pair")
        alpha = alphas.get(raw_layer)
        alpha = float(alpha) if alpha is not None else (network_alpha if network_alpha is not None else rank)
        scale = alpha / rank
        if layer.endswith(".attn.to_qkv"):
            base = layer[: -len(".to_qkv")]
            ups = split_qkv(up, config.num_attention_heads, config.attention_head_dim,
                            "interleaved" if interleaved_qkv else "stacked")
            for name, u in zip(("to_q", "to_k", "to_v"), ups):
                ops.append(_Op("delta", f"{base}.{name}.weight", (u.shape[0], down.shape[1]),
                               lambda u=u, d=down, s=scale: s * (u.float() @ d.float())))
            continue
        if _original_fc1(raw_layer):
            up = swap_halves(up)
        ops.append(_Op("delta", f"{layer}.weight", (up.shape[0], down.shape[1]),
                       lambda u=up, d=down, s=scale: s * (u.float() @ d.float())))
    return ops, unmatched


@torch.no_grad()
def apply_loras(model, specs: list[LoraSpec], *, base: dict[str, torch.Tensor] | None = None) -> list[dict]:
    """Merge each LoRA into the model's weights; returns one report per LoRA.

    Every key is resolved and every shape checked before the first weight changes, so a bad
    file leaves the model untouched; then each delta is made and added on its own, so a LoRA
    over the whole 33 B model never needs more than one layer's fp32 delta at a time.
    """
    targets = lora_targets(model)
    reports = []
    originals: dict[str, torch.Tensor] = {}
    bank, bank_spec = None, None
    for spec in specs:
        tensors, metadata = read_lora(spec.path)
        interleaved = any(".default." in k for k in tensors)
        ops, unmatched = plan_lora(model, tensors, metadata, interleaved_qkv=interleaved)
        if unmatched:
            raise CheckpointError(
                f"{spec.path}: {len(unmatched)} LoRA tensors match no H3 layer, e.g. {', '.join(sorted(unmatched)[:3])}"
            )
        spec_bank = read_head_bank(spec.path, tensors, metadata, model.config, device=model.proj_out.weight.device)
        if not ops and spec_bank is None:
            raise CheckpointError(f"{spec.path}: holds no LoRA tensors")
        if spec_bank is not None:
            _check_bank_spec(spec, bank_spec)
            bank, bank_spec = spec_bank, spec
        for op in ops:
            if op.param not in targets:
                raise CheckpointError(f"{spec.path}: {op.param} is not a parameter of this model")
        for op in ops:
            shape = targets[op.param]
            if op.shape != shape:
                if op.kind == "replace":
                    raise CheckpointError(
                        f"{spec.path}: replacement {op.param} {op.shape} does not fit this model "
                        f"({shape}); pruned-checkpoint LoRAs need a pruned checkpoint")
                raise CheckpointError(
                    f"{spec.path}: {op.param} delta {op.shape} does not fit the weight {shape}"
                    + (" (a LoRA for full checkpoints on a pruned one?)" if "adaln" in op.param else ""))
        dense_weights(model, [op.param for op in ops])
        params = dict(model.named_parameters())
        for op in ops:
            param = params[op.param]
            value = op.compute().to(param.device)
            if op.kind == "delta":
                param.copy_((param.float() + spec.strength * value).to(param.dtype))
            else:
                # Relative to the loaded base, so two pruned LoRAs add up instead of overwriting each other.
                start = originals.setdefault(op.param, (base or {}).get(op.param, param.detach().float().clone()))
                param.copy_((param.float() + spec.strength * (value - start.to(param.device))).to(param.dtype))
            del value
        reports.append({"path": str(spec.path), "strength": spec.strength,
                        "merged": sum(op.kind == "delta" for op in ops),
                        "replaced": sum(op.kind == "replace" for op in ops),
                        **({"head_bank": spec_bank.count} if spec_bank is not None else {})})
    if bank is not None:
        model.head_bank = bank
    return reports


def _check_bank_spec(spec: LoraSpec, earlier: LoraSpec | None) -> None:
    """One head bank per DiT (the heads replace each other, they do not add up), at strength 1."""
    if earlier is not None:
        raise CheckpointError(f"{earlier.path} and {spec.path} both carry a PDD head bank: load one PDD LoRA")
    check_bank_strength(spec.path, spec.strength)


# ------------------------------------------------------------------------------------------ headers only
# What a LoRA layer changes, told by its name in any accepted style (dots or musubi's underscores), in order.
_LAYER_KINDS = (("VSA gate", re.compile(r"to_gate_compress")),
                ("final AdaLN", re.compile(r"final_layer[._]adaln_proj|norm_out[._]linear")),
                ("AdaLN", re.compile(r"adaln_proj")),
                ("attention q/k/v", re.compile(r"qkv_proj|to_q(?:kv)?$|to_[kv]$|to_q(?:kv)?[._]|to_[kv][._]")),
                ("attention out", re.compile(r"out_proj|to_out")),
                ("feed-forward", re.compile(r"mlp[._]fc[12]|ff[._]net")),
                ("output heads", re.compile(r"video_out|audio_out|proj_out")))
_BLOCK_INDEX = re.compile(r"(?:^|[._])(?:transformer_blocks|blocks)[._](\d+)[._]")


def _layer_kind(layer: str) -> str:
    return next((kind for kind, rx in _LAYER_KINDS if rx.search(layer)), "other")


def is_lora_file(keys) -> bool:
    """Whether tensor names are a LoRA's: low-rank pairs, full deltas or replacement tensors, no model weights."""
    return any(_PAIR.match(k) or k.endswith((".diff", ".diff_b", ".set_weight", ".set_bias")) for k in keys)


def lora_facts(keys: list[str], shape, metadata: dict[str, str]) -> dict:
    """What a LoRA file holds, from its names and shapes (`shape(key)`) alone: naming style, pair naming, targets
    by kind with their ranks, the DiT and refiner blocks it reaches, its AdaLN adapters' input width (none, the
    full model's time_embed_dim, or a pruned DiT's curve width), replacements, head bank, alpha, and the keys no
    accepted style reads. Which model it fits and what it was trained for the names cannot tell."""
    pairs: dict[str, dict[str, str]] = {}
    extra = {"full deltas (.diff / .diff_b)": 0, "replacements (set / adaln_t_table)": 0}
    bank, alphas, unread = 0, 0, []
    for key in keys:
        if key.endswith(".alpha"):
            alphas += 1
        elif bank_part(key, len(shape(key))) is not None:
            bank += 1
        elif (m := _PAIR.match(key)):
            part = "down" if (m["peft"] or m["kohya"]) in ("lora_A", "lora_down") else "up"
            pairs.setdefault(m["layer"], {})[part] = key
        elif key.endswith((".diff", ".diff_b")):
            extra["full deltas (.diff / .diff_b)"] += 1
        elif _strip(key) == "adaln_t_table" or key.endswith((".set_weight", ".set_bias")) or \
                (_REPLACEMENT.match(key) and "adaln_proj" in key):
            extra["replacements (set / adaln_t_table)"] += 1
        else:
            unread.append(key)
    targets: dict[str, dict] = {}
    adaln_widths, dit_blocks, refiner_blocks, half = set(), set(), set(), []
    for layer, parts in sorted(pairs.items()):
        if set(parts) != {"down", "up"}:
            half.append(layer)
            continue
        kind = _layer_kind(_strip(layer))
        rank = shape(parts["down"])[0]
        slot = targets.setdefault(kind, {"layers": 0, "ranks": set()})
        slot["layers"] += 1
        slot["ranks"].add(rank)
        if kind in ("AdaLN", "final AdaLN"):
            adaln_widths.add(shape(parts["down"])[1])
        block = _BLOCK_INDEX.search(_strip(layer))
        if block:
            (refiner_blocks if "refiner" in layer else dit_blocks).add(int(block.group(1)))
    styles = sorted({_style(v.get("down") or v["up"]) for v in pairs.values()})
    prefixes = sorted({k[: len(k) - len(_strip(k))] for k in pairs})
    naming = sorted({"lora_A / lora_B" if ".lora_A" in v["down"] else "lora_down / lora_up"
                     for v in pairs.values() if "down" in v})
    return {
        "names": styles,
        "prefixes": prefixes,
        "pair_names": naming,
        "targets": {k: {"layers": v["layers"], "ranks": sorted(v["ranks"])} for k, v in targets.items()},
        "dit_blocks": len(dit_blocks),
        "refiner_blocks": len(refiner_blocks),
        "adaln_input_widths": sorted(adaln_widths),
        **{k: v for k, v in extra.items() if v},
        "head_bank_tensors": bank,
        "alpha": (f"{alphas} per-layer .alpha tensors" if alphas else
                  f"header {next(k for k in ('alpha', 'ss_network_alpha', 'lora_alpha') if k in metadata)}"
                  if _network_alpha(metadata) is not None else "none (alpha = rank: scale 1)"),
        "half_pairs": half,
        "unread": sorted(unread),
    }


def _style(key: str) -> str:
    stripped = _strip(key)
    if stripped.startswith("lora_unet_"):
        return "musubi (lora_unet_ flattened)"
    diffusers = stripped.startswith(("transformer_blocks.", "token_refiner.refiner_blocks.", "proj_out", "norm_out",
                                     "audio_proj_out", "proj_in", "audio_proj_in", "context_embedder"))
    names = "diffusers names" if diffusers else "original / ComfyUI names"
    return f"peft (.default.) on {names}" if ".default." in key else names
